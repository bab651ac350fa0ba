"""The training gateway's sessions: an outside agent's chat calls, recorded token for token, as trajectories.

An agent written for the OpenAI API (its own framework, its own loop) plays an episode as a series
of chat calls sharing a session id. For each call the gateway renders the prompt, samples the reply
with the engine and records the exact prompt tokens, sampled tokens, their log-probs and the policy
version; when the harness posts the session's reward, the session becomes one trajectory for the
learner, in the group of its task.

Token fidelity. A model must be trained on the tokens it sampled, not on a re-tokenised rendering
of their text. When the next call's messages are the last call's messages, then the assistant
message the gateway returned (same text, same tool calls), then new messages (a user message, or
the results of the tools it called), the gateway keeps its own record of the sampled tokens and
appends only the template tokens of the new messages: the next prompt is the conversation so far,
exactly, and the session stays one sample. When the agent sends anything else (it edited or
re-rendered the history, dropped a reasoning block, inserted a message), that is a *history
break*, counted per session and in the gateway's stats. `on_history_break = "split"` starts a new
segment from the full rendering of the new messages, and the trajectory then trains each reply in
the context it was sampled in (a sample per turn, all sharing the session's reward);
`"refuse"` answers the call with an error the agent can read, and the session keeps its record.

Tool calls are parsed from the reply with a tool-call format (envs/tool_calls.py) and returned as
OpenAI `tool_calls`; tool results come back in the format's tool-result layout (for `hermes`, the
`<tool_response>` turn Qwen's template writes). A template that renders no tools (SmolLM2's) is
given them in the system message, as the tools agent loop does.

Images: on a vision-language model a user message may hold `image_url` parts (base64 data URLs);
each call shows the engine every image its prompt holds, and the trajectory carries them with the
offset of the piece of tokens that shows each (`Trajectory.image_offsets`).

Groups: a session opened for a task joins that task's open group until it holds `group_size`
sessions, so GRPO compares sessions of one task. Sessions that never finish time out and are
counted; the learner's partial-group rules handle the group they leave short.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from longhorizon.common.chat import ContentError, TokenRecord, check_images, content_parts
from longhorizon.common.chat import takes_images as tokenizer_takes_images
from longhorizon.common.codec import pack_arrays
from longhorizon.common.wire import Trajectory
from longhorizon.envs.tool_calls import ToolCall, ToolCallFormat, ToolCallParseError, to_openai, tool_call_from_object


class GatewayError(Exception):
    """A request the gateway refuses: an HTTP status, an OpenAI-style error type and code, and a
    message the agent can read."""

    def __init__(self, status: int, message: str, code: str, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.kind = kind

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "code": self.code, "param": None}}


@dataclass(frozen=True)
class GatewaySettings:
    group_size: int
    max_context_tokens: int
    max_new_tokens: int
    on_history_break: str = "split"
    """"split" (a new segment) or "refuse" (an error to the agent)."""
    session_idle_timeout_s: float = 600.0
    actor_id: str = "gateway"
    env_name: str = "gateway"


def message_parts(message: dict) -> tuple[str, list[bytes]]:
    """A message's text and images: its content a string, or OpenAI's list of parts (text parts
    joined by newlines; `image_url` parts, base64 data URLs, in user messages)."""
    try:
        return content_parts(message.get("content"), message.get("role", "user"))
    except ContentError as error:
        raise GatewayError(400, str(error), error.code) from None


def message_text(message: dict) -> str:
    return message_parts(message)[0]


def message_images(messages: Sequence[dict]) -> list[bytes]:
    """The images of `messages`, in order."""
    return [image for message in messages for image in message_parts(message)[1]]


def message_calls(message: dict) -> tuple[ToolCall, ...]:
    """The tool calls of an assistant message in OpenAI's shape (arguments as a JSON string)."""
    calls = []
    for index, call in enumerate(message.get("tool_calls") or ()):
        function = call.get("function") if isinstance(call, dict) else None
        try:
            parsed = tool_call_from_object(function, f"tool call {index + 1} of an assistant message")
        except ToolCallParseError as error:
            raise GatewayError(400, str(error), "invalid_tool_calls") from None
        calls.append(ToolCall(parsed.name, parsed.arguments, str(call.get("id", ""))))
    return tuple(calls)


def _same_message(first: dict, second: dict) -> bool:
    """Whether two chat messages say the same: role, text and tool calls (ids aside)."""
    def key(message: dict):
        calls = tuple((call.name, json.dumps(call.arguments, sort_keys=True)) for call in message_calls(message))
        text, images = message_parts(message)
        return message.get("role"), text.strip(), calls, tuple(images)
    return key(first) == key(second)


def check_messages(messages: Any, takes_images: bool = False) -> list[dict]:
    """The request's messages, checked: a non-empty list of role/content objects; images only for
    a model that takes them, and only readable ones."""
    if not isinstance(messages, list) or not messages:
        raise GatewayError(400, "messages must be a non-empty list", "invalid_messages")
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ("system", "developer", "user", "assistant", "tool"):
            raise GatewayError(400, f"messages[{index}] needs a role of system, user, assistant or tool", "invalid_messages")
        _, images = message_parts(message)
        if images and not takes_images:
            raise GatewayError(400, "the model takes no images (its folder has no image processor, or its engine "
                               "shows none)", "unsupported_content")
        try:
            check_images(images)
        except ContentError as error:
            raise GatewayError(400, f"messages[{index}]: {error}", error.code) from None
        if message["role"] == "assistant":
            message_calls(message)
    return messages


def check_tools(tools: Any) -> list[dict] | None:
    """The request's tools: None, or a list of OpenAI function tools each with a name."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise GatewayError(400, "tools must be a list of function tools", "invalid_tools")
    for index, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict) \
                or not isinstance(function.get("name"), str) or not function["name"] \
                or not isinstance(function.get("parameters", {}), dict):
            raise GatewayError(400, f"tools[{index}] must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                               "\"parameters\": {...}}}}", "invalid_tools")
    return tools or None


class ChatRenderer:
    """Messages (and tools) as the model's prompt tokens, and the tokens that follow a reply."""

    def __init__(self, tokenizer: Any, tool_format: ToolCallFormat, takes_images: bool | None = None) -> None:
        self.tokenizer = tokenizer
        self.tool_format = tool_format
        self.template_tools = bool(getattr(tokenizer, "renders_tools", False))
        self.takes_images = tokenizer_takes_images(tokenizer) if takes_images is None else takes_images
        """Whether user messages may hold images (a vision-language model on an engine that shows them)."""

    def template_messages(self, messages: Sequence[dict], tools: list[dict] | None) -> list[dict]:
        """What the chat template is given: messages as text; where it renders no tools, the tool
        schemas in the system message, calls in the reply text and results in user turns."""
        rendered: list[dict] = []
        for message in messages:
            role, (text, images) = message["role"], message_parts(message)
            role = "system" if role == "developer" else role
            if role == "assistant" and message.get("tool_calls"):
                rendered.append({"role": "assistant", "content": self._reply_text(text, message_calls(message))})
            elif role == "tool":
                rendered.append({"role": "user", "content": self.tool_format.tool_result(text)})
            else:
                rendered.append({"role": role, "content": text, **({"images": images} if images else {})})
        if tools and not self.template_tools:
            described = self.tool_format.tools_prompt(tools)
            if rendered[0]["role"] == "system":
                rendered[0] = {"role": "system", "content": f"{rendered[0]['content']}\n\n{described}".strip()}
            else:
                rendered.insert(0, {"role": "system", "content": described})
        return rendered

    def _reply_text(self, text: str, calls: Sequence[ToolCall]) -> str:
        try:
            return self.tool_format.render(calls, content=text)
        except ValueError:
            return self.tool_format.render(calls)

    def prompt_tokens(self, messages: Sequence[dict], tools: list[dict] | None) -> list[int]:
        rendered = self.template_messages(messages, tools)
        if tools and self.template_tools:
            return list(self.tokenizer.prompt_tokens(rendered, tools=tools))
        return list(self.tokenizer.prompt_tokens(rendered))

    def continuation_tokens(self, new_messages: Sequence[dict], stopped_on_eos: bool) -> list[int] | None:
        """The tokens after a reply for what the agent added (one user message, or the results
        of its tool calls as one turn), or None when that is not what it added."""
        roles = [message["role"] for message in new_messages]
        images: list[bytes] = []
        if roles == ["user"]:
            text, images = message_parts(new_messages[0])
        elif roles and all(role == "tool" for role in roles):
            text = "\n".join(self.tool_format.tool_result(message_text(m)) for m in new_messages)
        else:
            return None
        if images:  # the tokenizer's signature has images only where it takes them
            return list(self.tokenizer.continuation_tokens(text, stopped_on_eos=stopped_on_eos, images=images))
        return list(self.tokenizer.continuation_tokens(text, stopped_on_eos=stopped_on_eos))

    def reply(self, text: str) -> tuple[str, tuple[ToolCall, ...]]:
        """A sampled reply as (content, tool calls); text whose calls cannot be read is content."""
        try:
            parsed = self.tool_format.parse(text)
        except ToolCallParseError:
            return text, ()
        return parsed.content, parsed.calls


@dataclass(kw_only=True)
class Session(TokenRecord):
    """One agent episode: its calls' tokens, as one conversation per segment."""

    session_id: str
    task_id: str
    group_id: str
    group_size: int
    horizon_cap: int
    created: float = field(default_factory=time.monotonic)
    last_active: float = field(default_factory=time.monotonic)
    first_prompt_length: int = 0
    segment_start: int = 0
    windows: list[tuple[int, int, int]] = field(default_factory=list)
    """Per reply: (its segment's start, reply start, reply end) in token_ids."""
    calls: int = 0
    history_breaks: int = 0
    last_messages: list[dict] | None = None
    """The last call's messages followed by the assistant message the gateway returned."""
    last_response: dict | None = None
    """What the last chat call answered: a resend of that call (a client that retried after its
    connection dropped, the reply lost on the way) gets it again instead of a new reply."""
    last_stopped_on_eos: bool = True
    generation_seconds: float = 0.0
    turn_rewards: list[float] = field(default_factory=list)
    images: list[bytes] = field(default_factory=list)
    """The images in token_ids (a vision-language model's), in the order of their tokens."""
    image_offsets: list[int] = field(default_factory=list)
    """Where the piece of token_ids that shows each image begins (Trajectory.image_offsets)."""
    finished: bool = False
    busy: bool = False
    """A call of the session is being answered: another one, or its reward, must wait for it."""


@dataclass
class GatewayCounters:
    sessions_opened: int = 0
    sessions_finished: int = 0
    sessions_expired: int = 0
    calls: int = 0
    history_breaks: int = 0
    calls_refused: int = 0
    calls_resent: int = 0
    """Calls that repeated the session's last call (a client's retry), answered with its reply."""


class SessionBook:
    """Every live session of one gateway: opened, extended call by call, finished into trajectories.

    Not thread-safe: one event loop owns it (the gateway's), and a session's calls are handled in
    the order they arrive (an agent waits for each reply before its next call)."""

    def __init__(self, settings: GatewaySettings, renderer: ChatRenderer) -> None:
        self.settings = settings
        self.renderer = renderer
        self.sessions: dict[str, Session] = {}
        self.counters = GatewayCounters()
        self._open_groups: dict[str, tuple[str, int]] = {}  # task id -> (group id, sessions in it)
        self._groups_made = 0

    def open(self, session_id: str | None, task_id: str | None, horizon_cap: int) -> Session:
        """A new session (an id made up when none is given); `task_id` picks its group."""
        session_id = session_id or uuid.uuid4().hex
        if session_id in self.sessions:
            raise GatewayError(409, f"session {session_id!r} already exists", "session_exists")
        task_id = task_id or session_id
        group_id, members = self._open_groups.get(task_id, ("", self.settings.group_size))
        if members >= self.settings.group_size:
            self._groups_made += 1
            group_id, members = f"{self.settings.actor_id}-g{self._groups_made}", 0
        self._open_groups[task_id] = (group_id, members + 1)
        session = Session(session_id=session_id, task_id=task_id, group_id=group_id,
                          group_size=self.settings.group_size, horizon_cap=horizon_cap)
        self.sessions[session_id] = session
        self.counters.sessions_opened += 1
        return session

    def get(self, session_id: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None:
            raise GatewayError(404, f"no open session {session_id!r} (finished, expired or never opened)",
                               "session_not_found")
        return session

    @contextlib.contextmanager
    def calling(self, session: Session):
        """Hold the session for one call: a second call or a reward meanwhile is refused (its
        record would be built from a history that is about to change), and the session is not
        idle while its reply is generated."""
        if session.busy:
            raise GatewayError(409, f"session {session.session_id!r} has a call in progress: wait for its reply",
                               "session_busy")
        session.busy = True
        session.last_active = time.monotonic()
        try:
            yield session
        finally:
            session.busy = False
            session.last_active = time.monotonic()

    def prompt_for(self, session: Session, messages: list[dict], tools: list[dict] | None) -> tuple[list[int], bool]:
        """The prompt tokens for a session's next call and whether it continues the record (False:
        a new segment starts with it). Refuses a call past the horizon cap or one that cannot fit
        the context, and a history break when configured to."""
        if session.calls >= session.horizon_cap:
            self.counters.calls_refused += 1
            raise GatewayError(400, f"session {session.session_id!r} has made {session.calls} calls, the horizon cap: "
                               "end the episode and post its reward", "horizon_cap_reached")
        continuation = self._continuation(session, messages)
        if continuation is not None:
            return list(session.token_ids[session.segment_start:]) + continuation, True
        if session.calls and self.settings.on_history_break == "refuse":
            self.counters.calls_refused += 1
            raise GatewayError(400, "the messages are not this session's history followed by new messages: "
                               "send back every earlier message and the assistant's replies as they were",
                               "history_break")
        return self.renderer.prompt_tokens(messages, tools), False

    def prompt_images(self, session: Session, messages: list[dict], continues: bool) -> list[bytes]:
        """The images a call's prompt shows (`prompt_for`'s tokens hold them): the segment's so
        far and the new messages' when it continues the record, else every message's."""
        if not continues:
            return message_images(messages)
        before = [image for image, offset in zip(session.images, session.image_offsets)
                  if offset >= session.segment_start]
        return before + message_images(messages[len(session.last_messages or ()):])

    def resent(self, session: Session, messages: list[dict]) -> dict | None:
        """The answer already given, when `messages` are exactly the last call's (a retry)."""
        before = session.last_messages
        if session.last_response is None or before is None or len(messages) != len(before) - 1:
            return None
        return session.last_response if all(_same_message(old, new) for old, new in zip(before, messages)) else None

    def _continuation(self, session: Session, messages: list[dict]) -> list[int] | None:
        before = session.last_messages
        if before is None or len(messages) <= len(before):
            return None
        if not all(_same_message(old, new) for old, new in zip(before, messages)):
            return None
        return self.renderer.continuation_tokens(messages[len(before):], session.last_stopped_on_eos)

    def check_fits(self, prompt_length: int, max_tokens: int) -> None:
        if prompt_length + max_tokens > self.settings.max_context_tokens:
            self.counters.calls_refused += 1
            raise GatewayError(400, f"the prompt has {prompt_length} tokens: with max_tokens = {max_tokens} it does "
                               f"not fit the context of {self.settings.max_context_tokens} tokens",
                               "context_length_exceeded")

    def record(self, session: Session, messages: list[dict], prompt: list[int], continues: bool, generation: Any,
               reply_message: dict, seconds: float) -> None:
        """A call's prompt and sampled reply, added to the session's record."""
        images = message_images(messages[len(session.last_messages or ()):] if continues else messages)
        session.images += images
        session.image_offsets += [len(session.token_ids)] * len(images)  # where this call's prompt piece begins
        if continues:
            session.append_tokens(prompt[len(session.token_ids) - session.segment_start:], generated=False)
        else:
            if session.calls:
                session.history_breaks += 1
                self.counters.history_breaks += 1
            session.segment_start = len(session.token_ids)
            if not session.calls:
                session.first_prompt_length = len(prompt)
            session.append_tokens(prompt, generated=False)
        reply_start = len(session.token_ids)
        session.append_tokens(generation.token_ids, generated=True, logprobs=generation.logprobs,
                              policy_version=generation.policy_version)
        session.windows.append((session.segment_start, reply_start, len(session.token_ids)))
        session.last_messages = [*messages, reply_message]
        session.last_stopped_on_eos = bool(generation.stopped_on_eos)
        session.calls += 1
        session.generation_seconds += seconds
        session.last_active = time.monotonic()
        self.counters.calls += 1

    def finish(self, session_id: str, reward: float, *, success: bool | None = None,
               truncated: bool = False) -> Trajectory:
        """The session, ended with its reward, as a trajectory (and forgotten)."""
        session = self.get(session_id)
        if session.busy:
            raise GatewayError(409, f"session {session_id!r} has a call in progress: post its reward after the reply",
                               "session_busy")
        if not session.calls:
            raise GatewayError(400, f"session {session_id!r} made no call: there is nothing to train on", "empty_session")
        del self.sessions[session_id]
        session.finished = True
        self.counters.sessions_finished += 1
        return session_trajectory(session, reward, success=reward > 0 if success is None else success,
                                  truncated=truncated, settings=self.settings)

    def expire(self, now: float | None = None) -> list[str]:
        """Forget sessions idle for longer than the timeout; their ids."""
        now = time.monotonic() if now is None else now
        idle = [sid for sid, s in self.sessions.items()
                if not s.busy and now - s.last_active > self.settings.session_idle_timeout_s]
        for session_id in idle:
            del self.sessions[session_id]
        self.counters.sessions_expired += len(idle)
        return idle


def session_trajectory(session: Session, reward: float, *, success: bool, truncated: bool,
                       settings: GatewaySettings) -> Trajectory:
    """A finished session as the learner's Trajectory: one sample when it never broke its history,
    else a sample per reply in the context it was sampled in (prompt_length 0: each window holds
    its whole context)."""
    arrays = pack_arrays({
        "token_ids": np.asarray(session.token_ids, np.int32),
        "loss_mask": np.asarray(session.loss_mask, np.uint8),
        "behaviour_logprobs": np.asarray(session.behaviour_logprobs, np.float32),
        "policy_versions": np.asarray(session.policy_versions, np.int32),
    })
    split = session.history_breaks > 0
    return Trajectory(
        trajectory_id=uuid.uuid4().hex,
        actor_id=settings.actor_id,
        env_name=settings.env_name,
        task_id=session.task_id,
        group_id=session.group_id,
        group_size=session.group_size,
        token_ids=arrays["token_ids"],
        loss_mask=arrays["loss_mask"],
        behaviour_logprobs=arrays["behaviour_logprobs"],
        policy_versions=arrays["policy_versions"],
        prompt_length=0 if split else session.first_prompt_length,
        reward=float(reward),
        turn_rewards=[0.0] * (session.calls - 1) + [float(reward)],
        num_turns=session.calls,
        horizon_cap=session.horizon_cap,
        terminated=not truncated,
        truncated=truncated,
        success=bool(success),
        generation_seconds=session.generation_seconds,
        env_seconds=max(0.0, time.monotonic() - session.created - session.generation_seconds),
        sample_windows=[index for window in session.windows for index in window] if split else [],
        cut_by="horizon" if truncated else "",
        images=list(session.images),
        image_offsets=list(session.image_offsets),
    )


def reply_message(renderer: ChatRenderer, text: str) -> tuple[dict, str]:
    """The assistant message returned for a sampled reply, and its finish reason."""
    content, calls = renderer.reply(text)
    if calls:
        calls = tuple(ToolCall(c.name, c.arguments, f"call_{uuid.uuid4().hex[:24]}") for c in calls)
        return {"role": "assistant", "content": content or None, "tool_calls": to_openai(calls)}, "tool_calls"
    return {"role": "assistant", "content": content}, "stop"
