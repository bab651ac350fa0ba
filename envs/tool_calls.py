"""Tool calls written as text: how a model's reply carries calls, parsed and rendered per format.

A model trained to call tools writes its calls in the text of its reply, in the layout its chat
template taught it. A format knows one such layout both ways: `parse` finds the calls in a reply
(or says, in a sentence the model can be shown, why the reply holds no usable call) and `render`
writes calls as that model would, for oracle conversations, SFT data and tests. It also says how
to describe the tools in a system message for a template that does not render tools itself.

Built-in formats:
- `hermes`: each call a JSON object `{"name": ..., "arguments": {...}}` between `<tool_call>` and
  `</tool_call>` tags, the layout of Hermes, Qwen2.5 and Qwen3 templates; results go back between
  `<tool_response>` tags.
- `json`: the reply is one JSON object `{"name": ..., "arguments": {...}}` (or a list of them),
  optionally in a ```json fence, the layout Llama 3.1 uses (`parameters` is read as `arguments`).

Formats are parts like every other (common/plugins.py): the built-ins, formats registered in this
process, the `longhorizon.tool_call_formats` entry-point group, or `package.module:attribute`.
`to_openai` turns parsed calls into the `tool_calls` of an OpenAI chat message.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Sequence

from longhorizon.common.plugins import PluginError, Registry

# A reply's arguments larger than this are refused: no env action needs them, and a model that
# loops inside a JSON string should be told, not parsed.
MAX_ARGUMENTS_CHARS = 16000


class ToolCallParseError(ValueError):
    """A reply's tool calls cannot be read; the message says why, in words a model can act on."""


@dataclass(frozen=True)
class ToolCall:
    """One call: the tool's name and its arguments (a JSON object)."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    call_id: str = ""
    """The id the call is known by in an OpenAI message ("" until one is given)."""


@dataclass(frozen=True)
class ParsedReply:
    """A reply split into its free text (reasoning, an answer) and its calls, in order."""

    content: str
    calls: tuple[ToolCall, ...]


def tool_call_from_object(value: Any, where: str) -> ToolCall:
    """A call from its decoded JSON (`{"name": ..., "arguments": {...}}`); `arguments` may also be
    a JSON string holding the object (as OpenAI's wire format has it) or be named `parameters`."""
    if not isinstance(value, dict):
        raise ToolCallParseError(f"{where} is not a JSON object with \"name\" and \"arguments\"")
    name = value.get("name")
    if not isinstance(name, str) or not name.strip():
        raise ToolCallParseError(f"{where} has no \"name\" string")
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as error:
            raise ToolCallParseError(f"the arguments of {name!r} are not valid JSON: {error.msg}") from None
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        raise ToolCallParseError(f"the arguments of {name!r} must be a JSON object, got {type(arguments).__name__}")
    return ToolCall(name=name.strip(), arguments=arguments)


def _load_json(text: str, where: str) -> Any:
    if len(text) > MAX_ARGUMENTS_CHARS:
        raise ToolCallParseError(f"{where} is longer than {MAX_ARGUMENTS_CHARS} characters")
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise ToolCallParseError(f"{where} is not valid JSON ({error.msg} at character {error.pos})") from None


def _describe_tools(tools: Sequence[dict]) -> str:
    """One JSON line per tool (the OpenAI function schema), as templates that render tools do."""
    return "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)


class ToolCallFormat:
    """The interface of a tool-call format; subclass it and give `parse` and `render`."""

    name: str = ""
    stop_strings: tuple[str, ...] = ()
    """Where generation may stop: after the first call, as a turn makes one."""

    def parse(self, reply: str) -> ParsedReply:
        """The reply's calls and the text around them; ToolCallParseError when a call is there
        but cannot be read (a reply with no call at all parses to no calls)."""
        raise NotImplementedError

    def render(self, calls: Sequence[ToolCall], content: str = "") -> str:
        """A reply that says `content` and makes `calls`, as this format writes it."""
        raise NotImplementedError

    def tools_prompt(self, tools: Sequence[dict]) -> str:
        """What a system message says of the tools when the chat template does not render them."""
        raise NotImplementedError

    def tool_result(self, result: str) -> str:
        """The text of the message that carries a tool's result back to the model."""
        return result

    def tool_result_content(self, message: str) -> str:
        """The inverse of `tool_result`: the result a message carries (the message itself when it
        is not a tool result)."""
        return message


class HermesFormat(ToolCallFormat):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call."""

    name = "hermes"
    stop_strings = ("</tool_call>",)
    _BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def parse(self, reply: str) -> ParsedReply:
        calls = []
        for index, match in enumerate(self._BLOCK.finditer(reply)):
            where = f"tool call {index + 1}" if index else "the tool call"
            calls.append(tool_call_from_object(_load_json(match.group(1).strip(), where), where))
        rest = self._BLOCK.sub("", reply)
        if "<tool_call>" in rest:
            raise ToolCallParseError("a <tool_call> is not closed: end each call with </tool_call>")
        if "</tool_call>" in rest:
            raise ToolCallParseError("a </tool_call> has no <tool_call> before it")
        return ParsedReply(content=rest.strip(), calls=tuple(calls))

    def render(self, calls: Sequence[ToolCall], content: str = "") -> str:
        blocks = [
            "<tool_call>\n" + json.dumps({"name": call.name, "arguments": call.arguments}, ensure_ascii=False)
            + "\n</tool_call>"
            for call in calls
        ]
        return "\n".join(([content.strip()] if content.strip() else []) + blocks)

    def tools_prompt(self, tools: Sequence[dict]) -> str:
        return (
            "You may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
            f"{_describe_tools(tools)}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within "
            "<tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
        )

    def tool_result(self, result: str) -> str:
        return f"<tool_response>\n{result}\n</tool_response>"

    def tool_result_content(self, message: str) -> str:
        opening, closing = "<tool_response>\n", "\n</tool_response>"
        if message.startswith(opening) and message.endswith(closing):
            return message[len(opening):-len(closing)]
        return message


class JsonFormat(ToolCallFormat):
    """The whole reply is a call as a JSON object (or a list of them), maybe in a ```json fence."""

    name = "json"
    _FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)

    def parse(self, reply: str) -> ParsedReply:
        text = reply.strip()
        fenced = self._FENCE.match(text)
        if fenced:
            text = fenced.group(1)
        if not text.startswith(("{", "[")):
            return ParsedReply(content=reply.strip(), calls=())
        value = _load_json(text, "the reply")
        values = value if isinstance(value, list) else [value]
        if not values:
            raise ToolCallParseError("the reply is an empty list of calls")
        calls = [tool_call_from_object(item, f"call {index + 1} of the reply" if len(values) > 1 else "the reply")
                 for index, item in enumerate(values)]
        return ParsedReply(content="", calls=tuple(calls))

    def render(self, calls: Sequence[ToolCall], content: str = "") -> str:
        if content.strip():
            raise ValueError("the json format's reply is the calls alone: it has no room for text")
        objects = [{"name": call.name, "arguments": call.arguments} for call in calls]
        return json.dumps(objects[0] if len(objects) == 1 else objects, ensure_ascii=False)

    def tools_prompt(self, tools: Sequence[dict]) -> str:
        return (
            "You have access to the following functions:\n"
            f"{_describe_tools(tools)}\n\n"
            "To call a function, reply with only a JSON object of the form "
            '{"name": <function-name>, "arguments": <args-json-object>} and nothing else.'
        )


def _check_format(name: str, part: Any) -> None:
    missing = [method for method in ("parse", "render", "tools_prompt", "tool_result")
               if not callable(getattr(part, method, None))]
    if missing:
        raise TypeError(
            f"tool-call format {name!r} ({part!r}) lacks {', '.join(missing)}: subclass "
            "longhorizon.envs.tool_calls.ToolCallFormat"
        )


TOOL_CALL_FORMATS: Registry = Registry(
    "tool-call format",
    "longhorizon.tool_call_formats",
    {"hermes": "longhorizon.envs.tool_calls:HermesFormat", "json": "longhorizon.envs.tool_calls:JsonFormat"},
    check=_check_format,
)


class ToolCallFormatError(ValueError):
    """A tool-call format cannot be found; the message names those that exist."""


def get_tool_call_format(name: str) -> ToolCallFormat:
    """The format called `name` (or found at the dotted path `name`), ready to use."""
    try:
        part = TOOL_CALL_FORMATS.get(name)
    except PluginError as error:
        raise ToolCallFormatError(str(error)) from error
    return part() if isinstance(part, type) else part


def tool_call_format_names() -> list[str]:
    return TOOL_CALL_FORMATS.names()


def to_openai(calls: Sequence[ToolCall], id_prefix: str = "call") -> list[dict]:
    """Calls as an OpenAI chat message's `tool_calls` (arguments as a JSON string); a call
    without an id gets `<id_prefix>_<n>`."""
    return [
        {
            "id": call.call_id or f"{id_prefix}_{index}",
            "type": "function",
            "function": {"name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)},
        }
        for index, call in enumerate(calls)
    ]
