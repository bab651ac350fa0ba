"""Reading a search-env reply: which tool call (<search>, <answer>, <python>) it makes, if any."""

from __future__ import annotations

import re
from dataclasses import dataclass

TOOLS = ("search", "answer", "python")
_THINK_BLOCK = re.compile(r"<think>.*?</think>", re.DOTALL | re.IGNORECASE)
# The closing tag may be missing: engines that stop on "</search>" often leave the stop string out.
_TOOL_CALL = re.compile(r"<(search|answer|python)>(.*?)(?:</\1>|\Z)", re.DOTALL | re.IGNORECASE)


@dataclass(frozen=True)
class ToolCall:
    tool: str
    """"search", "answer" or "python"."""
    argument: str


def parse_reply(reply: str) -> ToolCall | None:
    """The first tool call outside <think> blocks; text after its closing tag is ignored. None if none."""
    visible = _THINK_BLOCK.sub(" ", reply)
    match = _TOOL_CALL.search(visible)
    if match is None:
        return None
    argument = match.group(2)
    if match.group(1).lower() != "python":
        argument = " ".join(argument.split())
    else:
        argument = argument.strip("\n")
    return ToolCall(match.group(1).lower(), argument)
