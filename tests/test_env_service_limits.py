"""The env service's limits against clients that hog it: slow requests, connection bursts, resets, instance floods."""

from __future__ import annotations

import http.client
import json
import logging
import socket
import struct
import threading
import time

import pytest
from longhorizon.envs.server import EnvServer, _HTTPServer, _LostClientLog
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


def test_trickling_clients_lose_their_connections_at_the_request_deadline():
    settings = ServiceSettings("codebook", max_connections=8, request_timeout_s=1.0, keep_alive_timeout_s=30.0)
    with EnvServer(settings) as server:
        port = server.port
        tricklers = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(8)]
        stop = threading.Event()

        def trickle() -> None:
            # One byte of a never-ending header per connection every 0.2 s: each read is quick,
            # so only a deadline over the whole request can end it.
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
            # Every slot is held: a good request is turned away until the deadline has ended the
            # trickling requests (without it they would hold the slots as long as they trickle).
            started = time.monotonic()
            while (status := _request(port, "GET", "/health")[0]) != 200:
                assert status == 503
                assert time.monotonic() - started < WAIT_S, "the trickling clients kept every connection slot"
                time.sleep(0.05)
            _wait_until(lambda: server.error_counts.get(408, 0) == 8, "a 408 for each trickling request")
            for connection in tricklers:
                try:
                    answer = connection.recv(4096)
                except ConnectionResetError:
                    continue  # our trickled byte reached a closed socket; the server's RST won
                assert answer == b"" or answer.startswith(b"HTTP/1.1 408 ")
        finally:
            stop.set()
            if thread.is_alive():
                thread.join()
            for connection in tricklers:
                connection.close()


def test_an_idle_keep_alive_outlasts_the_deadline_but_a_slow_body_gets_408():
    with EnvServer(ServiceSettings("codebook", request_timeout_s=1.0)) as server:
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
            slow.sendall(b'POST /step HTTP/1.1\r\nContent-Length: 40\r\n\r\n{"id": 0,')
            answer = _read_until_closed(slow)  # nothing more is sent: the deadline answers
            assert answer.startswith(b"HTTP/1.1 408 ") and b"Connection: close" in answer
            assert b"did not arrive within 1.0 s" in answer
        finally:
            slow.close()


def test_the_listen_backlog_holds_a_burst_of_connections():
    # A server that binds and listens but does not accept yet: every connection waits in the backlog.
    # With http.server's default backlog of 5 the seventh connect would stall on SYN retries.
    idle = _HTTPServer(("127.0.0.1", 0), EnvServer(ServiceSettings("codebook")))
    clients = []
    try:
        for _ in range(64):
            clients.append(socket.create_connection(idle.server_address, timeout=5))
    finally:
        for client in clients:
            client.close()
        idle.server_close()


# ---------------------------------------------------------------- clients that vanish mid-request


def test_clients_that_reset_mid_request_leave_a_short_line_and_no_traceback(capfd, caplog):
    caplog.set_level(logging.DEBUG, logger="longhorizon.envs.server")
    with EnvServer(ServiceSettings("codebook")) as server:
        partial_requests = [
            b"POST /step HTTP/1.1\r\nHost: service\r\n",  # inside the head
            b'POST /step HTTP/1.1\r\nContent-Length: 100\r\n\r\n{"id": 0',  # inside the body
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
    limiter = _LostClientLog(interval_s=10.0, clock=lambda: now[0], emit=lines.append)
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
