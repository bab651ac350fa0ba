"""`longhorizon serve-model MODEL_DIR --port P`: a small OpenAI-compatible HTTP server for a local model.

It serves any local Hugging Face model folder through the `hf` engine on 127.0.0.1:
- `GET /v1/models`: the served model (and the version of the weights it holds);
- `POST /v1/completions`: prompt as text or token ids; returns the sampled token ids
  (`choices[i].token_ids`) and per-token log-probs in the shape vLLM's server uses
  (`logprobs.tokens` as `token_id:N` when `return_tokens_as_token_ids` is set);
- `POST /v1/chat/completions`: messages rendered with the model's chat template;
- `POST /v1/load_weights` `{"path": FOLDER, "version": N}`: load safetensors weights in place, so
  the `openai` engine can be used for training against this server. The folder is checked whole
  first (names, shapes, dtypes, finite values); weights that do not fit are refused with a 422
  whose error code is `weights_refused` (the problems under `problems`), counted
  (`weights_refused` in `/health` and `/v1/models`), and the server keeps serving its version.

Requests that arrive together are batched: one worker thread owns the model and runs every queued
request with the same sampling settings in one forward batch. Log-probs are those of the sampling
distribution (temperature and top-p applied), like the `hf` engine's. Bad requests get a 4xx JSON
error in the OpenAI shape, `{"error": {"message", "type", "code"}}`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import queue
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 32 << 20
MAX_CHOICES = 16
MAX_STOP_STRINGS = 4


class RequestError(ValueError):
    """A request the server refuses, with the HTTP status to answer it with (and, optionally, a
    code for the error's `code` field and more fields for the error object)."""

    def __init__(self, message: str, status: int = 400, code: str | None = None, details: dict | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.details = details or {}


WEIGHTS_REFUSED_CODE = "weights_refused"
"""The error `code` of a `/v1/load_weights` answer that refused weights which do not fit the
model (status 422, the problems listed under `problems`): the `openai` engine raises
`WeightsRefused` for it, as the engines that load weights themselves do."""


@dataclass(frozen=True)
class Sampling:
    """Per-request sampling settings; requests with equal settings share a batch."""

    max_tokens: int
    temperature: float
    top_p: float


@dataclass
class _Job:
    prompts: list[list[int]]
    sampling: Sampling
    done: threading.Event = field(default_factory=threading.Event)
    results: list = field(default_factory=list)
    error: BaseException | None = None


class ModelServer:
    """The model, its tokenizer and the batching worker, independent of HTTP."""

    def __init__(
        self,
        model_dir: str,
        *,
        served_name: str = "",
        dtype: str = "float32",
        max_batch_size: int = 16,
        seed: int = 0,
        torch_threads: int = 1,
        batch_window_s: float = 0.002,
    ) -> None:
        from longhorizon.actor.engines.base import EngineSettings
        from longhorizon.actor.engines.hf import HFEngine

        self.model_dir = str(model_dir)
        self.served_name = served_name or Path(model_dir).name
        self.engine = HFEngine(
            EngineSettings(
                model_path=self.model_dir, dtype=dtype, max_batch_size=max_batch_size, seed=seed,
                torch_threads=torch_threads,
            )
        )
        self.tokenizer = self.engine.tokenizer
        self.vocab_size = int(self.engine.model.config.vocab_size)
        self.max_positions = int(getattr(self.engine.model.config, "max_position_embeddings", 0) or 0)
        self.max_batch_size = max(1, max_batch_size)
        self.batch_window_s = max(0.0, batch_window_s)
        self.weights_refused = 0
        """Weight loads refused because the weights did not fit the model."""
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._worker = threading.Thread(target=self._run_batches, name="serve-model-batcher", daemon=True)
        self._worker.start()

    @property
    def policy_version(self) -> int:
        return self.engine.policy_version

    def generate(self, prompts: list[list[int]], sampling: Sampling) -> list:
        """Generate one reply per prompt (blocking); returns the hf engine's GenerationResults."""
        job = _Job(prompts, sampling)
        self._jobs.put(job)
        job.done.wait()
        if job.error is not None:
            raise job.error
        return job.results

    def load_weights(self, path: str, version: int) -> None:
        """Load a safetensors folder in place, all or nothing: weights that do not fit the model
        (names, shapes, dtypes, finite values) raise `WeightsRefused` before any tensor is
        copied; they are counted (`weights_refused`) and the server keeps serving its version."""
        from longhorizon.common.models import WeightsRefused
        from longhorizon.common.wire import WeightsUpdate

        try:
            self.engine.update_weights(WeightsUpdate(version=version, path=path))
        except WeightsRefused as refused:
            self.weights_refused += 1
            log.warning("refused weights v%d from %s, still serving v%d (%d refused so far): %s",
                        version, path, self.policy_version, self.weights_refused, refused)
            raise

    def stop(self) -> None:
        self._jobs.put(None)
        self._worker.join(timeout=10)

    def _run_batches(self) -> None:
        from longhorizon.actor.engines.base import GenerationRequest
        from longhorizon.common.config import SamplingConfig

        while True:
            first = self._jobs.get()
            if first is None:
                return
            jobs = [first]
            rows = len(first.prompts)
            # Requests that arrived while the last batch ran, or within the short window after
            # the first one, join this batch: clients' requests rarely arrive in the same instant.
            window_ends = time.monotonic() + self.batch_window_s
            while rows < self.max_batch_size:
                try:
                    job = self._jobs.get(timeout=max(0.0, window_ends - time.monotonic()))
                except queue.Empty:
                    break
                if job is None:
                    self._jobs.put(None)
                    break
                jobs.append(job)
                rows += len(job.prompts)
            by_sampling: dict[Sampling, list[_Job]] = {}
            for job in jobs:
                by_sampling.setdefault(job.sampling, []).append(job)
            for sampling, group in by_sampling.items():
                requests = [
                    GenerationRequest(token_ids=prompt, episode_id=f"serve-{index}")
                    for job in group for index, prompt in enumerate(job.prompts)
                ]
                try:
                    # Only this thread generates, so setting the engine's sampling per batch is safe.
                    self.engine.sampling = SamplingConfig(
                        temperature=sampling.temperature, top_p=sampling.top_p, max_new_tokens=sampling.max_tokens
                    )
                    results = []
                    for start in range(0, len(requests), self.max_batch_size):
                        results += self.engine._generate_batch(requests[start:start + self.max_batch_size])
                    for job in group:
                        job.results, results = results[: len(job.prompts)], results[len(job.prompts):]
                except Exception as exc:  # the waiting requests answer with a 500
                    log.exception("generation failed")
                    for job in group:
                        job.error = exc
                for job in group:
                    job.done.set()


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


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list of {role, content} objects")
    for message in messages:
        if (
            not isinstance(message, dict) or message.get("role") not in ("system", "user", "assistant")
            or not isinstance(message.get("content"), str)
        ):
            raise RequestError("each message needs a role (system, user or assistant) and a string content")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


# ----------------------------------------------------------------------------- responses


def _cut_at_stop(server: ModelServer, token_ids: list[int], logprobs: list[float], stop: list[str]):
    """Shorten a reply at the first stop string: (tokens, logprobs, text, stopped). The text ends
    before the stop string, as OpenAI-compatible servers return it; the tokens include the one
    that completed it."""
    from longhorizon.actor.engines.base import tokens_through_stop_string

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


def completion_response(server: ModelServer, body: dict, prompts: list[list[int]], results: list, n: int) -> dict:
    stop = _stop_strings(body)
    as_ids = bool(body.get("return_tokens_as_token_ids"))
    want_logprobs = body.get("logprobs") is not None
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
        if want_logprobs:
            offsets, position = [], 0
            for label in labels:
                offsets.append(position)
                position += 0 if as_ids else len(label)
            choice["logprobs"] = {
                "tokens": labels,
                "token_logprobs": logprobs,
                # Only the sampled token's log-prob is known here, so the "top" list holds just it.
                "top_logprobs": [{label: lp} for label, lp in zip(labels, logprobs)],
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


def chat_response(server: ModelServer, body: dict, prompt: list[int], results: list) -> dict:
    stop = _stop_strings(body)
    as_ids = bool(body.get("return_tokens_as_token_ids"))
    want_logprobs = bool(body.get("logprobs"))
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
        if want_logprobs:
            choice["logprobs"] = {"content": [
                {"token": _token_label(server, t, as_ids), "logprob": lp, "bytes": None, "top_logprobs": []}
                for t, lp in zip(tokens, logprobs)
            ]}
        choices.append(choice)
    return _response("chatcmpl", "chat.completion", server, results, choices, len(prompt), completion_tokens)


def handle_completions(server: ModelServer, body: dict) -> dict:
    _check_model(body, server)
    if body.get("echo"):
        raise RequestError("'echo' is not supported by this server")
    if body.get("stream"):
        raise RequestError("'stream' is not supported by this server")
    prompts = _prompts(body, server)
    n = _integer(body, "n", 1, 1, MAX_CHOICES)
    _integer(body, "logprobs", None, 0, 20)
    _stop_strings(body)
    sampling = _sampling(body, server, max(len(p) for p in prompts))
    results = server.generate([p for p in prompts for _ in range(n)], sampling)
    return completion_response(server, body, prompts, results, n)


def handle_chat(server: ModelServer, body: dict) -> dict:
    _check_model(body, server)
    if body.get("stream"):
        raise RequestError("'stream' is not supported by this server")
    messages = _messages(body)
    n = _integer(body, "n", 1, 1, MAX_CHOICES)
    _stop_strings(body)
    try:
        prompt = server.tokenizer.prompt_tokens(messages)
    except Exception as exc:  # a template that rejects the roles or their order
        raise RequestError(f"the chat template cannot render these messages: {exc}") from None
    sampling = _sampling(body, server, len(prompt))
    results = server.generate([prompt] * n, sampling)
    return chat_response(server, body, prompt, results)


def handle_load_weights(server: ModelServer, body: dict) -> dict:
    path = body.get("path")
    if not isinstance(path, str) or not path:
        raise RequestError("'path' must name a folder of safetensors files")
    if not Path(path).is_dir():
        # 400, not 404: 404 means "no such route", which the openai engine reports as an endpoint
        # that cannot take weights at all.
        raise RequestError(f"no such folder on the server: {path} (the server must see the actor's files)", 400)
    version = _integer(body, "version", server.policy_version + 1, 0, 1 << 62)
    from longhorizon.common.models import WeightsRefused

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


_POST_ROUTES = {
    "/v1/completions": handle_completions,
    "/v1/chat/completions": handle_chat,
    "/v1/load_weights": handle_load_weights,
}


def make_handler(server: ModelServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def setup(self) -> None:
            super().setup()
            # Headers and body go out as two writes; without this, Nagle's algorithm holds the
            # body back until the client acknowledges the headers (~40 ms per reply).
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("%s %s", self.address_string(), format % args)

        def _reply(self, status: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _error(self, status: int, message: str, code: str | None = None, details: dict | None = None) -> None:
            kind = "invalid_request_error" if status < 500 else "server_error"
            self._reply(status, {"error": {"message": message, "type": kind, "code": code or status, **(details or {})}})

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0].rstrip("/")
            if path == "/v1/models":
                self._reply(200, models_response(server))
            elif path in ("/health", "/v1/health"):
                self._reply(200, {"status": "ok", "policy_version": server.policy_version,
                                  "weights_refused": server.weights_refused})
            else:
                self._error(404, f"no route GET {path}")

        def do_POST(self) -> None:
            path = self.path.split("?", 1)[0].rstrip("/")
            handler = _POST_ROUTES.get(path)
            length = int(self.headers.get("Content-Length") or 0)
            if length > MAX_BODY_BYTES:
                self.close_connection = True
                self._error(413, f"request body over {MAX_BODY_BYTES} bytes")
                return
            raw = self.rfile.read(length) if length else b""
            if handler is None:
                self._error(404, f"no route POST {path}; routes: {', '.join(sorted(_POST_ROUTES))}")
                return
            try:
                body = json.loads(raw or b"null")
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                self._error(400, f"request body is not JSON: {exc}")
                return
            if not isinstance(body, dict):
                self._error(400, "request body must be a JSON object")
                return
            try:
                self._reply(200, handler(server, body))
            except RequestError as exc:
                self._error(exc.status, str(exc), exc.code, exc.details)
            except Exception as exc:
                log.exception("request to %s failed", path)
                self._error(500, f"{type(exc).__name__}: {exc}")

    return Handler


def start_http_server(server: ModelServer, host: str, port: int) -> ThreadingHTTPServer:
    httpd = ThreadingHTTPServer((host, port), make_handler(server))
    httpd.daemon_threads = True
    return httpd


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
    parser.add_argument("--cache-dir", default=".cache/models", help="where converted and tiny models are kept")
    parser.add_argument("--ready-file", help="write the server's base URL to this file once it listens")
    parser.add_argument("--exit-with-parent", action="store_true",
                        help="stop when the process that started this one exits (engines that start their own server)")
    return parser


def main(argv: list[str]) -> int:
    from longhorizon.common.args import parse_args

    args = parse_args(build_parser(), argv)
    if isinstance(args, int):  # --help, or a usage error argparse has printed
        return args
    # Read now: if the parent dies while the model loads, getppid() would already name init.
    parent_pid = os.getppid()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from longhorizon.common.models import ModelError, resolve_model_path

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
    host, port = httpd.server_address[:2]
    base_url = f"http://{host}:{port}/v1"
    print(f"serving {server.served_name} from {model_dir} at {base_url}", flush=True)
    if args.ready_file:
        partial = Path(args.ready_file + ".partial")
        partial.write_text(base_url)
        partial.replace(args.ready_file)  # readers never see a half-written URL
    try:
        httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        httpd.server_close()
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
