"""`longhorizon serve-model MODEL_DIR --port P`: a small OpenAI-compatible HTTP server for a local model.

It serves any local Hugging Face model folder through the `hf` engine on 127.0.0.1:
- `GET /v1/models`: the served model (and the version of the weights it holds);
- `POST /v1/completions`: prompt as text or token ids; returns the sampled token ids
  (`choices[i].token_ids`) and per-token log-probs in the shape vLLM's server uses
  (`logprobs.tokens` as `token_id:N` when `return_tokens_as_token_ids` is set); `logprobs: N`
  (0-5) puts the N most likely tokens at each position, and the sampled one, in `top_logprobs`;
- `POST /v1/chat/completions`: messages rendered with the model's chat template (a content is a
  string or a list of text parts and, for a vision-language model, `image_url` parts holding
  base64 `data:` URLs, shown to the model with the text); `logprobs: true`
  returns each token's log-prob, and `top_logprobs: N` (0-20) the N most likely tokens at each
  position, most likely first;
- `POST /v1/load_weights` `{"path": FOLDER, "version": N}`: load safetensors weights in place, so
  the `openai` engine can be used for training against this server. The folder is checked whole
  first (names, shapes, dtypes, finite values); weights that do not fit are refused with a 422
  whose error code is `weights_refused` (the problems under `problems`), counted
  (`weights_refused` in `/health` and `/v1/models`), and the server keeps serving its version;
- `GET /health`: `status` ("ok" while the generation worker runs; 503 once it has stopped), the
  model, the weights' `policy_version`, `queue_depth` (requests waiting for the worker),
  `requests_in_flight` (waiting or generating) and `weights_refused`;
- `GET /metrics`: Prometheus text format: requests by endpoint and status, prompt and generated
  tokens, weight loads and refusals, abandoned requests (counters), queue depth, requests in
  flight and policy version (gauges), and a histogram of request latency by endpoint.

Streaming: with `stream: true` both completion routes answer with server-sent events
(`Content-Type: text/event-stream`, one `data: {chunk}` event each, then `data: [DONE]`) in
OpenAI's chunk shapes: `chat.completion.chunk` (a first delta with the role, one content delta per
token, a last chunk with `finish_reason`) and `text_completion` (one text piece per token, then the
`finish_reason`). Tokens are sent as the batch samples them: the hf engine reports every decoding
step, so a streamed request shares its batch with the others and nothing waits for the whole
reply. Each token's chunk carries its log-probs when they were asked for, and its id in
`token_ids`. A token's text is found by decoding a short window of tokens, so a character made of
several tokens' bytes arrives whole with its last token; with `stop` strings the last characters
that could begin one are held back until the reply goes past them, and whatever the finished
reply has beyond what was sent comes just before the `finish_reason`, so the joined pieces equal
the unstreamed reply's text. `stream_options: {"include_usage": true}` adds a last chunk with the
usage and no choices. The stream uses chunked transfer encoding, so the connection stays open for
the next request. A request refused before generation, or whose generation fails before its
first token, gets the usual JSON error; a failure after that arrives as an `{"error": ...}` event.

HTTP: a Starlette app (`model_app`, written on anyio, so it runs on asyncio or trio) served by
uvicorn (`actor/http_serving.py`): the request handlers run in the event loop and wait for the
generation thread (`actor/model_batching.py`) without a thread each; bodies over 32 MiB are
refused with a 413. SIGINT or
SIGTERM stops the server gracefully: generation stops (requests under way and queued are answered
with a 503), then the server closes its connections.

Requests that arrive together are batched: one worker thread owns the model and runs every queued
request with the same sampling settings in one forward batch. Log-probs, the sampled token's and
the top ones alike, are those of the sampling distribution (temperature and top-p applied), like
the `hf` engine's: tokens that top-p leaves out cannot be drawn and are not listed, so a top list
may be shorter than asked. At temperature 0 (greedy) they are the model's own distribution, and
the chosen token is the first of each top list. Bad requests get a 4xx JSON error in the OpenAI
shape, `{"error": {"message", "type", "code", "param"}}`.

A client that closes its connection before its reply is ready (a timeout, a cancelled agent step)
is not generated for any more: a queued request is dropped, and its rows in a running batch end
at the next decoding step. The server hears of it as soon as the connection closes, whether the
request waits for its reply or streams it. They are counted in `requests_abandoned_total`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import queue
import signal
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from longhorizon.actor.engines.base import tokens_through_stop_string
from longhorizon.actor.http_serving import (
    MAX_BODY_BYTES,
    HTTPRefusal,
    HTTPServer,
    error_body,
    error_headers,
    read_body,
)
from longhorizon.actor.model_batching import ClientGone, Job, Metrics, ModelServer, Sampling, ServerStopping
from longhorizon.common.args import parse_args
from longhorizon.common.chat import ContentError, check_images, content_parts, takes_images
from longhorizon.common.models import ModelError, WeightsRefused, resolve_model_path

log = logging.getLogger(__name__)

MAX_CHOICES = 16
MAX_STOP_STRINGS = 4
MAX_CHAT_TOP_LOGPROBS = 20  # OpenAI's limits: chat `top_logprobs`, legacy completions `logprobs`
MAX_COMPLETION_LOGPROBS = 5
MAX_IMAGES = 16


class RequestError(HTTPRefusal, ValueError):
    """A request the server refuses, with the HTTP status to answer it with (and, optionally, a
    code for the error's `code` field and more fields for the error object)."""

    def __init__(self, message: str, status: int = 400, code: str | None = None, details: dict | None = None) -> None:
        super().__init__(status, message, code, details=details)


WEIGHTS_REFUSED_CODE = "weights_refused"
"""The error `code` of a `/v1/load_weights` answer that refused weights which do not fit the
model (status 422, the problems listed under `problems`): the `openai` engine raises
`WeightsRefused` for it, as the engines that load weights themselves do."""


# ----------------------------------------------------------------------------- request parsing


def _number(body: dict, key: str, default: float, low: float, high: float) -> float:
    value = body.get(key, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise RequestError(f"'{key}' must be a number in [{low}, {high}], got {value!r}")
    return float(value)


def _integer(body: dict, key: str, default: int | None, low: int, high: int) -> int | None:
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise RequestError(f"'{key}' must be an integer in [{low}, {high}], got {value!r}")
    return value


def _stop_strings(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if (
        not isinstance(stop, list) or len(stop) > MAX_STOP_STRINGS
        or not all(isinstance(s, str) and s for s in stop)
    ):
        raise RequestError(f"'stop' must be a non-empty string or a list of at most {MAX_STOP_STRINGS} of them")
    return stop


def _sampling(body: dict, server: ModelServer, longest_prompt: int) -> Sampling:
    max_tokens = _integer(body, "max_tokens", 16, 1, 1 << 20)
    if body.get("max_completion_tokens") is not None:
        max_tokens = _integer(body, "max_completion_tokens", 16, 1, 1 << 20)
    if server.max_positions and longest_prompt + max_tokens > server.max_positions:
        raise RequestError(
            f"prompt ({longest_prompt} tokens) plus max_tokens ({max_tokens}) exceeds the model's "
            f"context of {server.max_positions} tokens"
        )
    return Sampling(
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, 100.0),
        top_p=_number(body, "top_p", 1.0, 1e-6, 1.0),
    )


def _check_model(body: dict, server: ModelServer) -> None:
    model = body.get("model")
    if model is not None and model not in (server.served_name, server.model_dir):
        raise RequestError(f"model {model!r} is not served here; this server serves {server.served_name!r}", 404)


def _is_token_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _prompts(body: dict, server: ModelServer) -> list[list[int]]:
    """The completion prompts as token ids: a string, a token list, or a list of either."""
    prompt = body.get("prompt")
    if isinstance(prompt, str) or _is_token_list(prompt):
        items = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or _is_token_list(p) for p in prompt):
        items = prompt
    else:
        raise RequestError("'prompt' must be a string, a list of token ids, or a non-empty list of either")
    prompts = []
    for item in items:
        ids = server.tokenizer.encode(item) if isinstance(item, str) else list(item)
        if not ids:
            raise RequestError("a prompt encodes to no tokens")
        bad = [t for t in ids if not 0 <= t < server.vocab_size]
        if bad:
            raise RequestError(f"token id {bad[0]} is outside the vocabulary (size {server.vocab_size})")
        prompts.append(ids)
    return prompts


def _content(message: dict, takes_images: bool) -> dict:
    """A message as the chat tokenizer takes it: its text, and its images where it has some
    (`content_parts`: a string, or text and image_url parts; a model's chat template shows a
    message's images before its text)."""
    role = message["role"]
    try:
        text, images = content_parts(message.get("content"), role)
        if images and not takes_images:
            raise ContentError("the served model takes no images (its folder has no image processor)")
        if len(images) > MAX_IMAGES:
            raise ContentError(f"at most {MAX_IMAGES} images a message")
        check_images(images)
    except ContentError as error:
        raise RequestError(str(error)) from None
    return {"role": role, "content": text, **({"images": images} if images else {})}


def _messages(body: dict, takes_images: bool = False) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list of {role, content} objects")
    for message in messages:
        if not isinstance(message, dict) or message.get("role") not in ("system", "user", "assistant"):
            raise RequestError("each message needs a role (system, user or assistant) and a content")
    return [_content(message, takes_images) for message in messages]


def _flag(body: dict, key: str) -> bool:
    value = body.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise RequestError(f"'{key}' must be true or false, got {value!r}")
    return value


def _stream_settings(body: dict) -> tuple[bool, bool]:
    """(stream, include_usage) from `stream` and `stream_options`."""
    stream = _flag(body, "stream")
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not stream:
        raise RequestError("'stream_options' is only allowed with 'stream': true")
    if not isinstance(options, dict):
        raise RequestError("'stream_options' must be an object such as {\"include_usage\": true}")
    return stream, _flag(options, "include_usage")


def _chat_top_logprobs(body: dict) -> int | None:
    """None without `logprobs: true`, else how many top tokens each position lists (0-20)."""
    want = _flag(body, "logprobs")
    top = _integer(body, "top_logprobs", None, 0, MAX_CHAT_TOP_LOGPROBS)
    if top is not None and not want:
        raise RequestError("'top_logprobs' needs 'logprobs': true")
    return (top or 0) if want else None


# ----------------------------------------------------------------------------- responses


def _cut_at_stop(server: ModelServer, token_ids: list[int], logprobs: list[float], stop: list[str]):
    """Shorten a reply at the first stop string: (tokens, logprobs, text, stopped). The text ends
    before the stop string, as OpenAI-compatible servers return it; the tokens include the one
    that completed it."""
    count = tokens_through_stop_string(server.tokenizer.decode, token_ids, stop)
    if count is None:
        return token_ids, logprobs, server.tokenizer.decode(token_ids), False
    prefix = server.tokenizer.decode(token_ids[:count])
    return token_ids[:count], logprobs[:count], prefix[: min(prefix.index(s) for s in stop if s in prefix)], True


def _token_label(server: ModelServer, token_id: int, as_ids: bool) -> str:
    return f"token_id:{token_id}" if as_ids else server.tokenizer.tokenizer.decode([token_id])


def _choice_pieces(server: ModelServer, result, stop: list[str]):
    tokens, logprobs, text, stopped_on_string = _cut_at_stop(server, result.token_ids, result.logprobs, stop)
    finish = "stop" if (result.stopped_on_eos or stopped_on_string) else "length"
    return tokens, logprobs, text, finish


def _top_pairs(result, count: int, top: int) -> list[list[tuple[int, float]]]:
    """The `top` most likely (token id, log-prob) pairs at each of the first `count` positions."""
    lists = getattr(result, "top_logprobs", None) if top > 0 else None
    if lists is None:
        return [[] for _ in range(count)]
    return [pairs[:top] for pairs in lists[:count]]


def _chat_logprob(server: ModelServer, token: int, logprob: float, pairs: list, as_ids: bool) -> dict:
    """One entry of a chat reply's `logprobs.content`."""
    return {"token": _token_label(server, token, as_ids), "logprob": logprob, "bytes": None, "top_logprobs": [
        {"token": _token_label(server, t, as_ids), "logprob": value, "bytes": None} for t, value in pairs
    ]}


def _completion_top(server: ModelServer, label: str, logprob: float, pairs: list, as_ids: bool) -> dict:
    """One position of a completion's `top_logprobs`: the most likely tokens and, as the legacy
    API does, the sampled one."""
    return {**{_token_label(server, t, as_ids): value for t, value in pairs}, label: logprob}


def completion_response(
    server: ModelServer, body: dict, prompts: list[list[int]], results: list, n: int, top: int | None = None,
) -> dict:
    """A /v1/completions reply; `top` is the request's `logprobs` (None: no log-probs)."""
    stop = _stop_strings(body)
    as_ids = bool(body.get("return_tokens_as_token_ids"))
    choices = []
    completion_tokens = 0
    for index, result in enumerate(results):
        tokens, logprobs, text, finish = _choice_pieces(server, result, stop)
        completion_tokens += len(tokens)
        labels = [_token_label(server, t, as_ids) for t in tokens]
        choice = {
            "index": index,
            "text": text,
            "logprobs": None,
            "finish_reason": finish,
            "stop_reason": None,
            "token_ids": tokens,
            "prompt_token_ids": prompts[index // n],
        }
        if top is not None:
            offsets, position = [], 0
            for label in labels:
                offsets.append(position)
                position += 0 if as_ids else len(label)
            tops = _top_pairs(result, len(tokens), top)
            choice["logprobs"] = {
                "tokens": labels,
                "token_logprobs": logprobs,
                "top_logprobs": [_completion_top(server, label, lp, pairs, as_ids)
                                 for label, lp, pairs in zip(labels, logprobs, tops)],
                "text_offset": offsets,
            }
        choices.append(choice)
    prompt_tokens = sum(len(p) for p in prompts)
    return _response("cmpl", "text_completion", server, results, choices, prompt_tokens, completion_tokens)


def _response(
    id_prefix: str, kind: str, server: ModelServer, results: list, choices: list,
    prompt_tokens: int, completion_tokens: int,
) -> dict:
    """The envelope shared by completion and chat replies."""
    return {
        "id": f"{id_prefix}-{uuid.uuid4().hex}",
        "object": kind,
        "created": int(time.time()),
        "model": server.served_name,
        # The weights the replies were generated with (a reload may have landed since).
        "policy_version": min((result.policy_version for result in results), default=server.policy_version),
        "choices": choices,
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
    }


def chat_response(server: ModelServer, body: dict, prompt: list[int], results: list, top: int | None = None) -> dict:
    """A /v1/chat/completions reply; `top` as `_chat_top_logprobs` returns it (None: no log-probs)."""
    stop = _stop_strings(body)
    as_ids = bool(body.get("return_tokens_as_token_ids"))
    choices = []
    completion_tokens = 0
    for index, result in enumerate(results):
        tokens, logprobs, text, finish = _choice_pieces(server, result, stop)
        completion_tokens += len(tokens)
        choice = {
            "index": index,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": finish,
            "token_ids": tokens,
        }
        if top is not None:
            tops = _top_pairs(result, len(tokens), top)
            choice["logprobs"] = {"content": [
                _chat_logprob(server, t, lp, pairs, as_ids) for t, lp, pairs in zip(tokens, logprobs, tops)
            ]}
        choices.append(choice)
    return _response("chatcmpl", "chat.completion", server, results, choices, len(prompt), completion_tokens)


# ----------------------------------------------------------------------------- streamed replies


@dataclass
class EventStream:
    """A reply to send as server-sent events: each chunk as one `data:` event as the iterator
    yields it, then `data: [DONE]`. The first chunk is awaited before the headers go out, so a
    request that fails before its first token still gets a JSON error."""

    chunks: AsyncIterator[dict]
    job: Job


class StreamedText:
    """One reply's text as its tokens arrive: what can be sent so far.

    Each token's text is found by decoding a short window (the previous piece's tokens give a
    tokenizer the context it needs for leading spaces) with and without it. A token that leaves a
    character incomplete (its bytes decode to a replacement character) or adds no text adds
    nothing yet; its text comes with a later token. With stop strings, the last characters that
    could begin one are held back until the reply goes on past them, so no text is sent that the
    reply (which ends before its first stop string) does not have."""

    def __init__(self, decode, eos_token_id: int | None, stop: list[str]) -> None:
        self.decode = decode
        self.eos_token_id = eos_token_id
        self.stop = stop
        self.tokens: list[int] = []
        self.text = ""
        self.sent = 0
        """Characters of `text` already sent."""
        self.finished = False
        self._context = self._start = 0  # the decoding window is tokens[_context:_start] plus the new ones
        self._hold = max((len(s) for s in stop), default=1) - 1

    def add(self, token: int) -> str:
        """Take the next token; returns the text it lets through (often empty)."""
        self.tokens.append(token)
        before = self.decode(self.tokens[self._context:self._start])
        after = self.decode(self.tokens[self._context:])
        if not after.endswith("\ufffd") and len(after) > len(before):
            self.text += after[len(before):]
            self._context, self._start = self._start, len(self.tokens)
        hits = [self.text.index(s) for s in self.stop if s in self.text]
        if hits:
            self.finished, end = True, min(hits)
        elif token == self.eos_token_id:
            self.finished, end = True, len(self.text)
        else:
            end = len(self.text) - self._hold
        piece = self.text[self.sent:end] if end > self.sent else ""
        self.sent += len(piece)
        return piece


def _call_soon_from_threads() -> Callable[[Callable[[], None]], None]:
    """A function any thread can call to have the running event loop call a function at its next
    turn, without waiting for it (anyio's own `from_thread` waits for the result)."""
    native = anyio.lowlevel.current_token().native_token
    if hasattr(native, "call_soon_threadsafe"):  # asyncio's loop
        return native.call_soon_threadsafe
    return native.run_sync_soon  # trio's token


class _Wakeups:
    """The wakes of one event loop's tasks from the generation thread, delivered by one call into
    the loop for all of those that pile up before it runs. A batch step wakes every request it
    streams to, and each call into the loop is a write to the loop's wake-up socket that hands the
    interpreter lock to the loop; with one call per step instead of one per request, the
    generation thread gives the lock up once per step."""

    _per_loop = anyio.lowlevel.RunVar("model_server_wakeups")

    def __init__(self) -> None:
        self._call_soon = _call_soon_from_threads()
        self._lock = threading.Lock()
        self._pending: list[_Waker] = []

    @classmethod
    def of_this_loop(cls) -> _Wakeups:
        try:
            return cls._per_loop.get()
        except LookupError:
            wakeups = cls()
            cls._per_loop.set(wakeups)
            return wakeups

    def add(self, waker: _Waker) -> None:
        """Called from any thread: `waker` is set at the loop's next turn."""
        with self._lock:
            if waker._pending:
                return
            waker._pending = True
            call_loop = not self._pending  # otherwise a delivery is already on its way
            self._pending.append(waker)
        if call_loop:
            try:
                self._call_soon(self._deliver)
            except RuntimeError:  # the loop has ended (trio's RunFinishedError is one): nobody waits
                pass

    def _deliver(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
            for waker in pending:
                waker._pending = False
        for waker in pending:
            waker._event.set()


class _Waker:
    """Wakes a task of the event loop from the generation thread: `wait()` returns once
    `__call__` has been called since the last `wait()` returned (a call is never lost)."""

    def __init__(self) -> None:
        self._wakeups = _Wakeups.of_this_loop()
        self._event = anyio.Event()
        self._pending = False
        """Whether a wake is on its way to the loop (guarded by the `_Wakeups` lock)."""

    def __call__(self) -> None:
        self._wakeups.add(self)

    async def wait(self) -> None:
        await self._event.wait()
        self._event = anyio.Event()


async def _job_done(job: Job, waker: _Waker) -> list:
    """A job's results, once the generation thread has them (its error, raised)."""
    while not job.done.is_set():
        await waker.wait()
    if job.error is not None:
        raise job.error
    return job.results


async def _next_step(job: Job, waker: _Waker) -> tuple | None:
    """A streamed job's next step, None once it is done."""
    while True:
        try:
            return job.steps.get_nowait()
        except queue.Empty:
            await waker.wait()


async def _live_chunks(
    server: ModelServer, body: dict, job: Job, waker: _Waker, chat: bool, top: int | None, include_usage: bool,
    whole_reply,
) -> AsyncIterator[dict]:
    """A streamed job's chunks (`_job_chunks`). Closed before its end, the client has left: the
    job is abandoned."""
    try:
        async for chunk in _job_chunks(server, body, job, waker, chat, top, include_usage, whole_reply):
            yield chunk
    finally:
        server.abandon(job)  # nothing once the job is done


async def _job_chunks(
    server: ModelServer, body: dict, job: Job, waker: _Waker, chat: bool, top: int | None, include_usage: bool,
    whole_reply,
) -> AsyncIterator[dict]:
    """A streamed job's chunks: one per token as the batch samples it (its text piece, log-probs
    and id), then per choice whatever text the whole reply has beyond what was sent and the finish
    reason, then the usage. `whole_reply(results)` builds the reply the request would get unstreamed;
    the stream's text always ends as that reply's."""
    as_ids = bool(body.get("return_tokens_as_token_ids"))
    envelope = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
                "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": server.served_name}

    def chunk(choices: list, **extra) -> dict:
        event = {**envelope, "choices": choices, **extra}
        if include_usage:  # as OpenAI's API: null on every chunk but the last
            event.setdefault("usage", None)
        return event

    def token_chunk(index: int, token: int, piece: str, logprob: float, pairs: list) -> dict:
        if chat:
            logprobs = None if top is None else {"content": [_chat_logprob(server, token, logprob, pairs, as_ids)]}
            return chunk([{"index": index, "delta": {"content": piece}, "logprobs": logprobs, "finish_reason": None,
                           "token_ids": [token]}])
        logprobs = None
        if top is not None:
            label = _token_label(server, token, as_ids)
            logprobs = {"tokens": [label], "token_logprobs": [logprob],
                        "top_logprobs": [_completion_top(server, label, logprob, pairs, as_ids)],
                        "text_offset": [offsets[index]]}
            offsets[index] += 0 if as_ids else len(label)
        return chunk([{"index": index, "text": piece, "logprobs": logprobs, "finish_reason": None,
                       "token_ids": [token]}])

    stop = _stop_strings(body)
    texts = [StreamedText(server.tokenizer.decode, server.tokenizer.eos_token_id, stop) for _ in job.prompts]
    offsets = [0] * len(texts)
    started = False
    while (step := await _next_step(job, waker)) is not None:
        if not started and chat:  # after the first step: a request that fails at once gets a JSON error
            for index in range(len(texts)):
                yield chunk([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}])
        started = True
        index, token, logprob, pairs = step
        if not texts[index].finished:  # rows that have finished get padding
            yield token_chunk(index, token, texts[index].add(token), logprob, pairs)
    if job.error is not None:
        raise job.error
    response = whole_reply(job.results)
    server.metrics.count_tokens(response["usage"]["prompt_tokens"], response["usage"]["completion_tokens"])
    for choice, streamed in zip(response["choices"], texts):
        index = choice["index"]
        if not started and chat:
            yield chunk([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None}])
        # Tokens the steps did not show (none, as the engine reports every step) and text held back.
        for position in range(len(streamed.tokens), len(choice["token_ids"])):
            token = choice["token_ids"][position]
            if chat:
                entry = choice["logprobs"]["content"][position] if top is not None else None
                logprob, pairs = (entry["logprob"], []) if entry else (0.0, [])
            else:
                logprob, pairs = (choice["logprobs"]["token_logprobs"][position] if top is not None else 0.0), []
            yield token_chunk(index, token, "", logprob, pairs)
        text = choice["message"]["content"] if chat else choice["text"]
        rest = text[streamed.sent:]
        if rest:
            yield chunk([{"index": index, **({"delta": {"content": rest}} if chat else {"text": rest}),
                          "logprobs": None, "finish_reason": None}])
        finish = {"index": index, "logprobs": None, "finish_reason": choice["finish_reason"]}
        finish.update({"delta": {}} if chat else {"text": ""})
        yield chunk([finish], policy_version=response["policy_version"])
    if include_usage:
        yield chunk([], usage=response["usage"], policy_version=response["policy_version"])


# ----------------------------------------------------------------------------- routes


async def _unless_client_leaves(server: ModelServer, job: Job, until_gone, waiting: Callable[[], Awaitable]):
    """`await waiting()`, unless `until_gone()` returns first (the client has closed its
    connection): then the job is abandoned and `ClientGone` raised."""
    if until_gone is None:
        return await waiting()
    gone = False
    result = error = None
    async with anyio.create_task_group() as group:
        async def watch() -> None:
            nonlocal gone
            await until_gone()
            gone = True
            group.cancel_scope.cancel()  # `waiting()` is cancelled

        group.start_soon(watch)
        try:
            result = await waiting()
        except Exception as exc:  # raised below: not wrapped in the group's exception group
            error = exc
        group.cancel_scope.cancel()
    if gone:
        server.abandon(job)
        raise ClientGone("the client closed its connection")
    if error is not None:
        raise error
    return result


async def _generated(server: ModelServer, rows: list[list[int]], sampling: Sampling, top: int, until_gone,
                     images: list[bytes] = ()) -> list:
    """The replies to `rows` (the GenerationResults), waited for in the event loop. `images` are
    the prompt's, each row's the same."""
    waker = _Waker()
    job = server.submit(rows, sampling, top, wake=waker, images=images)
    return await _unless_client_leaves(server, job, until_gone, lambda: _job_done(job, waker))


def _streamed(server: ModelServer, body: dict, rows: list[list[int]], sampling: Sampling, chat: bool,
              top: int | None, include_usage: bool, whole_reply, images: list[bytes] = ()) -> EventStream:
    waker = _Waker()
    job = server.submit(rows, sampling, top or 0, stream=True, wake=waker, images=images)
    return EventStream(_live_chunks(server, body, job, waker, chat, top, include_usage, whole_reply), job)


async def handle_completions(server: ModelServer, body: dict, until_gone=None) -> dict | EventStream:
    """`until_gone()`, when given, returns once the client has closed its connection: its
    generation stops (`ClientGone`). Likewise `handle_chat`."""
    _check_model(body, server)
    if body.get("echo"):
        raise RequestError("'echo' is not supported by this server")
    stream, include_usage = _stream_settings(body)
    prompts = _prompts(body, server)
    n = _integer(body, "n", 1, 1, MAX_CHOICES)
    top = _integer(body, "logprobs", None, 0, MAX_COMPLETION_LOGPROBS)
    _stop_strings(body)
    sampling = _sampling(body, server, max(len(p) for p in prompts))
    rows = [p for p in prompts for _ in range(n)]
    if stream:
        return _streamed(server, body, rows, sampling, False, top, include_usage,
                         lambda results: completion_response(server, body, prompts, results, n, top))
    results = await _generated(server, rows, sampling, top or 0, until_gone)
    response = completion_response(server, body, prompts, results, n, top)
    server.metrics.count_tokens(response["usage"]["prompt_tokens"], response["usage"]["completion_tokens"])
    return response


async def handle_chat(server: ModelServer, body: dict, until_gone=None) -> dict | EventStream:
    _check_model(body, server)
    stream, include_usage = _stream_settings(body)
    messages = _messages(body, takes_images(server.tokenizer))
    images = [image for message in messages for image in message.get("images", ())]
    n = _integer(body, "n", 1, 1, MAX_CHOICES)
    top = _chat_top_logprobs(body)
    _stop_strings(body)
    try:
        prompt = server.tokenizer.prompt_tokens(messages)
    except Exception as exc:  # a template that rejects the roles or their order
        raise RequestError(f"the chat template cannot render these messages: {exc}") from None
    sampling = _sampling(body, server, len(prompt))
    if stream:
        return _streamed(server, body, [prompt] * n, sampling, True, top, include_usage,
                         lambda results: chat_response(server, body, prompt, results, top), images)
    results = await _generated(server, [prompt] * n, sampling, top or 0, until_gone, images)
    response = chat_response(server, body, prompt, results, top)
    server.metrics.count_tokens(response["usage"]["prompt_tokens"], response["usage"]["completion_tokens"])
    return response


def handle_load_weights(server: ModelServer, body: dict) -> dict:
    path = body.get("path")
    if not isinstance(path, str) or not path:
        raise RequestError("'path' must name a folder of safetensors files")
    if not Path(path).is_dir():
        # 400, not 404: 404 means "no such route", which the openai engine reports as an endpoint
        # that cannot take weights at all.
        raise RequestError(f"no such folder on the server: {path} (the server must see the actor's files)", 400)
    version = _integer(body, "version", server.policy_version + 1, 0, 1 << 62)
    try:
        server.load_weights(path, version)
    except WeightsRefused as refused:
        raise RequestError(f"cannot load weights from {path}: {refused}", 422, WEIGHTS_REFUSED_CODE,
                           {"problems": refused.problems}) from None
    except (FileNotFoundError, ValueError) as exc:
        raise RequestError(f"cannot load weights from {path}: {exc}") from None
    return {"object": "load_weights", "policy_version": server.policy_version}


def models_response(server: ModelServer) -> dict:
    return {"object": "list", "data": [{
        "id": server.served_name, "object": "model", "created": 0, "owned_by": "longhorizon",
        "root": server.model_dir, "max_model_len": server.max_positions or None,
        "policy_version": server.policy_version, "weights_refused": server.weights_refused,
    }]}


# ----------------------------------------------------------------------------- HTTP


_POST_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/load_weights")
_GET_ROUTES = ("/v1/models", "/health", "/v1/health", "/metrics")


def _json(payload: dict, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    """A JSON reply. The standard encoder, as clients of this server have always read it (an
    infinite log-prob, say, goes out as -Infinity, which Python's and JavaScript's parsers read)."""
    return Response(json.dumps(payload).encode(), status, headers, media_type="application/json")


def _error(status: int, message: str, code: str | int | None = None, details: dict | None = None) -> Response:
    return _json(error_body(status, message, code, details=details), status, error_headers(status))


def _event(data: str) -> bytes:
    return f"data: {data}\n\n".encode()


class _NoReply:
    """What a request whose client has left is answered with: nothing."""

    async def __call__(self, scope, receive, send) -> None:
        pass


async def _until_disconnected(receive) -> None:
    """Returns once the client has closed its connection (asked after the body is read: the
    only message left to receive is the disconnect)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class _EventStreamResponse:
    """Server-sent events, `first` and the rest of `chunks`, then `[DONE]`, in chunked transfer
    encoding (which marks the end of the reply, so the connection can carry the next request).
    A client that leaves mid-stream ends the response, which closes `chunks`: its generation
    stops (`_live_chunks`).

    A plain ASGI response rather than Starlette's StreamingResponse: every event costs a trip
    through the server's send path, so the events that are ready together (the loop got to a
    stream after several of its tokens, or the reply's last chunks) go out in one body message;
    one that would have to wait for the next token never holds back those before it."""

    _headers = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]

    def __init__(self, chunks: AsyncIterator[dict], first: dict | None, job: Job) -> None:
        self.chunks = chunks
        self.first = first
        self.job = job

    def _next_waits(self) -> bool:
        """Whether the next chunk waits for the generation thread (its steps so far all taken)."""
        steps = self.job.steps
        return not self.job.done.is_set() and steps is not None and steps.empty()

    async def _events(self, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self._headers})
        ready: list[bytes] = []
        try:
            if self.first is not None:
                ready.append(_event(json.dumps(self.first)))
            while True:
                if ready and self._next_waits():
                    await send({"type": "http.response.body", "body": b"".join(ready), "more_body": True})
                    ready = []
                chunk = await anext(self.chunks, None)
                if chunk is None:
                    break
                ready.append(_event(json.dumps(chunk)))
        except Exception as exc:  # the status has gone out: the error is an event, as OpenAI's are
            log.exception("streamed generation failed")
            ready.append(_event(json.dumps(error_body(500, f"{type(exc).__name__}: {exc}"))))
        ready.append(_event("[DONE]"))
        await send({"type": "http.response.body", "body": b"".join(ready), "more_body": False})

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as group:
                async def stream() -> None:
                    await self._events(send)
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                await _until_disconnected(receive)  # the client left: the stream is cut short
                group.cancel_scope.cancel()
        finally:  # at once, not when the garbage collector gets to it
            await self.chunks.aclose()


def model_app(server: ModelServer):
    """The Starlette application of a model server, measured for /metrics."""

    async def body_of(request: Request) -> dict:
        raw = await read_body(request, MAX_BODY_BYTES)
        try:
            body = json.loads(raw or b"null")
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise RequestError(f"request body is not JSON: {exc}") from None
        if not isinstance(body, dict):
            raise RequestError("request body must be a JSON object")
        return body

    def handled(handler):
        async def route(request: Request):
            try:
                return await handler(request)
            except (ClientGone, ClientDisconnect):  # nobody to answer
                return _NoReply()
            except HTTPRefusal as exc:
                return _error(exc.status, str(exc), exc.code, exc.details)
            except ServerStopping as exc:
                return _error(503, str(exc))
            except Exception as exc:
                log.exception("request to %s failed", request.url.path)
                return _error(500, f"{type(exc).__name__}: {exc}")
        return route

    def generation(handle):
        async def route(request: Request):
            body = await body_of(request)
            until_gone = lambda: _until_disconnected(request.receive)  # noqa: E731
            reply = await handle(server, body, until_gone)
            if not isinstance(reply, EventStream):
                return _json(reply)
            chunks = reply.chunks
            try:  # before the headers go out: a failure here is a plain JSON error
                first = await _unless_client_leaves(server, reply.job, until_gone, lambda: anext(chunks, None))
            except BaseException:
                await chunks.aclose()
                raise
            return _EventStreamResponse(chunks, first, reply.job)
        return route

    async def load_weights(request: Request):
        body = await body_of(request)
        # Loading takes seconds and must not hold up the event loop.
        return _json(await anyio.to_thread.run_sync(handle_load_weights, server, body))

    async def models(request: Request):
        return _json(models_response(server))

    async def health(request: Request):
        running = server.running
        return _json({
            "status": "ok" if running else "stopped", "model": server.served_name,
            "policy_version": server.policy_version, "queue_depth": server.queue_depth,
            "requests_in_flight": server.in_flight, "weights_refused": server.weights_refused,
        }, 200 if running else 503)

    async def metrics(request: Request):
        text = server.metrics.render(
            weights_refused=server.weights_refused, queue_depth=server.queue_depth,
            in_flight=server.in_flight, policy_version=server.policy_version,
        )
        return Response(text.encode(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def no_route(request: Request, exc: Exception):
        method, path = request.method, request.url.path
        if method == "POST":
            return _error(404, f"no route POST {path}; routes: {', '.join(sorted(_POST_ROUTES))}")
        return _error(404, f"no route {method} {path}")

    app = Starlette(
        routes=[
            Route("/v1/completions", handled(generation(handle_completions)), methods=["POST"]),
            Route("/v1/chat/completions", handled(generation(handle_chat)), methods=["POST"]),
            Route("/v1/load_weights", handled(load_weights), methods=["POST"]),
            Route("/v1/models", handled(models), methods=["GET"]),
            Route("/health", handled(health), methods=["GET"]),
            Route("/v1/health", handled(health), methods=["GET"]),
            Route("/metrics", handled(metrics), methods=["GET"]),
        ],
        exception_handlers={404: no_route, 405: no_route},
    )
    return _measured(app, server.metrics)


def _measured(app, metrics: Metrics):
    """`app` with every request counted in `metrics` (method, endpoint, status, seconds until the
    reply's end; status 0 when nothing was sent) and its path taken without a trailing slash."""

    async def measured(scope, receive, send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        start = time.monotonic()
        path = scope["path"].rstrip("/")
        status = 0

        async def send_measured(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await app({**scope, "path": path or "/"}, receive, send_measured)
        finally:
            # Unknown paths share one label, so scanners cannot grow the metrics without bound.
            endpoint = path if path in _POST_ROUTES or path in _GET_ROUTES else "other"
            metrics.count_request(scope["method"], endpoint, status, time.monotonic() - start)

    return measured


def start_http_server(server: ModelServer, host: str, port: int) -> HTTPServer:
    """The model server's HTTP server, bound to host:port (0: a free port); `serve_forever()`
    serves it (see `HTTPServer`)."""
    return HTTPServer(model_app(server), host, port)


def _exit_with_parent(parent_pid: int) -> None:
    """A killed parent cannot stop its child server; the child notices being re-parented instead."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        log.info("parent process %d is gone; stopping", parent_pid)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="longhorizon serve-model",
        description="Serve a local Hugging Face model over an OpenAI-compatible HTTP API on 127.0.0.1.",
    )
    parser.add_argument("model_dir", help="a local model folder, smollm2-135m-instruct, or tiny:<folder>")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on; 0 picks a free one (default %(default)s)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default %(default)s; no authentication)")
    parser.add_argument("--served-name", default="", help="model name clients send (default: the folder name)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--max-batch-size", type=int, default=16, help="most sequences per forward batch")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling generator")
    parser.add_argument("--torch-threads", type=int, default=1, help="CPU threads for torch")
    parser.add_argument("--batch-window-ms", type=float, default=2.0,
                        help="how long a batch waits for more requests after its first (default %(default)s)")
    parser.add_argument("--cache-dir", default="",
                        help="where converted and tiny models are kept (default: models/ in the user's cache)")
    parser.add_argument("--ready-file", help="write the server's base URL to this file once it listens")
    parser.add_argument("--exit-with-parent", action="store_true",
                        help="stop when the process that started this one exits (engines that start their own server)")
    return parser


def main(argv: list[str]) -> int:
    args = parse_args(build_parser(), argv)
    if isinstance(args, int):  # --help, or a usage error argparse has printed
        return args
    # Read now: if the parent dies while the model loads, getppid() would already name init.
    parent_pid = os.getppid()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        model_dir = resolve_model_path(args.model_dir, args.cache_dir)
    except ModelError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    server = ModelServer(
        str(model_dir), served_name=args.served_name, dtype=args.dtype, max_batch_size=args.max_batch_size,
        seed=args.seed, torch_threads=args.torch_threads, batch_window_s=args.batch_window_ms / 1000,
    )
    httpd = start_http_server(server, args.host, args.port)
    if args.exit_with_parent:
        _exit_with_parent(parent_pid)
    base_url = f"{httpd.url}/v1"
    print(f"serving {server.served_name} from {model_dir} at {base_url}", flush=True)
    if args.ready_file:
        partial = Path(args.ready_file + ".partial")
        partial.write_text(base_url)
        partial.replace(args.ready_file)  # readers never see a half-written URL
    try:
        # On Ctrl-C or SIGTERM generation stops first, so that the requests under way are answered
        # (a 503) before the connections close.
        httpd.serve_forever(stop_signals=(signal.SIGINT, signal.SIGTERM), before_stop=server.stop)
    finally:
        httpd.server_close()
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
