"""Model server benchmark: chats answered per second by running `serve-model` servers, streamed and not.

Measured from outside, against servers given by URL (`--server LABEL=URL`, repeatable), so two
builds of `longhorizon serve-model` compare side by side in one run: per case (streamed or not, 1
or 16 clients at once) the servers take turns within each of --rounds rounds. Each client holds one
keep-alive connection (httpx) and sends the same chat back to back for --seconds; a streamed reply
is read to its `data: [DONE]`.

With `--pid LABEL=PID` (Linux) it also reports the server's CPU time per request, and the part of it
spent outside the threads that generate: the threads the server had before the run, less its main
thread, are taken as the generation side (the batching thread and torch's workers), so what is
left is the serving side, the event loop or the per-connection threads, whichever the server has.
Where wall time moves with the load of the machine, that figure moves much less.

Run: `longhorizon bench model-server --server old=http://127.0.0.1:8721 \\
--server new=http://127.0.0.1:8722 --pid old=PID1 --pid new=PID2`
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from typing import Any

from longhorizon.launch.bench.tables import BenchStopped, Column, parsed, print_table, run_as_command, load_average

PROG = "longhorizon bench model-server"

CASES = (("streamed", 1), ("streamed", 16), ("plain", 1), ("plain", 16))


def _chat(stream: bool, tokens: int) -> dict:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": tokens,
                            "temperature": 1.0, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def _one_request(client, url: str, stream: bool, tokens: int) -> None:
    if stream:
        with client.stream("POST", url + "/v1/chat/completions", json=_chat(True, tokens)) as reply:
            if reply.status_code != 200:
                raise RuntimeError(f"{url} answered {reply.status_code}")
            for line in reply.iter_lines():
                if line == "data: [DONE]":
                    return
        raise RuntimeError(f"{url} ended a stream without data: [DONE]")
    reply = client.post(url + "/v1/chat/completions", json=_chat(False, tokens))
    if reply.status_code != 200:
        raise RuntimeError(f"{url} answered {reply.status_code}: {reply.text[:200]}")


def _thread_cpu_seconds(pid: int, thread_id: int) -> float:
    try:
        with open(f"/proc/{pid}/task/{thread_id}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:  # the thread has ended
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _process_cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _measure(url: str, pid: int | None, stream: bool, clients: int, tokens: int, seconds: float) -> dict[str, float]:
    import httpx

    generation_threads = []
    if pid:
        generation_threads = [int(name) for name in os.listdir(f"/proc/{pid}/task") if int(name) != pid]
    sessions = [httpx.Client(timeout=120) for _ in range(clients)]
    answered = [0] * clients
    failures: list[BaseException] = []
    try:
        for session in sessions:  # connections open, the server warm
            _one_request(session, url, stream, tokens)
        cpu_before = _process_cpu_seconds(pid) if pid else 0.0
        generation_before = sum(_thread_cpu_seconds(pid, thread) for thread in generation_threads)
        started = time.perf_counter()
        until = started + seconds

        def client(index: int) -> None:
            try:
                while time.perf_counter() < until:
                    _one_request(sessions[index], url, stream, tokens)
                    answered[index] += 1
            except Exception as error:  # reported after the run
                failures.append(error)

        threads = [threading.Thread(target=client, args=(index,)) for index in range(clients)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        elapsed = time.perf_counter() - started
    finally:
        for session in sessions:
            session.close()
    if failures:
        raise RuntimeError(f"{url}: {failures[0]!r}")
    requests = max(sum(answered), 1)
    figures = {"requests_per_s": sum(answered) / elapsed}
    if pid:
        cpu = _process_cpu_seconds(pid) - cpu_before
        generation = sum(_thread_cpu_seconds(pid, thread) for thread in generation_threads) - generation_before
        figures["server_cpu_ms_per_request"] = 1000 * cpu / requests
        figures["serving_cpu_ms_per_request"] = 1000 * (cpu - generation) / requests
    return figures


def _check(args: argparse.Namespace) -> None:
    args.servers = {}
    for item in args.server:
        label, separator, url = item.partition("=")
        if not separator or not label or not url.startswith("http://"):
            raise ValueError(f"--server takes LABEL=http://HOST:PORT, got {item!r}")
        args.servers[label] = url.rstrip("/")
    if not args.servers:
        raise ValueError("name at least one --server LABEL=URL")
    args.pids = {}
    for item in args.pid:
        label, separator, number = item.partition("=")
        if not separator or label not in args.servers or not number.isdigit():
            raise ValueError(f"--pid takes LABEL=PID for a LABEL of --server, got {item!r}")
        args.pids[label] = int(number)
    if args.seconds <= 0 or args.rounds < 1 or args.tokens < 1:
        raise ValueError("--seconds, --rounds and --tokens must be positive")


def print_report(result: dict) -> None:
    print(f"chats of {result['tokens']} tokens at most, {result['seconds_per_run']:.0f} s per run, "
          f"{result['rounds']} rounds (median, then every round)")
    rows = []
    for case, figures in result["cases"].items():
        for label, runs in figures.items():
            rates = [run["requests_per_s"] for run in runs]
            cpu = [run["server_cpu_ms_per_request"] for run in runs if "server_cpu_ms_per_request" in run]
            serving = [run["serving_cpu_ms_per_request"] for run in runs if "serving_cpu_ms_per_request" in run]
            rows.append([case, label, statistics.median(rates), " ".join(f"{rate:.1f}" for rate in rates),
                         f"{statistics.median(cpu):.2f}" if cpu else "-",
                         f"{statistics.median(serving):.2f}" if serving else "-"])
    print_table([Column("case", 14, left=True), Column("server", 8, left=True), Column("req/s", 7, ".1f"),
                 Column("rounds", 26), Column("CPU ms/req", 11), Column("serving ms/req", 15)], rows)


def run(argv: list[str]) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("--server", action="append", default=[], metavar="LABEL=URL",
                        help="a running `longhorizon serve-model` to measure (repeatable)")
    parser.add_argument("--pid", action="append", default=[], metavar="LABEL=PID",
                        help="the process of a --server, for its CPU time per request (Linux)")
    parser.add_argument("--seconds", type=float, default=5.0, help="length of each run (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per case and server (default %(default)s)")
    parser.add_argument("--tokens", type=int, default=32, help="max_tokens of each chat (default %(default)s)")
    args = parsed(parser, argv, check=_check)
    result: dict[str, Any] = {"servers": args.servers, "seconds_per_run": args.seconds, "rounds": args.rounds,
                              "tokens": args.tokens, "load_average_before": load_average(), "cases": {}}
    try:
        for kind, clients in CASES:
            case = f"{kind} x{clients}"
            figures: dict[str, list] = {label: [] for label in args.servers}
            for _ in range(args.rounds):
                for label, url in args.servers.items():
                    figures[label].append(_measure(url, args.pids.get(label), kind == "streamed", clients,
                                                   args.tokens, args.seconds))
            result["cases"][case] = figures
    except (RuntimeError, OSError) as error:
        raise BenchStopped(1, str(error)) from error
    result["load_average_after"] = load_average()
    print_report(result)
    return result


def main(argv: list[str]) -> int:
    return run_as_command(PROG, run, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
