"""The search bench: its generated corpus, and (slow) a whole run printing a table and one JSON line."""

import json

import pytest

from longhorizon.envs.search.corpus import iter_corpus
from longhorizon.envs.search.retriever import BM25Retriever
from longhorizon.launch.bench import search as bench_search


def test_generated_corpus_is_deterministic_and_searchable(tmp_path):
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    bench_search.write_generated_corpus(first, 300, seed=3, vocabulary_size=2000)
    bench_search.write_generated_corpus(second, 300, seed=3, vocabulary_size=2000)
    assert first.read_bytes() == second.read_bytes()
    passages = list(iter_corpus(first))
    assert len(passages) == 300 and all(40 <= len(p.text.split()) <= 120 for p in passages)
    retriever = BM25Retriever(first, tmp_path / "index")
    # rare words drawn from one passage find that passage first
    words = sorted(set(passages[123].text.split()), key=lambda word: sum(word in p.text.split() for p in passages))
    (hits,) = retriever.search([" ".join(words[:3])], 3)
    assert hits[0].passage.passage_id == "123"
    latency = bench_search._latency(retriever.search, ["a b", "c d"], 3)
    assert latency["queries"] == 2 and 0 < latency["p50_ms"] <= latency["p95_ms"]
    retriever.close()


@pytest.mark.slow
def test_bench_prints_a_table_then_json(capsys):
    assert bench_search.main(["--queries", "100", "--env-seconds", "3"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    result = json.loads(lines[-1])
    builtin = result["builtin"]
    assert builtin["passages"] > 30_000 and builtin["build_s"] > 0
    assert set(builtin["recall_at_3"]) == {"all", "hops-1", "hops-2", "hops-3", "hops-4"}
    assert builtin["env"]["oracle_success"] >= 0.95
    assert any(line.startswith("built-in") for line in lines[:-1])
