"""Transport benchmark: raw ZeroMQ PUSH->PULL against real Trajectory messages through our sockets.

Each run has a sender in a child process (as an actor is) and the receiver in this process (as the
learner is), over tcp loopback with the same high-water marks, the receiver polled from trio; so
the ratio shows what the codec and the transport layer cost where they really run:

- raw: single byte frames of ``trajectory_bytes``, sent and received without copying
  (``copy=False`` on both ends) by the leanest loop we can write;
- trajectory: ``Trajectory`` messages of about the same size (mostly token arrays) through
  ``ZmqPushSender`` -> ``ZmqPullReceiver``: full encode, and a validating decode of every message.
- raw_split (for diagnosis): raw byte frames of exactly the sizes a Trajectory's frames have (a
  header plus one frame per large array), no codec. It separates what ZeroMQ charges per frame
  from what the codec and the transport layer cost.

Both processes of every run, whatever the kind, use the same allocator settings: by default
those our learner and actors run with (``common/memory.py``: freed message buffers kept for
reuse), or glibc's own with ``keep_freed_memory=False``.

Where Linux says how much CPU each thread used (``/proc/self/task``), every run also reports the
CPU time per message of each side's threads (the Python thread, ZeroMQ's I/O threads, the rest)
and how many cores the two processes kept busy: when that is close to the machine's core count,
throughput is set by the CPU the threads share, not by any one of them.

Run: ``longhorizon bench transport`` (or ``python -m longhorizon.launch.bench.transport``). Prints a
table, then one line of JSON.
"""

import multiprocessing
import os
import statistics
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import trio
import zmq

from longhorizon.common.codec import encode, pack_arrays
from longhorizon.common.memory import keep_freed_message_memory, keeping_freed_message_memory
from longhorizon.common.transport import DEFAULT_TRAJECTORY_HWM, ZmqPullReceiver, ZmqPushSender
from longhorizon.common.wire import Trajectory
from longhorizon.launch.bench.tables import Column, print_table

TARGET_RATIO = 0.8
"""Trajectory throughput should reach this share of the raw baseline."""

_BYTES_PER_TOKEN = 4 + 1 + 4 + 4  # token id, loss mask, behaviour log-prob, policy version
_WARMUP_MESSAGES = 10
THREAD_GROUPS = ("main", "zeromq", "other")
"""How a process's threads are grouped in the CPU figures: the main thread (where the Python loop
and the codec run), ZeroMQ's own threads (I/O and reaper), and the rest (pyzmq's garbage
collector thread, which releases zero-copy frames; worker threads)."""


def thread_cpu_seconds() -> dict[str, float] | None:
    """CPU seconds used so far by this process's threads, summed per group of ``THREAD_GROUPS``.

    None where the kernel does not say (not Linux). A thread that ended is no longer counted, so
    take differences over a stretch in which the threads of interest live throughout.
    """
    task_folder = "/proc/self/task"
    try:
        thread_ids = os.listdir(task_folder)
    except OSError:
        return None
    main_thread = str(os.getpid())
    totals = dict.fromkeys(THREAD_GROUPS, 0.0)
    # The kernel brings a thread's figure up to date only when the thread is switched out or a
    # timer tick lands, so a thread's own clock is the exact one for itself.
    on_main_thread = threading.current_thread() is threading.main_thread()
    if on_main_thread:
        totals["main"] = time.thread_time()
    for thread_id in thread_ids:
        if on_main_thread and thread_id == main_thread:
            continue
        try:
            with open(f"{task_folder}/{thread_id}/comm") as comm_file:
                name = comm_file.read().strip()
            seconds = _thread_cpu(f"{task_folder}/{thread_id}")
        except OSError:  # the thread ended while we were reading
            continue
        if seconds is None:
            return None
        group = "main" if thread_id == main_thread else "zeromq" if name.startswith("ZMQbg") else "other"
        totals[group] += seconds
    return totals


def _thread_cpu(folder: str) -> float | None:
    # schedstat's first field is nanoseconds on a CPU; stat's utime and stime (clock ticks) are the
    # coarser fallback for kernels built without scheduler statistics.
    try:
        with open(f"{folder}/schedstat") as schedstat:
            return int(schedstat.read().split()[0]) / 1e9
    except FileNotFoundError:
        pass
    with open(f"{folder}/stat") as stat:
        # The command name (field 2) may hold spaces; the fields after its closing parenthesis don't.
        fields = stat.read().rsplit(")", 1)[1].split()
    try:
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (IndexError, ValueError):
        return None


def _cpu_since(before: dict[str, float] | None, messages: int) -> dict[str, float] | None:
    """Microseconds per message each thread group used since ``before``."""
    after = thread_cpu_seconds()
    if before is None or after is None:
        return None
    return {group: (after[group] - before[group]) / messages * 1e6 for group in THREAD_GROUPS}


@dataclass(frozen=True)
class _Run:
    """One run of one kind: seconds for the timed messages, and CPU per message by thread group
    on each side (``receiver_main``, ``sender_zeromq``, ...; None where not measurable)."""

    seconds: float
    cpu_us_per_message: dict[str, float] | None


def make_trajectory(trajectory_bytes: int, *, seed: int = 0) -> Trajectory:
    """A realistic trajectory of about ``trajectory_bytes`` on the wire: token arrays plus an
    eighth of the size as episode text."""
    rng = np.random.default_rng(seed)
    text_chars = trajectory_bytes // 8
    tokens = max(1, (trajectory_bytes - text_chars) // _BYTES_PER_TOKEN)
    prompt_length = min(tokens, 300)
    # A 30-turn episode: each turn a generated action (mask 1) then an observation (mask 0).
    num_turns = 30
    turn_length = max(1, (tokens - prompt_length) // (2 * num_turns))
    loss_mask = np.zeros(tokens, dtype=np.uint8)
    for turn in range(num_turns):
        start = prompt_length + 2 * turn * turn_length
        loss_mask[start : start + turn_length] = 1
    behaviour_logprobs = np.where(loss_mask == 1, -rng.exponential(1.0, tokens), 0.0).astype(np.float32)
    policy_versions = np.where(loss_mask == 1, 41, -1).astype(np.int32)
    # Laid out in one buffer, as the actor builds its trajectories (see codec.pack_arrays).
    arrays = pack_arrays({
        "token_ids": rng.integers(0, 49152, tokens, dtype=np.int32),
        "loss_mask": loss_mask,
        "behaviour_logprobs": behaviour_logprobs,
        "policy_versions": policy_versions,
    })
    return Trajectory(
        trajectory_id="bench-actor-0/episode-000001",
        actor_id="bench-actor-0",
        env_name="textcraft",
        task_id="craft/iron_pickaxe",
        group_id="bench-actor-0/group-0001",
        group_size=8,
        **arrays,
        prompt_length=prompt_length,
        reward=1.0,
        turn_rewards=[0.0] * (num_turns - 1) + [1.0],
        num_turns=num_turns,
        horizon_cap=30,
        terminated=True,
        truncated=False,
        success=True,
        generation_seconds=12.5,
        env_seconds=0.8,
        text="Thought: I need sticks first.\nAction: get 2 stick\n" * (text_chars // 50 + 1),
        error="",
    )


def _sender_process(
    kind: str, address: str, count: int, trajectory_bytes: int, received, keep_freed_memory: bool, cpu_report
) -> None:
    """Child process: connect like an actor does and send ``_WARMUP_MESSAGES`` then ``count``
    messages as fast as possible.

    Sockets close with linger 0 (as actors' do), which would drop what is still queued: the
    child waits for the receiver to say it has everything before closing. It then sends its
    threads' CPU per message down ``cpu_report``: from the end of the warm-up until the receiver
    had every message (by then ZeroMQ's I/O thread has written them all out)."""
    if keep_freed_memory:
        keep_freed_message_memory()
    context = zmq.Context()
    trajectory = make_trajectory(trajectory_bytes)
    if kind == "trajectory":
        sender = ZmqPushSender(address, context=context)

        async def send_one() -> None:
            await sender.send(trajectory)

        close = sender.close
    else:
        frames = [bytes(trajectory_bytes)] if kind == "raw" else [
            bytes(memoryview(frame).nbytes) for frame in encode(trajectory)
        ]
        push = context.socket(zmq.PUSH)
        push.setsockopt(zmq.SNDHWM, DEFAULT_TRAJECTORY_HWM)
        push.connect(address)
        fd = push.getsockopt(zmq.FD)

        async def send_one() -> None:
            # The leanest trio-polled loop: the same I/O model as our sockets, without them.
            while True:
                try:
                    push.send_multipart(frames, zmq.NOBLOCK, copy=False)
                    return
                except zmq.Again:
                    while not push.getsockopt(zmq.EVENTS) & zmq.POLLOUT:
                        await trio.lowlevel.wait_readable(fd)

        def close() -> None:
            push.close(linger=0)

    cpu_before: list[dict[str, float] | None] = []

    async def send_all() -> None:
        for _ in range(_WARMUP_MESSAGES):
            await send_one()
        cpu_before.append(thread_cpu_seconds())
        for _ in range(count):
            await send_one()

    trio.run(send_all)
    received.wait(timeout=120)
    cpu_report.send(_cpu_since(cpu_before[0], count))
    close()
    context.term()


async def _receive_raw(
    address_holder: list[str], count: int, started: trio.Event
) -> tuple[float, dict[str, float] | None]:
    context = zmq.Context.instance()
    pull = context.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    pull.setsockopt(zmq.RCVHWM, DEFAULT_TRAJECTORY_HWM)
    pull.bind("tcp://127.0.0.1:0")
    address_holder.append(pull.getsockopt_string(zmq.LAST_ENDPOINT))
    started.set()
    fd = pull.getsockopt(zmq.FD)

    async def receive_one() -> None:
        while True:
            try:
                pull.recv_multipart(zmq.NOBLOCK, copy=False)
                return
            except zmq.Again:
                while not pull.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    await trio.lowlevel.wait_readable(fd)

    try:
        return await _timed(receive_one, count)
    finally:
        pull.close(linger=0)


async def _receive_trajectories(
    address_holder: list[str], count: int, started: trio.Event
) -> tuple[float, dict[str, float] | None]:
    receiver = ZmqPullReceiver("tcp://127.0.0.1:0")
    address_holder.append(receiver.address)
    started.set()

    async def receive_one() -> None:
        received = await receiver.receive()
        assert isinstance(received, Trajectory)

    try:
        return await _timed(receive_one, count)
    finally:
        receiver.close()


async def _timed(
    receive_one: Callable[[], Awaitable[None]], count: int
) -> tuple[float, dict[str, float] | None]:
    """Seconds to receive ``count`` messages after ``_WARMUP_MESSAGES`` untimed ones, and this
    process's CPU per message by thread group over the same stretch."""
    for _ in range(_WARMUP_MESSAGES):
        await receive_one()
    cpu_before = thread_cpu_seconds()
    started = time.perf_counter()
    for _ in range(count):
        await receive_one()
    seconds = time.perf_counter() - started
    return seconds, _cpu_since(cpu_before, count)


def _measure(kind: str, count: int, trajectory_bytes: int, keep_freed_memory: bool) -> _Run:
    """Receive here (as the learner does) from a sender in another process (as an actor is).

    The allocator setting of this process is the caller's (see ``bench_transport``)."""
    context = multiprocessing.get_context("spawn")
    received = context.Event()
    cpu_reports, cpu_report = context.Pipe(duplex=False)

    async def run() -> _Run:
        address: list[str] = []
        started = trio.Event()
        receive = _receive_trajectories if kind == "trajectory" else _receive_raw
        async with trio.open_nursery() as nursery:
            result: list[tuple[float, dict[str, float] | None]] = []

            async def receiving() -> None:
                result.append(await receive(address, count, started))

            nursery.start_soon(receiving)
            await started.wait()
            child = context.Process(
                target=_sender_process,
                args=(kind, address[0], count, trajectory_bytes, received, keep_freed_memory, cpu_report),
            )
            child.start()
            cpu_report.close()  # the child's end: without this copy, a dead child reads as EOF
        received.set()
        sender_cpu = await trio.to_thread.run_sync(_read_report, cpu_reports)
        await trio.to_thread.run_sync(child.join)
        seconds, receiver_cpu = result[0]
        cpu = None
        if receiver_cpu is not None and sender_cpu is not None:
            cpu = {f"{side}_{group}": figures[group]
                   for side, figures in (("receiver", receiver_cpu), ("sender", sender_cpu))
                   for group in THREAD_GROUPS}
        return _Run(seconds, cpu)

    try:
        return trio.run(run)
    finally:
        cpu_reports.close()


def _read_report(connection) -> dict[str, float] | None:
    try:
        return connection.recv() if connection.poll(120) else None
    except EOFError:  # the sender ended without reporting
        return None


def _figures(prefix: str, count: int, seconds: list[float], message_bytes: int) -> dict[str, Any]:
    median_seconds = statistics.median(seconds)
    return {
        f"{prefix}_message_bytes": message_bytes,
        f"{prefix}_messages": count,
        f"{prefix}_seconds": median_seconds,
        f"{prefix}_messages_per_s": count / median_seconds,
        f"{prefix}_mb_per_s": count * message_bytes / median_seconds / 1e6,
    }


def _cpu_figures(prefix: str, count: int, runs: list[_Run]) -> dict[str, Any]:
    """Median CPU per message of each side's thread groups, and the cores both processes kept
    busy (CPU per message times messages per second; None where the kernel does not say)."""
    measured = [run for run in runs if run.cpu_us_per_message is not None]
    if not measured:
        return {
            f"{prefix}_cpu_us_per_message": None, f"{prefix}_cores_busy": None,
            f"{prefix}_core_per_thread_messages_per_s": None,
        }
    return {
        f"{prefix}_cpu_us_per_message": {
            group: statistics.median(run.cpu_us_per_message[group] for run in measured)
            for group in measured[0].cpu_us_per_message
        },
        f"{prefix}_cores_busy": statistics.median(
            sum(run.cpu_us_per_message.values()) * 1e-6 * count / run.seconds for run in measured
        ),
        # An estimate, not a measurement: the rate if every thread group had a core of its own,
        # where the busiest one would set the pace.
        f"{prefix}_core_per_thread_messages_per_s": statistics.median(
            1e6 / max(run.cpu_us_per_message.values()) for run in measured
        ),
    }


def bench_transport(
    *,
    trajectory_bytes: int = 1 << 20,
    messages: int = 500,
    rounds: int = 3,
    keep_freed_memory: bool = True,
) -> dict:
    """Throughput of raw frames and of Trajectory messages over tcp loopback, same run.

    Runs ``rounds`` alternating rounds of each kind (medians reported), each timing ``messages``
    messages after a few untimed ones.
    ``keep_freed_memory`` applies our processes' allocator settings to both sides of every run
    (this process's setting cannot be undone: run with False in a fresh process).
    """
    if trajectory_bytes < 64 or messages < 1 or rounds < 1:
        raise ValueError("need trajectory_bytes >= 64, messages >= 1, rounds >= 1")
    if not keep_freed_memory and keeping_freed_message_memory():
        raise ValueError(
            "this process already keeps freed buffers (it cannot undo that): measure glibc's "
            "defaults in a fresh process"
        )
    if keep_freed_memory and not keep_freed_message_memory():
        keep_freed_memory = False  # not glibc's malloc: both sides run with the C library's defaults
    trajectory = make_trajectory(trajectory_bytes)
    frame_sizes = [memoryview(frame).nbytes for frame in encode(trajectory)]
    kinds = ("raw", "trajectory", "raw_split")
    runs: dict[str, list[_Run]] = {kind: [] for kind in kinds}
    for _ in range(rounds):
        for kind in kinds:
            runs[kind].append(_measure(kind, messages, trajectory_bytes, keep_freed_memory))
    seconds = {kind: [run.seconds for run in runs[kind]] for kind in kinds}
    message_bytes = {"raw": trajectory_bytes, "trajectory": sum(frame_sizes), "raw_split": sum(frame_sizes)}
    result: dict[str, Any] = {
        "trajectory_bytes": trajectory_bytes, "rounds": rounds, "keep_freed_memory": keep_freed_memory,
    }
    for kind in kinds:
        result.update(_figures(kind, messages, seconds[kind], message_bytes[kind]))
        result.update(_cpu_figures(kind, messages, runs[kind]))
    result["cores"] = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    # Each round's own ratio: how far apart they are shows how noisy the machine was.
    result["round_ratios"] = [
        (message_bytes["trajectory"] / trajectory_s) / (message_bytes["raw"] / raw_s)
        for raw_s, trajectory_s in zip(seconds["raw"], seconds["trajectory"])
    ]
    result["trajectory_frames"] = len(frame_sizes)
    result["trajectory_tokens"] = int(len(trajectory.token_ids))
    result["raw_split_ratio"] = result["raw_split_mb_per_s"] / result["raw_mb_per_s"]
    result["ratio"] = result["trajectory_mb_per_s"] / result["raw_mb_per_s"]
    result["target_ratio"] = TARGET_RATIO
    result["meets_target"] = result["ratio"] >= TARGET_RATIO
    return result


def print_report(result: dict) -> None:
    """A table for people (the command prints the result as JSON after it)."""
    allocator = "freed buffers kept for reuse" if result["keep_freed_memory"] else "glibc defaults"
    print(f"transport over tcp loopback, {result['rounds']} rounds, medians; allocator on both sides: {allocator}")
    kinds = ("raw", "trajectory", "raw_split")
    print_table(
        [Column("", 12, left=True), Column("bytes/msg", 11, ","), Column("messages", 9),
         Column("msg/s", 10, ".1f"), Column("MB/s", 10, ".1f")],
        [[kind, result[kind + "_message_bytes"], result[kind + "_messages"], result[kind + "_messages_per_s"],
          result[kind + "_mb_per_s"]] for kind in kinds],
    )
    verdict = "meets" if result["meets_target"] else "misses"
    print("trajectory / raw per round: " + ", ".join(f"{ratio:.2f}" for ratio in result["round_ratios"]))
    print(f"trajectory / raw = {result['ratio']:.2f} ({verdict} the target {result['target_ratio']:.2f})")
    print(
        f"raw_split / raw = {result['raw_split_ratio']:.2f} (the same bytes in "
        f"{result['trajectory_frames']} frames, no codec: ZeroMQ's own cost of the framing)"
    )
    if all(result[f"{kind}_cpu_us_per_message"] is not None for kind in kinds):
        _print_cpu_table(result)


def _print_cpu_table(result: dict) -> None:
    print(
        "CPU per message in microseconds (main thread / ZeroMQ threads / others on each side), the "
        "cores the two processes kept busy, and the msg/s the busiest thread group would allow on a "
        "core of its own (an estimate for machines with a core per thread):"
    )
    rows = []
    for kind in ("raw", "trajectory", "raw_split"):
        cpu = result[kind + "_cpu_us_per_message"]
        sides = [" /".join(f"{cpu[f'{side}_{group}']:>4.0f}" for group in THREAD_GROUPS) for side in ("receiver", "sender")]
        cores_busy = f"{result[kind + '_cores_busy']:>6.2f} of {result['cores']}"
        rows.append([kind, *sides, sum(cpu.values()), cores_busy, result[kind + "_core_per_thread_messages_per_s"]])
    print_table(
        [Column("", 12, left=True), Column("receiver", 17), Column("sender", 17), Column("total", 7, ".0f"),
         Column("cores busy", 11), Column("msg/s bound", 12, ",.0f")],
        rows,
    )


if __name__ == "__main__":
    print_report(bench_transport())
