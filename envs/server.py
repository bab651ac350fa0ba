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
{"error": "..."}: 400 bad JSON / types / missing fields, 404 unknown endpoint or instance id, 405
wrong method, 408 request not received in time, 409 stepping a finished episode, 411 no
Content-Length, 413 body too large, 429 the client address holds its share of instances, 503
instance table or connection slots full, 504 env call timed out, 500 the env itself failed.

data_idx values, instance ids and the instance limits are the service's (envs/service.py says how
they are chosen). How it compares with the reference AgentGym services is checked by tests in
tests/test_env_service.py and tests/test_textcraft.py.

Limits against clients that hog the service: max_connections threads, each connection closed after
keep_alive_timeout_s idle between requests and after request_timeout_s for a whole request (head
and body, however slowly it trickles in), so a slow client holds a slot for a bounded time; a
listen backlog of LISTEN_BACKLOG for bursts of connects. A client that resets its connection
mid-request costs one short log line, at most one per LOST_CLIENT_LOG_INTERVAL_S, not a traceback.

Threads: http.server's ThreadingHTTPServer parses requests on one thread per connection, and one
trio event loop on a dedicated thread owns the instance table and runs every env call, reached
through trio.from_thread with the loop's token. One loop per server (not one per instance) because
the envs are cheap coroutines that mostly compute: extra loops would cost threads and gain nothing
under the GIL, while a single owner of the table needs no locks. A per-instance trio.Lock keeps two
requests for the same instance from interleaving.
"""

from __future__ import annotations

import io
import json
import logging
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

import trio
from longhorizon.envs.base import SPLITS, make_env
from longhorizon.envs.service import EnvService, ServiceError, ServiceSettings, build_task_table, task_listing

log = logging.getLogger(__name__)

MAX_TASKS_PAGE = 1000
# An oversized body is read and thrown away up to this size so the client can read our 413 before
# the connection closes; beyond it the connection is simply closed.
MAX_DISCARDED_BODY_BYTES = 16 * 1024 * 1024
# The listen backlog (the kernel caps it at net.core.somaxconn).
LISTEN_BACKLOG = 128
# Clients that reset their connection are logged in one line at most this often.
LOST_CLIENT_LOG_INTERVAL_S = 10.0


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


# ---------------------------------------------------------------- HTTP side (one thread per connection)


@dataclass(frozen=True)
class _Route:
    method: str
    handler: Callable[[EnvServer, dict, Mapping[str, list[str]], str], tuple[int, Any]]
    """(server, JSON body, query, client address) -> (status, JSON answer)."""


def _create(server: EnvServer, payload: dict, query: Mapping[str, list[str]], client: str) -> tuple[int, Any]:
    if payload.get("commands") is not None:
        raise ServiceError(
            HTTPStatus.BAD_REQUEST, "custom crafting commands are not supported; pick a task with data_idx or goal"
        )
    data_idx = integer_field(payload, "data_idx", required=False)
    goal = string_field(payload, "goal", required=False)
    seed = integer_field(payload, "seed", required=False)
    if goal is not None and data_idx is None:
        data_idx = server.service.data_idx_for_goal(goal)  # reads an immutable table: no hop needed
    return HTTPStatus.OK, server.call(server.service.create, data_idx, seed, client)


def _reset(server: EnvServer, payload: dict, query: Mapping[str, list[str]], client: str) -> tuple[int, Any]:
    instance_id = integer_field(payload, "id")
    data_idx = integer_field(payload, "data_idx")
    seed = integer_field(payload, "seed", required=False)
    return HTTPStatus.OK, server.call(server.service.reset, instance_id, data_idx, seed)


def _step(server: EnvServer, payload: dict, query: Mapping[str, list[str]], client: str) -> tuple[int, Any]:
    instance_id = integer_field(payload, "id")
    action = string_field(payload, "action")
    return HTTPStatus.OK, server.call(server.service.step, instance_id, action)


def _close(server: EnvServer, payload: dict, query: Mapping[str, list[str]], client: str) -> tuple[int, Any]:
    return HTTPStatus.OK, server.call(server.service.close, integer_field(payload, "id"))


def _observation(server: EnvServer, payload: dict, query: Mapping[str, list[str]], client: str) -> tuple[int, Any]:
    return HTTPStatus.OK, server.call(server.service.observation, query_integer(query, "id"))


def _tasks(server: EnvServer, payload: dict, query: Mapping[str, list[str]], client: str) -> tuple[int, Any]:
    split = query.get("split", [None])[-1]
    offset = query_integer(query, "offset", 0)
    limit = query_integer(query, "limit", MAX_TASKS_PAGE)
    if offset < 0 or not 1 <= limit <= MAX_TASKS_PAGE:
        raise ServiceError(HTTPStatus.BAD_REQUEST, f"need offset >= 0 and 1 <= limit <= {MAX_TASKS_PAGE}")
    listing = task_listing(server.table, split, offset, limit)
    return HTTPStatus.OK, {"env": server.settings.env_name, **listing}


def _info(server: EnvServer, payload: dict, query: Mapping[str, list[str]], client: str) -> tuple[int, Any]:
    return HTTPStatus.OK, server.info


def _health(server: EnvServer, payload: dict, query: Mapping[str, list[str]], client: str) -> tuple[int, Any]:
    return HTTPStatus.OK, server.call(server.service.health)


def _action_hint(server: EnvServer, payload: dict, query: Mapping[str, list[str]], client: str) -> tuple[int, Any]:
    return HTTPStatus.OK, server.call(server.service.action_hint, query_integer(query, "id"))


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


class _RequestTooSlow(Exception):
    """A request's head and body did not arrive within request_timeout_s.

    Deliberately not a TimeoutError: http.server treats those as an idle keep-alive connection
    and closes it without a word, while a late request gets a 408.
    """


class _DeadlineReader(io.RawIOBase):
    """A connection's socket reads, limited per request as a whole instead of per read.

    Between requests one read may wait keep_alive_timeout_s for the next request to begin. From the
    first byte of a request (from the accept, for a connection's first request) every read shares
    one deadline request_timeout_s away, so a client that trickles a byte every few seconds is cut
    off like a silent one. A request whose head was already buffered with the previous one starts
    its clock at its first read from the socket, so it may get one keep-alive wait more.
    """

    def __init__(self, connection: socket.socket, keep_alive_timeout_s: float, request_timeout_s: float):
        super().__init__()
        self._connection = connection
        self._keep_alive_timeout_s = keep_alive_timeout_s
        self._request_timeout_s = request_timeout_s
        self.deadline: float | None = time.monotonic() + request_timeout_s
        """When the request being read must be complete; None while waiting for the next one."""

    def readable(self) -> bool:
        return True

    def await_next_request(self) -> None:
        self.deadline = None

    def request_read(self) -> None:
        """The request is in (or refused): what follows writes the answer under the keep-alive timeout."""
        self.deadline = None
        self._connection.settimeout(self._keep_alive_timeout_s)

    def readinto(self, buffer: Any) -> int:
        if self.deadline is None:
            # A TimeoutError here is an idle keep-alive connection; http.server closes it.
            self._connection.settimeout(self._keep_alive_timeout_s)
            count = self._connection.recv_into(buffer)
            if count:
                self.deadline = time.monotonic() + self._request_timeout_s
            return count
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise _RequestTooSlow()
        self._connection.settimeout(remaining)
        try:
            return self._connection.recv_into(buffer)
        except TimeoutError:
            raise _RequestTooSlow() from None


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: a RemoteEnv reuses one connection per instance
    server_version = "longhorizon-env"
    # Headers and body go out in two writes; with Nagle on, the second waits for a delayed ACK.
    disable_nagle_algorithm = True
    server: _HTTPServer
    # What a refusal written before the request line was parsed (a 408) reports; parse_request
    # replaces them for every request that gets that far.
    requestline = ""
    request_version = "HTTP/1.1"
    command = ""

    def setup(self) -> None:
        settings = self.server.env_server.settings
        self.timeout = settings.keep_alive_timeout_s
        super().setup()
        # Swap the stdlib's reader for one with a per-request deadline. The stdlib's must be closed:
        # it holds a reference that would keep the socket open after the handler ends.
        self.rfile.close()
        self._reader = _DeadlineReader(self.connection, settings.keep_alive_timeout_s, settings.request_timeout_s)
        self.rfile = io.BufferedReader(self._reader)
        self._requests_begun = 0

    def handle_one_request(self) -> None:
        if self._requests_begun:
            self._reader.await_next_request()
        self._requests_begun += 1
        try:
            super().handle_one_request()
        except _RequestTooSlow:
            self.send_error(HTTPStatus.REQUEST_TIMEOUT, self._too_slow_message())

    def _too_slow_message(self) -> str:
        return f"the request did not arrive within {self.server.env_server.settings.request_timeout_s} s"

    def do_GET(self) -> None:
        self._handle("GET")

    def do_POST(self) -> None:
        self._handle("POST")

    def do_PUT(self) -> None:
        self._handle("PUT")

    def do_DELETE(self) -> None:
        self._handle("DELETE")

    def do_PATCH(self) -> None:
        self._handle("PATCH")

    def _handle(self, method: str) -> None:
        env_server = self.server.env_server
        try:
            body = self._read_body(env_server.settings.max_body_bytes)
            parts = urlsplit(self.path)
            route = ROUTES.get(parts.path.rstrip("/") or "/")
            if route is None:
                raise ServiceError(HTTPStatus.NOT_FOUND, f"unknown endpoint {parts.path[:100]!r}; endpoints: {', '.join(ROUTES)}")
            if method != route.method:
                raise ServiceError(
                    HTTPStatus.METHOD_NOT_ALLOWED, f"{parts.path} takes {route.method}, not {method}", {"Allow": route.method}
                )
            payload = parse_json_object(body) if method == "POST" else {}
            status, response = route.handler(env_server, payload, parse_qs(parts.query), self.client_address[0])
            self._send_json(status, response)
        except ServiceError as error:
            env_server.count_error(error.status)
            self._send_json(error.status, {"error": error.message}, error.headers)
        except ConnectionError:
            raise  # the client went away mid-request: _HTTPServer.handle_error notes it in one line
        except Exception as error:  # the service outlives any one bad request
            log.exception("request %s %s failed", method, self.path[:100])
            env_server.count_error(HTTPStatus.INTERNAL_SERVER_ERROR)
            self._send_json(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": f"internal error: {error!r}"})

    def _read_body(self, limit: int) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() not in ("", "identity"):
            self.close_connection = True
            raise ServiceError(HTTPStatus.LENGTH_REQUIRED, "chunked bodies are not accepted; send Content-Length")
        declared = self.headers.get("Content-Length")
        if declared is None:
            return b""
        try:
            length = int(declared)
            if length < 0:
                raise ValueError
        except ValueError:
            self.close_connection = True
            raise ServiceError(HTTPStatus.BAD_REQUEST, f"bad Content-Length {declared[:40]!r}") from None
        if length > limit:
            self.close_connection = True
            self._discard(length)
            raise ServiceError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"the body is {length} bytes; the limit is {limit}")
        try:
            body = self.rfile.read(length)
        except (_RequestTooSlow, TimeoutError):
            # TimeoutError: a body whose head came buffered with the previous request, then silence.
            self.close_connection = True
            raise ServiceError(HTTPStatus.REQUEST_TIMEOUT, self._too_slow_message()) from None
        if len(body) != length:
            self.close_connection = True
            raise ServiceError(HTTPStatus.BAD_REQUEST, "the body ended before Content-Length bytes arrived")
        return body

    def _discard(self, length: int) -> None:
        if length > MAX_DISCARDED_BODY_BYTES:
            return
        remaining = length
        try:
            while remaining > 0:
                chunk = self.rfile.read(min(remaining, 64 * 1024))
                if not chunk:
                    return
                remaining -= len(chunk)
        except (OSError, _RequestTooSlow):
            return

    def _send_json(self, status: int, payload: Any, headers: Mapping[str, str] | None = None) -> None:
        try:
            data = json.dumps(payload, allow_nan=False).encode("utf-8")
        except ValueError as error:
            status, data = HTTPStatus.INTERNAL_SERVER_ERROR, json.dumps({"error": f"unserialisable response: {error}"}).encode()
        try:
            self._reader.request_read()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data)
        except OSError:
            self.close_connection = True  # the client went away; nothing left to tell it

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        # http.server's own refusals (bad request line, oversized headers, unknown method) as JSON too.
        self.close_connection = True
        if self.request_version == "HTTP/0.9":
            self.request_version = "HTTP/1.0"  # an unparsable request line still gets a status line
        self.server.env_server.count_error(code)
        self._send_json(code, {"error": message or HTTPStatus(code).phrase})

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)


class _LostClientLog:
    """One short log line for clients that vanish mid-request, at most one per interval.

    A client that resets its connection is the client's affair, not a service fault: no traceback,
    and a storm of them (a killed trainer's hundred connections) makes one line with a count.
    """

    def __init__(
        self,
        interval_s: float = LOST_CLIENT_LOG_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
        emit: Callable[[str], None] = log.info,
    ):
        self.interval_s = interval_s
        self.clock = clock
        self.emit = emit
        self.total = 0
        self._unreported = 0
        self._last_line: float | None = None
        self._lock = threading.Lock()

    def note(self, client: str, error: BaseException) -> None:
        with self._lock:
            self.total += 1
            now = self.clock()
            if self._last_line is not None and now - self._last_line < self.interval_s:
                self._unreported += 1
                return
            self._last_line = now
            unreported, self._unreported = self._unreported, 0
        since = f" ({unreported} more since the last such line)" if unreported else ""
        self.emit(f"client {client} went away mid-request: {type(error).__name__}{since}")


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    # Connections the kernel completes while the accept loop is busy wait here; at http.server's
    # default of 5, a burst of connects (many actors starting at once) stalls on SYN retries.
    request_queue_size = LISTEN_BACKLOG

    def __init__(self, address: tuple[str, int], env_server: EnvServer):
        self.env_server = env_server
        self._slots = threading.BoundedSemaphore(env_server.settings.max_connections)
        self._open: set[socket.socket] = set()
        self._open_lock = threading.Lock()
        super().__init__(address, _Handler)

    def process_request(self, request: socket.socket, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            body = json.dumps({"error": "too many open connections; retry later"}).encode()
            head = (
                f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n"
            ).encode()
            try:
                request.settimeout(1.0)
                request.sendall(head + body)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        with self._open_lock:
            self._open.add(request)
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._forget(request)
            raise

    def process_request_thread(self, request: socket.socket, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._forget(request)

    def handle_error(self, request: socket.socket, client_address: Any) -> None:
        error = sys.exc_info()[1]
        if isinstance(error, (ConnectionError, TimeoutError)):
            self.env_server.lost_clients.note(str(client_address[0]), error)
        else:  # a fault of ours: worth its traceback (socketserver would print it to stderr)
            log.error("connection from %s failed", client_address[0], exc_info=True)

    def _forget(self, request: socket.socket) -> None:
        with self._open_lock:
            if request in self._open:
                self._open.discard(request)
                self._slots.release()

    def open_connections(self) -> int:
        with self._open_lock:
            return len(self._open)

    def drop_connections(self) -> None:
        # Wakes handler threads blocked reading an idle keep-alive connection so shutdown is prompt.
        with self._open_lock:
            for request in self._open:
                try:
                    request.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


class EnvServer:
    """The HTTP service around one env: start() binds and serves on background threads; stop() ends it.

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
            "request_timeout_s": settings.request_timeout_s,
            "max_body_bytes": settings.max_body_bytes,
        }
        self.service = EnvService(settings, self.table)
        self.error_counts: dict[int, int] = {}
        self._error_lock = threading.Lock()
        self.lost_clients = _LostClientLog()
        self._http: _HTTPServer | None = None
        self._trio_token: trio.lowlevel.TrioToken | None = None
        self._stop_event: trio.Event | None = None
        self._threads: list[threading.Thread] = []

    @property
    def port(self) -> int:
        if self._http is None:
            raise RuntimeError("the env server is not started")
        return self._http.server_address[1]

    @property
    def url(self) -> str:
        host = self.settings.host if ":" not in self.settings.host else f"[{self.settings.host}]"
        return f"http://{host}:{self.port}"

    def count_error(self, status: int) -> None:
        with self._error_lock:
            self.error_counts[int(status)] = self.error_counts.get(int(status), 0) + 1

    def open_connections(self) -> int:
        return 0 if self._http is None else self._http.open_connections()

    def call(self, async_function: Callable[..., Any], *args: Any) -> Any:
        """Run a service method on the trio thread and wait for its result (from a handler thread)."""
        if self._trio_token is None:
            raise ServiceError(HTTPStatus.SERVICE_UNAVAILABLE, "the service is shutting down")
        try:
            return trio.from_thread.run(async_function, *args, trio_token=self._trio_token)
        except trio.RunFinishedError:
            raise ServiceError(HTTPStatus.SERVICE_UNAVAILABLE, "the service is shutting down") from None

    def start(self) -> EnvServer:
        if self._http is not None:
            raise RuntimeError("the env server is already started")
        ready = threading.Event()
        failure: list[BaseException] = []

        async def loop_main() -> None:
            self._trio_token = trio.lowlevel.current_trio_token()
            self._stop_event = trio.Event()
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._expire_forever)
                    ready.set()
                    await self._stop_event.wait()
                    nursery.cancel_scope.cancel()
            finally:
                with trio.CancelScope(shield=True):
                    await self.service.close_all()

        def run_loop() -> None:
            try:
                trio.run(loop_main)
            except BaseException as error:
                failure.append(error)
                log.exception("the env service's trio loop failed")
            finally:
                ready.set()

        loop_thread = threading.Thread(target=run_loop, name="env-service-trio", daemon=True)
        loop_thread.start()
        ready.wait()
        if failure:
            raise RuntimeError(f"the env service's event loop did not start: {failure[0]!r}")
        try:
            self._http = _HTTPServer((self.settings.host, self.settings.port), self)
        except BaseException:
            self._stop_loop()
            loop_thread.join()
            raise
        http_thread = threading.Thread(target=self._http.serve_forever, kwargs={"poll_interval": 0.2}, name="env-service-http", daemon=True)
        http_thread.start()
        self._threads = [loop_thread, http_thread]
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

    def _stop_loop(self) -> None:
        if self._trio_token is None or self._stop_event is None:
            return
        token, event = self._trio_token, self._stop_event
        self._trio_token = None
        try:
            # run_sync_soon works from any thread, a trio thread of another loop included.
            token.run_sync_soon(event.set)
        except trio.RunFinishedError:
            pass

    def stop(self) -> None:
        """Stop accepting, close every instance, end the threads. Safe to call twice."""
        if self._http is not None:
            self._http.shutdown()
            self._http.drop_connections()
            self._http.server_close()
        self._stop_loop()
        for thread in self._threads:
            thread.join(timeout=10)
        self._threads = []

    def __enter__(self) -> EnvServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def serve_until_interrupted(self) -> None:
        """Start, print where, and serve until Ctrl-C (the CLI's `env serve`)."""
        self.start()
        print(f"serving {self.settings.env_name} at {self.url} (Ctrl-C stops)", flush=True)
        try:
            while all(thread.is_alive() for thread in self._threads):
                time.sleep(0.5)
        except KeyboardInterrupt:
            pass
        finally:
            self.stop()


def serve(settings: ServiceSettings) -> None:
    """Serve until interrupted."""
    EnvServer(settings).serve_until_interrupted()
