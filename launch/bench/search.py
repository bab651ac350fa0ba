"""Search env benchmark: index build time and memory, query latency, recall@3 and env steps/s.

On the built-in corpus (always): generating the corpus and questions, building the BM25 index
from scratch (time, peak resident memory added, size on disk), opening it memory-mapped, query
latency (p50/p95) over the test questions and their gold queries, recall@3 of the gold passages
per hop count (with each hop's gold query, and with the question as the only query), and env
steps per second with the oracle over the test split (env calls only, resets included).

With --generated N (opt-in; 1000000 is the headline figure, a few minutes and several GB): the
same build, open and latency figures on a generated corpus of N passages of Zipf-distributed
made-up words, written to a temporary folder and deleted afterwards.

Run: `longhorizon bench search [--generated 1000000] [--queries 2000]`; prints a table, then one
line of JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import trio

from longhorizon.launch.bench.memory import MIB, PeakRss, memory_use
from longhorizon.launch.bench.tables import Column, parsed, print_table, run_as_command
from longhorizon.envs.search.retriever import BM25Retriever, build_bm25_index
from longhorizon.envs.base import action_from_reply, make_env, make_policy, list_tasks
from longhorizon.envs.search.builtin import CORPUS_FILE, write_builtin
from longhorizon.envs.search.data import load_qa, resolve_data
from longhorizon.envs.search.recall import recall_at_k

PROG = "longhorizon bench search"


def _folder_mb(path: Path) -> float:
    return sum(file.stat().st_size for file in path.rglob("*") if file.is_file()) / MIB


def _latency(search: Callable[[list[str], int], Any], queries: Sequence[str], k: int) -> dict[str, float]:
    timings = []
    for query in queries:
        started = time.perf_counter()
        search([query], k)
        timings.append(time.perf_counter() - started)
    milliseconds = np.asarray(timings) * 1000
    return {"p50_ms": float(np.percentile(milliseconds, 50)), "p95_ms": float(np.percentile(milliseconds, 95)),
            "queries": len(queries)}


def _serve(corpus_path: str, index_dir: str, queries: list[str], k: int) -> dict[str, Any]:
    """In a fresh process (as an actor would): open the index, time the queries, report memory."""
    before_open = memory_use().rss_bytes
    started = time.perf_counter()
    retriever = BM25Retriever(corpus_path, index_dir)
    figures: dict[str, Any] = {"open_s": time.perf_counter() - started,
                               "open_added_rss_mb": (memory_use().rss_bytes - before_open) / MIB}
    figures["latency"] = _latency(retriever.search, queries, k)
    memory = memory_use(detailed=True)
    # Index pages are mapped from the page cache and shared by every process serving this index.
    figures["serving_rss_mb"] = memory.rss_bytes / MIB
    figures["serving_private_mb"] = memory.uss_bytes / MIB
    retriever.close()
    return figures


def _serve_in_fresh_process(corpus_path: Path, index_dir: Path, queries: list[str], k: int) -> dict[str, Any]:
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_serve, str(corpus_path), str(index_dir), queries, k).result()


def _build(corpus_path: Path, index_dir: Path) -> dict[str, Any]:
    with PeakRss() as build_memory:
        started = time.perf_counter()
        meta = build_bm25_index(corpus_path, index_dir)
        build_seconds = time.perf_counter() - started
    return {"passages": meta["num_passages"], "build_s": build_seconds,
            "build_peak_added_mb": build_memory.added_mb, "index_disk_mb": _folder_mb(index_dir),
            "corpus_disk_mb": corpus_path.stat().st_size / MIB}


async def _oracle_steps(tasks: list, seconds_cap: float) -> dict[str, float]:
    env = make_env("search")
    calls = successes = episodes = 0
    env_seconds = 0.0
    deadline = time.perf_counter() + seconds_cap
    for index, task in enumerate(tasks):
        if time.perf_counter() > deadline:
            break
        policy = make_policy("search", "oracle")
        started = time.perf_counter()
        observation, _ = await env.reset(task, seed=index)
        env_seconds += time.perf_counter() - started
        calls += 1
        policy.reset(task, observation, random.Random(index))
        for _ in range(10):
            action = action_from_reply(policy.act(observation), env.prompt_format)
            started = time.perf_counter()
            observation, _, terminated, _, info = await env.step(action)
            env_seconds += time.perf_counter() - started
            calls += 1
            if terminated:
                successes += int(info["success"])
                break
        episodes += 1
    await env.close()
    return {"episodes": episodes, "oracle_success": successes / max(episodes, 1),
            "env_calls_per_s": calls / max(env_seconds, 1e-9), "ms_per_call": 1000 * env_seconds / max(calls, 1)}


def bench_builtin(query_count: int, seconds_cap: float) -> dict[str, Any]:
    """Figures on the built-in corpus; the index is built from scratch in a temporary folder."""
    result: dict[str, Any] = {}
    scratch = Path(tempfile.mkdtemp(prefix="bench-search-"))
    try:
        started = time.perf_counter()
        write_builtin(scratch / "data")
        result["generate_s"] = time.perf_counter() - started
        corpus_path = scratch / "data" / CORPUS_FILE
        result.update(_build(corpus_path, scratch / "index"))
        questions = load_qa(scratch / "data" / "questions.jsonl")
        test_items = list(questions["test"])
        queries = [item.question for item in test_items] + [query for item in test_items for query in item.gold_queries]
        result.update(_serve_in_fresh_process(corpus_path, scratch / "index", queries[:query_count], 3))
        retriever = BM25Retriever(corpus_path, scratch / "index")
        result["recall_at_3"] = recall_at_k(retriever, test_items, k=3)
        retriever.close()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    # Env speed on the cached built-in data (what an actor uses).

    resolve_data("builtin", None, None, None)
    result["env"] = trio.run(_oracle_steps, list_tasks("search", "test"), seconds_cap)
    return result


def _made_up_vocabulary(size: int, rng: np.random.Generator) -> np.ndarray:
    """`size` distinct lower-case words of 3 to 9 letters."""
    words = np.array([], dtype="<U9")
    while len(words) < size:
        letters = rng.integers(ord("a"), ord("z") + 1, size=(size, 9), dtype=np.uint32)
        lengths = rng.integers(3, 10, size=size)
        letters[np.arange(9)[None, :] >= lengths[:, None]] = 0  # NUL pads end a numpy unicode string
        words = np.unique(np.concatenate([words, letters.view("<U9").ravel()]))
    return rng.permutation(words)[:size]


def write_generated_corpus(path: Path, passages: int, seed: int = 0, vocabulary_size: int = 100_000) -> None:
    """N passages of 40-120 Zipf-distributed made-up words (a stand-in for wiki-sized corpora)."""
    rng = np.random.default_rng(seed)
    vocabulary = _made_up_vocabulary(vocabulary_size, rng)
    ranks = np.arange(1, vocabulary_size + 1)
    probabilities = (1 / ranks) / (1 / ranks).sum()
    with open(path, "w", encoding="utf-8") as file:
        chunk = 10_000
        for start in range(0, passages, chunk):
            count = min(chunk, passages - start)
            lengths = rng.integers(40, 121, size=count)
            words = vocabulary[rng.choice(vocabulary_size, size=int(lengths.sum()), p=probabilities)]
            offset = 0
            lines = []
            for index, length in enumerate(lengths):
                text = " ".join(words[offset:offset + length])
                offset += length
                title = " ".join(words[offset - 2:offset]).title()
                lines.append(json.dumps({"id": str(start + index), "title": title, "text": text}))
            file.write("\n".join(lines) + "\n")


def bench_generated(passages: int, query_count: int) -> dict[str, Any]:
    scratch = Path(tempfile.mkdtemp(prefix="bench-search-generated-"))
    try:
        corpus = scratch / "corpus.jsonl"
        started = time.perf_counter()
        write_generated_corpus(corpus, passages)
        generate_s = time.perf_counter() - started
        figures = _build(corpus, scratch / "index")
        figures["generate_s"] = generate_s
        # Queries of 2 to 5 words drawn from random passages (frequent words included, as in real text).
        rng = random.Random(1)
        with open(corpus, "rb") as file:
            texts = [json.loads(line)["text"].split() for _, line in zip(range(20_000), file)]
        queries = [" ".join(rng.sample(words, rng.randint(2, 5))) for words in rng.choices(texts, k=query_count)]
        del texts
        figures.update(_serve_in_fresh_process(corpus, scratch / "index", queries, 3))
        return figures
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def print_report(result: dict[str, Any]) -> None:
    """Tables for people."""
    corpora = [("built-in", result["builtin"])] + ([("generated", result["generated"])] if "generated" in result else [])
    print_table(
        [Column("corpus", 10, left=True), Column("passages", 9), Column("build s", 8, ".2f"),
         Column("build +MB", 9, ".0f"), Column("index MB", 9, ".1f"), Column("open s", 7, ".3f"),
         Column("p50 ms", 7, ".3f"), Column("p95 ms", 7, ".3f"), Column("serve RSS MB", 12, ".0f"),
         Column("private MB", 10, ".0f")],
        [[name, figures["passages"], figures["build_s"], figures["build_peak_added_mb"], figures["index_disk_mb"],
          figures["open_s"], figures["latency"]["p50_ms"], figures["latency"]["p95_ms"], figures["serving_rss_mb"],
          figures["serving_private_mb"]] for name, figures in corpora],
    )
    recall = result["builtin"]["recall_at_3"]
    print("\nrecall@3 of gold passages, built-in test split")
    print_table(
        [Column("category", 10, left=True), Column("count", 6, ".0f"), Column("gold queries", 13, ".3f"),
         Column("question only", 14, ".3f")],
        [[category, figures["count"], figures["gold_queries"], figures["question"]]
         for category, figures in recall.items()],
    )
    env = result["builtin"]["env"]
    print(f"\nenv (oracle, test split): {env['episodes']} episodes, success {env['oracle_success']:.3f}, "
          f"{env['env_calls_per_s']:.0f} env calls/s ({env['ms_per_call']:.3f} ms per call)")


def _check(args: argparse.Namespace) -> None:
    if args.queries < 1 or args.generated < 0:
        raise ValueError("--queries must be positive and --generated non-negative")


def run(argv: list[str]) -> dict[str, Any]:
    """Measure as the options say, print the tables, return the result."""
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("--queries", type=int, default=2000, help="queries timed per corpus")
    parser.add_argument("--generated", type=int, default=0, metavar="N",
                        help="also bench a generated corpus of N passages (e.g. 1000000; minutes, GBs)")
    parser.add_argument("--env-seconds", type=float, default=30.0, help="cap on the oracle env run")
    args = parsed(parser, argv, check=_check)
    result: dict[str, Any] = {"builtin": bench_builtin(args.queries, args.env_seconds)}
    if args.generated:
        result["generated"] = bench_generated(args.generated, args.queries)
    print_report(result)
    return result


def main(argv: list[str]) -> int:
    return run_as_command(PROG, run, argv)


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
