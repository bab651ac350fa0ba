"""The training gateway's HTTP face: OpenAI-compatible routes (Starlette) served by Hypercorn on trio.

Routes:
- `POST /v1/chat/completions`: messages (and `tools`) rendered with the model's chat template; the
  reply's tool calls come back as `tool_calls` (finish_reason "tool_calls"); `stream: true`
  answers with server-sent events in OpenAI's chunk shapes. Every call is recorded in its session.
- `POST /v1/completions`: a prompt as text or token ids, recorded the same way; the reply's
  `token_ids` are the sampled ids, and a prompt of token ids that extends the session's tokens
  continues it.
- `GET /v1/models`: the served model and the weights version it holds.
- `POST /v1/sessions` `{"task_id", "session_id"}`: open a session explicitly (else the first call
  opens it); the answer says its group and horizon cap.
- `POST /v1/sessions/{id}/reward` `{"reward", "success", "truncated"}`: end the session; it goes to
  the learner as a trajectory.
- `GET /health`: live sessions and the gateway's counters.

A call names its session by the `X-Session-Id` header, else the request's `user` field, else the
API key (so an agent that only lets you set `api_key` can still be traced); its task by the
`X-Task-Id` header or `metadata.task_id`. Sampling is the run's (`actor.sampling`), whatever a
request asks: the learner corrects for the policy that sampled, which must be the one recorded.
Errors have OpenAI's body `{"error": {"message", "type", "code", "param"}}` and a 4xx status; a
bad request never ends the gateway or another session. Bodies over 32 MiB are refused with a 413.
The serving itself (Hypercorn on trio), error bodies and the body cap are in `actor/http_serving.py`,
shared with the model server.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections import deque
from pathlib import Path
from typing import Any, Awaitable, Callable

import trio

from longhorizon.actor.engines.base import GenerationRequest, capabilities_of
from longhorizon.actor.gateway import (
    ChatRenderer,
    GatewayError,
    GatewaySettings,
    SessionBook,
    check_messages,
    check_tools,
    reply_message,
)
from longhorizon.actor.http_serving import (
    MAX_BODY_BYTES,
    HTTPRefusal,
    error_response,
    listening_socket,
    read_body,
    serve_app,
)
from longhorizon.actor.worker import Actor
from longhorizon.common.chat import takes_images
from longhorizon.common.wire import Trajectory
from longhorizon.envs.tool_calls import ToolCallFormatError, get_tool_call_format

log = logging.getLogger(__name__)

_FINISHED_REMEMBERED = 4096  # finished session ids kept to tell "already finished" from "unknown"


class Gateway:
    """The gateway's behaviour behind its routes: sessions, generation, rewards."""

    def __init__(self, engine: Any, book: SessionBook, *, model_name: str,
                 horizon_cap: Callable[[], int | None],
                 on_trajectory: Callable[[Trajectory], Awaitable[None]]) -> None:
        self.engine = engine
        self.book = book
        self.model_name = model_name
        self.horizon_cap = horizon_cap
        self.on_trajectory = on_trajectory
        self.finished: deque[str] = deque(maxlen=_FINISHED_REMEMBERED)

    def session_of(self, headers: Any, body: dict, *, open_if_new: bool = True):
        session_id = headers.get("x-session-id") or (body.get("user") if isinstance(body.get("user"), str) else "")
        if not session_id:
            key = headers.get("authorization", "").removeprefix("Bearer ").strip()
            session_id = key if key and key != "EMPTY" else ""
        if not session_id:
            raise GatewayError(400, "no session: send an X-Session-Id header, the `user` field or the session id as "
                               "the API key", "missing_session")
        if session_id in self.book.sessions:
            return self.book.sessions[session_id]
        if session_id in self.finished:
            raise GatewayError(409, f"session {session_id!r} has already ended", "session_finished")
        if not open_if_new:
            return self.book.get(session_id)
        metadata = body.get("metadata") if isinstance(body.get("metadata"), dict) else {}
        return self.open(session_id, headers.get("x-task-id") or metadata.get("task_id"))

    def open(self, session_id: str | None, task_id: str | None):
        cap = self.horizon_cap()
        if cap is None:
            raise GatewayError(503, "the gateway is waiting for the learner's first horizon broadcast: retry shortly",
                               "not_ready", kind="server_error")
        return self.book.open(session_id, None if task_id is None else str(task_id), cap)

    async def generate(self, session, messages: list[dict], tools: list[dict] | None, stop: Any, max_tokens: Any):
        prompt, continues = self.book.prompt_for(session, messages, tools)
        limit = self.book.settings.max_new_tokens
        if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1):
            raise GatewayError(400, f"max_tokens must be a positive integer, got {max_tokens!r}", "invalid_max_tokens")
        self.book.check_fits(len(prompt), min(max_tokens or limit, limit))
        stop_strings = (stop,) if isinstance(stop, str) else tuple(s for s in (stop or ()) if isinstance(s, str))
        started = time.perf_counter()
        generation = await self.engine.generate(GenerationRequest(
            token_ids=prompt, episode_id=session.session_id, messages=messages, stop_strings=stop_strings,
            images=self.book.prompt_images(session, messages, continues)))
        return prompt, continues, generation, time.perf_counter() - started

    async def chat(self, headers: Any, body: dict) -> tuple[dict, Any]:
        messages = check_messages(body.get("messages"), self.book.renderer.takes_images)
        tools = check_tools(body.get("tools"))
        session = self.session_of(headers, body)
        with self.book.calling(session):
            resent = self.book.resent(session, messages)
            if resent is not None:
                self.book.counters.calls_resent += 1
                return resent, None
            prompt, continues, generation, seconds = await self.generate(
                session, messages, tools, body.get("stop"), body.get("max_completion_tokens", body.get("max_tokens")))
            message, finish = reply_message(self.book.renderer, generation.text)
            if not generation.stopped_on_eos and finish == "stop":
                finish = "length"
            self.book.record(session, messages, prompt, continues, generation, message, seconds)
        usage = {"prompt_tokens": len(prompt), "completion_tokens": len(generation.token_ids),
                 "total_tokens": len(prompt) + len(generation.token_ids)}
        response = {
            "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": self.model_name,
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
            "usage": usage,
            # What the learner will train on, for harnesses that check it.
            "policy_version": int(generation.policy_version), "session_id": session.session_id,
        }
        session.last_response = response
        return response, generation

    async def completion(self, headers: Any, body: dict) -> dict:
        prompt = body.get("prompt")
        if isinstance(prompt, str) and prompt:
            tokens = list(self.book.renderer.tokenizer.encode(prompt))
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                         for t in prompt):
            tokens = list(prompt)  # token ids: how a text session extends its tokens exactly
        else:
            raise GatewayError(400, "prompt must be a non-empty string or a list of token ids", "invalid_prompt")
        session = self.session_of(headers, body)
        recorded = session.token_ids[session.segment_start:]
        continues = bool(session.calls) and tokens[:len(recorded)] == recorded
        if session.calls >= session.horizon_cap:
            self.book.prompt_for(session, [], None)  # raises the horizon refusal
        if session.calls and not continues and self.book.settings.on_history_break == "refuse":
            raise GatewayError(400, "the prompt does not extend this session's tokens", "history_break")
        limit = self.book.settings.max_new_tokens
        self.book.check_fits(len(tokens), limit)
        with self.book.calling(session):
            started = time.perf_counter()
            generation = await self.engine.generate(GenerationRequest(token_ids=tokens, episode_id=session.session_id))
            self.book.record(session, [], tokens, continues, generation, {}, time.perf_counter() - started)
            session.last_messages = session.last_response = None  # a text session goes by its tokens
        return {
            "id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": self.model_name,
            "choices": [{"index": 0, "text": generation.text, "logprobs": None,
                         "finish_reason": "stop" if generation.stopped_on_eos else "length",
                         # The sampled ids: a next prompt of these after the last one's continues
                         # the session exactly (text would lose the end-of-turn token).
                         "token_ids": [int(t) for t in generation.token_ids]}],
            "usage": {"prompt_tokens": len(tokens), "completion_tokens": len(generation.token_ids),
                      "total_tokens": len(tokens) + len(generation.token_ids)},
            "policy_version": int(generation.policy_version), "session_id": session.session_id,
        }

    async def reward(self, session_id: str, body: dict) -> dict:
        reward = body.get("reward")
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or reward != reward or abs(reward) == float("inf"):
            raise GatewayError(400, f"reward must be a finite number, got {reward!r}", "invalid_reward")
        success = body.get("success")
        if success is not None and not isinstance(success, bool):
            raise GatewayError(400, f"success must be true or false, got {success!r}", "invalid_success")
        if session_id in self.finished:
            raise GatewayError(409, f"session {session_id!r} has already ended", "session_finished")
        trajectory = self.book.finish(session_id, float(reward), success=success,
                                      truncated=bool(body.get("truncated", False)))
        self.finished.append(session_id)
        self.engine.end_episode(session_id)
        await self.on_trajectory(trajectory)
        return {"session_id": session_id, "trajectory_id": trajectory.trajectory_id, "group_id": trajectory.group_id,
                "num_turns": trajectory.num_turns, "history_breaks": len(trajectory.sample_windows) > 0}


def _stream_events(response: dict):
    """A finished chat completion as OpenAI's stream of chunks (role, content, tool calls, finish)."""
    choice = response["choices"][0]
    message = choice["message"]
    base = {"id": response["id"], "object": "chat.completion.chunk", "created": response["created"],
            "model": response["model"]}

    def chunk(delta: dict, finish: str | None = None) -> str:
        return "data: " + json.dumps({**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}) + "\n\n"

    yield chunk({"role": "assistant", "content": ""})
    if message.get("content"):
        yield chunk({"content": message["content"]})
    for index, call in enumerate(message.get("tool_calls") or ()):
        yield chunk({"tool_calls": [{"index": index, **call}]})
    yield chunk({}, choice["finish_reason"])
    yield "data: [DONE]\n\n"


def gateway_app(gateway: Gateway):
    """The Starlette application of a gateway."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    async def body_of(request: Request) -> dict:
        raw = await read_body(request, MAX_BODY_BYTES)
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            raise GatewayError(400, "the request body is not valid JSON", "invalid_json") from None
        if not isinstance(body, dict):
            raise GatewayError(400, "the request body must be a JSON object", "invalid_json")
        return body

    def handled(handler):
        async def route(request: Request):
            try:
                return await handler(request)
            except GatewayError as error:
                return error_response(error.status, str(error), error.code, error.kind)
            except HTTPRefusal as refusal:
                return refusal.response()
            except Exception as error:  # an engine failure fails this call, not the gateway
                log.exception("gateway call failed")
                return error_response(500, f"{type(error).__name__}: {error}", "internal_error", "server_error")
        return route

    async def chat(request: Request):
        body = await body_of(request)
        response, _ = await gateway.chat(request.headers, body)
        if body.get("stream"):
            return StreamingResponse(_stream_events(response), media_type="text/event-stream")
        return JSONResponse(response)

    async def completions(request: Request):
        body = await body_of(request)
        if body.get("stream"):
            raise GatewayError(400, "stream is supported on /v1/chat/completions only", "unsupported_stream")
        return JSONResponse(await gateway.completion(request.headers, body))

    async def models(request: Request):
        return JSONResponse({"object": "list", "data": [{
            "id": gateway.model_name, "object": "model", "created": 0, "owned_by": "longhorizon",
            "policy_version": int(gateway.engine.policy_version)}]})

    async def open_session(request: Request):
        body = await body_of(request)
        session = gateway.open(body.get("session_id"), body.get("task_id"))
        return JSONResponse({"session_id": session.session_id, "task_id": session.task_id,
                             "group_id": session.group_id, "horizon_cap": session.horizon_cap}, status_code=201)

    async def reward(request: Request):
        return JSONResponse(await gateway.reward(request.path_params["session_id"], await body_of(request)))

    async def health(request: Request):
        return JSONResponse({"status": "ok", "sessions": len(gateway.book.sessions),
                             "policy_version": int(gateway.engine.policy_version),
                             **vars(gateway.book.counters)})

    return Starlette(routes=[
        Route("/v1/chat/completions", handled(chat), methods=["POST"]),
        Route("/v1/completions", handled(completions), methods=["POST"]),
        Route("/v1/models", handled(models), methods=["GET"]),
        Route("/v1/sessions", handled(open_session), methods=["POST"]),
        Route("/v1/sessions/{session_id}/reward", handled(reward), methods=["POST"]),
        Route("/health", handled(health), methods=["GET"]),
    ])


async def serve_gateway(gateway: Gateway, host: str, port: int, *,
                        task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve until cancelled; `task_status.started` gets the bound address ("http://host:port")."""

    async def expire_sessions() -> None:
        while True:
            await trio.sleep(min(30.0, gateway.book.settings.session_idle_timeout_s / 2))
            for session_id in gateway.book.expire():
                gateway.engine.end_episode(session_id)
                log.warning("gateway session %s expired: idle past the timeout", session_id)

    with listening_socket(host, port) as sock:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(expire_sessions)
            bound = await nursery.start(lambda task_status: serve_app(gateway_app(gateway), sock,
                                                                       task_status=task_status))
            task_status.started(bound[0])


class GatewayActor(Actor):
    """An actor whose episodes are the sessions of outside agents: it serves the gateway where
    the rollout loops would run, and takes weights, horizon and stop from the learner as any
    actor does."""

    @classmethod
    def check_config(cls, config: Any) -> None:
        """Before any process starts (ValueError): async mode and a known tool-call format."""
        if config.run.mode != "async":
            raise ValueError("actor.driver = \"gateway\" needs run.mode = \"async\": outside agents call when "
                             "they like, not once per learner version")
        try:
            get_tool_call_format(config.gateway.tool_format)
        except ToolCallFormatError as error:
            raise ValueError(f"gateway.tool_format: {error}") from None

    def _start_drivers(self, nursery: trio.Nursery) -> None:
        nursery.start_soon(self._serve)

    def stats(self):
        stats = super().stats()
        if self._gateway is not None:
            stats.history_breaks = self._gateway.book.counters.history_breaks
        return stats

    def gateway(self) -> Gateway:
        config = self.config
        settings = GatewaySettings(
            group_size=config.actor.group_size, max_context_tokens=config.actor.max_context_tokens,
            max_new_tokens=config.actor.sampling.max_new_tokens, on_history_break=config.gateway.on_history_break,
            session_idle_timeout_s=config.gateway.session_idle_timeout_s, actor_id=self.actor_id,
            env_name=config.env.name)
        # Images reach the model where its tokenizer can place them and its engine shows them.
        shows_images = capabilities_of(type(self.engine)).takes_images
        renderer = ChatRenderer(self.engine.tokenizer, get_tool_call_format(config.gateway.tool_format),
                                takes_images=takes_images(self.engine.tokenizer) and shows_images)
        model_name = config.gateway.model_name or Path(str(config.model.path)).name
        return Gateway(self.engine, SessionBook(settings, renderer), model_name=model_name,
                       horizon_cap=lambda: None if self.horizon is None else int(self.horizon.horizon_cap),
                       on_trajectory=self._send)

    _gateway: Gateway | None = None

    async def _serve(self) -> None:
        gateway_config = self.config.gateway
        port = gateway_config.port + self.actor_index if gateway_config.port else 0
        self._gateway = self.gateway()
        address_file = self.config.run_dir / "gateway" / f"{self.actor_id}.json"
        try:
            async with trio.open_nursery() as nursery:
                address = await nursery.start(serve_gateway, self._gateway, gateway_config.host, port)
                address_file.parent.mkdir(parents=True, exist_ok=True)
                address_file.write_text(json.dumps({"actor_id": self.actor_id, "url": f"{address}/v1"}))
                log.info("%s: gateway serving on %s/v1", self.actor_id, address)
        finally:
            # Gone with the server: an agent that finds no file for its address knows training
            # has ended, rather than waiting to see whether the address comes back.
            address_file.unlink(missing_ok=True)
