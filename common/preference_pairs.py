"""Preference-pair files: JSONL of two conversations of one prompt, the preferred and the other
(`longhorizon dpo` reads them from `dpo.pairs`).

One JSON object per line (docs/offline.md):

- `chosen`, `rejected` (required): each a conversation object with the keys of a line of a
  conversation file (common/conversations.py): `messages` and optionally `token_ids`, `loss_mask`,
  `tokenizer`, `reward`, ... Both must start from the same prompt (the messages before the first
  assistant message), as DPO compares two answers to one question, and must differ.
- `task_id` (optional): the task the two conversations played, for reports.
- `metadata` (optional): a free-form object for anything else.

Any other key is an error, as a misspelt key would otherwise be ignored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from longhorizon.common.conversations import ConversationFileError, ConversationRecord, parse_record

PAIR_KEYS = ("chosen", "rejected", "task_id", "metadata")


@dataclass
class PairRecord:
    """One validated line of a preference-pair file."""

    chosen: ConversationRecord
    rejected: ConversationRecord
    where: str
    """`file:line`, for error messages."""
    task_id: str | None = None


def prompt_messages(messages: list[dict]) -> list[dict]:
    """The messages before the first assistant message: what both answers of a pair respond to."""
    roles = [message["role"] for message in messages]
    return messages[: roles.index("assistant")] if "assistant" in roles else list(messages)


def read_preference_pairs(path: str | Path) -> list[PairRecord]:
    """Every pair of a file, each checked; the first bad line is an error naming the file, the
    line, what is wrong and how to fix it. Blank lines are skipped."""
    path = Path(path)
    if not path.is_file():
        raise ConversationFileError(f"preference-pair file not found: {path}")
    pairs = []
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if line.strip():
                pairs.append(parse_pair_line(line, f"{path}:{number}"))
    return pairs


def parse_pair_line(line: str, where: str) -> PairRecord:
    try:
        data: Any = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ConversationFileError(
            f"{where}: not valid JSON ({exc.msg} at column {exc.colno}); each line must be one JSON "
            f"object: fix or delete the line"
        ) from None
    if not isinstance(data, dict):
        raise ConversationFileError(f"{where}: expected a JSON object, got {type(data).__name__}")
    unknown = sorted(set(data) - set(PAIR_KEYS))
    if unknown:
        hint = (" (this looks like a conversation-file line: list such files in dpo.data, where episodes "
                "of one task are paired)") if "messages" in data else " (put fields of your own under \"metadata\")"
        raise ConversationFileError(f"{where}: unknown key {unknown[0]!r}; valid keys: {', '.join(PAIR_KEYS)}{hint}")
    for side in ("chosen", "rejected"):
        if side not in data:
            raise ConversationFileError(f"{where}: no \"{side}\": every line needs both conversations, chosen "
                                        f"and rejected")
    chosen = parse_record(data["chosen"], f"{where}: chosen")
    rejected = parse_record(data["rejected"], f"{where}: rejected")
    if prompt_messages(chosen.messages) != prompt_messages(rejected.messages):
        raise ConversationFileError(
            f"{where}: chosen and rejected start from different prompts (the messages before the first "
            f"assistant message); a pair answers one prompt two ways")
    if chosen.messages == rejected.messages:
        raise ConversationFileError(f"{where}: chosen and rejected are the same conversation: nothing to prefer; "
                                    f"delete the line")
    task_id = data.get("task_id")
    if task_id is not None and not isinstance(task_id, str):
        raise ConversationFileError(f"{where}: task_id must be a string, got {task_id!r}")
    if data.get("metadata") is not None and not isinstance(data["metadata"], dict):
        raise ConversationFileError(f"{where}: metadata must be an object, got {data['metadata']!r}")
    return PairRecord(chosen=chosen, rejected=rejected, where=where, task_id=task_id)


def pair_line(chosen: dict, rejected: dict, **fields: Any) -> str:
    """One pair as a line of the file (`chosen`, `rejected`: conversation records as dicts)."""
    unknown = sorted(set(fields) - set(PAIR_KEYS[2:]))
    if unknown:
        raise ValueError(f"unknown pair field {unknown[0]!r}; valid: {', '.join(PAIR_KEYS)}")
    record = {"chosen": chosen, "rejected": rejected, **fields}
    return json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n"
