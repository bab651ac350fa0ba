"""Transport benchmark: raw ZeroMQ PUSH->PULL against real Trajectory messages through our sockets.

Both runs use the same process, the same tcp loopback, the same high-water marks and the same way
of polling from trio, so the ratio shows what the codec and the transport layer cost:

- raw: single byte frames of ``trajectory_bytes``, sent and received without copying
  (``copy=False`` on both ends) by the leanest loop we can write;
- trajectory: ``Trajectory`` messages of about the same size (mostly token arrays) through
  ``ZmqPushSender`` -> ``ZmqPullReceiver``: full encode, and a validating decode of every message.

Run: ``python -m longhorizon.launch.bench_transport``. Prints a table, then one line of JSON.
"""

import json
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import trio
import zmq

from longhorizon.common.transport import DEFAULT_TRAJECTORY_HWM, ZmqPullReceiver, ZmqPushSender
from longhorizon.common.wire import Trajectory, encode

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
    return Trajectory(
        trajectory_id="bench-actor-0/episode-000001",
        actor_id="bench-actor-0",
        env_name="textcraft",
        task_id="craft/iron_pickaxe",
        group_id="bench-actor-0/group-0001",
        group_size=8,
        token_ids=rng.integers(0, 49152, tokens, dtype=np.int32),
        loss_mask=loss_mask,
        behaviour_logprobs=behaviour_logprobs,
        policy_versions=policy_versions,
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


async def _transfer(
    send_one: Callable[[], Awaitable[None]],
    receive_one: Callable[[], Awaitable[Any]],
    messages: int,
) -> float:
    """Seconds from the first send until the last of ``messages`` has been received."""
    started = time.perf_counter()

    async def send_all() -> None:
        for _ in range(messages):
            await send_one()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(send_all)
        for _ in range(messages):
            await receive_one()
    return time.perf_counter() - started


async def _measure(
    send_one: Callable[[], Awaitable[None]],
    receive_one: Callable[[], Awaitable[Any]],
    messages: int,
    budget_s: float,
) -> tuple[int, float]:
    """(messages timed, seconds) after a warm-up that also sizes the run to fit ``budget_s``."""
    warmup_seconds = await _transfer(send_one, receive_one, _WARMUP_MESSAGES)
    per_message_s = warmup_seconds / _WARMUP_MESSAGES
    count = max(1, min(messages, int(budget_s / max(per_message_s, 1e-9))))
    return count, await _transfer(send_one, receive_one, count)


async def _measure_raw(
    context: zmq.Context, payload: bytes, messages: int, budget_s: float
) -> tuple[int, float]:
    pull = context.socket(zmq.PULL)
    push = context.socket(zmq.PUSH)
    try:
        for socket in (pull, push):
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.SNDHWM, DEFAULT_TRAJECTORY_HWM)
            socket.setsockopt(zmq.RCVHWM, DEFAULT_TRAJECTORY_HWM)
        pull.bind("tcp://127.0.0.1:0")
        push.connect(pull.getsockopt_string(zmq.LAST_ENDPOINT))
        push_fd, pull_fd = push.getsockopt(zmq.FD), pull.getsockopt(zmq.FD)

        async def send_one() -> None:
            while True:
                try:
                    push.send(payload, zmq.NOBLOCK, copy=False)
                    return
                except zmq.Again:
                    while not push.getsockopt(zmq.EVENTS) & zmq.POLLOUT:
                        await trio.lowlevel.wait_readable(push_fd)

        async def receive_one() -> zmq.Frame:
            while True:
                try:
                    return pull.recv(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    while not pull.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                        await trio.lowlevel.wait_readable(pull_fd)

        return await _measure(send_one, receive_one, messages, budget_s)
    finally:
        push.close(linger=0)
        pull.close(linger=0)


async def _measure_trajectories(
    context: zmq.Context, trajectory: Trajectory, messages: int, budget_s: float
) -> tuple[int, float]:
    receiver = ZmqPullReceiver("tcp://127.0.0.1:0", context=context)
    sender = ZmqPushSender(receiver.address, context=context)
    try:

        async def send_one() -> None:
            await sender.send(trajectory)

        async def receive_one() -> Any:
            received = await receiver.receive()
            assert isinstance(received, Trajectory)
            return received

        return await _measure(send_one, receive_one, messages, budget_s)
    finally:
        sender.close()
        receiver.close()


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
    *, trajectory_bytes: int = 1 << 20, messages: int = 500, seconds_cap: float = 20, rounds: int = 3
) -> dict:
    """Throughput of raw frames and of Trajectory messages over tcp loopback, same run.

    Runs ``rounds`` alternating rounds of each (medians reported), each timed run sized to fit
    its share of ``seconds_cap`` (warm-ups and setup come on top, a second or two).
    """
    if trajectory_bytes < 64 or messages < 1 or seconds_cap <= 0 or rounds < 1:
        raise ValueError("need trajectory_bytes >= 64, messages >= 1, seconds_cap > 0, rounds >= 1")
    trajectory = make_trajectory(trajectory_bytes)
    trajectory_message_bytes = sum(memoryview(frame).nbytes for frame in encode(trajectory))
    payload = bytes(trajectory_bytes)
    budget_s = seconds_cap / (2 * rounds)
    context = zmq.Context.instance()

    async def run_all() -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
        raw_runs, trajectory_runs = [], []
        for _ in range(rounds):
            raw_runs.append(await _measure_raw(context, payload, messages, budget_s))
            trajectory_runs.append(await _measure_trajectories(context, trajectory, messages, budget_s))
        return raw_runs, trajectory_runs

    raw_runs, trajectory_runs = trio.run(run_all)
    # Every round times the same count unless a slow warm-up shrank one; normalise to the smallest.
    raw_count = min(count for count, _ in raw_runs)
    trajectory_count = min(count for count, _ in trajectory_runs)
    raw_seconds = [seconds * raw_count / count for count, seconds in raw_runs]
    trajectory_seconds = [seconds * trajectory_count / count for count, seconds in trajectory_runs]
    result: dict[str, Any] = {"trajectory_bytes": trajectory_bytes, "rounds": rounds}
    result.update(_figures("raw", raw_count, raw_seconds, len(payload)))
    result.update(_figures("trajectory", trajectory_count, trajectory_seconds, trajectory_message_bytes))
    result["trajectory_tokens"] = int(len(trajectory.token_ids))
    result["ratio"] = result["trajectory_mb_per_s"] / result["raw_mb_per_s"]
    result["target_ratio"] = TARGET_RATIO
    result["meets_target"] = result["ratio"] >= TARGET_RATIO
    return result


def print_table(result: dict) -> None:
    """A table for people, then the result as one line of JSON for machines."""
    print(f"transport over tcp loopback, {result['rounds']} rounds, medians")
    print(f"{'':12} {'bytes/msg':>11} {'messages':>9} {'msg/s':>10} {'MB/s':>10}")
    for prefix in ("raw", "trajectory"):
        print(
            f"{prefix:12} {result[prefix + '_message_bytes']:>11,} {result[prefix + '_messages']:>9}"
            f" {result[prefix + '_messages_per_s']:>10.1f} {result[prefix + '_mb_per_s']:>10.1f}"
        )
    verdict = "meets" if result["meets_target"] else "misses"
    print(f"trajectory / raw = {result['ratio']:.2f} ({verdict} the target {result['target_ratio']:.2f})")
    print(json.dumps(result, sort_keys=True))


if __name__ == "__main__":
    print_table(bench_transport())
