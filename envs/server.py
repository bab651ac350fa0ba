"""An AgentGym-compatible HTTP service that exposes any registered env as a table of live instances.

Run it with `longhorizon env serve NAME --port P`; talk to it with envs/remote.py or any AgentGym
client. Endpoints (JSON in, JSON out):

    POST /create  {data_idx?, seed?, goal?, commands?} -> {id, observation, reward, score, done, ...}
    POST /reset   {id, data_idx, seed?}               -> {id, observation, reward, score, done, ...}
    POST /step    {id, action}                        -> {observation, reward, score, done, ...}
    POST /close   {id}                                -> {id, closed}
    GET  /observation?id=I                            -> the instance's latest observation (a string)
    GET  /action_hint?id=I                            -> {id, action_hint: [...]} (envs that list valid actions)
    GET  /tasks?split=train|test&offset=&limit=       -> {env, split, total, offset, tasks: [...]}
    GET  /info                                        -> env name, options, prompt format, instructions
    GET  /health                                      -> {status, env, instances, max_instances}

Success responses keep the reference's field names (`id`, `observation`, `reward`, `done`, `score`)
so existing clients read them; extra fields (`terminated`, `truncated`, `info`, `task_id`) carry
what our Env protocol returns. Failures, unlike the reference's, use real status codes with a body
{"error": "..."}: 400 bad JSON / types / missing fields, or a malformed head (an HTTP/1.1 request
without Host, Content-Length with Transfer-Encoding, differing Content-Length fields, a folded
header line: these also close the connection), 404 unknown endpoint or instance id, 405 wrong
method, 408 request not received in time, 409 stepping a finished episode, 411 a POST without
Content-Length (or with a chunked body), 413 body too large, 429 the client address holds its
share of instances, 431 request head too large, 503 instance table full or every connection busy,
504 env call timed out, 505 an HTTP version other than 1.0 and 1.1, 500 the env itself failed.

data_idx values, instance ids and the instance limits are the service's (envs/service.py says how
they are chosen). How it compares with the reference AgentGym services is checked by tests in
tests/test_env_service.py and tests/test_textcraft.py.

Limits against clients that hog the service (common/http.py, which parses with httptools): one trio
task per connection, so an idle, trickling or cut-off connection costs no thread; a request runs
only once its head and whole body are in, within header_timeout_s and request_timeout_s of its
first byte; a connection idle keep_alive_timeout_s between requests is closed; beyond
max_connections a new connection evicts the one that has waited longest without a whole request.
A client that resets its connection mid-request costs one short log line, at most one per
LOST_CLIENT_LOG_INTERVAL_S, not a traceback.

Threads: EnvServer runs one trio event loop on a dedicated thread; it accepts, reads, parses, owns
the instance table and runs every env call. One loop (not one per instance) because the envs are
cheap coroutines that mostly compute, and the heavy ones (SciWorld's JVM, the browsers) already
hand their blocking calls to worker threads; a single owner of the table needs no locks. A
per-instance trio.Lock keeps two requests for the same instance from interleaving.
"""

from __future__ import annotations

import json
import logging
import resource
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any
from urllib.parse import parse_qs, urlsplit

import trio
from longhorizon.common.http import HTTPLimits, HTTPServer, LostClientLog, Request, Response, open_listener
from longhorizon.envs.base import SPLITS, make_env
from longhorizon.envs.service import EnvService, ServiceError, ServiceSettings, build_task_table, task_listing

log = logging.getLogger(__name__)

MAX_TASKS_PAGE = 1000
# Descriptors kept free beyond max_connections: the listener, env files, worker threads' pipes.
SPARE_DESCRIPTORS = 256


# ---------------------------------------------------------------- request validation (pure)


def parse_json_object(body: bytes) -> dict:
    """The request body as a JSON object; anything else is a 400."""
    if not body.strip():
        return {}
    try:
        payload = json.loads(body)
    except (ValueError, RecursionError) as error:
        raise ServiceError(HTTPStatus.BAD_REQUEST, f"the body is not valid JSON: {error}") from None
    if not isinstance(payload, dict):
        raise ServiceError(HTTPStatus.BAD_REQUEST, f"the body must be a JSON object, got {type(payload).__name__}")
    return payload


def integer_field(payload: Mapping[str, Any], name: str, *, required: bool = True) -> int | None:
    value = payload.get(name)
    if value is None:
        if required:
            raise ServiceError(HTTPStatus.BAD_REQUEST, f"missing field {name!r} (an integer)")
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ServiceError(HTTPStatus.BAD_REQUEST, f"field {name!r} must be an integer, got {json.dumps(value)[:80]}")
    return value


def string_field(payload: Mapping[str, Any], name: str, *, required: bool = True) -> str | None:
    value = payload.get(name)
    if value is None:
        if required:
            raise ServiceError(HTTPStatus.BAD_REQUEST, f"missing field {name!r} (a string)")
        return None
    if not isinstance(value, str):
        raise ServiceError(HTTPStatus.BAD_REQUEST, f"field {name!r} must be a string, got {json.dumps(value)[:80]}")
    return value


def query_integer(query: Mapping[str, list[str]], name: str, default: int | None = None) -> int:
    values = query.get(name)
    if not values:
        if default is None:
            raise ServiceError(HTTPStatus.BAD_REQUEST, f"missing query parameter {name!r} (an integer)")
        return default
    try:
        return int(values[-1])
    except ValueError:
        raise ServiceError(
            HTTPStatus.BAD_REQUEST, f"query parameter {name!r} must be an integer, got {values[-1][:80]!r}"
        ) from None


# ---------------------------------------------------------------- routes (run on the service's trio loop)


@dataclass(frozen=True)
class _Route:
    method: str
    handler: Callable[[EnvServer, dict, Mapping[str, list[str]], str], Awaitable[tuple[int, Any]]]
    """(server, JSON body, query, client address) -> (status, JSON answer)."""


async def _create(server: EnvServer, payload: dict, query: Mapping[str, list[str]], client: str) -> tuple[int, Any]:
    if payload.get("commands") is not None:
        raise ServiceError(
            HTTPStatus.BAD_REQUEST, "custom crafting commands are not supported; pick a task with data_idx or goal"
        )
    data_idx = integer_field(payload, "data_idx", required=False)
    goal = string_field(payload, "goal", required=False)
    seed = integer_field(payload, "seed", required=False)
    if goal is not None and data_idx is None:
        data_idx = server.service.data_idx_for_goal(goal)
    return HTTPStatus.OK, await server.service.create(data_idx, seed, client)


async def _reset(server: EnvServer, payload: dict, query: Mapping[str, list[str]], client: str) -> tuple[int, Any]:
    instance_id = integer_field(payload, "id")
    data_idx = integer_field(payload, "data_idx")
    seed = integer_field(payload, "seed", required=False)
    return HTTPStatus.OK, await server.service.reset(instance_id, data_idx, seed)


async def _step(server: EnvServer, payload: dict, query: Mapping[str, list[str]], client: str) -> tuple[int, Any]:
    instance_id = integer_field(payload, "id")
    action = string_field(payload, "action")
    return HTTPStatus.OK, await server.service.step(instance_id, action)


async def _close(server: EnvServer, payload: dict, query: Mapping[str, list[str]], client: str) -> tuple[int, Any]:
    return HTTPStatus.OK, await server.service.close(integer_field(payload, "id"))


async def _observation(server: EnvServer, payload: dict, query: Mapping[str, list[str]], client: str) -> tuple[int, Any]:
    return HTTPStatus.OK, await server.service.observation(query_integer(query, "id"))


async def _tasks(server: EnvServer, payload: dict, query: Mapping[str, list[str]], client: str) -> tuple[int, Any]:
    split = query.get("split", [None])[-1]
    offset = query_integer(query, "offset", 0)
    limit = query_integer(query, "limit", MAX_TASKS_PAGE)
    if offset < 0 or not 1 <= limit <= MAX_TASKS_PAGE:
        raise ServiceError(HTTPStatus.BAD_REQUEST, f"need offset >= 0 and 1 <= limit <= {MAX_TASKS_PAGE}")
    listing = task_listing(server.table, split, offset, limit)
    return HTTPStatus.OK, {"env": server.settings.env_name, **listing}


async def _info(server: EnvServer, payload: dict, query: Mapping[str, list[str]], client: str) -> tuple[int, Any]:
    return HTTPStatus.OK, server.info


async def _health(server: EnvServer, payload: dict, query: Mapping[str, list[str]], client: str) -> tuple[int, Any]:
    return HTTPStatus.OK, await server.service.health()


async def _action_hint(server: EnvServer, payload: dict, query: Mapping[str, list[str]], client: str) -> tuple[int, Any]:
    return HTTPStatus.OK, await server.service.action_hint(query_integer(query, "id"))


ROUTES: Mapping[str, _Route] = {
    "/action_hint": _Route("GET", _action_hint),
    "/create": _Route("POST", _create),
    "/reset": _Route("POST", _reset),
    "/step": _Route("POST", _step),
    "/close": _Route("POST", _close),
    "/observation": _Route("GET", _observation),
    "/tasks": _Route("GET", _tasks),
    "/info": _Route("GET", _info),
    "/health": _Route("GET", _health),
}


def _json_response(status: int, payload: Any, headers: Mapping[str, str] | None = None) -> Response:
    try:
        body = json.dumps(payload, allow_nan=False).encode("utf-8")
    except ValueError as error:
        status, body = HTTPStatus.INTERNAL_SERVER_ERROR, json.dumps({"error": f"unserialisable response: {error}"}).encode()
    return Response(int(status), body, dict(headers or {}))


def _raise_descriptor_limit(wanted: int) -> None:
    """Lift the soft limit on open files toward `wanted` (never past the hard limit, never lower it)."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        if soft != resource.RLIM_INFINITY and soft < target:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        if soft != resource.RLIM_INFINITY and soft < wanted:
            log.warning(
                "open files are limited to %d, fewer than max_connections needs (%d): beyond it the service "
                "evicts waiting connections early", soft, wanted,
            )
    except (OSError, ValueError) as error:
        log.warning("could not read or raise the open-file limit: %r", error)


class EnvServer:
    """The HTTP service around one env: start() binds and serves on a background thread; stop() ends it.

    Usable as a context manager. `port` and `url` are known once start() returns.
    """

    def __init__(self, settings: ServiceSettings):
        self.settings = settings
        self.table = build_task_table(settings.env_name, settings.env_options)
        probe = make_env(settings.env_name, **dict(settings.env_options))
        self.info = {
            "env": settings.env_name,
            "options": dict(settings.env_options),
            "prompt_format": probe.prompt_format,
            "instructions": probe.instructions(),
            "num_tasks": {split: len(self.table.data_idx_by_split[split]) for split in SPLITS},
            "data_idx_mapping": self.table.mapping,
            "max_instances": settings.max_instances,
            "max_instances_per_client": settings.client_instance_limit(),
            "idle_timeout_s": settings.idle_timeout_s,
            "unused_idle_timeout_s": settings.unused_idle_timeout_s,
            "header_timeout_s": settings.header_timeout_s,
            "request_timeout_s": settings.request_timeout_s,
            "max_body_bytes": settings.max_body_bytes,
            "max_connections": settings.max_connections,
        }
        self.limits = HTTPLimits(
            max_connections=settings.max_connections,
            header_timeout_s=settings.header_timeout_s,
            request_timeout_s=settings.request_timeout_s,
            keep_alive_timeout_s=settings.keep_alive_timeout_s,
            max_body_bytes=settings.max_body_bytes,
        )
        self.service = EnvService(settings, self.table)
        self.error_counts: dict[int, int] = {}
        self.lost_clients = LostClientLog(emit=log.info)  # under this module's logger, with its other lines
        self._http: HTTPServer | None = None
        self._port: int | None = None
        self._trio_token: trio.lowlevel.TrioToken | None = None
        self._stop_event: trio.Event | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("the env server is not started")
        return self._port

    @property
    def url(self) -> str:
        host = self.settings.host if ":" not in self.settings.host else f"[{self.settings.host}]"
        return f"http://{host}:{self.port}"

    def count_error(self, status: int) -> None:
        # Called on the loop thread only; readers elsewhere see a dict that is only ever added to.
        self.error_counts[int(status)] = self.error_counts.get(int(status), 0) + 1

    def open_connections(self) -> int:
        return 0 if self._http is None else self._http.open_connections()

    async def answer(self, request: Request) -> Response:
        """One whole request -> its response (runs on the loop, on the request's connection task)."""
        parts = urlsplit(request.target)
        try:
            route = ROUTES.get(parts.path.rstrip("/") or "/")
            if route is None:
                raise ServiceError(HTTPStatus.NOT_FOUND, f"unknown endpoint {parts.path[:100]!r}; endpoints: {', '.join(ROUTES)}")
            if request.method != route.method:
                raise ServiceError(
                    HTTPStatus.METHOD_NOT_ALLOWED, f"{parts.path} takes {route.method}, not {request.method}",
                    {"Allow": route.method},
                )
            payload = parse_json_object(request.body) if request.method == "POST" else {}
            status, answer = await route.handler(self, payload, parse_qs(parts.query), request.client)
            return _json_response(status, answer)
        except ServiceError as error:
            self.count_error(error.status)
            return _json_response(error.status, {"error": error.message}, error.headers)
        except Exception as error:  # the service outlives any one bad request
            log.exception("request %s %s failed", request.method, request.target[:100])
            self.count_error(HTTPStatus.INTERNAL_SERVER_ERROR)
            return _json_response(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": f"internal error: {error!r}"})

    def start(self) -> EnvServer:
        if self._thread is not None:
            raise RuntimeError("the env server is already started")
        _raise_descriptor_limit(self.settings.max_connections + SPARE_DESCRIPTORS)
        listener = open_listener(self.settings.host, self.settings.port)  # bind errors surface here
        self._port = listener.getsockname()[1]
        self._http = HTTPServer(
            listener, self.answer, self.limits, count_error=self.count_error, lost_clients=self.lost_clients,
            server_name="longhorizon-env",
        )
        ready = threading.Event()
        failure: list[BaseException] = []

        async def loop_main() -> None:
            self._trio_token = trio.lowlevel.current_trio_token()
            self._stop_event = trio.Event()
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._expire_forever)
                    nursery.start_soon(self._http.serve)
                    ready.set()
                    await self._stop_event.wait()
                    nursery.cancel_scope.cancel()
            finally:
                listener.close()
                with trio.CancelScope(shield=True):
                    await self.service.close_all()

        def run_loop() -> None:
            try:
                trio.run(loop_main)
            except BaseException as error:
                failure.append(error)
                log.exception("the env service's event loop failed")
            finally:
                listener.close()
                ready.set()

        self._thread = threading.Thread(target=run_loop, name="env-service-trio", daemon=True)
        self._thread.start()
        ready.wait()
        if failure:
            self._thread.join()
            self._thread = None
            raise RuntimeError(f"the env service's event loop did not start: {failure[0]!r}")
        log.info("serving env %s at %s (%d tasks)", self.settings.env_name, self.url, len(self.table.by_data_idx))
        if self.settings.host not in ("127.0.0.1", "localhost", "::1"):
            log.warning("the env service listens on %s without authentication: anyone who can reach it can use it", self.settings.host)
        return self

    async def _expire_forever(self) -> None:
        shortest = min(self.settings.idle_timeout_s, self.settings.unused_idle_timeout_s)
        interval = min(max(shortest / 4, 0.05), 10.0)
        while True:
            await trio.sleep(interval)
            await self.service.expire_idle()

    def stop(self) -> None:
        """Stop accepting, close every connection and instance, end the loop's thread. Safe to call twice."""
        if self._trio_token is not None and self._stop_event is not None:
            token, event = self._trio_token, self._stop_event
            self._trio_token = None
            try:
                # run_sync_soon works from any thread, a trio thread of another loop included.
                token.run_sync_soon(event.set)
            except trio.RunFinishedError:
                pass
        if self._thread is not None:
            self._thread.join(timeout=10)

    def __enter__(self) -> EnvServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def serve_until_interrupted(self) -> None:
        """Start, print where, and serve until Ctrl-C (the CLI's `env serve`)."""
        self.start()
        print(f"serving {self.settings.env_name} at {self.url} (Ctrl-C stops)", flush=True)
        try:
            while self._thread is not None and self._thread.is_alive():
                time.sleep(0.5)
        except KeyboardInterrupt:
            pass
        finally:
            self.stop()


def serve(settings: ServiceSettings) -> None:
    """Serve until interrupted."""
    EnvServer(settings).serve_until_interrupted()
