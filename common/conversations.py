"""Conversation files: the JSONL that `longhorizon collect` writes and offline trainers (SFT) read.

One JSON object per line (docs/offline.md):

- `messages` (required): the conversation as played, `[{"role": ..., "content": ...}, ...]`. The
  messages before the first assistant message are the prompt (an optional system message, then
  user messages); after it, assistant and user messages alternate and the last one is the
  assistant's. Messages are the source of truth: any model can be trained on them.
- `token_ids`, `loss_mask`, `tokenizer` (optional, together): the same conversation in the chat
  template of the tokenizer whose fingerprint `tokenizer` holds, laid out exactly as the actor lays
  out an RL trajectory (`tokenize_conversation`), with loss mask 1 on the assistant's tokens. A
  trainer uses them only when its model's tokenizer has that fingerprint, and tokenizes the
  messages itself otherwise.
- `reward`, `success`, `task_id`, `env`, `split`, `category`, `num_turns`, `terminated`,
  `truncated`, `engine`, `episode`, `seed`: what the episode was and how it went;
  `metadata`: a free-form object for anything else.

Any other key is an error, as a misspelt key would otherwise be ignored.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from longhorizon.common.chat import ChatTokenizer, TokenConversation

ROLES = ("system", "user", "assistant")

# Optional fields and the JSON types they take.
_DESCRIPTIVE_FIELDS: dict[str, tuple[type, ...]] = {
    "reward": (int, float),
    "success": (bool,),
    "task_id": (str,),
    "env": (str,),
    "split": (str,),
    "category": (str,),
    "num_turns": (int,),
    "terminated": (bool,),
    "truncated": (bool,),
    "engine": (str,),
    "episode": (int,),
    "seed": (int,),
    "metadata": (dict,),
}
RECORD_KEYS = ("messages", "token_ids", "loss_mask", "tokenizer", *_DESCRIPTIVE_FIELDS)


class ConversationFileError(ValueError):
    """A conversation file, or one of its lines, that cannot be used as it is."""


@dataclass
class ConversationRecord:
    """One validated line of a conversation file."""

    messages: list[dict]
    where: str
    """`file:line`, for error messages."""
    token_ids: list[int] | None = None
    loss_mask: list[int] | None = None
    tokenizer: dict | None = None
    success: bool | None = None
    reward: float | None = None
    task_id: str | None = None


def tokenizer_fingerprint(hf_tokenizer) -> str:
    """A short hash of everything that decides how a Hugging Face tokenizer turns a conversation
    into ids: its whole serialised definition (vocabulary, merges, normaliser, special tokens) and
    its chat template. Two folders holding the same tokenizer files share it."""
    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    if backend is not None:
        definition = backend.to_str()
    else:  # a slow tokenizer: the vocabulary with its special tokens
        definition = json.dumps(sorted(hf_tokenizer.get_vocab().items()))
    payload = json.dumps(
        {"definition": definition, "chat_template": hf_tokenizer.chat_template, "eos": hf_tokenizer.eos_token},
        sort_keys=True,
    )
    return "sha256:" + hashlib.sha256(payload.encode()).hexdigest()[:32]


def message_structure_problem(messages: Any) -> str | None:
    """What keeps `messages` from being a trainable conversation, or None."""
    if not isinstance(messages, list) or not messages:
        return "messages must be a non-empty list of {\"role\": ..., \"content\": ...} objects"
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or set(message) != {"role", "content"}:
            return f"message {index} must be an object with exactly the keys role and content, got {message!r}"
        if message["role"] not in ROLES:
            return f"message {index} has role {message['role']!r}; roles are {', '.join(ROLES)}"
        if not isinstance(message["content"], str):
            return f"message {index} content must be a string, got {type(message['content']).__name__}"
        if message["role"] == "system" and index != 0:
            return f"message {index} is a system message; only the first message may be one"
    roles = [message["role"] for message in messages]
    if "assistant" not in roles:
        return "no assistant message: nothing to learn from (remove the line or re-collect it)"
    first_reply = roles.index("assistant")
    if "user" not in roles[:first_reply]:
        return "the first assistant message must follow a user message"
    for offset, role in enumerate(roles[first_reply:]):
        expected = "assistant" if offset % 2 == 0 else "user"
        if role != expected:
            return (
                f"message {first_reply + offset} is {role!r} where {expected!r} was expected: after the "
                f"first assistant message, assistant and user messages alternate"
            )
    if roles[-1] != "assistant":
        return "the last message must be the assistant's (a trailing observation is never trained on: drop it)"
    return None


def tokenize_conversation(tokenizer: ChatTokenizer, messages: Sequence[dict]) -> TokenConversation:
    """A finished conversation in the token layout the actor builds for RL.

    The prompt is the chat template's rendering of the messages before the first reply; each
    assistant message is encoded as if the model had written that text and then its end-of-turn
    token (loss mask 1); each user message after it is appended as template tokens (loss mask 0),
    exactly as `TokenConversation.add_observation` appends an env's reply. A model fine-tuned on
    these ids and then trained with RL sees one format.
    """
    problem = message_structure_problem(list(messages))
    if problem is not None:
        raise ValueError(problem)
    first_reply = [m["role"] for m in messages].index("assistant")
    conversation = TokenConversation.start(tokenizer, messages[:first_reply])
    for message in messages[first_reply:]:
        if message["role"] == "assistant":
            reply = tokenizer.encode(message["content"]) + [tokenizer.eos_token_id]
            conversation.add_generation(reply, [0.0] * len(reply), -1, message["content"])
        else:
            conversation.add_observation(message["content"], stopped_on_eos=True)
    return conversation


def without_trailing_observations(messages: Sequence[dict]) -> list[dict]:
    """The messages up to the last assistant reply: an episode cut short after an observation (the
    context budget ran out before the next reply) ends on a user message, which nothing learns from."""
    messages = [dict(m) for m in messages]
    while messages and messages[-1]["role"] != "assistant":
        messages.pop()
    return messages


def record_from_episode(
    conversation: TokenConversation, *, tokenized: TokenConversation | None, tokenizer: dict | None, **fields: Any
) -> dict:
    """A conversation-file record: the episode's messages, its ids in the target tokenizer when
    given, and the descriptive fields (reward, success, task_id, ...)."""
    unknown = sorted(set(fields) - set(_DESCRIPTIVE_FIELDS))
    if unknown:
        raise ValueError(f"unknown conversation field {unknown[0]!r}; valid: {', '.join(RECORD_KEYS)}")
    record: dict[str, Any] = {"messages": without_trailing_observations(conversation.messages)}
    if tokenized is not None:
        record["token_ids"] = list(tokenized.token_ids)
        record["loss_mask"] = list(tokenized.loss_mask)
        record["tokenizer"] = dict(tokenizer or {})
    record.update(fields)
    return record


def read_conversations(path: str | Path) -> list[ConversationRecord]:
    """Every record of a conversation file, each checked; the first bad line is an error naming
    the file, the line, what is wrong and how to fix it. Blank lines are skipped."""
    path = Path(path)
    if not path.is_file():
        raise ConversationFileError(f"conversation file not found: {path} (write one with `longhorizon collect`)")
    records = []
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            records.append(_parse_line(line, f"{path}:{number}"))
    return records


def _parse_line(line: str, where: str) -> ConversationRecord:
    try:
        data = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ConversationFileError(
            f"{where}: not valid JSON ({exc.msg} at column {exc.colno}); each line must be one JSON "
            f"object: fix or delete the line"
        ) from None
    return parse_record(data, where)


def parse_record(data: Any, where: str) -> ConversationRecord:
    """One conversation object (a line of a conversation file, or one side of a preference pair),
    checked; `where` prefixes every error."""
    if not isinstance(data, dict):
        raise ConversationFileError(f"{where}: expected a JSON object, got {type(data).__name__}")
    unknown = sorted(set(data) - set(RECORD_KEYS))
    if unknown:
        raise ConversationFileError(
            f"{where}: unknown key {unknown[0]!r}; valid keys: {', '.join(RECORD_KEYS)} "
            f"(put fields of your own under \"metadata\")"
        )
    if "messages" not in data:
        raise ConversationFileError(f"{where}: no \"messages\": every line needs the conversation as messages")
    problem = message_structure_problem(data["messages"])
    if problem is not None:
        raise ConversationFileError(f"{where}: {problem}")
    for key, types in _DESCRIPTIVE_FIELDS.items():
        value = data.get(key)
        if value is None:
            continue
        if not isinstance(value, types) or (bool not in types and isinstance(value, bool)):
            names = " or ".join(t.__name__ for t in types)
            raise ConversationFileError(f"{where}: {key} must be {names}, got {value!r}")
    if "reward" in data and data["reward"] is not None and not math.isfinite(data["reward"]):
        raise ConversationFileError(f"{where}: reward must be finite, got {data['reward']!r}")
    token_ids, loss_mask, tokenizer = _parse_tokens(data, where)
    return ConversationRecord(
        messages=data["messages"], where=where, token_ids=token_ids, loss_mask=loss_mask, tokenizer=tokenizer,
        success=data.get("success"), reward=data.get("reward"), task_id=data.get("task_id"),
    )


def _parse_tokens(data: dict, where: str) -> tuple[list[int] | None, list[int] | None, dict | None]:
    present = [key for key in ("token_ids", "loss_mask", "tokenizer") if data.get(key) is not None]
    if not present:
        return None, None, None
    if len(present) != 3:
        missing = sorted({"token_ids", "loss_mask", "tokenizer"} - set(present))
        raise ConversationFileError(
            f"{where}: {', '.join(present)} without {', '.join(missing)}: token ids need their loss mask "
            f"and the tokenizer that made them; delete all three to have the trainer tokenize the messages"
        )
    token_ids, loss_mask, tokenizer = data["token_ids"], data["loss_mask"], data["tokenizer"]
    if not isinstance(token_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in token_ids):
        raise ConversationFileError(f"{where}: token_ids must be a list of integers")
    if any(t < 0 for t in token_ids):
        raise ConversationFileError(f"{where}: token_ids holds a negative id ({min(token_ids)})")
    if not isinstance(loss_mask, list) or len(loss_mask) != len(token_ids):
        raise ConversationFileError(
            f"{where}: loss_mask must be a list as long as token_ids ({len(token_ids)} ids)"
        )
    if any(m not in (0, 1) or isinstance(m, bool) for m in loss_mask):
        raise ConversationFileError(f"{where}: loss_mask values must be 0 or 1")
    if not isinstance(tokenizer, dict) or not isinstance(tokenizer.get("fingerprint"), str):
        raise ConversationFileError(
            f"{where}: tokenizer must be an object with a \"fingerprint\" string (and optionally \"model\")"
        )
    return token_ids, loss_mask, tokenizer


def record_line(record: dict) -> str:
    """One record as a line of the file."""
    return json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n"
