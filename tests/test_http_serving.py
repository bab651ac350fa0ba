"""The model server's HTTP serving (actor/http_serving.py's `HTTPServer`) on each event loop it runs on."""

from __future__ import annotations

import json
import os
import socket
import threading
from urllib.parse import urlsplit

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from longhorizon.actor import http_serving


@pytest.fixture(params=["uvloop", "asyncio"])
def base_url(request, monkeypatch):
    """A one-route app served by `HTTPServer` on a free loopback port, on uvloop's event loop or
    on asyncio's own (where uvloop is not installed)."""
    if request.param == "uvloop":
        pytest.importorskip("uvloop", reason="uvloop is not installed here")
    else:
        monkeypatch.setattr(http_serving, "_event_loop_factory", lambda: None)

    async def hello(request):
        return PlainTextResponse("hello")

    server = http_serving.HTTPServer(Starlette(routes=[Route("/hello", hello)]), "127.0.0.1", 0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.url
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def test_replies_are_not_held_back_by_nagles_algorithm(base_url):
    """A reply goes out as two writes (head, then body); with Nagle's algorithm on, the second
    waits for the client's delayed acknowledgement of the first, 40 ms a request. The server's
    end of the connection (found among this process's descriptors) must have it off."""
    with httpx.Client() as client:
        assert client.get(f"{base_url}/hello").text == "hello"
        connection = next(iter(client._transport._pool.connections))  # its one keep-alive connection
        ours = connection._connection._network_stream.get_extra_info("socket").getsockname()
        server_ends = []
        for name in os.listdir("/proc/self/fd"):
            try:
                candidate = socket.socket(fileno=os.dup(int(name)))
            except OSError:
                continue
            with candidate:
                try:
                    if candidate.type == socket.SOCK_STREAM and candidate.getpeername() == ours:
                        server_ends.append(candidate.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                except OSError:
                    pass
    assert len(server_ends) == 1 and server_ends[0], server_ends



def test_a_head_over_the_limit_is_refused_with_a_431_and_the_connection_closed(base_url):
    address = urlsplit(base_url)
    # One byte past the cap, the head never finished: the answer must not wait for its end. (Not
    # further past: bytes the server has not read when it closes make the close a reset, which
    # can overtake the answer.)
    start = b"GET /hello HTTP/1.1\r\nHost: x\r\nX-Padding: "
    with socket.create_connection((address.hostname, address.port), timeout=30) as connection:
        connection.sendall(start + b"a" * (http_serving.MAX_HEAD_BYTES + 1 - len(start)))
        reply = b""
        while piece := connection.recv(65536):
            reply += piece
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431") and b"connection: close" in head.lower()
    assert json.loads(body)["error"]["message"] == f"request head over {http_serving.MAX_HEAD_BYTES} bytes"
    # A head just under the cap is served, and so are heads in several reads.
    padding = "a" * (http_serving.MAX_HEAD_BYTES - 200)
    assert httpx.get(f"{base_url}/hello", headers={"X-Padding": padding}, timeout=30).text == "hello"
    with httpx.Client() as client:
        for _ in range(3):
            assert client.get(f"{base_url}/hello", headers={"X-Padding": padding}).text == "hello"
