"""The learner under faults: gone peers at shutdown, silent actors, a joining flood, torn weights,
a synchronous batch that lost a group, and sampling settings it cannot correct for."""
import time

import numpy as np
import pytest
import torch
import trio

from longhorizon.common.config import load_config
from longhorizon.common.models import build_tiny_model, load_causal_lm
from longhorizon.common.transport import (
    InProcessNetwork,
    UnknownPeer,
    ZmqDealer,
    zmq_learner_endpoints,
)
from longhorizon.common.wire import Hello, Stop
from longhorizon.learner import worker as learner_worker
from longhorizon.learner.broadcast import make_weights_update
from longhorizon.learner.worker import Learner


@pytest.fixture(scope="module")
def byte_model(tmp_path_factory):
    """A tiny model whose vocabulary covers the byte tokens the scripted engine writes."""
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-bytes", words=[f"w{i}" for i in range(260)])


def _config(tmp_path, model, *overrides):
    return load_config(None, [
        f"run.output_dir={str(tmp_path)!r}", "run.name='faults'", f"model.path={str(model)!r}",
        "env.name='codebook'", "actor.engine='scripted'", "actor.scripted_policy='random'",
        "actor.num_actors=1", "actor.group_size=2", "actor.concurrent_groups=2", "actor.max_context_tokens=256",
        "actor.sampling.max_new_tokens=8", "learner.groups_per_step=2", "learner.learning_rate=1e-3",
        "horizon.schedule='fixed'", "horizon.stages=[2]", *overrides,
    ])


def _hello(actor_id: str, version: int = 0) -> Hello:
    return Hello(actor_id=actor_id, pid=1, hostname="test", policy_version=version, engine="scripted")


async def _make_learner(config, endpoints, model):
    return await trio.to_thread.run_sync(Learner, config, endpoints, config.run_dir, str(model))


async def test_stop_reaches_live_actors_when_a_peer_that_said_hello_is_gone(tmp_path, byte_model):
    endpoints = zmq_learner_endpoints(
        trajectory_address="tcp://127.0.0.1:*", broadcast_address="tcp://127.0.0.1:*",
        control_address="tcp://127.0.0.1:*",
    )
    actor = ZmqDealer("actor-0", endpoints.control.address)
    ghost = ZmqDealer("ghost", endpoints.control.address)
    try:
        learner = await _make_learner(_config(tmp_path, byte_model), endpoints, byte_model)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(learner._control)
            await actor.send(_hello("actor-0"))
            await ghost.send(_hello("ghost"))
            with trio.fail_after(10):
                while set(learner.peers) != {"actor-0", "ghost"}:
                    await trio.sleep(0.01)
            ghost.close()
            # Wait until the router has seen the ghost disconnect: sending to it then fails.
            with trio.fail_after(10):
                while True:
                    try:
                        await endpoints.control.send("ghost", Stop(reason="probe"))
                    except UnknownPeer:
                        break
                    await trio.sleep(0.02)
            assert await learner.stop_actors("training finished") == 1
            with trio.fail_after(10):
                message = await actor.receive()
            assert isinstance(message, Stop) and message.reason == "training finished"
            nursery.cancel_scope.cancel()
    finally:
        actor.close()
        ghost.close()
        endpoints.close()


async def test_silent_actors_are_counted_lost_once_and_not_sent_to(tmp_path, byte_model):
    network = InProcessNetwork()
    learner = await _make_learner(_config(tmp_path, byte_model), network.learner_endpoints(), byte_model)
    live = network.actor_endpoints("actor-0")
    now = time.monotonic()
    learner.peers.known = {
        "actor-0": {"last_seen": now},
        "silent": {"last_seen": now - 10 * learner.config.learner.peer_timeout_s},
    }
    assert learner.peers.live() == ["actor-0"]
    assert learner.peers.live() == ["actor-0"]
    assert learner.counters["actors_lost"] == 1  # reported once, not at every look
    assert await learner.stop_actors("done") == 1
    assert isinstance(await live.control.receive(), Stop)


async def test_joining_actors_get_the_horizon_each_and_the_weights_once_per_interval(tmp_path, byte_model, monkeypatch):
    monkeypatch.setattr(learner_worker, "_REPUBLISH_AFTER_S", 1000.0)  # no second send in this test
    network = InProcessNetwork(broadcast_keep_latest=1000)
    learner = await _make_learner(_config(tmp_path, byte_model), network.learner_endpoints(), byte_model)
    subscriber = network.subscriber()
    learner.version = 1
    learner.latest_weights = make_weights_update(learner.model, 1, "inline")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(learner._control)
        dealers = [network.dealer(f"actor-{index}") for index in range(50)]
        for index, dealer in enumerate(dealers):
            # Half the newcomers already hold version 1; the others hold nothing yet.
            await dealer.send(_hello(f"actor-{index}", version=index % 2))
        with trio.fail_after(10):
            while len(learner.peers) < 50:
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    kinds = []
    while subscriber._pending:
        kinds.append(type(await subscriber.receive()).__name__)
    assert kinds.count("HorizonUpdate") >= 50
    assert kinds.count("WeightsUpdate") == 1
    assert learner.counters["weights_republished"] == 1


async def test_a_version_an_actor_refused_is_not_sent_to_it_again(tmp_path, byte_model, monkeypatch, caplog):
    """An actor whose engine refused the latest weights keeps saying it serves an older version;
    re-sending the same weights every few seconds would only be refused again."""
    import logging

    from longhorizon.common.wire import ActorStats, Heartbeat

    monkeypatch.setattr(learner_worker, "_REPUBLISH_AFTER_S", 0.0)  # resend at every look
    network = InProcessNetwork(broadcast_keep_latest=1000)
    learner = await _make_learner(_config(tmp_path, byte_model), network.learner_endpoints(), byte_model)
    subscriber = network.subscriber()
    learner.version = 2
    learner.latest_weights = make_weights_update(learner.model, 2, "inline")

    def heartbeat(refused_version):
        return Heartbeat(actor_id="actor-0", policy_version=1, episodes_done=0, time=0.0,
                         refused_version=refused_version)

    async def weights_sent() -> int:
        sent = 0
        while subscriber._pending:
            sent += type(await subscriber.receive()).__name__ == "WeightsUpdate"
        return sent

    dealer = network.dealer("actor-0")
    with caplog.at_level(logging.WARNING, logger="longhorizon.learner.worker"):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(learner._control)
            await dealer.send(heartbeat(-1))  # behind, refused nothing: sent again
            with trio.fail_after(10):
                while learner.counters["weights_republished"] < 1:
                    await trio.sleep(0.01)
            for _ in range(3):  # behind because it refused v2: not sent again
                await dealer.send(heartbeat(2))
            await dealer.send(ActorStats(actor_id="actor-0", episodes_done=0, episodes_per_s=0.0,
                                         generated_tokens_per_s=0.0, mean_generation_seconds=0.0,
                                         mean_env_seconds=0.0, errors=0, weights_refused=1))
            with trio.fail_after(10):
                while "stats" not in learner.peers.known.get("actor-0", {}):
                    await trio.sleep(0.01)
            assert learner.counters["weights_republished"] == 1
            learner.version = 3
            learner.latest_weights = make_weights_update(learner.model, 3, "inline")
            await dealer.send(heartbeat(2))  # a newer version goes out as usual
            with trio.fail_after(10):
                while learner.counters["weights_republished"] < 2:
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
    assert await weights_sent() == 2
    assert learner.peers.stats_total("weights_refused") == 1
    refusals = [r.getMessage() for r in caplog.records if "not sending v2 to it again" in r.getMessage()]
    assert len(refusals) == 1, refusals  # said once, not at every heartbeat


def test_a_weights_update_owns_its_bytes(tiny_codebook_model):
    model = load_causal_lm(tiny_codebook_model)
    update = make_weights_update(model, 3, "inline")
    before = {name: array.copy() for name, array in update.tensors.items()}
    parameters = dict(model.named_parameters())
    with torch.no_grad():
        for name, array in update.tensors.items():
            assert not np.may_share_memory(array, parameters[name].detach().numpy()), name
            parameters[name].add_(1.0)  # the learner's next step, in place
    for name, array in update.tensors.items():
        np.testing.assert_array_equal(array, before[name])


async def test_a_sync_batch_that_lost_a_group_goes_ahead(tmp_path, byte_model):
    """Sync actors make exactly one batch per version; a lost trajectory used to stall the learner."""
    from longhorizon.actor.worker import run_actor
    from longhorizon.learner.worker import run_learner

    config = _config(tmp_path, byte_model, "run.mode='sync'", "run.total_steps=3", "learner.group_timeout_s=1.0")
    network = InProcessNetwork()
    endpoints = network.actor_endpoints("actor-0")

    class DropFirst:
        def __init__(self, inner):
            self.inner, self.dropped = inner, 0

        async def send(self, message):
            if self.dropped == 0:
                self.dropped += 1
                return
            await self.inner.send(message)

        def close(self):
            self.inner.close()

    endpoints.trajectories = DropFirst(endpoints.trajectories)
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_actor, config, 0, endpoints)
            learner = await run_learner(config, network.learner_endpoints(), model_path=str(byte_model))
            nursery.cancel_scope.cancel()
    assert learner.step == 3
    assert learner.counters["short_sync_batches"] == 1
    assert learner.buffer.counters["dropped_partial_groups"] == 1


def test_training_refuses_top_p_below_one(tmp_path, byte_model):
    from longhorizon.common.config import ConfigError
    from longhorizon.launch.checks import validate_config

    with pytest.raises(ConfigError, match="top_p"):
        validate_config(_config(tmp_path, byte_model, "actor.sampling.top_p=0.8"))
    with pytest.raises(ValueError, match="top_p"):
        Learner(_config(tmp_path, byte_model, "actor.sampling.top_p=0.8"), None, tmp_path, str(byte_model))
    validate_config(_config(tmp_path, byte_model).replace())


async def test_a_sync_batch_counts_only_its_own_versions_lost_groups(tmp_path, byte_model):
    from tests.test_buffer import trajectory as stand_in

    def trajectory(*args, **kwargs):
        made = stand_in(*args, **kwargs)
        made.token_ids = np.zeros(len(made.loss_mask), np.int64)  # the learner checks the vocabulary
        return made

    config = _config(tmp_path, byte_model, "run.mode='sync'", "learner.groups_per_step=2")
    learner = await _make_learner(config, InProcessNetwork().learner_endpoints(), byte_model)
    learner.version = 3
    now = time.monotonic()
    # A late member of a version-2 group: refused as stale, its group dropped as partial.
    learner.buffer.add(trajectory("late", "old", versions=[-1, 2], group_size=2), learner_version=3)
    learner.buffer.pop_ready(2, learner_version=3)
    assert learner.buffer.counters["dropped_partial_groups"] == 1
    assert not learner._sync_batch_is_over(ready=1, wanted=2, batch_started=now)
    # A group of this version lost a member: now the batch has all it will get.
    learner.buffer.add(trajectory("a", "mine", versions=[-1, 3], group_size=2), learner_version=3)
    learner.buffer.pop_ready(2, learner_version=3, give_up_waiting=True)
    assert learner._sync_batch_is_over(ready=1, wanted=2, batch_started=now)
    # Nothing arriving for the timeout ends a batch too.
    assert not learner._sync_batch_is_over(ready=0, wanted=2, batch_started=now)
    learner.last_arrival = now - 10 * config.learner.sync_batch_timeout_s
    assert learner._sync_batch_is_over(ready=0, wanted=2, batch_started=now - 10 * config.learner.sync_batch_timeout_s)


async def test_resume_restores_counters_and_clock_and_cuts_later_records(tmp_path, byte_model):
    from longhorizon.common.metrics import read_metrics

    config = _config(tmp_path, byte_model)
    first = await _make_learner(config, InProcessNetwork().learner_endpoints(), byte_model)
    first.step, first.version = 3, 3
    first.buffer.counters["duplicates"] = 7
    first.counters["actors_lost"] = 2
    first.peers.episodes_reported.update({("actor-0", ("host", 11)): 40, ("actor-0", ("host", 12)): 5})
    first.elapsed_before = 100.0
    await trio.to_thread.run_sync(first._checkpoint)
    for step in range(1, 6):
        first.metrics.write({"step": step})
    first.metrics.close()

    resumed_config = _config(tmp_path, byte_model, "run.resume=true")
    second = await _make_learner(resumed_config, InProcessNetwork().learner_endpoints(), byte_model)
    assert (second.step, second.version) == (3, 3)
    assert second.buffer.counters["duplicates"] == 7
    assert second.counters["actors_lost"] == 2
    # What the actors reported to the first process still counts (a soak compares it with what
    # the learner received, which the checkpoint keeps too).
    assert second.peers.episodes_reported_total() == 45
    assert second.elapsed_before >= 100.0
    assert second._elapsed() >= 100.0
    assert [record["step"] for record in read_metrics(config.run_dir)] == [1, 2, 3]
    second.metrics.close()


async def test_what_a_restarted_learner_held_at_its_checkpoint_is_counted_lost(tmp_path, byte_model):
    """accepted = trained + dropped with their group + held + lost on restart, exactly, across two
    restarts: the trajectories a buffer held at the checkpoint died with the process holding them."""
    from longhorizon.learner.scoring import ScoredBatch
    from tests.test_buffer import trajectory

    def accounts(learner) -> tuple[int, dict]:
        record = learner._record([], ScoredBatch([], 0, 0, 0, 0), {}, 1.0, learner.version)
        terms = ("trained", "dropped_with_group", "held", "lost_on_restart")
        return record["trajectories_accepted"], {term: record[f"trajectories_{term}"] for term in terms}

    async def restarted(step: int) -> Learner:
        config = _config(tmp_path, byte_model, "run.resume=true")
        learner = await _make_learner(config, InProcessNetwork().learner_endpoints(), byte_model)
        assert learner.step == step
        return learner

    first = await _make_learner(_config(tmp_path, byte_model), InProcessNetwork().learner_endpoints(), byte_model)
    for identity, group in [("a", "trained"), ("b", "trained"), ("c", "dropped"), ("d", "held"), ("e", "held"),
                            ("f", "held-too")]:
        first.buffer.add(trajectory(identity, group, versions=[-1, 0]), learner_version=0)
        if identity == "c":
            # "trained" is complete and goes out; "dropped" lost its wait for a second member.
            assert [g.group_id for g in first.buffer.pop_ready(1, learner_version=0, give_up_waiting=True)] == ["trained"]
    assert accounts(first) == (6, {"trained": 2, "dropped_with_group": 1, "held": 3, "lost_on_restart": 0})
    first.step = 3
    await trio.to_thread.run_sync(first._checkpoint)
    first.metrics.close()

    second = await restarted(3)
    assert accounts(second) == (6, {"trained": 2, "dropped_with_group": 1, "held": 0, "lost_on_restart": 3})
    for identity in ("g", "h"):
        second.buffer.add(trajectory(identity, "held-again", versions=[-1, 0]), learner_version=0)
    second.step = 4
    await trio.to_thread.run_sync(second._checkpoint)
    second.metrics.close()

    third = await restarted(4)
    assert accounts(third) == (8, {"trained": 2, "dropped_with_group": 1, "held": 0, "lost_on_restart": 5})
    third.metrics.close()


async def test_a_step_record_is_written_before_its_checkpoint(tmp_path, byte_model, monkeypatch):
    """A learner killed between the two resumes from the older checkpoint and cuts the record;
    the other order would leave a checkpoint whose step never gets a record."""
    from longhorizon.actor.worker import run_actor
    from longhorizon.common.metrics import read_metrics
    from longhorizon.learner.worker import run_learner

    config = _config(tmp_path, byte_model, "run.mode='sync'", "run.total_steps=2", "learner.checkpoint_every=1")
    seen_at_checkpoint = []
    save = learner_worker.save_checkpoint

    def save_and_look(run_dir, **kwargs):
        seen_at_checkpoint.append((kwargs["step"], [r["step"] for r in read_metrics(run_dir)]))
        return save(run_dir, **kwargs)

    monkeypatch.setattr(learner_worker, "save_checkpoint", save_and_look)
    network = InProcessNetwork()
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_actor, config, 0, network.actor_endpoints("actor-0"))
            await run_learner(config, network.learner_endpoints(), model_path=str(byte_model))
            nursery.cancel_scope.cancel()
    assert seen_at_checkpoint == [(1, [1]), (2, [1, 2])]
    records = read_metrics(config.run_dir)
    assert [r["checkpoint"].rsplit("/", 1)[-1] for r in records] == ["step_000001", "step_000002"]
