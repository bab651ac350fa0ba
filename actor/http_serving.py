"""What our HTTP servers share: Starlette apps, errors in OpenAI's JSON shape, and a cap on request
bodies.

Two servers, each where it fits: `serve_app` serves an app with Hypercorn inside a trio program
(the training gateway runs in its actor's trio event loop); `HTTPServer` serves one with uvicorn
(httptools parsing, asyncio) in a loop of its own, from a thread or the main thread, for
`longhorizon serve-model`, binds at once and stops gracefully on `shutdown()` or on a signal.
uvicorn rather than Hypercorn there because a streamed reply sends one body message per token:
uvicorn's send path writes it to the transport, Hypercorn's passes it through its stream, h11's
chunked writer and trio's socket, about ten times the serving CPU per streamed reply
(docs/benchmarks.md, "Model server").
"""

from __future__ import annotations

import asyncio
import contextlib
import json
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

MAX_HEAD_BYTES = 64 << 10
"""The largest request head (request line and header fields) `HTTPServer` reads; a longer one is
refused with a 431 and the connection closed. Hypercorn (the gateway) has a cap of its own."""


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


def error_headers(status: int) -> dict[str, str]:
    """The headers of an error answer: a 413 closes the connection, as the body it refused is
    left unread and would otherwise have to arrive (and be thrown away) before the next request."""
    return {"connection": "close"} if status == 413 else {}


def error_response(status: int, message: str, code: str | int | None = None, kind: str | None = None,
                   details: dict | None = None):
    from starlette.responses import JSONResponse

    return JSONResponse(error_body(status, message, code, kind, details), status_code=status,
                        headers=error_headers(status))


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
    # IPPROTO_TCP named, not left 0: asyncio turns Nagle's algorithm off (TCP_NODELAY) only on
    # sockets that say they are TCP, and with it on a reply written as head, then body waits for
    # the client's delayed ACK of the head, 40 ms a request.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
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


def _capped_head_protocol() -> type:
    """uvicorn's httptools protocol with a cap on the request head, which uvicorn does not have:
    without one a client can make the server hold a header of any size. The bytes that arrive
    while a head is incomplete are counted, so what is held is at most the cap and one read."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    body = json.dumps(error_body(431, f"request head over {MAX_HEAD_BYTES} bytes")).encode()
    refusal = (b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
               b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body))

    class CappedHeadProtocol(HttpToolsProtocol):
        _head_open = True
        _head_bytes = 0

        def data_received(self, data: bytes) -> None:
            if self._head_open:
                self._head_bytes += len(data)
            super().data_received(data)
            if self._head_open and self._head_bytes > MAX_HEAD_BYTES and not self.transport.is_closing():
                self.transport.write(refusal)
                self.transport.close()

        def on_headers_complete(self) -> None:
            self._head_open, self._head_bytes = False, 0
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._head_open = True

    return CappedHeadProtocol


def _event_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's event loop where it is installed (a third less serving CPU per request than
    asyncio's own), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


class HTTPServer:
    """An app bound to host:port at construction (so `server_address` is known at once), served by
    uvicorn in `serve_forever()` until `shutdown()` from another thread or, where asked, a signal.

    The methods are those of the standard library's servers: a thread runs `serve_forever`,
    another calls `shutdown()` (which returns once serving has stopped) and `server_close()`."""

    def __init__(self, app: Any, host: str, port: int) -> None:
        self.app = app
        self.socket = listening_socket(host, port)
        self.server_address = self.socket.getsockname()
        self.url = socket_url(self.socket)
        self._lock = threading.Lock()
        self._server: Any = None
        self._stop_asked = False
        self._finished = threading.Event()

    def serve_forever(self, stop_signals: tuple[int, ...] = (),
                      before_stop: Callable[[], None] | None = None) -> None:
        """Serve until `shutdown()` or one of `stop_signals` (main thread only, e.g. SIGINT and
        SIGTERM); on a signal, `before_stop()` runs first (in a thread, while requests are still
        answered), for what must end before the server does. A second signal cuts the requests
        under way short instead of waiting `GRACEFUL_TIMEOUT_S` for them."""
        try:
            with asyncio.Runner(loop_factory=_event_loop_factory()) as runner:
                runner.run(self._serve(stop_signals, before_stop))
        finally:
            self._finished.set()

    def shutdown(self) -> None:
        """Stop serving: no new connections, the requests under way finish; returns once
        `serve_forever` has returned (at once if it never ran)."""
        with self._lock:
            self._stop_asked = True
            server = self._server
            if server is not None:
                server.should_exit = True  # uvicorn looks at it every 0.1 s
        if server is not None:
            self._finished.wait()

    def server_close(self) -> None:
        self.socket.close()

    async def _serve(self, stop_signals: tuple[int, ...], before_stop: Callable[[], None] | None) -> None:
        import uvicorn

        class Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self):  # the signals are ours (below): uvicorn would raise them again at exit
                yield

        config = uvicorn.Config(
            self.app, http=_capped_head_protocol(), ws="none", loop="none", lifespan="off", log_config=None,
            access_log=False, proxy_headers=False,
            timeout_keep_alive=KEEP_ALIVE_TIMEOUT_S, timeout_graceful_shutdown=GRACEFUL_TIMEOUT_S,
            backlog=LISTEN_BACKLOG,
        )
        server = Server(config)
        with self._lock:
            self._server = server
            server.should_exit = self._stop_asked
        loop = asyncio.get_running_loop()
        stopping: list[asyncio.Future] = []

        def on_signal(number: int) -> None:
            if stopping:  # asked twice: do not wait for the requests under way
                server.force_exit = True
                return
            log.info("%s: stopping", signal.Signals(number).name)
            if before_stop is None:
                server.should_exit = True
                return
            stopping.append(loop.run_in_executor(None, before_stop))
            stopping[0].add_done_callback(lambda _: setattr(server, "should_exit", True))

        for number in stop_signals:
            loop.add_signal_handler(number, on_signal, number)
        try:
            # uvicorn closes the sockets it is given when it stops: a duplicate, so that the bound
            # socket stays the caller's until `server_close()`.
            await server.serve(sockets=[self.socket.dup()])
            if stopping:
                await stopping[0]
        finally:
            for number in stop_signals:
                loop.remove_signal_handler(number)
