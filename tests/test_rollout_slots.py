"""An async actor's slots hold a whole group each, or one episode each (actor.rollout_slots)."""

from collections import defaultdict

import pytest
import trio

from longhorizon.actor.engines.base import make_engine
from longhorizon.actor.engines.factory import engine_settings
from longhorizon.actor.worker import Actor
from longhorizon.common.config import ConfigError, load_config
from longhorizon.common.transport import InProcessNetwork
from longhorizon.common.wire import HorizonUpdate, Trajectory

GROUP_SIZE = 4
CONCURRENT_GROUPS = 2
SLOTS = GROUP_SIZE * CONCURRENT_GROUPS


def _config(rollout_slots: str):
    # Half the episodes 1 turn long, half 20: almost every group holds a long member.
    return load_config(None, [
        "env.name='longtail'", "env.options={short_turns = [1, 1], long_turns = [20, 20], long_fraction = 0.5}",
        "actor.engine='scripted'", "actor.scripted_policy='oracle'", "actor.simulated_token_latency_s=0.01",
        f"actor.group_size={GROUP_SIZE}", f"actor.concurrent_groups={CONCURRENT_GROUPS}",
        f"actor.rollout_slots={rollout_slots!r}",
    ])


async def _play(rollout_slots: str, seconds: float, caps: dict[float, int]) -> tuple[list[Trajectory], Actor, int]:
    """Run one actor for `seconds` of trio's clock with a learner that takes every trajectory
    and broadcasts horizon cap caps[t] at time t; returns the trajectories, the actor and the
    most episodes that were ever running at once."""
    config = _config(rollout_slots)
    network = InProcessNetwork()
    learner = network.learner_endpoints()
    engine = make_engine("scripted", engine_settings(config, model_path=""))
    actor = Actor(config, 0, network.actor_endpoints("actor-0"), engine)
    running = peak = 0
    trajectories: list[Trajectory] = []
    original_acquire, original_release = actor.env_pool.acquire, actor.env_pool.release

    def acquire():
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        return original_acquire()

    def release(env, *, broken=False):
        nonlocal running
        running -= 1
        original_release(env, broken=broken)

    actor.env_pool.acquire, actor.env_pool.release = acquire, release

    async def take() -> None:
        while True:
            message = await learner.trajectories.receive()
            if isinstance(message, Trajectory):
                trajectories.append(message)

    async def broadcast() -> None:
        now = 0.0
        for at, cap in sorted(caps.items()):
            await trio.sleep(at - now)
            now = at
            await learner.broadcast.send(HorizonUpdate(horizon_cap=cap, stage=0, learner_step=0))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(take)
        nursery.start_soon(actor.run)
        nursery.start_soon(broadcast)
        await trio.sleep(seconds)
        nursery.cancel_scope.cancel()
    return trajectories, actor, peak


def _groups(trajectories: list[Trajectory]) -> dict[str, list[Trajectory]]:
    groups: dict[str, list[Trajectory]] = defaultdict(list)
    for trajectory in trajectories:
        groups[trajectory.group_id].append(trajectory)
    return groups


async def test_episode_slots_play_more_episodes_than_group_slots_with_as_many_running(autojump_clock):
    caps = {0.5: 30}
    by_group, _, group_peak = await _play("group", 120, caps)
    by_episode, _, episode_peak = await _play("episode", 120, caps)
    # A group slot waits for its group's 20-turn member while its 1-turn members' slots idle.
    assert len(by_episode) > 1.5 * len(by_group), (len(by_episode), len(by_group))
    assert group_peak == episode_peak == SLOTS
    for trajectories in (by_group, by_episode):
        groups = _groups(trajectories)
        finished = [members for members in groups.values() if len(members) == GROUP_SIZE]
        # Every group is whole or still has members in flight when the clock stopped.
        assert len(groups) - len(finished) <= SLOTS
        for members in finished:
            assert len({m.task_id for m in members}) == 1
            assert len({m.trajectory_id for m in members}) == GROUP_SIZE


async def test_a_groups_members_keep_the_cap_it_drew_when_its_first_member_started(autojump_clock):
    # The cap moves from 30 to 5 while groups are in flight: each group still plays one cap.
    trajectories, _, _ = await _play("episode", 60, {0.5: 30, 20.0: 5})
    groups = _groups(trajectories)
    caps_seen = {cap for members in groups.values() for cap in {m.horizon_cap for m in members}}
    assert caps_seen == {30, 5}
    for members in groups.values():
        assert len({m.horizon_cap for m in members}) == 1, [m.horizon_cap for m in members]


def test_an_unknown_rollout_slot_is_refused_when_the_config_loads():
    from longhorizon.launch.checks import validate_config

    with pytest.raises(ConfigError, match="actor.rollout_slots must be one of group, episode, got 'token'"):
        load_config(None, ["actor.rollout_slots='token'"])
    validate_config(load_config(None, ["actor.rollout_slots='episode'"]))
