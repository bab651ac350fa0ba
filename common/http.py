"""An HTTP/1.1 server on a trio loop, parsing with httptools, with limits against clients that hog it.

httptools (bindings to llhttp, the parser of Node.js) reads request lines and header fields; this
module owns the sockets and the policy around them, counts a body off its buffer by the
Content-Length the parser has checked, and writes the answers (a status line and five fields). One
task per connection, all on one trio loop: a connection that is idle, trickles bytes or was cut off
costs a small task and a socket, never a thread. A request reaches the handler only once its head
and its whole body are in; a body without Content-Length is refused (411), so a request cut off
after its head can never run.

Limits (HTTPLimits):
  - header_timeout_s: from a request's first byte (from the accept, for a connection's first
    request) until its head is complete; request_timeout_s: from the same moment until its body is
    complete. Both count across all reads, so a client that trickles a byte a second is cut off
    like a silent one. A late request that had begun gets 408; a connection that never sent a
    byte is closed without a word.
  - keep_alive_timeout_s: how long a connection may wait idle between requests.
  - max_connections: beyond it a new connection takes the place of the connection that has waited
    longest without a whole request: first those that never completed a request (silent or
    trickling newcomers, oldest first), then kept-alive ones (longest idle first). Connections
    whose request is being answered are never evicted; only when every slot holds one is a new
    connection refused with 503. Evicting instead of refusing means junk connections cannot lock
    out a good client: they only push each other out.
  - max_header_bytes and max_header_count (431), max_body_bytes (413).

Heads that readers could disagree on are refused with 400 and the connection closed, so no request
can be smuggled inside another: Content-Length together with Transfer-Encoding, a repeated
Content-Length (even with equal values, as llhttp refuses it), header lines folded onto the
previous one (we look at the raw head first), and lines ended by a bare LF. Every refusal has a
JSON body {"error": "..."}. HTTP/1.1 requests must carry Host; HTTP/1.0 connections close after
one answer.
"""

from __future__ import annotations

import errno
import json
import logging
import re
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from email.utils import formatdate
from http import HTTPStatus

import httptools
import trio

log = logging.getLogger(__name__)

# The listen backlog (the kernel caps it at net.core.somaxconn): connects that arrive in a burst
# wait here until the accept loop takes them.
LISTEN_BACKLOG = 1024
# An oversized body is read and thrown away up to this size so the client can read our 413 before
# the connection closes; beyond it the connection is simply closed.
MAX_DISCARDED_BODY_BYTES = 16 * 1024 * 1024
READ_SIZE = 64 * 1024
# Clients that reset their connection are logged in one line at most this often.
LOST_CLIENT_LOG_INTERVAL_S = 10.0
# accept() errors that mean "out of descriptors or memory for now", not a broken listener.
_RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
_METHODS_WITH_BODY = frozenset({"POST", "PUT", "PATCH"})
# Where a head ends and a folded continuation line. A head whose lines end in a bare LF is found
# too, so that its client gets the parser's 400 at once rather than a 408 at the deadline.
_HEAD_END = re.compile(rb"\n\r?\n")
_FOLDED_LINE = re.compile(rb"\n[ \t]")


@dataclass(frozen=True)
class HTTPLimits:
    max_connections: int = 1024
    header_timeout_s: float = 10.0
    request_timeout_s: float = 30.0
    keep_alive_timeout_s: float = 60.0
    max_body_bytes: int = 1024 * 1024
    max_header_bytes: int = 16 * 1024
    max_header_count: int = 100


class HTTPError(Exception):
    """A request refused before it reaches the handler; its connection is closed after the answer."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = int(status)
        self.message = message


@dataclass
class Request:
    method: str
    target: str
    version: str
    """"HTTP/1.1" or "HTTP/1.0"."""
    headers: dict[str, str]
    """Lower-case names; a repeated field's values joined with ", "."""
    body: bytes = b""
    client: str = ""
    """The peer's address."""


@dataclass
class Response:
    status: int
    body: bytes
    headers: Mapping[str, str] = field(default_factory=dict)


Handler = Callable[[Request], Awaitable[Response]]


def error_body(message: str) -> bytes:
    return json.dumps({"error": message}).encode("utf-8")


_DATE_CACHE: list = [0, b""]


def _http_date() -> bytes:
    now = int(time.time())
    if _DATE_CACHE[0] != now:
        _DATE_CACHE[:] = [now, formatdate(now, usegmt=True).encode("ascii")]
    return _DATE_CACHE[1]


_PHRASES = {int(status): status.phrase.encode("ascii") for status in HTTPStatus}
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


def response_bytes(
    status: int, body: bytes, headers: Mapping[str, str] | None = None, *,
    close: bool = False, head_only: bool = False, server_name: str = "longhorizon",
) -> bytes:
    """A whole JSON response; with `close` it says the connection closes after it. A HEAD answer
    (`head_only`) is the head alone, its Content-Length that of the body a GET would get."""
    status = int(status)
    head = [
        b"HTTP/1.1 %d %s\r\nServer: %s\r\nDate: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
        % (status, _PHRASES.get(status, b""), server_name.encode("ascii"), _http_date(), len(body))
    ]
    if headers:
        for name, value in headers.items():
            line = f"{name}: {value}\r\n"
            if "\n" in line[:-2] or "\r" in line[:-2]:  # a field may not start another
                raise ValueError(f"response header {name!r} holds a line break")
            head.append(line.encode("latin-1"))
    if close:
        head.append(b"Connection: close\r\n")
    head.append(b"\r\n")
    if not head_only:
        head.append(body)
    return b"".join(head)


def refusal_bytes(
    status: int, message: str, headers: Mapping[str, str] | None = None, *, server_name: str = "longhorizon",
) -> bytes:
    """A closing {"error": message} answer for a connection whose request never became whole."""
    return response_bytes(status, error_body(message), headers, close=True, server_name=server_name)


# ---------------------------------------------------------------- lost clients


class LostClientLog:
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
        self._lock = threading.Lock()  # tests and callers may note from other threads

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


# ---------------------------------------------------------------- connections


def open_listener(host: str, port: int) -> socket.socket:
    """A bound, listening, non-blocking TCP socket (IPv6 when host is an IPv6 address)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.create_server((host, port), family=family, backlog=LISTEN_BACKLOG)
    listener.setblocking(False)
    return listener


def _skip_blank_lines(buffer: bytearray) -> bool:
    """Drop blank lines before a head (some clients end a body with a stray CRLF, which the parser
    would refuse); whether there were any."""
    start = 0
    while buffer.startswith(b"\r\n", start) or buffer.startswith(b"\n", start):
        start += 2 if buffer.startswith(b"\r\n", start) else 1
    del buffer[:start]
    return start > 0


class _TooSlow(Exception):
    """A deadline of the request being read passed."""


class _Connection:
    __slots__ = ("begun", "busy", "client", "evicted", "proven", "scope", "sock")

    def __init__(self, sock: socket.socket, client: str):
        self.sock = sock
        self.client = client
        self.scope = trio.CancelScope()
        self.busy = False
        """A whole request is being answered: never evicted."""
        self.begun = False
        """Bytes of a request not yet whole have arrived (an eviction or deadline then answers)."""
        self.proven = False
        """At least one request was answered (evicted after the newcomers)."""
        self.evicted = False


class _HeadReader:
    """What httptools reports of one request head (its callbacks), and the head as our Request."""

    __slots__ = ("complete", "fields", "target")

    def __init__(self) -> None:
        self.target = b""
        self.fields: list[tuple[bytes, bytes]] = []
        self.complete = False

    def on_url(self, target: bytes) -> None:
        self.target += target

    def on_header(self, name: bytes, value: bytes) -> None:
        self.fields.append((name, value))

    def on_headers_complete(self) -> None:
        self.complete = True


def parse_head(head: bytes, limits: HTTPLimits) -> Request:
    """The request in `head` (its request line and fields, through the blank line), or HTTPError
    saying why it is refused: what llhttp cannot read, and what it lets through that we do not
    serve (other versions, chunked bodies, a body without a length, a missing Host)."""
    reader = _HeadReader()
    parser = httptools.HttpRequestParser(reader)
    line_end = head.find(b"\n") + 1
    try:
        parser.feed_data(head[:line_end])
    except httptools.HttpParserError as error:
        raise HTTPError(HTTPStatus.BAD_REQUEST, f"malformed request line: {error}") from None
    try:
        parser.feed_data(head[line_end:])
    except httptools.HttpParserError as error:
        message = str(error)
        if "Transfer-Encoding" in message:
            if "Content-Length" in message:
                # Two ways to delimit one body: a reader that picks the other one would see a
                # second request where we see a body. Refuse, and close the connection.
                raise HTTPError(HTTPStatus.BAD_REQUEST,
                                "Content-Length and Transfer-Encoding together; send Content-Length only") from None
            raise HTTPError(HTTPStatus.LENGTH_REQUIRED, "chunked bodies are not accepted; send Content-Length") from None
        raise HTTPError(HTTPStatus.BAD_REQUEST, f"malformed header: {message}") from None
    if not reader.complete:
        raise HTTPError(HTTPStatus.BAD_REQUEST, "malformed request head")
    version = parser.get_http_version()
    if version not in ("1.1", "1.0"):
        raise HTTPError(HTTPStatus.HTTP_VERSION_NOT_SUPPORTED, f"HTTP/{version} is not supported; use HTTP/1.1")
    if len(reader.fields) > limits.max_header_count:
        raise HTTPError(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, f"more than {limits.max_header_count} header fields")
    headers: dict[str, str] = {}
    for name, value in reader.fields:
        key, text = name.decode("ascii").lower(), value.decode("latin-1").strip(" \t")
        headers[key] = f"{headers[key]}, {text}" if key in headers else text
    method = parser.get_method().decode("ascii")
    if "transfer-encoding" in headers:
        raise HTTPError(HTTPStatus.LENGTH_REQUIRED, "chunked bodies are not accepted; send Content-Length")
    if "content-length" not in headers and method in _METHODS_WITH_BODY:
        # Without the length we could not tell a whole empty body from one cut off after the head.
        raise HTTPError(HTTPStatus.LENGTH_REQUIRED, f"{method} needs a Content-Length header")
    if version == "1.1" and "host" not in headers:
        raise HTTPError(HTTPStatus.BAD_REQUEST, "an HTTP/1.1 request needs a Host header")
    return Request(method, reader.target.decode("ascii"), f"HTTP/{version}", headers)


def keeps_alive(request: Request) -> bool:
    """Whether the connection stays open after this request's answer: HTTP/1.1 unless it asked to
    close (HTTP/1.0 connections always close, keep-alive or not)."""
    if request.version != "HTTP/1.1":
        return False
    tokens = request.headers.get("connection", "")
    return not tokens or "close" not in (token.strip().lower() for token in tokens.split(","))


class HTTPServer:
    """Serves HTTP/1.1 on a listening socket from the current trio loop until cancelled.

    `handler` turns a whole request into a Response; it runs on the connection's task, so a slow
    handler delays only its own connection. `count_error(status)` is told of every refusal this
    layer answers itself (400, 408, 411, 413, 431, 503, 505).
    """

    def __init__(
        self, listener: socket.socket, handler: Handler, limits: HTTPLimits, *,
        count_error: Callable[[int], None] = lambda status: None, lost_clients: LostClientLog | None = None,
        server_name: str = "longhorizon",
    ):
        self.listener = listener
        self.handler = handler
        self.limits = limits
        self.count_error = count_error
        self.lost_clients = lost_clients or LostClientLog()
        self.server_name = server_name
        # Insertion order is eviction order: newcomers by accept time; answered connections are
        # moved to the end each time they start waiting for their next request.
        self._newcomers: OrderedDict[_Connection, None] = OrderedDict()
        self._proven: OrderedDict[_Connection, None] = OrderedDict()
        self.evicted = 0
        self.refused = 0
        self._short_of_descriptors_logged = False

    def open_connections(self) -> int:
        return len(self._newcomers) + len(self._proven)

    async def serve(self) -> None:
        async with trio.open_nursery() as nursery:
            await self._accept_forever(nursery)

    # -------------------------------------------------------- accepting

    async def _accept_forever(self, nursery: trio.Nursery) -> None:
        while True:
            try:
                sock, address = self.listener.accept()
            except BlockingIOError:
                await trio.lowlevel.wait_readable(self.listener)
                continue
            except OSError as error:
                if error.errno in _RESOURCE_ERRNOS:
                    # Out of descriptors: make room as at the connection cap, and let the close land.
                    if not self._short_of_descriptors_logged:
                        log.warning("accept failed (%s); evicting waiting connections to make room", error)
                        self._short_of_descriptors_logged = True
                    self._evict_one()
                    await trio.sleep(0.01)
                    continue
                if error.errno in (errno.ECONNABORTED, errno.EPROTO, errno.EPERM):
                    continue  # the peer gave up before we took it
                raise
            sock.setblocking(False)
            try:
                # One send per response, but the client's next request should not wait on Nagle.
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
            client = str(address[0]) if isinstance(address, tuple) else str(address)
            if self.open_connections() >= self.limits.max_connections and not self._evict_one():
                self._refuse(sock)
            else:
                connection = _Connection(sock, client)
                self._newcomers[connection] = None
                nursery.start_soon(self._serve_connection, connection)
            # Each accept yields, so a flood of connects cannot starve the connections being served.
            await trio.lowlevel.checkpoint()

    def _evict_one(self) -> bool:
        """Close the connection that has waited longest without a whole request; False if none waits."""
        for table in (self._newcomers, self._proven):
            for connection in table:
                if not connection.busy:
                    del table[connection]
                    connection.evicted = True
                    connection.scope.cancel()
                    self.evicted += 1
                    return True
        return False

    def _refuse(self, sock: socket.socket) -> None:
        self.refused += 1
        self.count_error(HTTPStatus.SERVICE_UNAVAILABLE)
        answer = refusal_bytes(
            HTTPStatus.SERVICE_UNAVAILABLE, "too many open connections, all busy; retry later", {"Retry-After": "1"},
            server_name=self.server_name,
        )
        try:
            sock.send(answer)  # a fresh socket's send buffer takes it whole without waiting
        except OSError:
            pass
        sock.close()

    def _forget(self, connection: _Connection) -> None:
        self._newcomers.pop(connection, None)
        self._proven.pop(connection, None)

    # -------------------------------------------------------- one connection

    async def _serve_connection(self, connection: _Connection) -> None:
        sock = connection.sock
        answer_on_close: bytes | None = None
        try:
            with connection.scope:
                answer_on_close = await self._serve_requests(connection)
            if connection.evicted and connection.begun:
                self.count_error(HTTPStatus.SERVICE_UNAVAILABLE)
                answer_on_close = refusal_bytes(
                    HTTPStatus.SERVICE_UNAVAILABLE,
                    "the connection was closed to make room for others; send whole requests promptly",
                    {"Retry-After": "1"}, server_name=self.server_name,
                )
        except (ConnectionError, TimeoutError) as error:
            self.lost_clients.note(connection.client, error)
        except Exception:  # a fault of ours: worth its traceback, but the service goes on
            log.exception("connection from %s failed", connection.client)
        finally:
            self._forget(connection)
            _close(sock, answer_on_close)

    async def _serve_requests(self, connection: _Connection) -> bytes | None:
        """Requests of one connection until it closes; returns a last answer to send, if any."""
        sock, limits = connection.sock, self.limits
        buffer = bytearray()  # bytes received and not yet read as a request
        started = trio.current_time()  # the first request's clock runs from the accept
        while True:
            _skip_blank_lines(buffer)
            connection.begun = bool(buffer)
            header_deadline = started + limits.header_timeout_s
            request_deadline = started + limits.request_timeout_s
            head_end = -1
            try:
                # The head.
                searched_from = 0
                while (found := _HEAD_END.search(buffer, searched_from)) is None:
                    if len(buffer) > limits.max_header_bytes:
                        raise HTTPError(
                            HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE,
                            f"the request head is over {limits.max_header_bytes} bytes",
                        )
                    searched_from = max(0, len(buffer) - 2)
                    if not await _receive(sock, buffer, min(header_deadline, request_deadline)):
                        return None  # the client closed; a half-sent request is dropped unrun
                    connection.begun = True
                    if _skip_blank_lines(buffer):
                        searched_from = 0
                head_end = found.start()
                if head_end > limits.max_header_bytes:
                    raise HTTPError(
                        HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, f"the request head is over {limits.max_header_bytes} bytes"
                    )
                if _FOLDED_LINE.search(buffer, 0, head_end):
                    raise HTTPError(
                        HTTPStatus.BAD_REQUEST, "a header line folded onto the previous one; send each field on one line"
                    )
                # The parser reads the head alone; what follows it stays in our buffer.
                head_size = found.end()
                request = parse_head(bytes(buffer[:head_size]), limits)
                del buffer[:head_size]
                request.client = connection.client
                # The parser has checked the Content-Length (one field, digits only) and parse_head
                # refused chunked bodies, so the body is exactly that many bytes.
                length = int(request.headers.get("content-length", "0"))
                if length > limits.max_body_bytes:
                    return await self._refuse_body(sock, request, length, len(buffer), request_deadline)
                if len(buffer) < length and _waits_for_go_ahead(request):
                    await _send_all(sock, _CONTINUE, request_deadline)
                while len(buffer) < length:
                    if not await _receive(sock, buffer, request_deadline):
                        return None  # the client closed mid-body: the request never runs
            except _TooSlow:
                if not connection.begun:
                    return None  # connected and said nothing: close without a word
                self.count_error(HTTPStatus.REQUEST_TIMEOUT)
                what = "head" if head_end < 0 else "body"
                seconds = limits.header_timeout_s if head_end < 0 else limits.request_timeout_s
                message = f"the request's {what} did not arrive within {min(seconds, limits.request_timeout_s)} s"
                return refusal_bytes(HTTPStatus.REQUEST_TIMEOUT, message, server_name=self.server_name)
            except HTTPError as error:
                self.count_error(error.status)
                return refusal_bytes(error.status, error.message, server_name=self.server_name)
            request.body = bytes(buffer[:length])
            del buffer[:length]  # what is left is a pipelined next request, if any

            # The answer. From here the request is whole: the connection is not evicted.
            connection.busy, connection.begun = True, False
            response = await self.handler(request)
            keep_alive = keeps_alive(request)
            data = response_bytes(
                response.status, response.body, response.headers, close=not keep_alive,
                head_only=request.method == "HEAD", server_name=self.server_name,
            )
            # A client that does not read its answers is cut off like one that does not send.
            await _send_all(sock, data, trio.current_time() + limits.request_timeout_s)
            if not keep_alive:
                return None  # the client asked to close (or spoke HTTP/1.0)
            connection.busy = False
            if not connection.proven:
                connection.proven = True
                self._newcomers.pop(connection, None)
            self._proven[connection] = None
            self._proven.move_to_end(connection)

            # The next request: wait for its first byte up to the keep-alive timeout.
            if buffer:
                await trio.lowlevel.checkpoint()  # pipelined requests still take turns with others
            else:
                with trio.move_on_after(limits.keep_alive_timeout_s):
                    if not await _receive(sock, buffer, None):
                        return None
                if not buffer:
                    return None  # idle too long
            started = trio.current_time()

    async def _refuse_body(
        self, sock: socket.socket, request: Request, length: int, received: int, deadline: float,
    ) -> bytes:
        """A 413, after reading the body away (up to a bound) so the client sees the answer, not a reset."""
        self.count_error(HTTPStatus.REQUEST_ENTITY_TOO_LARGE)
        answer = response_bytes(
            HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
            error_body(f"the body is {length} bytes; the limit is {self.limits.max_body_bytes}"), close=True,
            head_only=request.method == "HEAD", server_name=self.server_name,
        )
        if length <= MAX_DISCARDED_BODY_BYTES and not _waits_for_go_ahead(request):
            remaining = length - received
            scratch = bytearray()
            try:
                while remaining > 0:
                    got = await _receive(sock, scratch, deadline)
                    if not got:
                        break
                    remaining -= got
                    del scratch[:]
            except _TooSlow:
                pass
        return answer


def _waits_for_go_ahead(request: Request) -> bool:
    """Whether the client holds its body back until a 100 Continue (HTTP/1.1's Expect)."""
    return request.version == "HTTP/1.1" and request.headers.get("expect", "").lower() == "100-continue"


async def _receive(sock: socket.socket, buffer: bytearray, deadline: float | None) -> int:
    """Appends what the socket has (waiting up to deadline) to buffer; 0 means the peer closed."""
    while True:
        try:
            data = sock.recv(READ_SIZE)
            break
        except BlockingIOError:
            pass
        if deadline is None:
            await trio.lowlevel.wait_readable(sock)
            continue
        if trio.current_time() >= deadline:
            raise _TooSlow()
        with trio.move_on_at(deadline):
            await trio.lowlevel.wait_readable(sock)
    buffer += data
    return len(data)


async def _send_all(sock: socket.socket, data: bytes, deadline: float) -> None:
    view = memoryview(data)
    while view:
        try:
            sent = sock.send(view)
        except BlockingIOError:
            with trio.move_on_at(deadline) as scope:
                await trio.lowlevel.wait_writable(sock)
            if scope.cancelled_caught:
                raise TimeoutError("the client did not read its answer in time") from None
            continue
        view = view[sent:]


def _close(sock: socket.socket, last_answer: bytes | None) -> None:
    """Close a connection, sending a last answer first when there is one (never waiting for it)."""
    if last_answer is not None:
        try:
            # Read away what the client already sent, or closing would reset the connection and
            # could destroy the answer before the client reads it.
            for _ in range(16):
                if not sock.recv(READ_SIZE):
                    break
        except OSError:
            pass
        try:
            sock.send(last_answer)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
    trio.lowlevel.notify_closing(sock)  # trio forgets the descriptor before the kernel reuses its number
    sock.close()
