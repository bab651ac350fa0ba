"""An actor never waits in silence: for a learner that is not there, or one that takes nothing."""

import logging

import trio

from longhorizon.actor.engines.base import EngineSettings, make_engine
from longhorizon.actor.worker import Actor
from longhorizon.common.config import load_config
from longhorizon.common.transport import InProcessNetwork
from longhorizon.common.wire import HorizonUpdate


def _actor(network, *overrides):
    config = load_config(None, [
        "env.name='codebook'", "actor.engine='scripted'", "actor.scripted_policy='random'",
        "actor.group_size=2", "actor.concurrent_groups=1", "actor.wait_report_s=30", *overrides,
    ])
    engine = make_engine("scripted", EngineSettings(env_name="codebook", scripted_policy="random"))
    return Actor(config, 0, network.actor_endpoints("actor-0"), engine)


async def test_an_actor_without_a_learner_says_what_it_waits_for(autojump_clock, caplog):
    network = InProcessNetwork()
    router = network.router()  # takes the actor's hello, answers nothing
    actor = _actor(network)
    with caplog.at_level(logging.WARNING, logger="longhorizon.actor.worker"):
        with trio.move_on_after(65):
            await actor.run()
    waits = [r.getMessage() for r in caplog.records if "first horizon" in r.getMessage()]
    assert len(waits) == 2 and "waiting 30s" in waits[0]
    router.close()


async def test_an_actor_whose_trajectories_are_not_taken_says_so(autojump_clock, caplog):
    network = InProcessNetwork(trajectory_buffer=0)  # nobody receives: every send waits
    publisher = network.publisher()
    actor = _actor(network)
    with caplog.at_level(logging.WARNING, logger="longhorizon.actor.worker"):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(actor.run)
            await trio.sleep(1)
            await publisher.send(HorizonUpdate(horizon_cap=3, stage=0, learner_step=0))
            await trio.sleep(100)
            nursery.cancel_scope.cancel()
    assert any("waiting 30s to send a trajectory" in r.getMessage() for r in caplog.records)
