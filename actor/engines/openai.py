"""The `openai` engine: generation through an OpenAI-compatible HTTP endpoint.

Two modes:
- `completions` (default, token-in/token-out): the conversation's token ids go to
  `/v1/completions` as the prompt, and the reply's token ids and per-token log-probs come back
  (vLLM's server with `return_token_ids`/`return_tokens_as_token_ids`, or `longhorizon
  serve-model`). Needs the model's tokenizer locally to build conversations. Usable for training.
- `chat`: the conversation's text messages go to `/v1/chat/completions` and text comes back.
  Works with any hosted model; evaluation only, since no token ids or log-probs are returned.

With no `base_url`, the engine starts `longhorizon serve-model` for `settings.model_path` on a free
loopback port and stops it on `close()`: `make_engine("openai", settings)` then works on its own.

Weights: a remote endpoint cannot take our weights. `update_weights` posts the folder of a
`WeightsUpdate` to the endpoint's `/v1/load_weights` route (our server has it; inline tensors are
written to a local folder first, so that server must share this machine's filesystem); an endpoint
without the route fails with an error saying so. Weights our server refuses as not fitting its
model (it checks them whole before loading any) raise `WeightsRefused`, as the other engines do,
and the version stays.

Options come from, in increasing priority: `LONGHORIZON_OPENAI_<OPTION>` environment variables,
`settings.engine_options` (when the config carries one), and the `options` argument. The API key
is never a config value: the `api_key_env` option names the environment variable holding it.
"""

from __future__ import annotations

import logging
import os
import random
import subprocess
import sys
import tempfile
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Mapping

import trio
from pydantic import Field

from longhorizon.actor.engines.base import (
    EngineCapabilities,
    EngineError,
    EngineSettings,
    GenerationRequest,
    GenerationResult,
    tokens_through_stop_string,
)
from longhorizon.common.config import Section, bounded, check_section
from longhorizon.common.models import WeightsRefused, load_tokenizer
from longhorizon.common.processes import stop_process
from longhorizon.actor.model_server import WEIGHTS_REFUSED_CODE
from longhorizon.common.chat import ByteChatTokenizer, HFChatTokenizer
from longhorizon.actor.weights import WeightsReceiver

log = logging.getLogger(__name__)

RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
ENVIRONMENT_PREFIX = "LONGHORIZON_OPENAI_"


class OpenAIEndpointError(RuntimeError):
    """The endpoint refused a request, or answered with something that is not a usable reply."""


class TokenLogprobsUnavailable(OpenAIEndpointError):
    """Training needs token ids and log-probs, and this endpoint does not return them."""


class OpenAIOptions(Section):
    """openai: any OpenAI-compatible endpoint (docs/actor-types.md). Each option can also be set as
    a `LONGHORIZON_OPENAI_<OPTION>` environment variable, which the config overrides."""

    base_url: str = ""
    """Endpoint root ending in /v1, e.g. http://10.0.0.5:8000/v1; empty starts `longhorizon
    serve-model` for the model folder on a free loopback port."""
    api_key_env: str = ""
    """Name of the environment variable holding the API key (sent as a Bearer token); the key
    itself never appears in config files or logs."""
    model: str = ""
    """Model name sent with each request; empty asks the endpoint's /v1/models for its first model."""
    mode: Literal["completions", "chat"] = "completions"
    """`completions` (token ids in and out, log-probs: training and eval) or `chat` (text: eval only)."""
    tokenizer_path: str = ""
    """Local model folder whose tokenizer and chat template build the conversation tokens; empty
    uses the engine's model_path. Chat mode without one counts UTF-8 bytes instead."""
    require_token_logprobs: bool = True
    """Fail a turn whose reply lacks token ids and log-probs (training needs them); `longhorizon
    eval` turns this off, so text-only endpoints can be evaluated."""
    timeout_s: float = bounded(300.0, gt=0)
    """Seconds one HTTP request may take."""
    max_concurrent_requests: int = bounded(0, ge=0)
    """Requests in flight at once; 0 uses the engine's max_batch_size."""
    max_retries: int = bounded(4, ge=0)
    """Retries of a request answered 408/429/5xx or lost to a connection error."""
    retry_backoff_s: float = bounded(0.5, ge=0)
    """First retry delay; each later retry doubles it (with jitter), or follows Retry-After."""
    server_start_timeout_s: float = bounded(300.0, gt=0)
    """Seconds to wait for the self-started server to listen."""
    extra_body: dict = Field(default_factory=dict)
    """Extra JSON fields sent with every generation request (endpoint-specific settings)."""

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> "OpenAIOptions":
        """Options from a dict, with text (from the environment or a command-line flag) converted to
        each option's type, then checked as a config section is (a ConfigError naming the key)."""
        unknown = sorted(set(values) - set(cls.model_fields))
        if unknown:
            raise ValueError(f"unknown openai engine option {unknown[0]!r}; "
                             f"valid options: {', '.join(sorted(cls.model_fields))}")
        defaults = cls()
        converted = {name: _convert_option(name, value, getattr(defaults, name)) for name, value in values.items()}
        return check_section(cls, converted, "actor.engine_options")


def _convert_option(name: str, value: Any, default: Any) -> Any:
    if isinstance(default, bool):
        if isinstance(value, str):
            lowered = value.strip().lower()
            if lowered in ("1", "true", "yes", "on"):
                return True
            if lowered in ("0", "false", "no", "off"):
                return False
        elif isinstance(value, bool):
            return value
    elif isinstance(default, (int, float)):
        try:
            number = type(default)(value) if not isinstance(value, bool) else None
        except (TypeError, ValueError):
            number = None
        if number is not None:
            return number
    elif isinstance(default, dict):
        if isinstance(value, str):
            import json

            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                pass
        if isinstance(value, dict):
            return dict(value)
    elif isinstance(value, str):
        return value
    raise ValueError(f"openai engine option {name} must be a {type(default).__name__}, got {value!r}")


def options_from_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Options set as LONGHORIZON_OPENAI_<NAME> environment variables (e.g. ..._BASE_URL)."""
    environ = os.environ if environ is None else environ
    names = set(OpenAIOptions.model_fields)
    found = {}
    for key, value in environ.items():
        if key.startswith(ENVIRONMENT_PREFIX):
            name = key[len(ENVIRONMENT_PREFIX):].lower()
            if name in names:
                found[name] = value
    return found


def resolve_options(settings: EngineSettings, options: OpenAIOptions | Mapping[str, Any] | None) -> OpenAIOptions:
    if isinstance(options, OpenAIOptions):
        return options
    merged: dict[str, Any] = options_from_environment()
    merged.update(settings.engine_options)
    merged.update(options or {})
    return OpenAIOptions.from_mapping(merged)


def _describe(payload: Any, limit: int = 300) -> str:
    text = repr(payload)
    return text if len(text) <= limit else text[:limit] + "..."


def parse_token_id(label: Any) -> int | None:
    """vLLM writes tokens as "token_id:123" when asked to return them as ids."""
    if isinstance(label, str) and label.startswith("token_id:"):
        try:
            return int(label[len("token_id:"):])
        except ValueError:
            return None
    return None


@dataclass
class ParsedReply:
    text: str
    finish_reason: str
    token_ids: list[int] | None
    logprobs: list[float] | None
    policy_version: int | None


def parse_completion(body: Any) -> ParsedReply:
    """Text, token ids and log-probs from a /v1/completions reply (None where the reply has none)."""
    choice = _first_choice(body)
    text = choice.get("text")
    if not isinstance(text, str):
        raise OpenAIEndpointError(f"completion choice has no text: {_describe(choice)}")
    token_ids = choice.get("token_ids")
    logprobs = None
    block = choice.get("logprobs")
    if isinstance(block, dict):
        values = block.get("token_logprobs")
        if isinstance(values, list):
            logprobs = values
        if token_ids is None and isinstance(block.get("tokens"), list):
            parsed = [parse_token_id(label) for label in block["tokens"]]
            token_ids = parsed if parsed and all(t is not None for t in parsed) else None
    return _checked_reply(body, text, choice, token_ids, logprobs)


def parse_chat(body: Any) -> ParsedReply:
    """Text (and token ids and log-probs where the endpoint adds them) from a chat reply."""
    choice = _first_choice(body)
    message = choice.get("message")
    if not isinstance(message, dict) or not isinstance(message.get("content"), (str, type(None))):
        raise OpenAIEndpointError(f"chat choice has no message content: {_describe(choice)}")
    logprobs = None
    block = choice.get("logprobs")
    if isinstance(block, dict) and isinstance(block.get("content"), list):
        logprobs = [entry.get("logprob") if isinstance(entry, dict) else None for entry in block["content"]]
    return _checked_reply(body, message.get("content") or "", choice, choice.get("token_ids"), logprobs)


def _first_choice(body: Any) -> dict:
    if not isinstance(body, dict):
        raise OpenAIEndpointError(f"reply is not a JSON object: {_describe(body)}")
    if isinstance(body.get("error"), dict):
        raise OpenAIEndpointError(f"endpoint error: {body['error'].get('message', body['error'])}")
    choices = body.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise OpenAIEndpointError(f"reply has no choices: {_describe(body)}")
    return choices[0]


def _checked_reply(body: dict, text: str, choice: dict, token_ids: Any, logprobs: Any) -> ParsedReply:
    if token_ids is not None and not (
        isinstance(token_ids, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in token_ids)
    ):
        raise OpenAIEndpointError(f"reply's token_ids are not a list of integers: {_describe(token_ids)}")
    if logprobs is not None:
        if not all(isinstance(lp, (int, float)) and not isinstance(lp, bool) for lp in logprobs):
            raise OpenAIEndpointError(f"reply's log-probs are not all numbers: {_describe(logprobs)}")
        logprobs = [float(lp) for lp in logprobs]
        if token_ids is not None and len(logprobs) != len(token_ids):
            raise OpenAIEndpointError(
                f"reply has {len(token_ids)} token ids but {len(logprobs)} log-probs"
            )
    version = body.get("policy_version")
    return ParsedReply(
        text=text,
        finish_reason=str(choice.get("finish_reason") or ""),
        token_ids=token_ids,
        logprobs=logprobs,
        policy_version=version if isinstance(version, int) and not isinstance(version, bool) else None,
    )


class _LocalServer:
    """`longhorizon serve-model` in a child process on a free loopback port."""

    def __init__(self, settings: EngineSettings, timeout_s: float) -> None:
        if not settings.model_path or not (Path(settings.model_path) / "config.json").is_file():
            raise EngineError(
                "the openai engine has no base_url and no local model folder to serve: set the "
                "base_url option (LONGHORIZON_OPENAI_BASE_URL) or model.path to a model folder"
            )
        self._folder = tempfile.TemporaryDirectory(prefix="longhorizon-serve-")
        ready = Path(self._folder.name) / "url"
        self.log_path = Path(self._folder.name) / "server.log"
        command = [
            sys.executable, "-m", "longhorizon.actor.model_server", settings.model_path, "--port", "0",
            "--dtype", settings.dtype, "--max-batch-size", str(max(1, settings.max_batch_size)),
            "--seed", str(settings.seed), "--torch-threads", str(max(1, settings.torch_threads)),
            "--ready-file", str(ready), "--exit-with-parent",
        ]
        with self.log_path.open("wb") as log_file:
            self.process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT)
        self._finalizer = weakref.finalize(self, _stop_process, self.process)
        deadline = time.monotonic() + timeout_s
        while not ready.is_file():
            if self.process.poll() is not None:
                output = self.log_path.read_text(errors="replace")[-2000:]
                self.stop()
                raise EngineError(f"the model server exited with code {self.process.returncode}:\n{output}")
            if time.monotonic() > deadline:
                self.stop()
                raise EngineError(f"the model server did not start within {timeout_s:.0f} s")
            time.sleep(0.05)
        self.base_url = ready.read_text().strip()

    def stop(self) -> None:
        self._finalizer()
        self._folder.cleanup()


def _stop_process(process: subprocess.Popen) -> None:
    stop_process(process, timeout_s=10)


class OpenAIEngine:
    """Generation over an OpenAI-compatible endpoint; see the module docstring for modes and weights."""

    capabilities = EngineCapabilities(
        # It may run without a local model (chat mode against a hosted model); with one, it
        # serves it itself and takes weights through the server's /v1/load_weights route.
        needs_local_model=False,
        weight_transports=("inline", "path"),
    )
    Options = OpenAIOptions

    @classmethod
    def options_for(cls, options: dict, *, purpose: str, hosted_model: str | None) -> dict:
        """A hosted model is named by model.path; playing for a score or for data needs the text
        only, so endpoints without token log-probs (chat) are fine there."""
        options = dict(options)
        if hosted_model is not None:
            options.setdefault("model", hosted_model)
        if purpose in ("eval", "collect"):
            options.setdefault("require_token_logprobs", False)
        return options

    def __init__(self, settings: EngineSettings, options: OpenAIOptions | Mapping[str, Any] | None = None) -> None:
        import httpx

        self.settings = settings
        self.sampling = settings.sampling
        self.options = resolve_options(settings, options)
        self.policy_version = 0
        self.max_concurrent_requests = self.options.max_concurrent_requests or max(1, settings.max_batch_size)
        self._server: _LocalServer | None = None
        self._weights_folder: tempfile.TemporaryDirectory | None = None
        self._client: Any = None
        self._client_token: Any = None
        self._limiter: trio.CapacityLimiter | None = None
        self._rng = random.Random(settings.seed)
        self.tokenizer = self._make_tokenizer()
        if self.options.base_url:
            self.base_url = self.options.base_url.rstrip("/")
        else:
            self._server = _LocalServer(settings, self.options.server_start_timeout_s)
            self.base_url = self._server.base_url
        self._headers = {"Content-Type": "application/json"}
        if self.options.api_key_env:
            key = os.environ.get(self.options.api_key_env)
            if not key:
                self._stop_server()
                raise EngineError(f"the openai engine's API key variable {self.options.api_key_env} is not set")
            self._headers["Authorization"] = f"Bearer {key}"
        self._timeout = httpx.Timeout(self.options.timeout_s, connect=min(30.0, self.options.timeout_s))
        try:
            self.model = self.options.model or self._first_model()
        except Exception:
            self._stop_server()
            raise

    # ------------------------------------------------------------------ setup

    def _make_tokenizer(self):
        folder = self.options.tokenizer_path or self.settings.model_path
        if folder and Path(folder).is_dir():
            return HFChatTokenizer(load_tokenizer(folder))
        if self.options.mode == "completions":
            raise EngineError(
                "the openai engine in completions mode sends token ids, so it needs the model's "
                "tokenizer locally: set model.path or the tokenizer_path option to a model folder, "
                "or use mode=chat (evaluation only)"
            )
        # Chat mode sends text; these tokens only measure the conversation for the context budget.
        return ByteChatTokenizer()

    def _first_model(self) -> str:
        import httpx

        try:
            response = httpx.get(f"{self.base_url}/models", headers=self._headers, timeout=self._timeout)
        except httpx.HTTPError as exc:
            raise EngineError(f"cannot reach the endpoint {self.base_url}: {exc!r}") from None
        if response.status_code != 200:
            raise EngineError(
                f"{self.base_url}/models answered {response.status_code}; set the model option to the "
                f"model name the endpoint expects"
            )
        try:
            models = response.json()["data"]
            return str(models[0]["id"])
        except (ValueError, KeyError, IndexError, TypeError):
            raise EngineError(f"{self.base_url}/models gave no model list: {_describe(response.text)}") from None

    def _async_client(self):
        """One client per trio run: connection pools cannot cross event loops."""
        import httpx

        token = trio.lowlevel.current_trio_token()
        if self._client is None or self._client_token is not token:
            self._client = httpx.AsyncClient(
                timeout=self._timeout, headers=self._headers,
                limits=httpx.Limits(max_connections=self.max_concurrent_requests),
            )
            self._client_token = token
            self._limiter = trio.CapacityLimiter(self.max_concurrent_requests)
        return self._client

    # ------------------------------------------------------------------ generation

    def _request_body(self, request: GenerationRequest) -> tuple[str, dict]:
        sampling = self.sampling
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": sampling.max_new_tokens,
            "temperature": max(0.0, sampling.temperature),
            "top_p": sampling.top_p,
            "n": 1,
        }
        if self.options.mode == "completions":
            body.update({
                "prompt": list(request.token_ids),
                "logprobs": 0,
                # vLLM extensions: the sampled ids themselves, and ids in place of token strings.
                "return_token_ids": True,
                "return_tokens_as_token_ids": True,
                "skip_special_tokens": True,
            })
            route = "completions"
        else:
            if not request.messages:
                raise OpenAIEndpointError("chat mode needs the conversation as messages; the request has none")
            body["messages"] = [{"role": m["role"], "content": m["content"]} for m in request.messages]
            route = "chat/completions"
        body.update(self.options.extra_body)
        return route, body

    async def _post(self, route: str, body: dict) -> Any:
        import httpx

        client = self._async_client()
        url = f"{self.base_url}/{route}"
        for attempt in range(self.options.max_retries + 1):
            last_try = attempt == self.options.max_retries
            try:
                async with self._limiter:
                    response = await client.post(url, json=body)
            except httpx.TransportError as exc:  # refused, reset, timed out
                if last_try:
                    raise OpenAIEndpointError(f"POST {url} failed after {attempt + 1} tries: {exc!r}") from None
                await trio.sleep(self._backoff(attempt, None))
                continue
            if response.status_code in RETRY_STATUSES and not last_try:
                await trio.sleep(self._backoff(attempt, response.headers.get("retry-after")))
                continue
            if response.status_code != 200:
                raise self._status_error(url, response)
            try:
                return response.json()
            except ValueError:
                raise OpenAIEndpointError(f"POST {url} answered 200 with a body that is not JSON: "
                                          f"{_describe(response.text)}") from None
        raise AssertionError("unreachable")

    def _backoff(self, attempt: int, retry_after: str | None) -> float:
        if retry_after:
            try:
                return min(60.0, max(0.0, float(retry_after)))
            except ValueError:
                pass
        return self.options.retry_backoff_s * (2 ** attempt) * (0.5 + self._rng.random())

    def _status_error(self, url: str, response) -> OpenAIEndpointError:
        try:
            detail = response.json().get("error", {})
            message = detail.get("message", detail) if isinstance(detail, dict) else detail
        except (ValueError, AttributeError):
            message = response.text
        if response.status_code == 404 and self.options.mode == "completions" and "completions" in url:
            return OpenAIEndpointError(
                f"{url} answered 404 ({_describe(message, 200)}): the endpoint may serve chat only. "
                f"Token-in/token-out generation (training) needs /v1/completions with token ids and "
                f"log-probs; for evaluation of a chat-only endpoint use mode=chat"
            )
        return OpenAIEndpointError(f"POST {url} answered {response.status_code}: {_describe(message, 500)}")

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        route, body = self._request_body(request)
        version = self.policy_version
        payload = await self._post(route, body)
        reply = parse_completion(payload) if self.options.mode == "completions" else parse_chat(payload)
        eos = self.tokenizer.eos_token_id
        has_tokens = reply.token_ids is not None and reply.logprobs is not None and self.options.mode == "completions"
        if has_tokens:
            token_ids, logprobs = reply.token_ids, reply.logprobs
            # The reply ends at the first stop string, as with the other engines (applied here, so
            # it does not depend on how an endpoint treats "stop").
            cut = tokens_through_stop_string(self.tokenizer.decode, token_ids, request.stop_strings)
            if cut is not None:
                token_ids, logprobs = token_ids[:cut], logprobs[:cut]
            text = self.tokenizer.decode(token_ids)
        elif self.options.require_token_logprobs:
            what = "chat replies carry text only" if self.options.mode == "chat" else (
                "its completions carry no token ids and log-probs")
            raise TokenLogprobsUnavailable(
                f"the endpoint {self.base_url} cannot be used for training: {what}. Training needs the "
                f"sampled token ids and their log-probs (vLLM's server or `longhorizon serve-model` in "
                f"completions mode return both); to evaluate this endpoint, run `longhorizon eval`, "
                f"which sets require_token_logprobs=false"
            )
        else:
            # Evaluation of a text-only endpoint: tokens only continue the conversation bookkeeping.
            text = _cut_text_at_stop(reply.text, request.stop_strings)
            token_ids = self.tokenizer.encode(text) + ([eos] if reply.finish_reason == "stop" else [])
            logprobs = [0.0] * len(token_ids)
        if not token_ids:
            raise OpenAIEndpointError(f"the endpoint returned an empty reply: {_describe(payload)}")
        return GenerationResult(
            token_ids=token_ids,
            logprobs=logprobs,
            text=text,
            stopped_on_eos=token_ids[-1] == eos,
            policy_version=reply.policy_version if reply.policy_version is not None else version,
        )

    # ------------------------------------------------------------------ weights and lifetime

    def update_weights(self, update: Any) -> None:
        """Ask the endpoint to load the update's weights (POST /v1/load_weights); blocking."""
        import httpx

        path = getattr(update, "path", None) or self._write_inline_weights(update)
        url = f"{self.base_url}/load_weights"
        try:
            response = httpx.post(url, json={"path": str(path), "version": int(update.version)},
                                  headers=self._headers, timeout=self._timeout)
        except httpx.HTTPError as exc:
            raise OpenAIEndpointError(f"POST {url} failed: {exc!r}") from None
        if response.status_code in (404, 405):
            raise OpenAIEndpointError(
                f"the endpoint {self.base_url} has no weight-reload route (POST /v1/load_weights answered "
                f"{response.status_code}): a remote endpoint cannot take the learner's weights. Use it for "
                f"evaluation, or serve the model with `longhorizon serve-model`, which has that route"
            )
        refused = _refused_problems(response)
        if refused:
            # The server checked the weights against its model and loaded none of them.
            raise WeightsRefused(refused)
        if response.status_code != 200:
            raise self._status_error(url, response)
        self.policy_version = int(update.version)

    def _write_inline_weights(self, update: Any) -> Path:
        """Inline tensors go to a local safetensors folder the (local) server can read."""
        from safetensors.torch import save_file


        if self._weights_folder is None:
            self._weights_folder = tempfile.TemporaryDirectory(prefix="longhorizon-weights-")
        folder = Path(self._weights_folder.name)
        state = {name: tensor.contiguous() for name, tensor in WeightsReceiver().receive(update).items()}
        save_file(state, str(folder / "model.safetensors"))
        return folder

    def end_episode(self, episode_id: str) -> None:
        pass

    def _stop_server(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            try:
                await client.aclose()
            except Exception as exc:  # a client from another event loop cannot close here; drop it
                log.debug("closing the HTTP client failed: %r", exc)
        self._stop_server()
        if self._weights_folder is not None:
            self._weights_folder.cleanup()
            self._weights_folder = None


def _refused_problems(response) -> list[str]:
    """The problems a `/v1/load_weights` answer lists when the server refused weights that do not
    fit its model (`longhorizon serve-model`'s 422 with code `weights_refused`), else none."""
    if response.status_code != 422:
        return []
    try:
        error = response.json().get("error")
    except (ValueError, AttributeError):
        return []
    if not isinstance(error, dict) or error.get("code") != WEIGHTS_REFUSED_CODE:
        return []
    problems = error.get("problems")
    if isinstance(problems, list) and problems and all(isinstance(problem, str) for problem in problems):
        return problems
    return [str(error.get("message") or "the server refused the weights")]


def _cut_text_at_stop(text: str, stop_strings: tuple[str, ...]) -> str:
    """Text-only replies end after the first stop string they contain (kept, as token replies keep it)."""
    ends = [text.index(stop) + len(stop) for stop in stop_strings if stop in text]
    return text[: min(ends)] if ends else text
