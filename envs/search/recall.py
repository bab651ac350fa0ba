"""Retrieval quality on questions with known gold passages: recall@k per category."""

from __future__ import annotations

from collections.abc import Iterable

from longhorizon.envs.search.data import QAItem
from longhorizon.envs.search.retriever import Retriever


def recall_at_k(retriever: Retriever, items: Iterable[QAItem], k: int = 3) -> dict[str, dict[str, float]]:
    """Per category (and "all"): mean share of gold passages found in the top k.

    "gold_queries": each hop's gold passage among the hits of that hop's gold query (what an agent
    that searches well gets); "question": the gold passages among the hits of the question itself
    (single-shot retrieval, as in ordinary retrieval-augmented QA). Items without gold passages are
    skipped; "count" says how many were measured.
    """
    totals: dict[str, list[float]] = {}
    for item in items:
        if not item.gold_passage_ids:
            continue
        gold = list(item.gold_passage_ids)
        queries = list(item.gold_queries) if len(item.gold_queries) == len(gold) else []
        results = retriever.search([item.question, *queries], k)
        question_ids = {hit.passage.passage_id for hit in results[0]}
        question_recall = sum(passage in question_ids for passage in gold) / len(gold)
        hop_recall = (sum(passage in {hit.passage.passage_id for hit in hits}
                          for passage, hits in zip(gold, results[1:])) / len(gold)) if queries else float("nan")
        for key in (item.category, "all"):
            sums = totals.setdefault(key, [0.0, 0.0, 0.0, 0.0])
            sums[0] += 1
            sums[1] += question_recall
            if queries:
                sums[2] += hop_recall
                sums[3] += 1
    return {
        key: {"count": count, "question": question_sum / count,
              "gold_queries": hop_sum / hop_count if hop_count else float("nan")}
        for key, (count, question_sum, hop_sum, hop_count) in sorted(totals.items())
    }
