"""Prompt formats and action parsing: turn a model's reply into one environment action.

Two formats:
- `react`: the model writes `Thought:` ... `Action:` ...; the action is the first non-empty line
  after `Action:`. More than one `Action:` is an error (the reference counts it as one too).
- `bare`: the whole reply, stripped, is the action.

A reply that cannot be parsed never reaches the environment and never crashes the actor: it
becomes an error observation that tells the model how to answer, and the turn still counts.
"""

from __future__ import annotations

import re

PROMPT_FORMATS = ("react", "bare")

_ACTION_MARKER = re.compile(r"(?im)^\s*\**\s*action\s*\**\s*:")
_MAX_ACTION_CHARS = 1000
# A bare reply is the whole action, reasoning included (e.g. the search env's <think> before its
# <search> tag), so it may be long; the env reads what it needs from it.
_MAX_BARE_REPLY_CHARS = 16000


class ActionParseError(ValueError):
    """The reply holds no usable action; the message is shown to the model."""


def parse_action(reply: str, prompt_format: str) -> str:
    """Extract the action from a model reply, or raise ActionParseError with a helpful message."""
    if prompt_format == "bare":
        action = reply.strip()
        if not action:
            raise ActionParseError("empty reply: write the action")
        return action[:_MAX_BARE_REPLY_CHARS]
    if prompt_format != "react":
        raise ValueError(f"unknown prompt format {prompt_format!r}; valid: {', '.join(PROMPT_FORMATS)}")
    markers = list(_ACTION_MARKER.finditer(reply))
    if not markers:
        raise ActionParseError(
            "no action found: end your reply with a line 'Action:' followed by one command"
        )
    if len(markers) > 1:
        raise ActionParseError("more than one 'Action:' in the reply: give exactly one command per turn")
    rest = reply[markers[0].end():]
    for line in rest.splitlines():
        action = line.strip().strip("`*").strip()
        if action:
            return action[:_MAX_ACTION_CHARS]
    raise ActionParseError("'Action:' is followed by nothing: write one command after it")


def error_observation(error: ActionParseError, prompt_format: str) -> str:
    """The observation shown instead of an environment step when the reply could not be parsed."""
    if prompt_format == "react":
        return f"Invalid reply: {error}. Answer as:\nThought:\n<your reasoning>\n\nAction:\n<one command>"
    return f"Invalid reply: {error}."
