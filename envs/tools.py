"""An env's actions as tools: the schemas a tool-calling model is given, and calls back to actions.

An env that can be played by tool calls gives a `ToolSet` (its `tool_set()` method): instructions
for a tool-calling agent (what the world is; no reply layout, which the tools and the chat template
say), and one `EnvTool` per kind of action. Each tool has an OpenAI function schema and turns a
call's arguments into the env's own text action, so the env itself is untouched: the same
`step(action)` serves ReAct replies and tool calls, and the same oracle plays both.

Arguments are checked against the schema before the env sees them (a subset of JSON Schema: the
types, `enum`, `required`, no unknown keys): a call with a wrong argument is an invalid action
whose message names the argument, like a garbled reply.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from longhorizon.envs.tool_calls import ToolCall

_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
}


_TOP = "the arguments"  # `where` for a call's whole arguments object


class ToolArgumentError(ValueError):
    """A call names no such tool, or its arguments do not fit the tool's schema."""


def argument_problem(schema: dict, value: Any, where: str) -> str:
    """Why `value` does not fit `schema` ("" when it does), naming the argument at `where`."""
    expected = schema.get("type")
    if expected is not None:
        types = _JSON_TYPES.get(expected, ())
        # bool is an int in Python, never a JSON integer.
        if not isinstance(value, types) or (expected in ("integer", "number") and isinstance(value, bool)):
            return f"{where} must be a{'n' if expected[0] in 'aeiou' else ''} {expected}, got {value!r}"
    if "enum" in schema and value not in schema["enum"]:
        return f"{where} must be one of {', '.join(map(str, schema['enum']))}, got {value!r}"
    if "minimum" in schema and isinstance(value, (int, float)) and value < schema["minimum"]:
        return f"{where} must be at least {schema['minimum']}, got {value!r}"
    if expected == "array":
        if len(value) < schema.get("minItems", 0):
            return f"{where} needs at least {schema['minItems']} item(s)"
        for index, item in enumerate(value):
            problem = argument_problem(schema.get("items", {}), item, f"{where}[{index}]")
            if problem:
                return problem
    if expected == "object":
        properties = schema.get("properties", {})
        missing = [key for key in schema.get("required", ()) if key not in value]
        top = where == _TOP
        if missing:
            names = ", ".join(repr(key) for key in missing)
            return f"missing argument {names}" if top else f"{where} lacks {names}"
        unknown = [key for key in value if key not in properties]
        if unknown and not schema.get("additionalProperties", False):
            allowed = ", ".join(repr(key) for key in properties) or "none"
            return f"{'no' if top else where + ' has no'} argument {unknown[0]!r} (arguments: {allowed})"
        for key, item in value.items():
            if key in properties:
                inner = f"argument {key!r}" if top else f"{where}.{key}"
                problem = argument_problem(properties[key], item, inner)
                if problem:
                    return problem
    return ""


def object_schema(properties: dict[str, dict], required: Sequence[str] | None = None) -> dict:
    """The JSON schema of a tool's arguments: these properties, all required unless said."""
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties if required is None else required),
        "additionalProperties": False,
    }


@dataclass(frozen=True)
class EnvTool:
    """One kind of env action offered as a tool."""

    name: str
    description: str
    parameters: dict
    """JSON schema of the arguments (an object schema; `object_schema` builds one)."""
    action: Callable[[dict], str]
    """The env's text action for checked arguments."""
    arguments_of: Callable[[str], dict | None] = lambda action: None
    """The inverse: the arguments of the call that makes a text action, None when the action is
    not this tool's (oracles and recorded text episodes played back as tool calls)."""

    def schema(self) -> dict:
        """The tool as an OpenAI function tool."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


@dataclass(frozen=True)
class ToolSet:
    """An env's tools and the instructions a tool-calling agent gets instead of the env's own."""

    instructions: str
    tools: tuple[EnvTool, ...]

    def __post_init__(self) -> None:
        names = [tool.name for tool in self.tools]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"a tool set needs tools with distinct names, got {names}")

    def schemas(self) -> list[dict]:
        return [tool.schema() for tool in self.tools]

    def tool(self, name: str) -> EnvTool:
        for tool in self.tools:
            if tool.name == name:
                return tool
        raise ToolArgumentError(
            f"there is no tool {name!r}; the tools are {', '.join(tool.name for tool in self.tools)}")

    def action_for(self, call: ToolCall) -> str:
        """The env's text action for a call; ToolArgumentError says what is wrong with it."""
        tool = self.tool(call.name)
        problem = argument_problem(tool.parameters, call.arguments, _TOP)
        if problem:
            raise ToolArgumentError(f"{call.name}: {problem}")
        return tool.action(call.arguments)


def call_for_action(tool_set: ToolSet, action: str) -> ToolCall:
    """The call that makes a text action: the first tool that reads it (ValueError if none)."""
    for tool in tool_set.tools:
        arguments = tool.arguments_of(action)
        if arguments is not None:
            return ToolCall(tool.name, arguments)
    raise ValueError(f"no tool makes the action {action!r}")


def env_tool_set(env: Any) -> ToolSet:
    """The env's tools, or a ValueError saying that it has none."""
    tool_set = getattr(env, "tool_set", None)
    if not callable(tool_set):
        raise ValueError(
            f"env {getattr(env, 'name', type(env).__name__)!r} offers no tools (no tool_set() method): "
            "play it with a text agent loop (actor.agent = \"react\" or \"bare\")"
        )
    return tool_set()
