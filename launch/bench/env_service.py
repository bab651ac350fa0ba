"""Env service load benchmark: requests/s of good keep-alive clients, then their latency under junk connections.

Measured from outside, against running services given by URL (`--server LABEL=URL`, repeatable),
so different builds of `longhorizon env serve` compare side by side in one run; without --server
it starts `longhorizon env serve textcraft` from this checkout on a free port.

Per server, one after the other:
  1. throughput: 1, then 8 good clients, each with one keep-alive connection, each creating an
     instance and then sending POST /step {"action": "inventory"} back to back; requests/s over
     --seconds, --rounds times (servers alternate between rounds);
  2. under attack: --junk connections (half trickle a never-ending head one byte per
     --trickle-interval; half send a whole /create head whose body never comes and wait), each
     reconnecting --reconnect-delay after it is cut, while 8 good clients run for
     --attack-seconds. A good request is timed from its first attempt, connect included; one that
     finds its kept-alive connection closed is retried once on a new one, as RemoteEnv does; one
     that fails anyway, gets a status other than 200 or takes over --timeout is an error (and
     the client waits 50 ms before its next try).

Run: `longhorizon bench env-service [--server old=http://127.0.0.1:8701 --server new=http://127.0.0.1:8702]`
The good clients run in this process on one trio loop, the junk in a child process of its own (so
its work does not delay the good clients' reads); raw sockets keep a request's client cost small
next to the service's.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import trio

from longhorizon.common.processes import stop_process
from longhorizon.launch.bench.tables import BenchStopped, Column, parsed, print_table, run_as_command, load_average

PROG = "longhorizon bench env-service"

STEP_ACTION = "inventory"  # a TextCraft action that never ends the episode


def percentile(values: Sequence[float], fraction: float) -> float:
    """Nearest-rank percentile: the smallest value with at least `fraction` of the values at or below it."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(fraction * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def _post(path: str, payload: dict) -> bytes:
    body = json.dumps(payload).encode()
    return (
        f"POST {path} HTTP/1.1\r\nHost: service\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body


class _Closed(Exception):
    """The server closed the connection before a whole answer arrived."""


class _Client:
    """One keep-alive connection, reopened when the server closes it."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.stream: trio.SocketStream | None = None
        self.buffer = bytearray()

    async def close(self) -> None:
        if self.stream is not None:
            stream, self.stream = self.stream, None
            with trio.CancelScope(shield=True):
                await stream.aclose()

    async def exchange(self, request: bytes) -> tuple[int, bytes]:
        """(status, body); a kept-alive connection found closed is replaced once, as RemoteEnv does."""
        for attempt in (0, 1):
            fresh = self.stream is None
            if fresh:
                self.stream = await trio.open_tcp_stream(self.host, self.port)
                self.buffer = bytearray()
            try:
                return await self._exchange_once(request)
            except (_Closed, trio.BrokenResourceError, OSError):
                await self.close()
                if fresh or attempt:
                    raise
        raise AssertionError("unreachable")

    async def _exchange_once(self, request: bytes) -> tuple[int, bytes]:
        assert self.stream is not None
        await self.stream.send_all(request)
        while True:
            end = self.buffer.find(b"\r\n\r\n")
            if end >= 0:
                head = bytes(self.buffer[:end]).decode("latin-1").split("\r\n")
                status = int(head[0].split(" ", 2)[1])
                fields = {line.partition(":")[0].strip().lower(): line.partition(":")[2].strip() for line in head[1:]}
                total = end + 4 + int(fields.get("content-length", "0"))
                if len(self.buffer) >= total:
                    body = bytes(self.buffer[end + 4 : total])
                    del self.buffer[:total]
                    if fields.get("connection", "").lower() == "close":
                        await self.close()
                    return status, body
            chunk = await self.stream.receive_some(65536)
            if not chunk:
                raise _Closed()
            self.buffer += chunk


@dataclass
class _GoodFigures:
    latencies: list[float] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)

    def error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1


async def _good_client(host: str, port: int, until: float, timeout_s: float, figures: _GoodFigures) -> None:
    client = _Client(host, port)
    instance: int | None = None
    try:
        while trio.current_time() < until:
            request = _post("/create", {}) if instance is None else _post("/step", {"id": instance, "action": STEP_ACTION})
            started = time.perf_counter()
            try:
                with trio.fail_after(timeout_s):
                    status, body = await client.exchange(request)
            except trio.TooSlowError:
                figures.error("timeout")
                await client.close()
                continue
            except (_Closed, trio.BrokenResourceError, OSError) as error:
                figures.error(type(error).__name__)
                await trio.sleep(0.05)  # a refused connect is immediate: wait a little before the next try
                continue
            elapsed = time.perf_counter() - started
            if status != 200:
                figures.error(f"http {status}")
                if status == 404:
                    instance = None
                await trio.sleep(0.05)  # as after a failed connect: a refusal is no reason to spin
                continue
            figures.latencies.append(elapsed)
            if instance is None:
                instance = json.loads(body)["id"]
    finally:
        if instance is not None and client.stream is not None:
            with trio.move_on_after(2), trio.CancelScope(shield=True):
                try:
                    await client.exchange(_post("/close", {"id": instance}))
                except (_Closed, trio.BrokenResourceError, OSError):
                    pass
        await client.close()


async def _throughput(host: str, port: int, clients: int, seconds: float, timeout_s: float) -> dict[str, Any]:
    figures = _GoodFigures()
    warm_until = trio.current_time() + min(1.0, seconds / 5)
    async with trio.open_nursery() as nursery:  # a short warm-up: connections, instances, caches
        for _ in range(clients):
            nursery.start_soon(_good_client, host, port, warm_until, timeout_s, _GoodFigures())
    until = trio.current_time() + seconds
    started = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(clients):
            nursery.start_soon(_good_client, host, port, until, timeout_s, figures)
    elapsed = time.perf_counter() - started
    return {
        "requests": len(figures.latencies),
        "requests_per_s": len(figures.latencies) / elapsed,
        "p50_ms": 1000 * percentile(figures.latencies, 0.5),
        "p99_ms": 1000 * percentile(figures.latencies, 0.99),
        "errors": sum(figures.errors.values()),
    }


@dataclass
class _JunkFigures:
    connects: int = 0
    cuts: int = 0
    refused: int = 0


async def _reconnecting(host: str, port: int, delay_s: float, figures: _JunkFigures, behave) -> None:
    """A junk client: connect, `behave(stream)` until the service cuts it (counted), wait
    `delay_s`, connect again; a refused connect is counted and retried after the same wait."""
    while True:
        try:
            stream = await trio.open_tcp_stream(host, port)
        except OSError:
            figures.refused += 1
            await trio.sleep(delay_s)
            continue
        figures.connects += 1
        try:
            try:
                await behave(stream)
            except (trio.BrokenResourceError, OSError):
                pass
            figures.cuts += 1  # the service ended it (not the bench's own cancellation)
        finally:
            with trio.CancelScope(shield=True):
                await stream.aclose()
        await trio.sleep(delay_s)


async def _trickler(host: str, port: int, interval_s: float, delay_s: float, figures: _JunkFigures) -> None:
    """A never-ending request head, one byte per interval; reconnects when cut."""
    async def trickle(stream) -> None:
        await stream.send_all(b"POST /create HTTP/1.1\r\nHost: service\r\nX-Slow: ")
        while True:
            await trio.sleep(interval_s)
            await stream.send_all(b"a")

    await _reconnecting(host, port, delay_s, figures, trickle)


async def _cut_off(host: str, port: int, delay_s: float, figures: _JunkFigures) -> None:
    """A whole /create head whose body never comes; waits to be cut, then reconnects."""
    head = b"POST /create HTTP/1.1\r\nHost: service\r\nContent-Type: application/json\r\nContent-Length: 64\r\n\r\n"

    async def send_head_and_wait(stream) -> None:
        await stream.send_all(head)
        while await stream.receive_some(4096):
            pass

    await _reconnecting(host, port, delay_s, figures, send_head_and_wait)


async def _junk(host: str, port: int, count: int, interval_s: float, delay_s: float, seconds: float) -> _JunkFigures:
    """`count` junk connections for `seconds`: half tricklers, half cut-off /create heads."""
    figures = _JunkFigures()
    with trio.move_on_after(seconds):
        async with trio.open_nursery() as nursery:
            for index in range(count):
                if index % 2:
                    nursery.start_soon(_cut_off, host, port, delay_s, figures)
                else:
                    nursery.start_soon(_trickler, host, port, interval_s, delay_s, figures)
                if index % 50 == 49:
                    await trio.sleep(0.05)  # a ramp, not one SYN burst
    return figures


def junk_process(host: str, port: int, count: int, interval_s: float, delay_s: float, seconds: float) -> None:
    """The junk of one attack, in a process of its own so that its work does not delay the good clients'
    reads; prints its figures as one line of JSON when done."""
    _raise_descriptor_limit(count + 256)
    figures = trio.run(_junk, host, port, count, interval_s, delay_s, seconds)
    print(json.dumps({"connects": figures.connects, "cuts": figures.cuts, "connect_failures": figures.refused}), flush=True)


async def _under_attack(host: str, port: int, settings: argparse.Namespace) -> dict[str, Any]:
    good = _GoodFigures()
    junk_seconds = settings.ramp_seconds + settings.attack_seconds + 1.0
    code = (
        "from longhorizon.launch.bench.env_service import junk_process; "
        f"junk_process({host!r}, {port}, {settings.junk}, {settings.trickle_interval}, "
        f"{settings.reconnect_delay}, {junk_seconds})"
    )
    junk = await trio.lowlevel.open_process([sys.executable, "-c", code], stdout=subprocess.PIPE)
    output = b""
    try:
        await trio.sleep(settings.ramp_seconds)
        until = trio.current_time() + settings.attack_seconds
        started = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for _ in range(8):
                nursery.start_soon(_good_client, host, port, until, settings.timeout, good)
        elapsed = time.perf_counter() - started
        assert junk.stdout is not None
        while chunk := await junk.stdout.receive_some():
            output += chunk
        await junk.wait()
    finally:
        if junk.returncode is None:
            junk.kill()
            with trio.CancelScope(shield=True):
                await junk.wait()
    lines = output.decode().strip().splitlines()
    junk_figures = json.loads(lines[-1]) if lines else {}
    return {
        "good_requests": len(good.latencies),
        "good_requests_per_s": len(good.latencies) / elapsed,
        "p50_ms": 1000 * percentile(good.latencies, 0.5),
        "p99_ms": 1000 * percentile(good.latencies, 0.99),
        "max_ms": 1000 * max(good.latencies, default=math.nan),
        "errors": sum(good.errors.values()),
        "error_kinds": good.errors,
        "junk_connects": junk_figures.get("connects", -1),
        "junk_cuts": junk_figures.get("cuts", -1),
        "junk_connect_failures": junk_figures.get("connect_failures", -1),
    }


def process_cpu_seconds(pid: int) -> float:
    """User plus system CPU time of a process, all its threads, from /proc."""
    import os

    with open(f"/proc/{pid}/stat") as stat:
        # The command name (field 2) may hold spaces: count fields after its closing parenthesis.
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _address(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname or not parts.port:
        raise ValueError(f"--server needs LABEL=http://HOST:PORT, got {url!r}")
    return parts.hostname, parts.port


async def _bench(servers: dict[str, str], settings: argparse.Namespace) -> dict[str, Any]:
    result: dict[str, Any] = {
        "servers": servers, "seconds_per_run": settings.seconds, "rounds": settings.rounds,
        "junk": settings.junk, "attack_seconds": settings.attack_seconds, "load_average_before": load_average(),
    }
    for clients in (1, 8):
        for label in servers:
            result[f"{label}_{clients}_clients_requests_per_s"] = []
    for _ in range(settings.rounds):
        for clients in (1, 8):
            for label, url in servers.items():
                host, port = _address(url)
                pid = settings.pids.get(label)
                cpu_before = process_cpu_seconds(pid) if pid else 0.0
                figures = await _throughput(host, port, clients, settings.seconds, settings.timeout)
                result[f"{label}_{clients}_clients_requests_per_s"].append(figures["requests_per_s"])
                if pid:
                    # Includes the short warm-up; requests then are few, so this slightly overstates.
                    cpu_ms = 1000 * (process_cpu_seconds(pid) - cpu_before) / max(figures["requests"], 1)
                    result.setdefault(f"{label}_{clients}_clients_server_cpu_ms_per_request", []).append(cpu_ms)
                result[f"{label}_{clients}_clients_errors"] = (
                    result.get(f"{label}_{clients}_clients_errors", 0) + figures["errors"]
                )
    if settings.junk:
        for label, url in servers.items():
            host, port = _address(url)
            result[f"{label}_attack"] = await _under_attack(host, port, settings)
            await trio.sleep(settings.recover_seconds)  # the junk's connections drain before the next server
    result["load_average_after"] = load_average()
    return result


def print_report(result: dict) -> None:
    """A table for people (the command prints the result as JSON after it)."""
    labels = list(result["servers"])
    print(f"good keep-alive clients, POST /step, {result['seconds_per_run']:.0f} s per run, "
          f"{result['rounds']} rounds (median, then every round)")
    rows = []
    for label in labels:
        for clients in (1, 8):
            values = result[f"{label}_{clients}_clients_requests_per_s"]
            cpu = result.get(f"{label}_{clients}_clients_server_cpu_ms_per_request")
            rows.append([label, clients, statistics.median(values), " ".join(f"{value:.0f}" for value in values),
                         result.get(f"{label}_{clients}_clients_errors", 0),
                         f"{statistics.median(cpu):.3f}" if cpu else "-"])
    print_table([Column("server", 10, left=True), Column("clients", 8, "d"), Column("req/s", 8, ",.0f"),
                 Column("rounds", 20), Column("errors", 7, "d"), Column("server CPU ms/req", 17)], rows)
    if any(f"{label}_attack" in result for label in labels):
        print(f"\n8 good clients for {result['attack_seconds']:.0f} s among {result['junk']} junk connections")
        print_table(
            [Column("server", 10, left=True), Column("good req", 9, "d"), Column("req/s", 8, ",.0f"),
             Column("p50 ms", 8, ".2f"), Column("p99 ms", 9, ".2f"), Column("max ms", 9, ".1f"),
             Column("errors", 7, "d"), Column("junk conns", 11, "d")],
            [[label, figures["good_requests"], figures["good_requests_per_s"], figures["p50_ms"], figures["p99_ms"],
              figures["max_ms"], figures["errors"], figures["junk_connects"]]
             for label in labels if (figures := result.get(f"{label}_attack"))],
        )


def _raise_descriptor_limit(wanted: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted if hard == resource.RLIM_INFINITY else min(wanted, hard), hard))


def _start_own_server() -> tuple[subprocess.Popen, str]:
    """`longhorizon env serve textcraft` from this checkout on a free port; (process, url)."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen(
        [sys.executable, "-m", "longhorizon.launch.cli", "env", "serve", "textcraft", "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    assert process.stdout is not None
    line = process.stdout.readline()
    if "serving" not in line:
        process.kill()
        raise RuntimeError(f"`env serve textcraft` did not start: {line!r}")
    return process, f"http://127.0.0.1:{port}"


def _check(args: argparse.Namespace) -> None:
    for item in args.server:
        label, separator, url = item.partition("=")
        if not separator or not label:
            raise ValueError(f"--server takes LABEL=URL, got {item!r}")
        _address(url)
    labels = {item.partition("=")[0] for item in args.server}
    args.pids = {}
    for item in args.pid:
        label, separator, number = item.partition("=")
        if not separator or label not in labels or not number.isdigit():
            raise ValueError(f"--pid takes LABEL=PID for a LABEL of --server, got {item!r}")
        args.pids[label] = int(number)
    if args.seconds <= 0 or args.attack_seconds <= 0 or args.rounds < 1 or args.junk < 0:
        raise ValueError("--seconds, --attack-seconds and --rounds must be positive, --junk at least 0")


def run(argv: list[str]) -> dict[str, Any]:
    """Measure as the options say (a server of its own unless --server), print the tables, return
    the result."""
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("--server", action="append", default=[], metavar="LABEL=URL",
                        help="a running `env serve textcraft` to measure (repeatable; default: start one here)")
    parser.add_argument("--pid", action="append", default=[], metavar="LABEL=PID",
                        help="the process of a --server, to report its CPU time per request (Linux)")
    parser.add_argument("--seconds", type=float, default=5.0, help="length of each throughput run (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=3, help="throughput rounds per server (default %(default)s)")
    parser.add_argument("--junk", type=int, default=1000, help="junk connections during the attack (0: none)")
    parser.add_argument("--attack-seconds", type=float, default=30.0, help="good clients' run under attack")
    parser.add_argument("--ramp-seconds", type=float, default=3.0, help="junk alone before the good clients start")
    parser.add_argument("--recover-seconds", type=float, default=2.0, help="pause after each attack")
    parser.add_argument("--trickle-interval", type=float, default=1.0, help="seconds between a trickler's bytes")
    parser.add_argument("--reconnect-delay", type=float, default=0.2, help="seconds a cut junk client waits")
    parser.add_argument("--timeout", type=float, default=10.0, help="a good request slower than this is an error")
    args = parsed(parser, argv, check=_check)
    _raise_descriptor_limit(args.junk + 256)
    own = None
    servers = {item.partition("=")[0]: item.partition("=")[2] for item in args.server}
    try:
        if not servers:
            own, url = _start_own_server()
            servers = {"this": url}
            args.pids = {"this": own.pid}
        result = trio.run(_bench, servers, args)
    except (RuntimeError, OSError) as error:
        raise BenchStopped(1, str(error)) from error
    finally:
        if own is not None:
            stop_process(own, timeout_s=10)
    print_report(result)
    return result


def main(argv: list[str]) -> int:
    return run_as_command(PROG, run, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
