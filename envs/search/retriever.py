"""Retrievers for the search env: the Retriever interface and a BM25 index built with bm25s.

The BM25 index is built once per corpus into a folder (scores matrix, vocabulary, passage offsets,
a meta.json naming the corpus it was built from) and opened memory-mapped afterwards, so a
process pays for loading only the pages its queries touch. A dense retriever can replace BM25 by
implementing `Retriever.search`.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from longhorizon.envs.search.corpus import Passage, PassageStore, iter_corpus, line_offsets

INDEX_FORMAT = 1
_META = "meta.json"
_OFFSETS = "offsets.npy"
_BM25 = "bm25"
_STOPWORDS = "en"


@dataclass(frozen=True)
class SearchHit:
    """A retrieved passage with its retrieval score (higher is better)."""

    passage: Passage
    score: float


@runtime_checkable
class Retriever(Protocol):
    """Finds the passages that best match each query."""

    def search(self, queries: Sequence[str], k: int) -> list[list[SearchHit]]:
        """For each query, up to k hits, best first; passages that match nothing are left out."""
        ...

    def __len__(self) -> int:
        """Number of passages in the corpus."""
        ...


def _import_bm25s():
    try:
        import bm25s
    except ImportError as error:
        raise ImportError("the search env's BM25 retriever needs bm25s: pip install 'bm25s==0.3.16'") from error
    return bm25s


def corpus_fingerprint(corpus_path: str | Path) -> dict[str, object]:
    """What identifies a corpus file cheaply: its absolute path, size and modification time."""
    path = Path(corpus_path).resolve()
    stat = path.stat()
    return {"corpus_path": str(path), "corpus_size": stat.st_size, "corpus_mtime_ns": stat.st_mtime_ns}


def _index_text(passage: Passage) -> str:
    return f"{passage.title}\n{passage.text}" if passage.title else passage.text


def build_bm25_index(corpus_path: str | Path, index_dir: str | Path) -> dict[str, object]:
    """Index the corpus into index_dir (atomically: built aside, then renamed); returns the meta."""
    bm25s = _import_bm25s()
    index_dir = Path(index_dir)
    index_dir.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    texts = [_index_text(passage) for passage in iter_corpus(corpus_path)]
    if not texts:
        raise ValueError(f"corpus {corpus_path} holds no passages")
    building = Path(tempfile.mkdtemp(prefix=f".{index_dir.name}.building-", dir=index_dir.parent))
    try:
        tokens = bm25s.tokenize(texts, stopwords=_STOPWORDS, show_progress=False)
        del texts
        model = bm25s.BM25()
        model.index(tokens, show_progress=False)
        del tokens
        model.save(str(building / _BM25), show_progress=False)
        offsets = line_offsets(corpus_path)
        np.save(building / _OFFSETS, offsets)
        meta = {
            "format": INDEX_FORMAT,
            **corpus_fingerprint(corpus_path),
            "num_passages": len(offsets) - 1,
            "build_seconds": round(time.perf_counter() - started, 3),
        }
        (building / _META).write_text(json.dumps(meta, indent=1))
        try:
            os.rename(building, index_dir)
        except OSError:
            # Another process finished the same index first; keep theirs.
            if not (index_dir / _META).exists():
                raise
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return json.loads((index_dir / _META).read_text())


def top_k_indices(scores: np.ndarray, k: int) -> list[int]:
    """Indices of the k highest positive scores, best first (ties: lower index first).

    Only the non-zero scores are ranked: numpy's argpartition slows down ~20x on the long runs of
    equal zeros a sparse BM25 score vector holds, which made it the whole cost of a query.
    """
    candidates = np.flatnonzero(scores > 0)
    if len(candidates) > k:
        candidates = candidates[np.argpartition(-scores[candidates], k - 1)[:k]]
    order = np.lexsort((candidates, -scores[candidates]))
    return [int(index) for index in candidates[order]]


class BM25Retriever:
    """BM25 over a JSONL corpus, with the index memory-mapped from its folder."""

    def __init__(self, corpus_path: str | Path, index_dir: str | Path):
        """Open the index in index_dir, building it first when the folder holds none."""
        bm25s = _import_bm25s()
        self._bm25s = bm25s
        index_dir = Path(index_dir)
        meta_path = index_dir / _META
        if not meta_path.exists():
            build_bm25_index(corpus_path, index_dir)
        self.meta = json.loads(meta_path.read_text())
        expected = corpus_fingerprint(corpus_path)
        found = {key: self.meta.get(key) for key in expected}
        if self.meta.get("format") != INDEX_FORMAT or found != expected:
            raise ValueError(
                f"the index in {index_dir} was built from another corpus or format ({found}, format "
                f"{self.meta.get('format')}); expected {expected}: delete that folder or choose another index_dir"
            )
        self.index_dir = index_dir
        self.model = bm25s.BM25.load(str(index_dir / _BM25), mmap=True, show_progress=False)
        self.store = PassageStore(corpus_path, np.load(index_dir / _OFFSETS, mmap_mode="r"))

    def __len__(self) -> int:
        return len(self.store)

    def search(self, queries: Sequence[str], k: int) -> list[list[SearchHit]]:
        if k < 1:
            raise ValueError(f"k must be at least 1, got {k}")
        if not queries:
            return []
        tokens = self._bm25s.tokenize(list(queries), stopwords=_STOPWORDS, return_ids=False, show_progress=False)
        results = []
        for query_tokens in tokens:
            scores = self.model.get_scores_from_ids(self.model.get_tokens_ids(query_tokens))
            results.append([SearchHit(self.store.get(int(index)), float(scores[index]))
                            for index in top_k_indices(scores, k)])
        return results

    def close(self) -> None:
        self.store.close()


_shared: dict[tuple[str, str], BM25Retriever] = {}
_shared_lock = threading.Lock()


def shared_bm25(corpus_path: str | Path, index_dir: str | Path) -> BM25Retriever:
    """One opened BM25Retriever per (corpus, index) in this process, shared by every env instance."""
    key = (str(Path(corpus_path).resolve()), str(Path(index_dir).resolve()))
    with _shared_lock:
        retriever = _shared.get(key)
        if retriever is None:
            retriever = BM25Retriever(corpus_path, index_dir)
            _shared[key] = retriever
        return retriever
