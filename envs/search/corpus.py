"""Passage corpora on disk: the {id, title, text} JSONL format and random access by line offsets.

A corpus file holds one JSON object per line, either `{"id", "title", "text"}` (the wiki-18 passage
dumps as distributed for retrieval work) or `{"id", "contents"}` with the title on the first line of
`contents`, optionally in double quotes (FlashRAG's layout). Passages are read on demand through a
table of byte offsets, so a corpus of millions of passages is never held in memory.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Passage:
    """One retrievable passage; `index` is its line number in the corpus file."""

    index: int
    passage_id: str
    title: str
    text: str

    def as_record(self) -> dict[str, str]:
        return {"id": self.passage_id, "title": self.title, "text": self.text}


def passage_from_record(record: object, index: int, where: str = "corpus") -> Passage:
    """A Passage from one decoded JSONL record; a record in neither format is a ValueError."""
    if not isinstance(record, dict):
        raise ValueError(f"{where} line {index + 1}: expected a JSON object, got {type(record).__name__}")
    passage_id = str(record.get("id", index))
    if isinstance(record.get("text"), str):
        title = record.get("title", "")
        return Passage(index, passage_id, title if isinstance(title, str) else str(title), record["text"])
    if isinstance(record.get("contents"), str):
        first_line, _, rest = record["contents"].partition("\n")
        return Passage(index, passage_id, first_line.strip().strip('"'), rest.strip())
    raise ValueError(f"{where} line {index + 1}: a passage needs a string 'text' (with 'id', 'title') or 'contents'")


def iter_corpus(path: str | Path) -> Iterator[Passage]:
    """Every passage of a JSONL corpus file in order; blank lines are not allowed (they shift ids)."""
    with open(path, "rb") as file:
        for index, line in enumerate(file):
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path} line {index + 1}: not valid JSON ({error.msg})") from error
            yield passage_from_record(record, index, str(path))


def write_corpus(passages: list[Passage] | Iterator[Passage], path: str | Path) -> int:
    """Write passages as {id, title, text} JSONL; returns how many were written."""
    count = 0
    with open(path, "w", encoding="utf-8") as file:
        for passage in passages:
            file.write(json.dumps(passage.as_record(), ensure_ascii=False) + "\n")
            count += 1
    return count


def line_offsets(path: str | Path) -> np.ndarray:
    """Byte offset of the start of every line, plus the file size at the end (int64)."""
    offsets = [0]
    with open(path, "rb") as file:
        for line in file:
            offsets.append(offsets[-1] + len(line))
    return np.asarray(offsets, dtype=np.int64)


class PassageStore:
    """Reads passages by line number from a corpus file using a saved offsets table.

    Reads use os.pread, so one store can serve several threads at once.
    """

    def __init__(self, corpus_path: str | Path, offsets: np.ndarray):
        self.corpus_path = Path(corpus_path)
        self._offsets = offsets
        self._fd = os.open(self.corpus_path, os.O_RDONLY)

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def get(self, index: int) -> Passage:
        if not 0 <= index < len(self):
            raise IndexError(f"passage {index} out of range (corpus has {len(self)})")
        start, end = int(self._offsets[index]), int(self._offsets[index + 1])
        line = os.pread(self._fd, end - start, start)
        return passage_from_record(json.loads(line), index, str(self.corpus_path))

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
