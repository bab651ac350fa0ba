"""What our HTTP servers share: Starlette apps served by Hypercorn on trio, errors in OpenAI's JSON
shape, and a cap on request bodies.

`serve_app` serves an app inside a trio program (the training gateway runs in an actor's event
loop); `HTTPServer` binds at once and serves from a thread of its own or the main thread
(`longhorizon serve-model`), and stops gracefully on `shutdown()` or on a signal.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import trio

log = logging.getLogger(__name__)

KEEP_ALIVE_TIMEOUT_S = 75.0
"""How long an idle connection is kept: longer than clients keep theirs (httpx: 5 s), so that the
client closes it first; at equal timeouts a request sent on a connection the server is closing is
lost on the way."""

GRACEFUL_TIMEOUT_S = 5.0
"""On shutdown, how long the requests under way have to finish before their connections are cut."""

LISTEN_BACKLOG = 128

MAX_BODY_BYTES = 32 << 20
"""The largest request body either server reads; a larger one is refused with a 413."""


class HTTPRefusal(Exception):
    """A request refused with an HTTP status and an error body in OpenAI's shape."""

    def __init__(self, status: int, message: str, code: str | int | None = None, kind: str | None = None,
                 details: dict | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.kind = kind
        self.details = details or {}

    def response(self):
        return error_response(self.status, str(self), self.code, self.kind, self.details)


def error_body(status: int, message: str, code: str | int | None = None, kind: str | None = None,
               details: dict | None = None) -> dict:
    """`{"error": {"message", "type", "code", "param", ...}}`: the type is the client's fault below
    500 unless named; the code is the status unless named; `details` adds fields."""
    kind = kind or ("invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "code": status if code is None else code, "param": None,
                      **(details or {})}}


def error_response(status: int, message: str, code: str | int | None = None, kind: str | None = None,
                   details: dict | None = None):
    from starlette.responses import JSONResponse

    return JSONResponse(error_body(status, message, code, kind, details), status_code=status)


async def read_body(request: Any, max_bytes: int = MAX_BODY_BYTES) -> bytes:
    """The request's body, refused (413) once it is over `max_bytes`: a declared Content-Length
    before anything is read, a chunked body as soon as its pieces add up to more."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise HTTPRefusal(413, f"request body over {max_bytes} bytes")
    pieces, size = [], 0
    async for piece in request.stream():
        size += len(piece)
        if size > max_bytes:
            raise HTTPRefusal(413, f"request body over {max_bytes} bytes")
        pieces.append(piece)
    return b"".join(pieces)


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket listening on host:port (port 0: a free one). Connections that arrive before
    the server runs wait in the backlog rather than being refused."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host.strip("[]"), port))
        sock.listen(LISTEN_BACKLOG)
    except OSError:
        sock.close()
        raise
    return sock


def socket_url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


async def serve_app(app: Any, sock: socket.socket, *, shutdown_trigger: Callable[[], Awaitable[Any]] | None = None,
                    task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve `app` on a bound socket (`listening_socket`) until cancelled or until
    `shutdown_trigger()` returns; then the requests under way get `GRACEFUL_TIMEOUT_S` to finish.
    `task_status.started` gets the base URL ("http://host:port"). The socket stays the caller's."""
    from hypercorn.config import Config as ServerConfig
    from hypercorn.trio import serve

    config = ServerConfig()
    # Hypercorn takes over the descriptor it is given, so it gets a duplicate: closing either
    # never closes the other's.
    config.bind = [f"fd://{os.dup(sock.fileno())}"]
    config.accesslog = None
    config.errorlog = log
    config.keep_alive_timeout = KEEP_ALIVE_TIMEOUT_S
    config.backlog = LISTEN_BACKLOG
    config.graceful_timeout = GRACEFUL_TIMEOUT_S
    await serve(app, config, shutdown_trigger=shutdown_trigger, task_status=task_status)


class HTTPServer:
    """An app bound to host:port at construction (so `server_address` is known at once), served by
    `serve_forever()` until `shutdown()` from another thread or, where asked, a signal.

    The methods are those of the standard library's servers: a thread runs `serve_forever`,
    another calls `shutdown()` (which returns once serving has stopped) and `server_close()`."""

    def __init__(self, app: Any, host: str, port: int) -> None:
        self.app = app
        self.socket = listening_socket(host, port)
        self.server_address = self.socket.getsockname()
        self.url = socket_url(self.socket)
        self._lock = threading.Lock()
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self._stop_asked = False
        self._finished = threading.Event()

    def serve_forever(self, stop_signals: tuple[int, ...] = (),
                      before_stop: Callable[[], None] | None = None) -> None:
        """Serve until `shutdown()` or one of `stop_signals` (main thread only, e.g. SIGINT and
        SIGTERM); on a signal, `before_stop()` runs first (in a thread, while requests are still
        answered), for what must end before the server does."""
        try:
            trio.run(self._serve, stop_signals, before_stop)
        finally:
            self._finished.set()

    def shutdown(self) -> None:
        """Stop serving: no new connections, the requests under way finish; returns once
        `serve_forever` has returned (at once if it never ran)."""
        with self._lock:
            self._stop_asked = True
            token, stop = self._token, self._stop
        if token is None:
            return
        try:
            token.run_sync_soon(stop.set)
        except trio.RunFinishedError:
            pass
        self._finished.wait()

    def server_close(self) -> None:
        self.socket.close()

    async def _serve(self, stop_signals: tuple[int, ...], before_stop: Callable[[], None] | None) -> None:
        stop = trio.Event()
        with self._lock:
            self._token, self._stop = trio.lowlevel.current_trio_token(), stop
            if self._stop_asked:
                stop.set()
        async with trio.open_nursery() as nursery:
            if stop_signals:
                nursery.start_soon(self._stop_on_signal, stop_signals, before_stop, stop)
            await serve_app(self.app, self.socket, shutdown_trigger=stop.wait)
            nursery.cancel_scope.cancel()

    @staticmethod
    async def _stop_on_signal(stop_signals: tuple[int, ...], before_stop, stop: trio.Event) -> None:
        with trio.open_signal_receiver(*stop_signals) as received:
            async for number in received:
                log.info("%s: stopping", signal.Signals(number).name)
                break
        if before_stop is not None:
            await trio.to_thread.run_sync(before_stop)
        stop.set()
