"""The env service's limits against clients that hog it: slow and cut-off requests, connection floods, resets, instance floods."""

from __future__ import annotations

import http.client
import json
import logging
import socket
import struct
import threading
import time

import h11
import pytest
import trio
from longhorizon.common.http import HTTPLimits, HTTPServer, LostClientLog, Response, open_listener
from longhorizon.envs.server import EnvServer
from longhorizon.envs.service import EnvService, ServiceError, ServiceSettings, build_task_table

# Generous bounds: they only catch a service that never recovers, not a slow machine.
WAIT_S = 20.0


def _request(port: int, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request(method, path, body=None if body is None else json.dumps(body).encode())
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def _wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.01)


def _read_until_closed(connection: socket.socket) -> bytes:
    received = b""
    while chunk := connection.recv(4096):
        received += chunk
    return received


def _reset(connection: socket.socket) -> None:
    """Close with an RST instead of a FIN, as a client that crashes or is killed does."""
    connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    connection.close()


# ---------------------------------------------------------------- slow requests and connection bursts


def _health_on(connection: http.client.HTTPConnection) -> int:
    connection.request("GET", "/health")
    response = connection.getresponse()
    response.read()
    return response.status


def test_trickling_clients_get_408_at_the_header_deadline_while_good_requests_pass():
    settings = ServiceSettings("codebook", header_timeout_s=3.0, request_timeout_s=30.0, keep_alive_timeout_s=30.0)
    with EnvServer(settings) as server:
        port = server.port
        tricklers = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(8)]
        stop = threading.Event()

        def trickle() -> None:
            # One byte of a never-ending header per connection every 0.2 s: each read is quick,
            # so only a deadline over the whole head can end it.
            while not stop.wait(0.2):
                for connection in tricklers:
                    try:
                        connection.sendall(b"a")
                    except OSError:
                        pass

        thread = threading.Thread(target=trickle, daemon=True)
        try:
            for connection in tricklers:
                connection.sendall(b"POST /step HTTP/1.1\r\nHost: service\r\nX-Slow: ")
            _wait_until(lambda: server.open_connections() == 8, "the trickling connections to be accepted")
            thread.start()
            # The tricklers hold no thread: a good request is answered long before their deadline.
            started = time.monotonic()
            assert _request(port, "GET", "/health")[0] == 200
            assert time.monotonic() - started < 2.5 and server.error_counts.get(408, 0) == 0
            _wait_until(lambda: server.error_counts.get(408, 0) == 8, "a 408 for each trickling request")
            for connection in tricklers:
                try:
                    answer = connection.recv(4096)
                except ConnectionResetError:
                    continue  # our trickled byte reached a closed socket; the server's RST won
                assert answer == b"" or answer.startswith(b"HTTP/1.1 408 ")
            _wait_until(lambda: server.open_connections() == 0, "the trickling connections to be closed")
        finally:
            stop.set()
            if thread.is_alive():
                thread.join()
            for connection in tricklers:
                connection.close()


def test_an_idle_keep_alive_outlasts_the_deadline_but_a_slow_body_gets_408():
    with EnvServer(ServiceSettings("codebook", header_timeout_s=1.0, request_timeout_s=1.0)) as server:
        connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        try:
            connection.request("GET", "/health")
            assert connection.getresponse().read() and server.open_connections() == 1
            # A keep-alive connection may sit idle between requests longer than the request deadline.
            time.sleep(1.5)
            connection.request("GET", "/health")
            response = connection.getresponse()
            assert response.status == 200 and json.loads(response.read())["status"] == "ok"
        finally:
            connection.close()
        slow = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        try:
            slow.sendall(b'POST /step HTTP/1.1\r\nHost: a\r\nContent-Length: 40\r\n\r\n{"id": 0,')
            answer = _read_until_closed(slow)  # nothing more is sent: the deadline answers
            assert answer.startswith(b"HTTP/1.1 408 ") and b"Connection: close" in answer
            assert b"did not arrive within 1.0 s" in answer
        finally:
            slow.close()
        # A connection that never sends a byte is closed at the header deadline, without an answer.
        silent = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        try:
            started = time.monotonic()
            assert _read_until_closed(silent) == b""
            assert 0.8 < time.monotonic() - started < 5
        finally:
            silent.close()


def test_cut_off_requests_create_nothing():
    # Heads of /create sent whole but their bodies not (or no Content-Length at all), then closed:
    # none of them may run, so none may take a slot of the instance table.
    with EnvServer(ServiceSettings("codebook", max_instances=128)) as server:
        cut_off = [
            b"POST /create HTTP/1.1\r\nHost: service\r\nContent-Type: application/json\r\n\r\n",
            b"POST /create HTTP/1.1\r\nHost: service\r\nContent-Length: 20\r\n\r\n",
            b'POST /create HTTP/1.1\r\nHost: service\r\nContent-Length: 20\r\n\r\n{"data_idx"',
        ]
        for index in range(200):
            client = socket.create_connection(("127.0.0.1", server.port), timeout=10)
            client.sendall(cut_off[index % len(cut_off)])
            client.close()
        # One more headers-only request, read this time: it is refused, not run.
        client = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        try:
            client.sendall(cut_off[0])
            answer = _read_until_closed(client)
            assert answer.startswith(b"HTTP/1.1 411 ") and b"Content-Length" in answer
        finally:
            client.close()
        _wait_until(lambda: server.open_connections() == 0, "the cut-off connections to be closed")
        status, health = _request(server.port, "GET", "/health")
        assert status == 200 and health["instances"] == 0
        assert len(server.service.instances) == 0
        status, created = _request(server.port, "POST", "/create", {})
        assert status == 200 and created["id"] in server.service.instances


def test_beyond_the_cap_the_longest_waiting_connection_makes_room():
    with EnvServer(ServiceSettings("codebook", max_connections=3)) as server:
        port = server.port
        kept = http.client.HTTPConnection("127.0.0.1", port, timeout=10)  # answered once, then idle
        assert _health_on(kept) == 200
        silent = socket.create_connection(("127.0.0.1", port), timeout=10)  # never sends a byte
        _wait_until(lambda: server.open_connections() == 2, "the silent connection to be accepted")
        trickler = socket.create_connection(("127.0.0.1", port), timeout=10)  # half a head
        trickler.sendall(b"GET /health HTTP/1.1\r\nHost: ")
        _wait_until(lambda: server.open_connections() == 3, "the trickling connection to be accepted")
        first, second, third = (http.client.HTTPConnection("127.0.0.1", port, timeout=10) for _ in range(3))
        try:
            # Newcomers that never completed a request go first, oldest first: the silent one
            # without a word, the trickler with a 503 for its half request...
            assert _health_on(first) == 200
            assert silent.recv(4096) == b""
            assert _health_on(second) == 200
            answer = _read_until_closed(trickler)
            assert answer.startswith(b"HTTP/1.1 503 ") and b"make room" in answer
            # ...then the kept-alive connection idle the longest.
            assert _health_on(third) == 200
            assert kept.sock.recv(4096) == b""
            assert server.open_connections() == 3
            for connection in (first, second, third):  # the newest are untouched
                assert _health_on(connection) == 200
        finally:
            for connection in (kept, first, second, third):
                connection.close()
            silent.close()
            trickler.close()


async def test_a_new_connection_is_refused_only_when_every_connection_is_busy():
    release, entered = trio.Event(), trio.Event()

    async def slow_handler(request):
        entered.set()
        await release.wait()
        return Response(200, b"{}")

    listener = open_listener("127.0.0.1", 0)
    server = HTTPServer(listener, slow_handler, HTTPLimits(max_connections=1))

    async def request(answers: list) -> None:
        stream = await trio.open_tcp_stream("127.0.0.1", listener.getsockname()[1])
        await stream.send_all(b"GET /x HTTP/1.1\r\nHost: a\r\n\r\n")
        received = b""
        while b"\r\n\r\n{" not in received and (chunk := await stream.receive_some()):
            received += chunk
        answers.append(received)
        await stream.aclose()

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.serve)
            busy: list[bytes] = []
            nursery.start_soon(request, busy)
            await entered.wait()  # its request is whole and in the handler
            refused: list[bytes] = []
            await request(refused)
            assert refused[0].startswith(b"HTTP/1.1 503 ") and b"Retry-After: 1" in refused[0]
            assert server.refused == 1 and not busy
            release.set()
            while not busy:
                await trio.sleep(0.01)
            assert busy[0].startswith(b"HTTP/1.1 200 ")
            nursery.cancel_scope.cancel()
    finally:
        listener.close()


def test_pipelined_requests_and_expect_continue_are_answered_in_order():
    with EnvServer(ServiceSettings("codebook")) as server:
        client = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        try:
            client.sendall(b"GET /health HTTP/1.1\r\nHost: a\r\n\r\nGET /nowhere HTTP/1.1\r\nHost: a\r\n\r\n")
            received = b""
            while received.count(b"HTTP/1.1 ") < 2:
                received += client.recv(65536)
            assert received.startswith(b"HTTP/1.1 200 ") and b"HTTP/1.1 404 " in received
            # A HEAD gets the head alone, and a stray CRLF before the next request is skipped.
            client.sendall(b"HEAD /health HTTP/1.1\r\nHost: a\r\n\r\n\r\nGET /health HTTP/1.1\r\nHost: a\r\n\r\n")
            received = b""
            while received.count(b"HTTP/1.1 ") < 2 or not received.endswith(b"}"):
                received += client.recv(65536)
            head, _, rest = received.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 405 ") and b"Content-Length: " in head
            assert rest.startswith(b"HTTP/1.1 200 ")
            client.sendall(b"POST /create HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\nExpect: 100-continue\r\n\r\n")
            assert client.recv(4096) == b"HTTP/1.1 100 Continue\r\n\r\n"
            client.sendall(b"{}")
            received = b""
            while b'"observation"' not in received:
                received += client.recv(65536)
            assert received.startswith(b"HTTP/1.1 200 ")
        finally:
            client.close()


def test_the_listen_backlog_holds_a_burst_of_connections():
    # A socket that listens but does not accept yet: every connection waits in the backlog.
    # With a backlog of 5 the seventh connect would stall on SYN retries.
    idle = open_listener("127.0.0.1", 0)
    clients = []
    try:
        for _ in range(64):
            clients.append(socket.create_connection(idle.getsockname()[:2], timeout=5))
    finally:
        for client in clients:
            client.close()
        idle.close()


# ---------------------------------------------------------------- request heads over the wire


def _exchange(port: int, data: bytes) -> bytes:
    """Raw bytes sent on a fresh connection; everything the server answers until it closes."""
    client = socket.create_connection(("127.0.0.1", port), timeout=10)
    try:
        client.sendall(data)
        return _read_until_closed(client)  # a server that kept the connection open would time out here
    finally:
        client.close()


def _answers(received: bytes) -> list[tuple[int, dict]]:
    """Each (status, JSON body) in a stream of answers, parsed by h11 as a client would."""
    reader = h11.Connection(h11.CLIENT)
    reader.send(h11.Request(method="GET", target="/", headers=[("Host", "a")]))
    reader.send(h11.EndOfMessage())
    reader.receive_data(received)
    answers, status, body = [], 0, b""
    while True:
        event = reader.next_event()
        if isinstance(event, h11.Response):
            status, body = event.status_code, b""
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            answers.append((status, json.loads(body) if body else {}))
            if reader.our_state is not h11.DONE or reader.their_state is not h11.DONE:
                break
            reader.start_next_cycle()
            reader.send(h11.Request(method="GET", target="/", headers=[("Host", "a")]))
            reader.send(h11.EndOfMessage())
        else:
            break
    return answers


MALFORMED_HEADS = [
    (b"POST /create HTTP/1.1\r\nHost: a\r\n\r\n", 411, "Content-Length"),  # no length: whole or cut off?
    (b"POST /create HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n", 411, "chunked"),
    (b"POST /create HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip\r\n\r\n", 411, "chunked"),
    (b"POST /create HTTP/1.1\r\nHost: a\r\nContent-Length: -1\r\n\r\n", 400, "Content-Length"),
    (b"POST /create HTTP/1.1\r\nHost: a\r\nContent-Length: \xb2\r\n\r\n", 400, "Content-Length"),  # a digit to str.isdigit only
    (b"GET /health HTTP/1.1\r\nHost: a\r\nBad Name: b\r\n\r\n", 400, "header"),
    (b"GET /health HTTP/1.1\r\nHost: a\r\nX-A: \x00\r\n\r\n", 400, "header"),
    (b"GET /health HTTP/1.1\r\n\r\n", 400, "Host"),  # HTTP/1.1 requires Host
    (b"GET /health HTTP/2.0\r\nHost: a\r\n\r\n", 505, "HTTP/2.0"),
    (b"NONSENSE\r\n\r\n", 400, "request line"),
    (b"GET /a b HTTP/1.1\r\nHost: a\r\n\r\n", 400, "request line"),
    (b"GET /health HTTP/1.1\r\nHost: a" + b"\r\nX: 1" * 101 + b"\r\n\r\n", 431, "header fields"),
    # A repeated Content-Length, even with equal values (RFC 9110 lets a server refuse it, and so
    # does llhttp): one reader might take the first, another the last.
    (b"POST /create HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\n{}", 400, "Content-Length"),
    # Lines ended by a bare LF: a reader in front that does not end lines there would see other fields.
    (b"GET /health HTTP/1.1\nHost: a\nConnection: close\n\n", 400, "CRLF"),
]


def test_malformed_heads_are_refused_with_a_reason_and_the_connection_closed():
    with EnvServer(ServiceSettings("codebook")) as server:
        for head, status, reason in MALFORMED_HEADS:
            answers = _answers(_exchange(server.port, head))
            assert [answer[0] for answer in answers] == [status], (head[:60], answers)
            message = answers[0][1]["error"]
            assert reason.lower() in message.lower() and "\n" not in message, (head[:60], message)
        assert server.error_counts[400] >= 7 and server.error_counts[411] == 3
        assert _request(server.port, "GET", "/health")[1]["instances"] == 0  # no /create above ran


def test_well_formed_heads_are_served_as_before():
    with EnvServer(ServiceSettings("codebook")) as server:
        # Spaces around a value are no part of it; field names are read in any case.
        received = _exchange(
            server.port,
            b"POST /create HTTP/1.1\r\nhOsT: a\r\nContent-Length:  2 \r\nConnection: close\r\n\r\n{}",
        )
        answers = _answers(received)
        assert [status for status, _ in answers] == [200] and "observation" in answers[0][1]
        assert b"\r\nConnection: close\r\n" in received  # the answer says the connection closes
        # HTTP/1.0 is answered, then the connection closed, keep-alive asked or not.
        for head in (b"GET /health HTTP/1.0\r\n\r\n", b"GET /health HTTP/1.0\r\nConnection: keep-alive\r\n\r\n"):
            received = _exchange(server.port, head)
            assert _answers(received)[0][0] == 200 and b"\r\nConnection: close\r\n" in received
        # A HEAD answer (the service serves no HEAD: a 405) is the head alone, with its body's length.
        head = _exchange(server.port, b"HEAD /health HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 405 ") and head.endswith(b"\r\n\r\n") and head.count(b"\r\n\r\n") == 1
        assert int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0]) > 0


def test_bodies_that_are_not_utf8_or_carry_lone_surrogates_are_answered_and_lose_nothing():
    """Bytes that are no UTF-8 are a 400 naming the JSON problem, on a connection that stays
    usable; an action holding a lone surrogate (valid JSON, `\\udcff`) is played as the text it
    is, an action the env cannot read, and its answer is JSON a strict client decodes."""
    with EnvServer(ServiceSettings("codebook")) as server:
        status, created = _request(server.port, "POST", "/create", {})
        assert status == 200
        not_utf8 = b'{"id": ' + str(created["id"]).encode() + b', "action": "\xff\xfe"}'
        for body in (b"\xff\xfe\xfd", not_utf8):
            connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
            try:
                connection.request("POST", "/step", body=body)
                response = connection.getresponse()
                answer = json.loads(response.read())
                assert response.status == 400 and "not valid JSON" in answer["error"], answer
                assert _health_on(connection) == 200  # the same connection serves on
            finally:
                connection.close()
        connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        try:
            body = '{"id": %d, "action": "a1\\udcff"}' % created["id"]
            connection.request("POST", "/step", body=body.encode("ascii"))
            response = connection.getresponse()
            raw = response.read()
        finally:
            connection.close()
        assert response.status == 200
        answer = json.loads(raw.decode("utf-8"))  # strict: no surrogate made it into the bytes raw
        assert isinstance(answer["observation"], str)
        assert _request(server.port, "GET", "/health")[1]["instances"] == 1
        assert 500 not in server.error_counts


# Each smuggles a /create inside a /health request's body, by a framing one reader takes and another
# reader (a proxy in front, say) does not. The service must refuse the carrier and run nothing else.
SMUGGLED_CREATE = b"POST /create HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\n{}"
SMUGGLING_ATTEMPTS = {
    "Content-Length and Transfer-Encoding": (
        b"POST /close HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"0\r\n\r\n" + SMUGGLED_CREATE
    ),
    "Transfer-Encoding and Content-Length": (
        b"POST /close HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\nContent-Length: "
        + str(5 + len(SMUGGLED_CREATE)).encode() + b"\r\n\r\n0\r\n\r\n" + SMUGGLED_CREATE
    ),
    "two different Content-Length": (
        b"POST /close HTTP/1.1\r\nHost: a\r\nContent-Length: 0\r\nContent-Length: "
        + str(len(SMUGGLED_CREATE)).encode() + b"\r\n\r\n" + SMUGGLED_CREATE
    ),
    "a folded Transfer-Encoding": (
        b"POST /close HTTP/1.1\r\nHost: a\r\nContent-Length: " + str(5 + len(SMUGGLED_CREATE)).encode()
        + b"\r\nTransfer-Encoding:\r\n chunked\r\n\r\n0\r\n\r\n" + SMUGGLED_CREATE
    ),
    "a folded Content-Length": (
        b"POST /close HTTP/1.1\r\nHost: a\r\nX-Note: a\r\n Content-Length: 0\r\nContent-Length: "
        + str(len(SMUGGLED_CREATE)).encode() + b"\r\n\r\n" + SMUGGLED_CREATE
    ),
}


@pytest.mark.parametrize("attempt", sorted(SMUGGLING_ATTEMPTS))
def test_request_smuggling_is_refused_with_400_and_the_smuggled_request_never_runs(attempt):
    with EnvServer(ServiceSettings("codebook")) as server:
        received = _exchange(server.port, SMUGGLING_ATTEMPTS[attempt])  # returns once the server closed
        answers = _answers(received)
        assert [status for status, _ in answers] == [400], received[:300]
        assert received.count(b"HTTP/1.1 ") == 1 and b"Connection: close" in received
        assert server.error_counts == {400: 1}
        assert len(server.service.instances) == 0 and _request(server.port, "GET", "/health")[1]["instances"] == 0


@pytest.mark.slow
def test_a_flood_of_ten_thousand_creates_is_held_to_the_instance_limit():
    # 10,000 /create calls pipelined over one connection in batches: the table fills to
    # max_instances, every call beyond it gets 503 with the reason, and memory stays flat.
    def resident_bytes() -> int:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * 4096

    batch = SMUGGLED_CREATE * 250
    with EnvServer(ServiceSettings("codebook", max_instances=64)) as server:
        client = socket.create_connection(("127.0.0.1", server.port), timeout=30)
        statuses: list[int] = []
        try:
            resident_after_first_batch = 0
            for batch_index in range(40):
                client.sendall(batch)
                received = b""
                while received.count(b"HTTP/1.1 ") < 250 or not received.endswith(b"}"):
                    # Answers gather while this thread sleeps: the server (a thread of this process)
                    # then runs without handing the GIL back and forth for each one.
                    time.sleep(0.02)
                    chunk = client.recv(1 << 20)
                    assert chunk, "the server closed the connection mid-flood"
                    received += chunk
                answers = _answers(received)
                statuses += [status for status, _ in answers]
                refused = [body for status, body in answers if status == 503]
                assert all("instance table is full (64 live instances)" in body["error"] for body in refused)
                if batch_index == 0:
                    resident_after_first_batch = resident_bytes()
        finally:
            client.close()
        assert len(statuses) == 10_000
        assert statuses.count(200) == 64 and statuses.count(503) == 10_000 - 64
        assert len(server.service.instances) == 64
        assert resident_bytes() - resident_after_first_batch < 20 * 1024 * 1024
        assert _request(server.port, "GET", "/health")[1]["instances"] == 64


def test_oversized_heads_get_431():
    with EnvServer(ServiceSettings("codebook")) as server:
        client = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        try:
            client.sendall(b"GET /health HTTP/1.1\r\nX-Big: " + b"a" * 20_000 + b"\r\n\r\n")
            assert _read_until_closed(client).startswith(b"HTTP/1.1 431 ")
        finally:
            client.close()


# ---------------------------------------------------------------- clients that vanish mid-request


def test_clients_that_reset_mid_request_leave_a_short_line_and_no_traceback(capfd, caplog):
    caplog.set_level(logging.DEBUG, logger="longhorizon.envs")
    with EnvServer(ServiceSettings("codebook")) as server:
        partial_requests = [
            b"POST /step HTTP/1.1\r\nHost: service\r\n",  # inside the head
            b'POST /step HTTP/1.1\r\nHost: a\r\nContent-Length: 100\r\n\r\n{"id": 0',  # inside the body
        ]
        for partial in partial_requests * 2:
            client = socket.create_connection(("127.0.0.1", server.port), timeout=10)
            client.sendall(partial)
            _wait_until(lambda: server.open_connections() == 1, "the connection to be accepted")
            _reset(client)
            _wait_until(lambda: server.open_connections() == 0, "the server to drop the reset connection")
        _wait_until(lambda: server.lost_clients.total == 4, "the resets to be counted")
        assert _request(server.port, "GET", "/health")[0] == 200  # and it still serves
    assert "Traceback" not in capfd.readouterr().err
    assert not [record for record in caplog.records if record.exc_info]
    lines = [record.getMessage() for record in caplog.records if "went away" in record.getMessage()]
    assert 1 <= len(lines) <= 4 and all("\n" not in line for line in lines)
    assert "ConnectionResetError" in lines[0]


def test_lost_client_lines_are_rate_limited():
    now = [0.0]
    lines = []
    limiter = LostClientLog(interval_s=10.0, clock=lambda: now[0], emit=lines.append)
    limiter.note("10.0.0.1", ConnectionResetError())
    for _ in range(5):
        now[0] += 1.0
        limiter.note("10.0.0.2", BrokenPipeError())
    assert len(lines) == 1 and "10.0.0.1" in lines[0]
    now[0] = 11.0
    limiter.note("10.0.0.3", BrokenPipeError())
    assert len(lines) == 2 and "10.0.0.3" in lines[1] and "5 more" in lines[1]
    assert limiter.total == 7


# ---------------------------------------------------------------- the instance table


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _service(clock: _Clock, **settings) -> EnvService:
    return EnvService(ServiceSettings("codebook", **settings), build_task_table("codebook", {}), clock=clock)


async def test_instances_never_used_after_create_expire_sooner():
    clock = _Clock()
    service = _service(clock, idle_timeout_s=600.0, unused_idle_timeout_s=60.0)
    created_only = (await service.create(None, None, "10.0.0.1"))["id"]
    stepped = (await service.create(None, None, "10.0.0.1"))["id"]
    reset = (await service.create(None, None, "10.0.0.1"))["id"]
    await service.step(stepped, "a0")
    await service.reset(reset, 5, None)
    clock.now += 59.0
    assert await service.expire_idle() == 0
    clock.now += 2.0
    assert await service.expire_idle() == 1 and created_only not in service.instances
    assert set(service.instances) == {stepped, reset}
    clock.now += 540.0
    assert await service.expire_idle() == 2 and not service.instances
    await service.close_all()


async def test_one_address_cannot_take_the_whole_instance_table():
    clock = _Clock()
    service = _service(clock, max_instances=8)  # one address may hold 8 // 2 = 4
    flood = [(await service.create(None, None, "203.0.113.9"))["id"] for _ in range(4)]
    with pytest.raises(ServiceError) as refused:
        await service.create(None, None, "203.0.113.9")
    assert refused.value.status == 429 and "203.0.113.9" in refused.value.message
    assert refused.value.headers["Retry-After"]
    # Everyone else still finds room, up to the table's own limit.
    others = [(await service.create(None, None, f"198.51.100.{number}"))["id"] for number in range(4)]
    assert len(service.instances) == 8
    with pytest.raises(ServiceError) as full:
        await service.create(None, None, "198.51.100.77")
    assert full.value.status == 503
    # The flood's untouched instances expire after unused_idle_timeout_s, freeing its share.
    for instance_id in others:
        await service.step(instance_id, "a0")
    clock.now += service.settings.unused_idle_timeout_s + 1
    assert (await service.create(None, None, "203.0.113.9"))["id"] not in flood
    assert set(flood).isdisjoint(service.instances) and set(others) <= set(service.instances)
    await service.close_all()


async def test_loopback_clients_share_the_whole_table():
    # Trainer and service on one machine all come from 127.0.0.1: a per-address cap could not tell
    # them apart and would only shrink the table (the codebook config runs 128 episodes at once).
    service = _service(_Clock(), max_instances=6, max_instances_per_client=2)
    for address in ("127.0.0.1", "::1", "::ffff:127.0.0.1", "127.0.0.1", "127.0.0.2", "::1"):
        await service.create(None, None, address)
    assert len(service.instances) == 6
    await service.close_all()


def test_settings_refuse_nonsense_limits():
    for name, value in (
        ("request_timeout_s", 0),
        ("unused_idle_timeout_s", -1.0),
        ("max_instances_per_client", 0),
        ("max_instances_per_client", True),
    ):
        with pytest.raises(ValueError, match=name):
            ServiceSettings("codebook", **{name: value})
    assert ServiceSettings("codebook", max_instances=1).client_instance_limit() == 1
    assert ServiceSettings("codebook", max_instances=128).client_instance_limit() == 64
    assert ServiceSettings("codebook", max_instances_per_client=100).client_instance_limit() == 100


def test_the_table_over_http_fills_from_one_loopback_client():
    with EnvServer(ServiceSettings("codebook", max_instances=4, max_instances_per_client=1)) as server:
        for _ in range(4):
            assert _request(server.port, "POST", "/create", {})[0] == 200
        status, answer = _request(server.port, "POST", "/create", {})
        assert status == 503 and "full" in answer["error"]


def test_env_serve_takes_the_connection_limits_as_options(tmp_path):
    import subprocess
    import sys

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [
        sys.executable, "-m", "longhorizon.launch.cli", "env", "serve", "codebook", "--port", str(port),
        "--max-connections", "2", "--header-timeout", "0.5", "--request-timeout", "3", "--keep-alive-timeout", "4",
        "--max-instances", "5",
    ]
    service = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        assert service.stdout is not None
        assert b"serving codebook" in service.stdout.readline()
        status, info = _request(port, "GET", "/info")
        assert status == 200 and info["max_connections"] == 2 and info["max_instances"] == 5
        assert info["header_timeout_s"] == 0.5 and info["request_timeout_s"] == 3.0
        silent = socket.create_connection(("127.0.0.1", port), timeout=10)
        try:
            started = time.monotonic()
            assert _read_until_closed(silent) == b""  # the header deadline of the option, not the default 10 s
            assert time.monotonic() - started < 3
        finally:
            silent.close()
    finally:
        service.terminate()
        service.wait(timeout=10)
