"""Agent loops: how a model and an environment talk, turn by turn.

An agent loop owns the three things between the model's tokens and the env's text:
- the prompt format: the first messages, built from the env's instructions and the task's first
  observation;
- action parsing: the one env action inside a reply, or an ActionParseError whose error
  observation tells the model how to answer (the turn still counts, the env is not stepped);
- what the model sees of the history for its next turn (everything, by default).

Built-in loops; the first two are named after the prompt formats the envs declare
(`Env.prompt_format`):
- `react`: the model writes `Thought:` ... `Action:` ...; the action is the first non-empty line
  after `Action:`. More than one `Action:` is an error (the reference counts it as one too).
- `bare`: the whole reply, stripped, is the action.
- `tools`: the model calls the env's actions as tools (envs/tools.py), written in a tool-call
  format (envs/tool_calls.py: `hermes`, `json`, or a plug-in); the chat template renders the tool
  schemas where it can, else the format describes them in the system message. A reply with no
  call, several calls, a garbled call or wrong arguments is an invalid action whose observation
  is the parser's reason.

A loop may declare `Options` (a `common.config.Section`): `actor.agent_options` is checked against
it before any process starts, and the loop is made with the checked options. A loop that needs
the env or the tokenizer of an episode (the `tools` loop: the env's tools, whether the template
renders them) gives `for_episode(env, tokenizer)`, which returns the loop the episode runs.

Loops are found by name like every other part (common/plugins.py): the built-ins, parts
registered in this process, the `longhorizon.agents` entry-point group, or a dotted path
`package.module:attribute`. `actor.agent` picks one; left empty, each env gets the loop named by
its own `prompt_format`. A reply that cannot be parsed never reaches the environment and never
crashes the actor.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import field_validator

from longhorizon.common.chat import ConversationView, TokenConversation
from longhorizon.common.config import ConfigError, Section, check_section
from longhorizon.common.plugins import PluginError, Registry
from longhorizon.envs.tool_calls import ToolCallFormatError, ToolCallParseError, get_tool_call_format
from longhorizon.envs.tools import ToolArgumentError, ToolSet, call_for_action, env_tool_set

_ACTION_MARKER = re.compile(r"(?im)^\s*\**\s*action\s*\**\s*:")
_MAX_ACTION_CHARS = 1000
# A bare reply is the whole action, reasoning included (e.g. the search env's <think> before its
# <search> tag), so it may be long; the env reads what it needs from it.
_MAX_BARE_REPLY_CHARS = 16000


class ActionParseError(ValueError):
    """The reply holds no usable action; the message is shown to the model."""


class AgentLoopError(ValueError):
    """An agent loop cannot be found or loaded; the message says which loops exist."""


class AgentLoop:
    """The interface of an agent loop, with the behaviour the built-ins share as defaults.

    Subclass it and override what differs (at least `parse_action`). One loop object serves
    every episode of a run at once, so it keeps no per-episode state: what it needs of an
    episode is in the conversation it is given.
    """

    name: str = ""

    def first_messages(self, instructions: str, observation: str) -> list[dict]:
        """The messages that open an episode: the env's instructions as the system message (none
        when empty) and the task's first observation as the user message."""
        messages = []
        if instructions:
            messages.append({"role": "system", "content": instructions})
        messages.append({"role": "user", "content": observation})
        return messages

    def parse_action(self, reply: str) -> str:
        """The env action inside the model's reply; raise ActionParseError when there is none."""
        raise NotImplementedError

    def error_observation(self, error: ActionParseError) -> str:
        """What the model is told instead of an env step when its reply could not be parsed."""
        return f"Invalid reply: {error}."

    def for_episode(self, env: Any, tokenizer: Any) -> "AgentLoop":
        """The loop an episode of `env` runs with the engine's `tokenizer` (this one, unless the
        loop needs either: the `tools` loop binds the env's tools here)."""
        return self

    def prompt_tools(self) -> list[dict] | None:
        """Tool schemas the chat template renders into the first prompt (None: none)."""
        return None

    def stop_strings(self, env: Any) -> tuple[str, ...]:
        """Where a reply may end before the end-of-turn token: the env's own stop strings."""
        return tuple(getattr(env, "stop_strings", ()))

    def env_observation(self, observation: str) -> str:
        """The text the model is shown for what an env step returned (the tools loop wraps it as
        the tool's result)."""
        return observation

    def model_view(self, conversation: TokenConversation) -> ConversationView:
        """What the model sees for its next turn. Build it only from the conversation's own views
        (`full_view`, `last_turns_view`): the model's tokens must never be decoded and
        tokenised again. A `last_turns_view` says where its turns begin, so the learner trains
        each reply in the context it was sampled in (a sample per turn); a view made any other way
        is taken for the whole history, and its replies are scored in the whole conversation (an
        off-policy gap the importance ratios will see)."""
        return conversation.full_view()


def parse_react_reply(reply: str) -> str:
    """The action after the single `Action:` marker of a react reply."""
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


def react_reasoning(reply: str) -> str:
    """The text of a react reply before its `Action:` marker, without the `Thought:` label."""
    marker = _ACTION_MARKER.search(reply)
    before = reply[: marker.start()] if marker else ""
    return re.sub(r"(?im)^\s*\**\s*thought\s*\**\s*:\s*", "", before, count=1).strip()


class ReactLoop(AgentLoop):
    """Thought, then one Action line; garbled replies are told the expected layout."""

    name = "react"

    def parse_action(self, reply: str) -> str:
        return parse_react_reply(reply)

    def error_observation(self, error: ActionParseError) -> str:
        return f"Invalid reply: {error}. Answer as:\nThought:\n<your reasoning>\n\nAction:\n<one command>"


class BareLoop(AgentLoop):
    """The whole reply is the action."""

    name = "bare"

    def parse_action(self, reply: str) -> str:
        action = reply.strip()
        if not action:
            raise ActionParseError("empty reply: write the action")
        return action[:_MAX_BARE_REPLY_CHARS]


class ToolsOptions(Section):
    format: str = "hermes"
    """How the model writes its calls: `hermes` (JSON in `<tool_call>` tags: Hermes, Qwen2.5,
    Qwen3), `json` (the reply is the call as a JSON object: Llama 3.1), a
    `longhorizon.tool_call_formats` entry point or `package.module:attribute`."""
    tools_in: Literal["auto", "template", "system"] = "auto"
    """Where the tool schemas are shown: `template` (the chat template renders them, as the model
    was trained), `system` (the format's description in the system message, for templates that
    render no tools, such as SmolLM2's) or `auto` (the template where it renders tools)."""

    @field_validator("format")
    @classmethod
    def _known_format(cls, name: str) -> str:
        try:
            get_tool_call_format(name)
        except ToolCallFormatError as error:
            raise ValueError(f"actor.agent_options.format: {error}") from None
        return name


def template_renders_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template shows tool schemas passed to it."""
    return bool(getattr(tokenizer, "renders_tools", False))


class ToolsLoop(AgentLoop):
    """The model calls the env's actions as tools, one call per turn."""

    name = "tools"
    Options = ToolsOptions
    needs_env_tools = True

    def __init__(self, options: ToolsOptions | None = None, *, tool_set: ToolSet | None = None,
                 template_tools: bool = False) -> None:
        self.options = options or ToolsOptions()
        self.format = get_tool_call_format(self.options.format)
        self.tool_set = tool_set
        self.template_tools = template_tools

    def for_episode(self, env: Any, tokenizer: Any) -> "ToolsLoop":
        renders = template_renders_tools(tokenizer)
        if self.options.tools_in == "template" and not renders:
            raise ValueError(
                "actor.agent_options.tools_in = \"template\", but the model's chat template renders no "
                "tools: use \"system\" (or \"auto\") to describe them in the system message")
        in_template = self.options.tools_in == "template" or (self.options.tools_in == "auto" and renders)
        return ToolsLoop(self.options, tool_set=env_tool_set(env), template_tools=in_template)

    def _tools(self) -> ToolSet:
        if self.tool_set is None:
            raise RuntimeError("the tools loop plays an episode once bound to its env: call for_episode(env, tokenizer)")
        return self.tool_set

    def first_messages(self, instructions: str, observation: str) -> list[dict]:
        """The env's instructions for tool-calling agents (not its text ones, which ask for
        another reply layout), with the tools described when the template does not show them."""
        tools = self._tools()
        system = tools.instructions
        if not self.template_tools:
            system = f"{system}\n\n{self.format.tools_prompt(tools.schemas())}" if system else \
                self.format.tools_prompt(tools.schemas())
        return [{"role": "system", "content": system}, {"role": "user", "content": observation}]

    def prompt_tools(self) -> list[dict] | None:
        return self._tools().schemas() if self.template_tools else None

    def stop_strings(self, env: Any) -> tuple[str, ...]:
        """The format's (after the first call), not the env's: those end its text actions."""
        return tuple(getattr(self.format, "stop_strings", ()))

    def parse_action(self, reply: str) -> str:
        tools = self._tools()
        try:
            calls = self.format.parse(reply).calls
        except ToolCallParseError as error:
            raise ActionParseError(str(error)) from None
        if not calls:
            raise ActionParseError(
                f"no tool call found: call one of the tools ({', '.join(t.name for t in tools.tools)})")
        if len(calls) > 1:
            raise ActionParseError(f"{len(calls)} tool calls in one reply: make exactly one call per turn")
        try:
            return tools.action_for(calls[0])
        except ToolArgumentError as error:
            raise ActionParseError(str(error)) from None

    def error_observation(self, error: ActionParseError) -> str:
        return f"Invalid tool call: {error}."

    def reply_for_action(self, action: str, reasoning: str = "") -> str:
        """The reply that calls the tool making the env action `action`, with `reasoning` before
        the call where the format has room for text: how an oracle written for text actions
        plays by tools (the scripted engine), and how its episodes become tool-call SFT data."""
        call = call_for_action(self._tools(), action)
        try:
            return self.format.render([call], content=reasoning)
        except ValueError:  # a format whose reply is the call alone
            return self.format.render([call])

    def env_observation(self, observation: str) -> str:
        return self.format.tool_result(observation)


_LOOP_METHODS = ("first_messages", "parse_action", "error_observation", "model_view")


def _check_agent_loop(name: str, part: Any) -> None:
    # A class is instantiated with no arguments on lookup; an object is used as it is.
    missing = [method for method in _LOOP_METHODS if not callable(getattr(part, method, None))]
    if missing:
        raise TypeError(
            f"agent loop {name!r} ({part!r}) lacks {', '.join(missing)}: subclass "
            "longhorizon.envs.agents.AgentLoop (or give it every method of that interface)"
        )


AGENT_LOOPS: Registry = Registry(
    "agent loop",
    "longhorizon.agents",
    {"react": "longhorizon.envs.agents:ReactLoop", "bare": "longhorizon.envs.agents:BareLoop",
     "tools": "longhorizon.envs.agents:ToolsLoop"},
    check=_check_agent_loop,
)


def register_agent_loop(name: str, loop: AgentLoop | type, *, replace: bool = False) -> None:
    """Make an agent loop (an object, or a class made with no arguments) available by name in
    this process; `unregister_agent_loop` forgets it."""
    AGENT_LOOPS.register(name, loop, replace=replace)


def unregister_agent_loop(name: str) -> None:
    AGENT_LOOPS.unregister(name)


def agent_options_schemas() -> dict:
    """The JSON schema of each built-in loop's declared options, by name (`longhorizon config
    schema`); loops that take none are left out."""
    schemas = {}
    for name in AGENT_LOOPS.builtin_names():
        declared = getattr(AGENT_LOOPS.get(name), "Options", None)
        if declared is not None:
            schemas[name] = declared.model_json_schema()
    return schemas


def agent_loop_names() -> list[str]:
    """Every agent loop name get_agent_loop accepts (dotted paths aside)."""
    return AGENT_LOOPS.names()


def get_agent_loop(name: str) -> AgentLoop:
    """The agent loop called `name` (or found at the dotted path `name`), ready to use."""
    try:
        part = AGENT_LOOPS.get(name)
    except PluginError as error:
        raise AgentLoopError(str(error)) from error
    return part() if isinstance(part, type) else part


def configured_agent(name: str, options: dict) -> AgentLoop | str:
    """The agent loop `actor.agent` and `actor.agent_options` ask for: the name itself when there
    are no options (looked up per env, "" being each env's own loop), else the loop made with its
    declared options checked (ConfigError with the key on a bad one)."""
    if not options:
        return name
    if not name:
        raise ConfigError("actor.agent_options needs actor.agent naming the loop they are for")
    try:
        part = AGENT_LOOPS.get(name)
    except PluginError as error:
        raise ConfigError(f"actor.agent: {error}") from None
    declared = getattr(part, "Options", None)
    if declared is None or not isinstance(part, type):
        raise ConfigError(f"agent loop {name!r} takes no options, got {', '.join(sorted(options))}")
    return part(check_section(declared, dict(options), "actor.agent_options"))


def agent_loop_for(env: Any, agent: AgentLoop | str = "") -> AgentLoop:
    """The loop an episode of `env` runs: `agent` when given (a loop or its name), else the loop
    named by the env's own prompt format."""
    if isinstance(agent, str):
        return get_agent_loop(agent or env.prompt_format)
    return agent


def episode_loop(loop: AgentLoop, env: Any, tokenizer: Any) -> AgentLoop:
    """The loop bound to one episode (`for_episode`, for loops that have it)."""
    bind = getattr(loop, "for_episode", None)
    return bind(env, tokenizer) if callable(bind) else loop


def parse_action(reply: str, prompt_format: str) -> str:
    """Extract the action from a model reply, or raise ActionParseError with a helpful message."""
    return _loop_for_format(prompt_format).parse_action(reply)


def error_observation(error: ActionParseError, prompt_format: str) -> str:
    """The observation shown instead of an environment step when the reply could not be parsed."""
    return _loop_for_format(prompt_format).error_observation(error)


def _loop_for_format(prompt_format: str) -> AgentLoop:
    try:
        return get_agent_loop(prompt_format)
    except AgentLoopError as error:
        raise ValueError(f"unknown prompt format {prompt_format!r} ({error})") from error
