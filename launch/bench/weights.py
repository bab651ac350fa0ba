"""`longhorizon bench weights`: seconds per weight update, learner to actor, for each weights transport.

One update, as a user meets it, through the production classes: this process plays the learner
and builds and publishes the update with the transport's `WeightsPublisher` (learner/weights/);
the update crosses our real PUB/SUB broadcast sockets (`common/transport.py`) over tcp 127.0.0.1
to a receiver in another process, which turns it into a state dict with `WeightsReceiver`
(actor/weights.py) and loads it the way the hf engine does (`load_state_into`). The clock runs from the start of the build until the receiver says it has
loaded the update; the receiver also reports when the update arrived and when it was loaded
(both processes read the same monotonic clock), which splits the time into build (and send),
transfer and load.

Transports: every name the registry knows (`learner.weights.TRANSPORTS`; the built-ins by
default). `inline` sends the tensors as ZeroMQ frames (bfloat16 as its 2-byte patterns); `path`
writes a safetensors folder and sends its location (here the receiver reads it back from the page
cache of the same machine; on a shared filesystem add its read rate); `collective` announces the
version on the socket (a learner uses the actor's control socket) and streams the tensors in
128 MiB buckets over a gloo pair group (learner/weight_sync.py, actor/weights.py); its build copies
the weights into the buckets and takes their CRC32, which the receiver checks.

Payloads:
- a model folder (`--model`, SmolLM2-135M-Instruct by default, as stored: fp32); the receiver
  loads that folder too and zeroes it, then loads each update into it with `load_state_into`;
- a synthetic state dict of `--synthetic-params` parameters in bfloat16, shaped like a real
  decoder (Qwen2.5-1.5B's proportions: embeddings, 28 layers of attention and MLP matrices,
  norms); the receiver loads it into preallocated zeroed tensors, inline tensor by tensor so
  that the received frames are freed as they are loaded.

After the last update the receiver's tensors are hashed and compared with the sender's
(`identical`: bit for bit). Beside the transports the table gives the machine's limits: a plain
memcpy, and raw ZeroMQ frames over tcp loopback between the two processes (no codec, nothing
loaded), so each transport's GB/s can be read against them. The loopback is measured again after
every run, and each run is read against the mean of the rates just before and after it: on a
machine shared with other work the rate moves by several times within minutes.

Times are the median of `--repeats` updates after `--warmup` (3) untimed ones: by the fourth
version every transport writes into memory kept from an earlier update (inline's and the
collective's copies, the collective receiver's buffers, the path folder replacing its oldest), as
in a long run. `first s` gives the first update of each run, with new memory everywhere.

Both processes keep freed message buffers for reuse, as the learner and actors do
(`common/memory.py`). Each run's peak resident memory is reported for both processes.

Run: `longhorizon bench weights` (SmolLM2 and 1.5B synthetic; `--synthetic-params 0` or
`--no-model` skips one). A table for people, then one line of JSON.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import math
import os
import select
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from longhorizon.common.args import positive_int, parse_args
from longhorizon.launch.bench.memory import peak_rss_bytes, reset_peak_rss
from longhorizon.launch.bench.tables import BenchStopped, Column, parsed, print_table, run_as_command
from longhorizon.common.models import load_causal_lm, resolve_model_path, load_state_into
from longhorizon.learner.weights import MESSAGE_FORMS, TRANSPORTS, PublisherContext, build_publisher, publisher_class
from longhorizon.actor.weights import WeightsReceiver
from longhorizon.common.transport import ZmqSubscriber, ZmqPublisher
from longhorizon.common.wire import CollectiveWeights, HorizonUpdate, WeightsUpdate
from longhorizon.common.processes import die_with_parent, remove_tied_folder, tied_folder
from longhorizon.common.memory import keep_freed_message_memory
from longhorizon.common.collective import copy_into

PROG = "longhorizon bench weights"

_EVENT_PREFIX = "@bench-weights "
"""Marks the receiver's event lines on its stdout, so stray prints from libraries are not read as events."""

_MB = 1e6
_GB = 1e9

# The synthetic decoder: Qwen2.5-1.5B's shapes at hidden size 1536, scaled with the hidden size.
_REFERENCE_HIDDEN = 1536
_REFERENCE_VOCABULARY = 151936
_REFERENCE_INTERMEDIATE = 8960
_REFERENCE_KEY_VALUE = 256
_SYNTHETIC_LAYERS = 28


# ---------------------------------------------------------------------------------------------
# Payloads
# ---------------------------------------------------------------------------------------------


def _multiple_of_64(value: float) -> int:
    return max(64, int(round(value / 64)) * 64)


def _decoder_shapes(hidden: int) -> dict[str, tuple[int, ...]]:
    """Tensor shapes of a Qwen2-style decoder with tied embeddings at this hidden size."""
    scale = hidden / _REFERENCE_HIDDEN
    vocabulary = _multiple_of_64(_REFERENCE_VOCABULARY * scale)
    intermediate = _multiple_of_64(_REFERENCE_INTERMEDIATE * scale)
    key_value = _multiple_of_64(_REFERENCE_KEY_VALUE * scale)
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocabulary, hidden)}
    for layer in range(_SYNTHETIC_LAYERS):
        prefix = f"model.layers.{layer}"
        shapes.update({
            f"{prefix}.input_layernorm.weight": (hidden,),
            f"{prefix}.self_attn.q_proj.weight": (hidden, hidden),
            f"{prefix}.self_attn.q_proj.bias": (hidden,),
            f"{prefix}.self_attn.k_proj.weight": (key_value, hidden),
            f"{prefix}.self_attn.k_proj.bias": (key_value,),
            f"{prefix}.self_attn.v_proj.weight": (key_value, hidden),
            f"{prefix}.self_attn.v_proj.bias": (key_value,),
            f"{prefix}.self_attn.o_proj.weight": (hidden, hidden),
            f"{prefix}.post_attention_layernorm.weight": (hidden,),
            f"{prefix}.mlp.gate_proj.weight": (intermediate, hidden),
            f"{prefix}.mlp.up_proj.weight": (intermediate, hidden),
            f"{prefix}.mlp.down_proj.weight": (hidden, intermediate),
        })
    shapes["model.norm.weight"] = (hidden,)
    return shapes


def synthetic_shapes(target_params: float) -> dict[str, tuple[int, ...]]:
    """The decoder (hidden size a multiple of 64) whose parameter count is closest to the target.

    1.5e9 gives Qwen2.5-1.5B's own shapes (hidden 1536, 1.54e9 parameters); the smallest is
    hidden 64 (about 2.9e6 parameters).
    """
    best, best_gap = _decoder_shapes(64), math.inf
    for hidden in range(64, 16384 + 1, 64):
        shapes = _decoder_shapes(hidden)
        count = sum(math.prod(shape) for shape in shapes.values())
        gap = abs(count - target_params)
        if gap < best_gap:
            best, best_gap = shapes, gap
        if count > target_params:  # counts grow with the hidden size
            break
    return best


def make_synthetic_state(shapes: dict[str, tuple[int, ...]], *, seed: int = 0) -> dict[str, Any]:
    """bfloat16 tensors of these shapes filled from one random block of 1 Mi values.

    Drawing 1.5e9 random numbers would take longer than the benchmark; copying a random block
    (from a different place in it for each tensor) costs about a memcpy and still gives every
    tensor non-trivial contents, so a lost or misplaced tensor shows in the final comparison.
    """
    import torch

    generator = torch.Generator().manual_seed(seed)
    block_size = 1 << 20
    block = torch.empty(block_size).uniform_(-0.05, 0.05, generator=generator).to(torch.bfloat16)
    doubled = torch.cat([block, block])  # a window of block_size starting anywhere in the block
    state = {}
    for index, (name, shape) in enumerate(shapes.items()):
        tensor = torch.empty(shape, dtype=torch.bfloat16)
        flat = tensor.view(-1)
        start = (index * 7919) % block_size
        for position in range(0, flat.numel(), block_size):
            piece = min(block_size, flat.numel() - position)
            flat[position:position + piece].copy_(doubled[start:start + piece])
        state[name] = tensor
    return state


def state_digest(state: dict[str, Any]) -> str:
    """SHA-256 over names, dtypes, shapes and raw bytes of a state dict, in name order."""
    import torch

    digest = hashlib.sha256()
    for name in sorted(state):
        tensor = state[name].detach().to("cpu").contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))
    return digest.hexdigest()


class StateDictSource:
    """A bare state dict where a model is expected (only state_dict() is called)."""

    def __init__(self, tensors: dict[str, Any]) -> None:
        self.tensors = tensors

    def state_dict(self) -> dict[str, Any]:
        return self.tensors


@dataclass(frozen=True)
class Payload:
    """What one run moves: a model folder or a synthetic state dict (as sent to the receiver)."""

    kind: str
    """`model` or `synthetic`."""
    label: str
    folder: str = ""
    synthetic_params: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "label": self.label, "folder": self.folder,
                "synthetic_params": self.synthetic_params}


def build_source(payload: Payload):
    """The sender's side of a payload: a model (as loaded for training) or a StateDictSource."""
    if payload.kind == "model":
        return load_causal_lm(payload.folder).eval()
    return StateDictSource(make_synthetic_state(synthetic_shapes(payload.synthetic_params)))


class ModelTarget:
    """The model folder loaded as the hf engine loads it, every parameter zeroed so that a missing
    tensor shows; updates go in as HFEngine.update_weights puts them."""

    def __init__(self, folder: str) -> None:
        import torch


        self.model = load_causal_lm(folder).eval()
        with torch.no_grad():
            for parameter in self.model.parameters():
                parameter.zero_()

    def load(self, update, receiver) -> None:
        load_state_into(self.model, receiver.receive(update))

    def state(self) -> dict[str, Any]:
        from longhorizon.learner.broadcast import unique_state_dict

        return unique_state_dict(self.model)


class TensorsTarget:
    """Preallocated zeroed bfloat16 tensors matching the synthetic state dict."""

    def __init__(self, synthetic_params: float) -> None:
        import torch

        self.tensors = {
            name: torch.zeros(shape, dtype=torch.bfloat16)
            for name, shape in synthetic_shapes(synthetic_params).items()
        }

    def load(self, update, receiver) -> None:
        received = update.tensors if isinstance(update, WeightsUpdate) else None
        if received is None:
            self._copy_in(receiver.receive(update))
            return
        if set(received) != set(self.tensors):
            raise ValueError(f"the update's tensors do not match: {sorted(set(received) ^ set(self.tensors))[:5]}")
        # Tensor by tensor through the same receiver, each received frame dropped once loaded.
        bfloat16 = set(update.bfloat16_tensors)
        for name in sorted(received, key=lambda tensor_name: received[tensor_name].nbytes):
            one = WeightsUpdate(version=update.version, tensors={name: received.pop(name)},
                                bfloat16_tensors=[name] if name in bfloat16 else [])
            self._copy_in(receiver.receive(one))

    def _copy_in(self, state: dict[str, Any]) -> None:
        unknown = set(state) - set(self.tensors)
        if unknown:
            raise ValueError(f"unexpected tensors in the update: {sorted(unknown)[:5]}")
        for name, tensor in state.items():
            target = self.tensors[name]
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(f"{name}: shape {tuple(tensor.shape)} in the update, {tuple(target.shape)} here")
            copy_into(target, tensor)

    def state(self) -> dict[str, Any]:
        return self.tensors


def make_target(payload: dict[str, Any]):
    if payload["kind"] == "model":
        return ModelTarget(payload["folder"])
    return TensorsTarget(payload["synthetic_params"])


# ---------------------------------------------------------------------------------------------
# Transports: the production publishers, driven as the learner worker drives them
# ---------------------------------------------------------------------------------------------

_BENCH_PEER = "bench-receiver"


def transport_names() -> list[str]:
    """What `--transports` accepts: every transport the registry knows (plug-ins too)."""
    return TRANSPORTS.names()


def default_transports() -> tuple[str, ...]:
    builtins = TRANSPORTS.builtin_names()
    return tuple(sorted(builtins, key=lambda name: MESSAGE_FORMS.index(name) if name in MESSAGE_FORMS else 99))


@dataclass(frozen=True)
class Sent:
    """What the learner's side reports of one update it sent."""

    built_at: float
    """time.monotonic() when the update was built and handed to the transport."""
    moved_bytes: int
    """Tensor bytes the transport moves for it (frames on the socket, files written, buckets)."""


class BenchSender:
    """The learner's side of one run: the transport's publisher, with our PUB socket as the
    broadcast socket and as the control channel of per-actor transports (a learner uses the
    actor's control socket), and this benchmark's receiver as its one actor."""

    def __init__(self, transport: str, zmq_publisher, weights_dir: Path, timeout_s: float) -> None:
        import trio


        self.zmq_publisher = zmq_publisher

        def announce(actor_id: str, message, timeout_s: float) -> None:  # from the transport's own threads
            trio.run(zmq_publisher.send, message)  # a PUB send never waits

        # The collective's settings here (gloo on this machine, the benchmark's own timeout), given
        # to a transport that declares those keys: one that declares none takes none.
        declared = publisher_class(transport).Options
        wanted = {"backend": "gloo", "timeout_s": timeout_s, "bucket_mb": 128}
        options = {key: value for key, value in wanted.items() if declared is not None and key in declared.model_fields}
        self.publisher = build_publisher(transport, PublisherContext(
            weights_dir=weights_dir, host="127.0.0.1", device="cpu", options=options, announce=announce,
        ))
        self.publisher.actor_joined(_BENCH_PEER, None)

    def send(self, source, version: int) -> Sent:
        import trio

        from longhorizon.learner.broadcast import unique_state_dict

        built = self.publisher.build(unique_state_dict(source), version)
        built_at = time.monotonic()
        # The publisher's send is async (a trio socket); nothing else here needs an event loop,
        # so each send runs in a short trio run of its own. A PUB send never waits.
        trio.run(self.publisher.publish, built, self.zmq_publisher)
        return Sent(built_at=built_at, moved_bytes=self.publisher.payload_bytes(built))

    def close(self) -> None:
        self.publisher.close()


# ---------------------------------------------------------------------------------------------
# The receiving process
# ---------------------------------------------------------------------------------------------


def _emit(event: str, **fields: Any) -> None:
    print(_EVENT_PREFIX + json.dumps({"event": event, **fields}), flush=True)


async def _receiver_main(address: str, threads: int) -> None:
    """Receive weights as an actor does; commands arrive on stdin, events leave on stdout."""
    import torch
    import trio
    import zmq


    torch.set_num_threads(threads)
    # One receiver for every run, as an engine holds one (a collective's group is kept in it).
    weights = WeightsReceiver()
    context = zmq.Context()
    subscriber = ZmqSubscriber(address, context=context)
    try:
        _emit("connected")
        # A subscriber only sees what is published after its subscription reached the publisher:
        # the sender publishes probes until one arrives.
        while not isinstance(await subscriber.receive(), HorizonUpdate):
            pass
        _emit("ready")
        while True:
            line = await trio.to_thread.run_sync(sys.stdin.readline)
            command = json.loads(line) if line.strip() else {"do": "exit"}
            if command["do"] == "exit":
                return
            if command["do"] == "loopback":
                _receive_raw_frames(context, command)
                continue
            if command["do"] != "prepare":
                raise ValueError(f"unknown command {command['do']!r}")
            target = make_target(command["payload"])
            gc.collect()
            reset_peak_rss()
            _emit("prepared")
            loaded = 0
            while loaded < command["updates"]:
                message = await subscriber.receive()
                if not isinstance(message, (WeightsUpdate, CollectiveWeights)):
                    continue  # a late probe
                received_at = time.monotonic()
                target.load(message, weights)
                version = message.version
                del message
                loaded_at = time.monotonic()
                loaded += 1
                _emit("loaded", version=version, received_at=received_at, loaded_at=loaded_at)
            _emit("finished", digest=state_digest(target.state()), peak_rss_bytes=peak_rss_bytes())
            del target
            gc.collect()
    finally:
        subscriber.close()
        context.term()


def _receive_raw_frames(context, command: dict[str, Any]) -> None:
    """The loopback limit's receiving end: plain ZeroMQ, frames received without a copy and dropped."""
    import zmq

    pull = context.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    pull.connect(command["address"])
    try:
        for _ in range(command["rounds"]):
            for _ in range(command["messages"]):
                pull.recv(copy=False)
            _emit("round")
    finally:
        pull.close(linger=0)


def run_receiver(address: str, threads: int, parent_pid: int) -> int:
    die_with_parent(parent_pid=parent_pid)  # a receiver never outlives the benchmark

    keep_freed_message_memory()
    import trio

    try:
        trio.run(_receiver_main, address, threads)
    except Exception as error:
        traceback.print_exc()
        _emit("error", message=f"{type(error).__name__}: {error}")
        return 1
    return 0


class ReceiverProcess:
    """The benchmark's handle on its receiving process: commands to its stdin, events from its stdout."""

    def __init__(self, address: str, threads: int) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "longhorizon.launch.bench.weights", "--receiver", address,
             "--threads", str(threads), "--parent-pid", str(os.getpid())],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        )
        self._buffer = b""

    def command(self, do: str, **fields: Any) -> None:
        self.process.stdin.write((json.dumps({"do": do, **fields}) + "\n").encode())
        self.process.stdin.flush()

    def expect(self, event: str, timeout_s: float) -> dict[str, Any]:
        """The next event, which must be `event`; raises RuntimeError if the receiver failed or
        exited, TimeoutError if nothing came within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            line = self._next_line(deadline, event)
            if not line.startswith(_EVENT_PREFIX):
                sys.stderr.write(line + "\n")  # a library's print, not ours
                continue
            record = json.loads(line[len(_EVENT_PREFIX):])
            if record["event"] == "error":
                raise RuntimeError(f"the receiver failed: {record['message']}")
            if record["event"] != event:
                raise RuntimeError(f"the receiver said {record['event']!r} where {event!r} was expected")
            return record

    def _next_line(self, deadline: float, event: str) -> str:
        descriptor = self.process.stdout.fileno()
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"the receiver did not say {event!r} in time (see --timeout-s)")
            ready, _, _ = select.select([descriptor], [], [], remaining)
            if not ready:
                continue
            chunk = os.read(descriptor, 65536)
            if not chunk:
                code = self.process.wait(timeout=10)
                raise RuntimeError(f"the receiver exited with code {code} (its error is above)")
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line.decode("utf-8", errors="replace")

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                self.command("exit")
                self.process.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait()


# ---------------------------------------------------------------------------------------------
# The sending side: limits and runs
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    """What one benchmark run does (the command's options)."""

    payloads: tuple[Payload, ...]
    transports: tuple[str, ...]
    repeats: int = 3
    warmup: int = 3
    loopback_frame_bytes: int = 64 << 20
    loopback_round_bytes: int = 1 << 30
    loopback_rounds: int = 3
    memcpy_bytes: int = 256 << 20
    weights_dir: str | None = None
    threads: int = 2
    timeout_s: float = 600.0


def memcpy_rates(size: int, repeats: int = 5) -> tuple[float, float]:
    """Bytes per second of a plain copy (median): into a buffer already in memory, and into a new
    one, whose pages the kernel faults in (zeroed) as the copy first touches them, as it does for
    every new tensor or frame larger than the allocator keeps for reuse."""
    import numpy as np

    source = np.ones(size, np.uint8)
    destination = np.zeros(size, np.uint8)
    np.copyto(destination, source)
    into_memory, into_new_pages = [], []
    for _ in range(repeats):
        started = time.perf_counter()
        np.copyto(destination, source)
        into_memory.append(time.perf_counter() - started)
        started = time.perf_counter()
        fresh = np.empty(size, np.uint8)
        np.copyto(fresh, source)
        into_new_pages.append(time.perf_counter() - started)
        del fresh
    return size / statistics.median(into_memory), size / statistics.median(into_new_pages)


def loopback_rate(context, receiver: ReceiverProcess, settings: Settings) -> float:
    """Bytes per second of raw ZeroMQ frames over tcp 127.0.0.1 to the receiver (median of rounds
    after one warm-up round), sent without a copy from one buffer, received without a copy."""
    import numpy as np
    import zmq

    frame = np.ones(settings.loopback_frame_bytes, np.uint8)
    messages = max(1, settings.loopback_round_bytes // settings.loopback_frame_bytes)
    push = context.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.bind("tcp://127.0.0.1:0")
    try:
        receiver.command("loopback", address=push.getsockopt_string(zmq.LAST_ENDPOINT),
                         messages=messages, rounds=settings.loopback_rounds + 1)
        times = []
        for _ in range(settings.loopback_rounds + 1):
            started = time.monotonic()
            for _ in range(messages):
                push.send(frame, copy=False)
            receiver.expect("round", settings.timeout_s)
            times.append(time.monotonic() - started)
    finally:
        push.close(linger=0)
    return messages * settings.loopback_frame_bytes / statistics.median(times[1:])


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (None where the kernel does not say)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_memory_for(label: str, state_bytes: int) -> None:
    """Refuse a payload that would not fit beside what the machine already holds.

    With the source built, a run still needs the receiver's copy of the weights, the update in
    flight, which every transport moves at the state's own size, and the copy inline and the
    collective keep between updates to write the next one into.
    """
    available = available_memory_bytes()
    if available is None:
        return
    needed = state_bytes * 3 + (1 << 30)  # plus a margin for the processes themselves
    if needed > available:
        raise RuntimeError(
            f"{label}: about {needed / _GB:.1f} GB more memory needed, {available / _GB:.1f} GB available; "
            "lower --synthetic-params, or stop other work on this machine"
        )


def run_transport(
    transport_name: str, payload: Payload, source, source_digest: str, state_bytes: int, params: int,
    dtype: str, publisher, receiver: ReceiverProcess, settings: Settings,
    progress: Callable[[str], None],
) -> dict[str, Any]:
    """Warm-up and timed updates of one payload over one transport; the receiver's tensors are
    compared with the source's after the last."""
    updates = settings.warmup + settings.repeats
    receiver.command("prepare", payload=payload.as_dict(), transport=transport_name, updates=updates)
    receiver.expect("prepared", settings.timeout_s)
    gc.collect()
    reset_peak_rss()
    weights_dir = Path(tied_folder("longhorizon-bench-weights-", settings.weights_dir))
    sender = BenchSender(transport_name, publisher, weights_dir, settings.timeout_s)
    timings = []
    first_s = math.nan
    moved_bytes = 0
    try:
        for index in range(updates):
            version = index + 1
            started = time.monotonic()
            sent = sender.send(source, version)
            moved_bytes = sent.moved_bytes
            loaded = receiver.expect("loaded", settings.timeout_s)
            finished = time.monotonic()
            if loaded["version"] != version:
                raise RuntimeError(f"the receiver loaded version {loaded['version']}, {version} was sent")
            timing = {
                "seconds": finished - started,
                "build_s": sent.built_at - started,
                "transfer_s": loaded["received_at"] - sent.built_at,
                "load_s": loaded["loaded_at"] - loaded["received_at"],
            }
            if index == 0:
                first_s = timing["seconds"]
            if index >= settings.warmup:
                timings.append(timing)
            progress(f"{payload.label} {transport_name} update {version}/{updates}: {timing['seconds']:.2f} s")
        finished_event = receiver.expect("finished", settings.timeout_s)
    finally:
        sender.close()
        remove_tied_folder(weights_dir)
    seconds = statistics.median(t["seconds"] for t in timings)
    sender_peak = peak_rss_bytes()
    receiver_peak = finished_event.get("peak_rss_bytes")
    return {
        "payload": payload.label,
        "transport": transport_name,
        "params": params,
        "dtype": dtype,
        "state_bytes": state_bytes,
        "moved_bytes": moved_bytes,
        "seconds": seconds,
        "seconds_each": [t["seconds"] for t in timings],
        "first_s": first_s,
        "build_s": statistics.median(t["build_s"] for t in timings),
        "transfer_s": statistics.median(t["transfer_s"] for t in timings),
        "load_s": statistics.median(t["load_s"] for t in timings),
        "gb_per_s": moved_bytes / seconds / _GB,
        "identical": finished_event["digest"] == source_digest,
        "sender_peak_rss_mb": None if sender_peak is None else sender_peak / _MB,
        "receiver_peak_rss_mb": None if receiver_peak is None else receiver_peak / _MB,
    }


def bench_weights(
    settings: Settings, progress: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
) -> dict[str, Any]:
    """Every payload over every transport, with the machine's limits; returns the figures."""
    import torch
    import trio
    import zmq
    from longhorizon.learner.broadcast import unique_state_dict

    known = transport_names()
    unknown = [name for name in settings.transports if name not in known]
    if unknown:
        raise ValueError(f"unknown transport {unknown[0]!r}; valid: {', '.join(known)}")
    keep_freed_message_memory()  # as the learner process does
    torch.set_num_threads(settings.threads)
    memcpy, memcpy_new_pages = memcpy_rates(settings.memcpy_bytes)
    context = zmq.Context()
    publisher = ZmqPublisher("tcp://127.0.0.1:0", context=context)
    receiver = ReceiverProcess(publisher.address, settings.threads)
    runs = []
    try:
        receiver.expect("connected", settings.timeout_s)
        deadline = time.monotonic() + 60
        probe = HorizonUpdate(horizon_cap=1, stage=0, learner_step=0)
        while True:
            trio.run(publisher.send, probe)
            try:
                receiver.expect("ready", 0.1)
                break
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise TimeoutError("the receiver's subscription did not reach the publisher in 60 s") from None
        loopback = loopback_rate(context, receiver, settings)
        loopbacks = [loopback]
        progress(f"limits: memcpy {memcpy / _GB:.2f} GB/s, raw ZeroMQ frames over loopback {loopback / _GB:.2f} GB/s")
        for payload in settings.payloads:
            progress(f"preparing {payload.label}")
            source = build_source(payload)
            state = unique_state_dict(source)
            source_digest = state_digest(state)
            params = sum(tensor.numel() for tensor in state.values())
            state_bytes = sum(tensor.numel() * tensor.element_size() for tensor in state.values())
            dtype = ", ".join(sorted({str(tensor.dtype).removeprefix("torch.") for tensor in state.values()}))
            del state
            check_memory_for(payload.label, state_bytes)
            for name in settings.transports:
                run = run_transport(name, payload, source, source_digest, state_bytes, params, dtype,
                                    publisher, receiver, settings, progress)
                # The machine's rate moves with the load on it (other work shares the cores): each
                # run is read against the loopback measured just before and just after it.
                before, after = loopbacks[-1], loopback_rate(context, receiver, settings)
                loopbacks.append(after)
                run["loopback_gb_per_s"] = (before + after) / 2 / _GB
                run["share_of_loopback"] = run["gb_per_s"] / run["loopback_gb_per_s"]
                progress(f"{payload.label} {name}: {run['share_of_loopback']:.0%} of loopback "
                         f"({before / _GB:.2f} GB/s before, {after / _GB:.2f} after)")
                runs.append(run)
            del source
            gc.collect()
    finally:
        receiver.close()
        publisher.close()
        context.term()
    return {
        "benchmark": "weights",
        "repeats": settings.repeats,
        "warmup": settings.warmup,
        "threads": settings.threads,
        "memcpy_gb_per_s": memcpy / _GB,
        "memcpy_new_pages_gb_per_s": memcpy_new_pages / _GB,
        "loopback_gb_per_s": loopback / _GB,
        "loopback_range_gb_per_s": [min(loopbacks) / _GB, max(loopbacks) / _GB],
        "loopback_frame_bytes": settings.loopback_frame_bytes,
        "runs": runs,
        "all_identical": all(run["identical"] for run in runs),
    }


_RUN_COLUMNS = (
    Column("payload", 24, left=True), Column("transport", 9, left=True), Column("params", 8), Column("dtype", 8),
    Column("moved MB", 9, ".1f"), Column("s/update", 9, ".3f"), Column("build s", 8, ".3f"),
    Column("send s", 7, ".3f"), Column("load s", 7, ".3f"), Column("first s", 8, ".3f"), Column("GB/s", 6, ".2f"),
    Column("loopback", 9, ".2f"), Column("of loopback", 12, ".0%"), Column("identical", 9), Column("peak MB send/recv", 18),
)


def print_report(result: dict[str, Any]) -> None:
    """A table for people (the command prints the result as JSON after it)."""
    print(
        f"weights updates to a receiver in another process over tcp 127.0.0.1: median of "
        f"{result['repeats']} after {result['warmup']} warm-up, {result['threads']} torch threads"
    )
    print(
        f"limits: memcpy {result['memcpy_gb_per_s']:.2f} GB/s ({result['memcpy_new_pages_gb_per_s']:.2f} into "
        f"new pages); raw ZeroMQ frames of "
        f"{result['loopback_frame_bytes'] >> 20} MiB over loopback {result['loopback_gb_per_s']:.2f} GB/s at the "
        f"start, {result['loopback_range_gb_per_s'][0]:.2f}-{result['loopback_range_gb_per_s'][1]:.2f} over the "
        f"runs (each run's: the mean of the rates measured just before and after it)"
    )
    rows = []
    for run in result["runs"]:
        peaks = "/".join("-" if run[key] is None else f"{run[key]:.0f}"
                         for key in ("sender_peak_rss_mb", "receiver_peak_rss_mb"))
        rows.append((run["payload"], run["transport"], f"{run['params'] / 1e6:.1f}M", run["dtype"],
                     run["moved_bytes"] / _MB, run["seconds"], run["build_s"], run["transfer_s"], run["load_s"],
                     run["first_s"], run["gb_per_s"], run["loopback_gb_per_s"], run["share_of_loopback"], "yes" if run["identical"] else "NO", peaks))
    print_table(_RUN_COLUMNS, rows)
    print("moved: inline, the tensors' frames on the socket (bfloat16 as 2 bytes a value); path, the "
          "safetensors file (the socket carries its location); collective, the buckets over the gloo "
          "group. GB/s = moved / s per update; of loopback: GB/s over the run's loopback GB/s. first s: the run's first update (new memory everywhere, "
          "not in the median).")


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number: {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text!r}")
    return value


def _transport_list(text: str) -> tuple[str, ...]:
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    known = transport_names()
    unknown = [name for name in names if name not in known]
    if not names or unknown:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated transports from {', '.join(known)}, got {text!r}"
        )
    return names


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="longhorizon bench weights", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="model folder or name (default %(default)s)")
    parser.add_argument("--model-cache", default="", help="where converted models live (default: models/ in the user's cache)")
    parser.add_argument("--no-model", action="store_true", help="skip the model payload")
    parser.add_argument("--synthetic-params", type=_non_negative_float, default=1.5e9,
                        help="parameters of the synthetic bfloat16 state dict; 0 skips it (default %(default)g)")
    parser.add_argument("--transports", type=_transport_list, default=default_transports(),
                        help=f"comma-separated, from {', '.join(transport_names())} (default the built-ins)")
    parser.add_argument("--repeats", type=positive_int, default=3, help="timed updates per run (default %(default)s)")
    parser.add_argument("--warmup", type=int, default=3,
                        help="untimed updates first (default %(default)s: from the fourth version on, the path "
                             "transport replaces its oldest folder and every transport writes into memory kept "
                             "from an earlier update, as in a long run)")
    parser.add_argument("--loopback-frame-mib", type=positive_int, default=64,
                        help="frame size of the raw loopback limit, MiB (default %(default)s)")
    parser.add_argument("--loopback-mib", type=positive_int, default=1024,
                        help="MiB sent per round of the raw loopback limit (default %(default)s)")
    parser.add_argument("--memcpy-mib", type=positive_int, default=256, help="memcpy buffer, MiB (default %(default)s)")
    parser.add_argument("--weights-dir", default=None,
                        help="folder under which the path transport writes (default: the system's temporary folder)")
    parser.add_argument("--threads", type=positive_int, default=2, help="torch CPU threads per process (default %(default)s)")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="longest wait for the receiver (default %(default)s)")
    parser.add_argument("--receiver", default=None, help=argparse.SUPPRESS)  # the receiving process: the publisher's address
    parser.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)
    return parser


def _settings_from(args: argparse.Namespace) -> Settings:
    payloads = []
    if not args.no_model:
        folder = resolve_model_path(args.model, args.model_cache)
        payloads.append(Payload(kind="model", label=Path(args.model).name, folder=str(folder)))
    if args.synthetic_params > 0:
        count = sum(math.prod(shape) for shape in synthetic_shapes(args.synthetic_params).values())
        size = f"{count / 1e9:.2f}B" if count >= 1e9 else f"{count / 1e6:.1f}M"
        payloads.append(Payload(kind="synthetic", label=f"synthetic {size} bf16",
                                synthetic_params=args.synthetic_params))
    if not payloads:
        raise ValueError("nothing to measure: drop --no-model or give --synthetic-params > 0")
    if args.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {args.warmup}")
    if args.timeout_s <= 0:
        raise ValueError(f"--timeout-s must be > 0, got {args.timeout_s}")
    if args.weights_dir is not None and not Path(args.weights_dir).is_dir():
        raise ValueError(f"--weights-dir {args.weights_dir!r} is not a folder; create it or leave the option out")
    return Settings(
        payloads=tuple(payloads), transports=args.transports, repeats=args.repeats, warmup=args.warmup,
        loopback_frame_bytes=args.loopback_frame_mib << 20, loopback_round_bytes=args.loopback_mib << 20,
        memcpy_bytes=args.memcpy_mib << 20, weights_dir=args.weights_dir, threads=args.threads,
        timeout_s=args.timeout_s,
    )


def run(argv: list[str]) -> dict[str, Any]:
    """Measure as the options say, print the table, return the result."""
    parser = build_parser()
    args = parsed(parser, argv)
    if args.receiver is not None:
        raise BenchStopped(2, "error: --receiver is the process the benchmark starts; run the benchmark without it")
    try:
        settings = _settings_from(args)
    except Exception as error:  # a bad option or a model that cannot be found
        parser.print_usage(sys.stderr)
        raise BenchStopped(2, f"error: {error}") from error
    try:
        result = bench_weights(settings)
    except (RuntimeError, TimeoutError, OSError, ValueError) as error:
        raise BenchStopped(1, str(error)) from error
    print_report(result)
    return result


def main(argv: list[str]) -> int:
    args = parse_args(build_parser(), argv)
    if isinstance(args, int):  # --help, or a usage error argparse has printed
        return args
    if args.receiver is not None:
        return run_receiver(args.receiver, args.threads, args.parent_pid or os.getppid())
    return run_as_command(PROG, run, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
