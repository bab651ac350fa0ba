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

Run: ``python -m longhorizon.launch.bench_transport``. Prints a table, then one line of JSON.
"""

import json
import multiprocessing
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import trio
import zmq

from longhorizon.common.memory import keep_freed_message_memory, keeping_freed_message_memory
from longhorizon.common.transport import DEFAULT_TRAJECTORY_HWM, ZmqPullReceiver, ZmqPushSender
from longhorizon.common.wire import Trajectory, encode, pack_arrays

TARGET_RATIO = 0.8
"""Trajectory throughput should reach this share of the raw baseline."""

_BYTES_PER_TOKEN = 4 + 1 + 4 + 4  # token id, loss mask, behaviour log-prob, policy version
_WARMUP_MESSAGES = 10


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
    # Laid out in one buffer, as the actor builds its trajectories (see wire.pack_arrays).
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
    kind: str, address: str, count: int, trajectory_bytes: int, received, keep_freed_memory: bool
) -> None:
    """Child process: connect like an actor does and send ``count`` messages as fast as possible.

    Sockets close with linger 0 (as actors' do), which would drop what is still queued: the
    child waits for the receiver to say it has everything before closing."""
    if keep_freed_memory:
        keep_freed_message_memory()
    context = zmq.Context()
    trajectory = make_trajectory(trajectory_bytes)
    if kind == "trajectory":
        sender = ZmqPushSender(address, context=context)

        async def send_all() -> None:
            for _ in range(count):
                await sender.send(trajectory)

        trio.run(send_all)
        received.wait(timeout=120)
        sender.close()
    else:
        frames = [bytes(trajectory_bytes)] if kind == "raw" else [
            bytes(memoryview(frame).nbytes) for frame in encode(trajectory)
        ]
        push = context.socket(zmq.PUSH)
        push.setsockopt(zmq.SNDHWM, DEFAULT_TRAJECTORY_HWM)
        push.connect(address)
        fd = push.getsockopt(zmq.FD)

        async def send_all() -> None:
            # The leanest trio-polled loop: the same I/O model as our sockets, without them.
            for _ in range(count):
                while True:
                    try:
                        push.send_multipart(frames, zmq.NOBLOCK, copy=False)
                        break
                    except zmq.Again:
                        while not push.getsockopt(zmq.EVENTS) & zmq.POLLOUT:
                            await trio.lowlevel.wait_readable(fd)

        trio.run(send_all)
        received.wait(timeout=120)
        push.close(linger=0)
    context.term()


async def _receive_raw(address_holder: list[str], count: int, started: trio.Event) -> float:
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


async def _receive_trajectories(address_holder: list[str], count: int, started: trio.Event) -> float:
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


async def _timed(receive_one: Callable[[], Awaitable[None]], count: int) -> float:
    """Seconds to receive ``count`` messages after ``_WARMUP_MESSAGES`` untimed ones."""
    for _ in range(_WARMUP_MESSAGES):
        await receive_one()
    started = time.perf_counter()
    for _ in range(count):
        await receive_one()
    return time.perf_counter() - started


def _measure(kind: str, count: int, trajectory_bytes: int, keep_freed_memory: bool) -> float:
    """Receive here (as the learner does) from a sender in another process (as an actor is).

    The allocator setting of this process is the caller's (see ``bench_transport``)."""
    context = multiprocessing.get_context("spawn")
    received = context.Event()

    async def run() -> float:
        address: list[str] = []
        started = trio.Event()
        receive = _receive_trajectories if kind == "trajectory" else _receive_raw
        async with trio.open_nursery() as nursery:
            result: list[float] = []

            async def receiving() -> None:
                result.append(await receive(address, count, started))

            nursery.start_soon(receiving)
            await started.wait()
            child = context.Process(
                target=_sender_process,
                args=(kind, address[0], count + _WARMUP_MESSAGES, trajectory_bytes, received, keep_freed_memory),
            )
            child.start()
        received.set()
        await trio.to_thread.run_sync(child.join)
        return result[0]

    return trio.run(run)


def _figures(prefix: str, count: int, seconds: list[float], message_bytes: int) -> dict[str, Any]:
    median_seconds = statistics.median(seconds)
    return {
        f"{prefix}_message_bytes": message_bytes,
        f"{prefix}_messages": count,
        f"{prefix}_seconds": median_seconds,
        f"{prefix}_messages_per_s": count / median_seconds,
        f"{prefix}_mb_per_s": count * message_bytes / median_seconds / 1e6,
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
    seconds: dict[str, list[float]] = {kind: [] for kind in kinds}
    for _ in range(rounds):
        for kind in kinds:
            seconds[kind].append(_measure(kind, messages, trajectory_bytes, keep_freed_memory))
    message_bytes = {"raw": trajectory_bytes, "trajectory": sum(frame_sizes), "raw_split": sum(frame_sizes)}
    result: dict[str, Any] = {
        "trajectory_bytes": trajectory_bytes, "rounds": rounds, "keep_freed_memory": keep_freed_memory,
    }
    for kind in kinds:
        result.update(_figures(kind, messages, seconds[kind], message_bytes[kind]))
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


def print_table(result: dict) -> None:
    """A table for people, then the result as one line of JSON for machines."""
    allocator = "freed buffers kept for reuse" if result["keep_freed_memory"] else "glibc defaults"
    print(f"transport over tcp loopback, {result['rounds']} rounds, medians; allocator on both sides: {allocator}")
    print(f"{'':12} {'bytes/msg':>11} {'messages':>9} {'msg/s':>10} {'MB/s':>10}")
    for prefix in ("raw", "trajectory", "raw_split"):
        print(
            f"{prefix:12} {result[prefix + '_message_bytes']:>11,} {result[prefix + '_messages']:>9}"
            f" {result[prefix + '_messages_per_s']:>10.1f} {result[prefix + '_mb_per_s']:>10.1f}"
        )
    verdict = "meets" if result["meets_target"] else "misses"
    print("trajectory / raw per round: " + ", ".join(f"{ratio:.2f}" for ratio in result["round_ratios"]))
    print(f"trajectory / raw = {result['ratio']:.2f} ({verdict} the target {result['target_ratio']:.2f})")
    print(
        f"raw_split / raw = {result['raw_split_ratio']:.2f} (the same bytes in "
        f"{result['trajectory_frames']} frames, no codec: ZeroMQ's own cost of the framing)"
    )
    print(json.dumps(result, sort_keys=True))


if __name__ == "__main__":
    print_table(bench_transport())
