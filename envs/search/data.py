"""Question sets and corpus locations for the search env: FlashRAG-style QA files and the built-in data.

A QA file holds one JSON object per line with `question` and `golden_answers` (a list of strings, or
one string), as FlashRAG distributes NQ, TriviaQA, PopQA, HotpotQA, 2Wiki, Musique and Bamboogle.
Optional fields: `id`, `split` ("train"; "test", "dev", "val" or "validation" count as test),
`hops` (the category becomes "hops-N"), `category`, `gold_passage_ids` and `gold_queries` (one
query per hop, used by the oracle and by recall measurements).

Splits of a user QA file: a second file given as `qa_test` makes `qa` the train split and `qa_test`
the test split; otherwise each record's `split` field decides; otherwise one record in five (by a
stable hash of its id, or of its question when it has none) is test.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from longhorizon.common.paths import user_cache
from longhorizon.envs.search.builtin import CORPUS_FILE, QUESTIONS_FILE, builtin_fingerprint, write_builtin
from longhorizon.envs.search.retriever import corpus_fingerprint

BUILTIN = "builtin"
TEST_SHARE_DIVISOR = 5
_SPLIT_NAMES = {"train": "train", "test": "test", "dev": "test", "val": "test", "validation": "test"}


@dataclass(frozen=True)
class QAItem:
    """One question with its accepted answers and, when known, its gold passages and queries."""

    qa_id: str
    question: str
    golden_answers: tuple[str, ...]
    split: str
    category: str
    hops: int | None = None
    gold_passage_ids: tuple[str, ...] = ()
    gold_queries: tuple[str, ...] = ()


def cache_root() -> Path:
    """The search env's cache folder: `search/` under the user's cache (common/paths.py)."""
    return user_cache("search")


def hash_split(key: str) -> str:
    """"train" or "test" from a stable hash of a question's id (one in five is test)."""
    digest = hashlib.sha256(f"search-qa:{key}".encode()).digest()
    return "test" if int.from_bytes(digest[:8], "big") % TEST_SHARE_DIVISOR == 0 else "train"


def _string_list(value: object, field: str, where: str) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(item, (str, int, float)) for item in value):
        return tuple(str(item) for item in value)
    raise ValueError(f"{where}: {field!r} must be a string or a list of strings, got {value!r}")


def parse_qa_record(record: object, where: str, forced_split: str | None) -> QAItem:
    """A QAItem from one decoded record of a QA file; bad records are ValueErrors naming the line."""
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object")
    question = record.get("question")
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f"{where}: a record needs a non-empty string 'question'")
    answers = _string_list(record.get("golden_answers", record.get("answers")), "golden_answers", where)
    if not answers:
        raise ValueError(f"{where}: 'golden_answers' is empty")
    qa_id = str(record.get("id", question))
    if forced_split is not None:
        split = forced_split
    elif "split" in record:
        split = _SPLIT_NAMES.get(str(record["split"]).lower())
        if split is None:
            raise ValueError(f"{where}: unknown split {record['split']!r}; valid: {', '.join(_SPLIT_NAMES)}")
    else:
        split = hash_split(qa_id)
    hops = record.get("hops")
    if hops is not None and (not isinstance(hops, int) or isinstance(hops, bool) or hops < 1):
        raise ValueError(f"{where}: 'hops' must be a positive integer, got {hops!r}")
    category = f"hops-{hops}" if hops is not None else str(record.get("category") or "qa")
    gold_ids = _string_list(record.get("gold_passage_ids", []), "gold_passage_ids", where)
    gold_queries = _string_list(record.get("gold_queries", []), "gold_queries", where)
    return QAItem(qa_id, question.strip(), answers, split, category, hops, gold_ids, gold_queries)


def _read_qa_file(path: Path, forced_split: str | None) -> list[QAItem]:
    items = []
    with open(path, "rb") as file:
        for line_number, line in enumerate(file, start=1):
            if not line.strip():
                continue
            where = f"{path} line {line_number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{where}: not valid JSON ({error.msg})") from error
            items.append(parse_qa_record(record, where, forced_split))
    return items


@functools.lru_cache(maxsize=8)
def _load_qa_cached(path: str, test_path: str | None, _stamp: tuple) -> dict[str, tuple[QAItem, ...]]:
    if test_path is None:
        items = _read_qa_file(Path(path), None)
    else:
        items = _read_qa_file(Path(path), "train") + _read_qa_file(Path(test_path), "test")
    return {split: tuple(item for item in items if item.split == split) for split in ("train", "test")}


def load_qa(path: str | Path, test_path: str | Path | None = None) -> dict[str, tuple[QAItem, ...]]:
    """The questions of a QA file (and optional test file) by split, in file order."""
    paths = [Path(path)] + ([Path(test_path)] if test_path is not None else [])
    for candidate in paths:
        if not candidate.is_file():
            raise ValueError(f"search env: QA file {candidate} does not exist")
    stamp = tuple((candidate.stat().st_size, candidate.stat().st_mtime_ns) for candidate in paths)
    return _load_qa_cached(str(paths[0].resolve()), str(paths[1].resolve()) if test_path is not None else None,
                           stamp)


@dataclass(frozen=True)
class SearchData:
    """Where the corpus, its index and the questions are."""

    corpus_path: Path
    index_dir: Path
    qa_path: Path
    qa_test_path: Path | None

    def questions(self) -> dict[str, tuple[QAItem, ...]]:
        return load_qa(self.qa_path, self.qa_test_path)


def ensure_builtin(directory: Path | None = None) -> Path:
    """The folder holding the built-in corpus and questions, generating them on first use."""
    directory = directory or cache_root() / f"builtin-{builtin_fingerprint()}"
    if (directory / QUESTIONS_FILE).exists():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    # Actors starting together must not rewrite the corpus under an index another one just built.
    with open(directory / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (directory / QUESTIONS_FILE).exists():
            write_builtin(directory)
    return directory


def resolve_data(corpus: str, qa: str | None, qa_test: str | None, index_dir: str | None) -> SearchData:
    """Check the env's data options and say where everything is (generating the built-in data if needed)."""
    if not isinstance(corpus, str) or not corpus:
        raise ValueError(f"search option corpus must be {BUILTIN!r} or a path to a JSONL corpus, got {corpus!r}")
    if qa_test is not None and qa is None:
        raise ValueError("search option qa_test needs qa (the train questions) as well")
    if corpus == BUILTIN:
        builtin_dir = ensure_builtin()
        corpus_path = builtin_dir / CORPUS_FILE
        default_index = builtin_dir / "index"
        qa_path = Path(qa) if qa is not None else builtin_dir / QUESTIONS_FILE
    else:
        corpus_path = Path(corpus)
        if not corpus_path.is_file():
            raise ValueError(f"search option corpus: {corpus_path} is not a file (or use {BUILTIN!r})")
        if qa is None:
            raise ValueError("search option qa (a FlashRAG-style JSONL of questions) is needed with a user corpus")
        fingerprint = json.dumps(corpus_fingerprint(corpus_path), sort_keys=True)
        default_index = cache_root() / f"index-{hashlib.sha256(fingerprint.encode()).hexdigest()[:16]}"
        qa_path = Path(qa)
    for candidate in (qa_path, Path(qa_test) if qa_test is not None else None):
        if candidate is not None and not candidate.is_file():
            raise ValueError(f"search env: QA file {candidate} does not exist")
    return SearchData(corpus_path=corpus_path, index_dir=Path(index_dir) if index_dir else default_index,
                      qa_path=qa_path, qa_test_path=Path(qa_test) if qa_test is not None else None)
