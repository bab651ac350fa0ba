"""Async actors pace themselves by the learner's backlog: a group the learner could not train within
max_staleness is not started (actor.pace_to_learner)."""

import logging

import pytest
import trio

from longhorizon.actor.engines.base import EngineSettings, make_engine
from longhorizon.actor.worker import Actor, group_would_be_trainable
from longhorizon.common.codec import WireError, decode, encode
from longhorizon.common.config import load_config
from longhorizon.common.transport import InProcessNetwork
from longhorizon.common.wire import Backlog, HorizonUpdate

# Two-member groups, four groups a step, a group may be trained one version after its weights.
SHAPE = dict(group_size=2, groups_per_step=4, max_staleness=1)


def _trainable(learner_version, waiting, *, held=5, unsent=0, sent_since=0, live_actors=1):
    backlog = Backlog(learner_version=learner_version, waiting_trajectories=waiting, live_actors=live_actors)
    return group_would_be_trainable(backlog, held_version=held, unsent_members=unsent,
                                    sent_since_backlog=sent_since, **SHAPE)


def test_without_a_report_every_group_may_start():
    assert group_would_be_trainable(None, held_version=0, unsent_members=10**6, sent_since_backlog=10**6, **SHAPE)


def test_a_group_starts_while_fewer_than_max_staleness_steps_of_groups_wait_ahead():
    # 6 trajectories = 3 groups ahead: trained in the next step, staleness 0.
    assert _trainable(5, 6)
    # 14 = 7 groups: one step must go first (staleness 1, allowed); 16 = 8 groups: two steps.
    assert _trainable(5, 14)
    assert not _trainable(5, 16)


def test_what_the_actor_sent_since_the_report_and_has_in_flight_counts_ahead():
    # 10 waiting + 2 unsent + 2 sent since = 14 trajectories, 7 groups: one step ahead.
    assert _trainable(5, 10, unsent=2, sent_since=2)
    # One more group of its own in flight: 16, two steps ahead.
    assert not _trainable(5, 10, unsent=4, sent_since=2)
    # A negative unsent count (members of a group sent twice, say) does not open the gate.
    assert _trainable(5, 10, unsent=-8, sent_since=2) == _trainable(5, 10, unsent=0, sent_since=2)


def test_each_live_actor_is_taken_to_make_what_this_one_makes():
    # 8 waiting + 4 of its own: alone 12 trajectories (6 groups, one step); with a second actor
    # doing the same 16 (8 groups, two steps).
    assert _trainable(5, 8, unsent=4, live_actors=1)
    assert not _trainable(5, 8, unsent=4, live_actors=2)


def test_weights_behind_the_learner_count_against_the_bound():
    # Nothing waits; the weights held lag by one version (allowed), by two (nothing trainable).
    assert _trainable(5, 0, held=4)
    assert not _trainable(5, 0, held=3)
    # One version behind and a step of groups ahead: staleness 2.
    assert not _trainable(5, 8, held=4)
    # An actor ahead of a learner resumed from an older checkpoint lags by nothing.
    assert _trainable(5, 14, held=9)


def test_the_backlog_crosses_the_wire_and_bad_values_are_refused():
    message = Backlog(learner_version=3, waiting_trajectories=40, live_actors=2)
    assert decode(encode(message)) == message
    for bad, error in ((Backlog(3, -1, 1), "waiting_trajectories must be >= 0"),
                       (Backlog(3, 0, 0), "live_actors must be >= 1")):
        with pytest.raises(WireError, match=error):
            encode(bad)


def _actor(network, *overrides):
    config = load_config(None, [
        "env.name='codebook'", "actor.engine='scripted'", "actor.scripted_policy='random'",
        "actor.group_size=2", "actor.concurrent_groups=2", "learner.groups_per_step=4",
        "learner.max_staleness=1", "actor.wait_report_s=30", *overrides,
    ])
    engine = make_engine("scripted", EngineSettings(env_name="codebook", scripted_policy="random"))
    return Actor(config, 0, network.actor_endpoints("actor-0"), engine)


_MOST_A_REPORT = 100


async def _play(actor, network, backlogs):
    """Run the actor under a learner that publishes `backlogs` (seconds, Backlog) in turn and takes
    every trajectory; returns the trajectories received before each next report."""
    publisher, trajectories = network.publisher(), network.pull_receiver()
    network.router()  # takes the actor's hello and heartbeats
    received: list[list] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(actor.run)
        await trio.sleep(0.5)
        for index, (seconds, backlog) in enumerate(backlogs):
            await publisher.send(backlog)
            if index == 0:  # as the learner does: the backlog, then the horizon
                await publisher.send(HorizonUpdate(horizon_cap=3, stage=0, learner_step=0))
            batch = []
            with trio.move_on_after(seconds):
                # Bounded: an actor that never holds back plays without the clock moving.
                while len(batch) < _MOST_A_REPORT:
                    batch.append(await trajectories.receive())
            received.append(batch)
        nursery.cancel_scope.cancel()
    return received


async def test_an_actor_holds_back_while_the_backlog_is_full_and_says_why(autojump_clock, caplog):
    network = InProcessNetwork()
    actor = _actor(network)
    full = Backlog(learner_version=0, waiting_trajectories=16, live_actors=1)  # 8 groups: two steps
    room = Backlog(learner_version=0, waiting_trajectories=0, live_actors=1)
    with caplog.at_level(logging.INFO, logger="longhorizon.actor.worker"):
        before, held, after = await _play(actor, network, [(1, room), (65, full), (5, room)])
    # Room: the two slots play, each trajectory sent counting ahead of the next group, until
    # 8 groups (16 trajectories, two steps) would be ahead of the next.
    assert len(before) == 16 and len({t.group_id for t in before}) == 8
    assert held == []
    assert actor.counters.paced_seconds >= 60
    reasons = [r.getMessage() for r in caplog.records if "room in the learner's backlog" in r.getMessage()]
    # One line per report interval (30 s), from one of the two slots held back.
    assert len(reasons) == 2 and "(16 trajectories waiting at v0, 4 a step, max_staleness 1)" in reasons[0]
    # Room again: play resumes, as far as the bound again.
    assert len(after) == 16 and actor.stats().paced_s == actor.counters.paced_seconds


async def test_weights_too_old_to_train_hold_the_actor_with_that_reason(autojump_clock, caplog):
    network = InProcessNetwork()
    actor = _actor(network)
    with caplog.at_level(logging.INFO, logger="longhorizon.actor.worker"):
        (played,) = await _play(actor, network, [(35, Backlog(learner_version=2, waiting_trajectories=0, live_actors=1))])
    assert played == []
    assert any("anything played with the ones held would be dropped as stale" in r.getMessage() for r in caplog.records)


async def test_without_pacing_the_actor_plays_whatever_the_backlog(autojump_clock):
    network = InProcessNetwork()
    actor = _actor(network, "actor.pace_to_learner=false")
    publisher, trajectories = network.publisher(), network.pull_receiver()
    network.router()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(actor.run)
        await trio.sleep(0.5)
        await publisher.send(Backlog(learner_version=2, waiting_trajectories=10**6, live_actors=4))
        await publisher.send(HorizonUpdate(horizon_cap=3, stage=0, learner_step=0))
        # Far beyond the bound, and played at once (the scripted engine takes no time: the
        # clock never moves while the actor plays, so the count, not a time, ends the test).
        with trio.fail_after(1):
            for _ in range(40):
                await trajectories.receive()
        nursery.cancel_scope.cancel()
    assert actor.counters.paced_seconds == 0
