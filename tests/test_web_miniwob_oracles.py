"""Every MiniWoB oracle solves its task type in a real Chromium, on three test seeds."""

from __future__ import annotations

import random

import pytest

from longhorizon.envs.base import Task, action_from_reply, make_env, make_policy
from longhorizon.envs.web.browser import BrowserPool
from longhorizon.envs.web.miniwob import ORACLE_TASKS, TASK_NAMES, TEST_SEED_BASE
from longhorizon.envs.web.miniwob_oracles import WITHOUT_ORACLE

SEEDS = (TEST_SEED_BASE, TEST_SEED_BASE + 1, TEST_SEED_BASE + 2)
MAX_STEPS = 40


def test_every_offered_type_has_an_oracle_or_a_reason():
    assert len(ORACLE_TASKS) >= 60
    assert set(ORACLE_TASKS) | set(WITHOUT_ORACLE) == set(TASK_NAMES)
    assert not set(ORACLE_TASKS) & set(WITHOUT_ORACLE)
    assert all(len(reason) > 20 for reason in WITHOUT_ORACLE.values())
    with pytest.raises(ValueError, match="no MiniWoB oracle"):
        make_policy("miniwob", "oracle").reset(
            Task("miniwob", "x", "test", "click-color", {"task": "click-color", "seed": 0}), "Goal: x", random.Random(0))


@pytest.fixture(scope="module")
def pool():
    browser_pool = BrowserPool(1)
    yield browser_pool
    browser_pool.close()


@pytest.mark.browser
@pytest.mark.slow
@pytest.mark.parametrize("name", ORACLE_TASKS)
async def test_oracle_solves_its_type_on_three_seeds(pool, name):
    # A 60 s page timer leaves room on a busy machine.
    env = make_env("miniwob", task_names=[name], pool=pool, time_limit_s=60.0)
    outcomes = []
    try:
        for seed in SEEDS:
            task = Task("miniwob", f"test-{name}-{seed}", "test", name, {"task": name, "seed": seed})
            observation, _ = await env.reset(task)
            policy = make_policy("miniwob", "oracle")
            policy.reset(task, observation, random.Random(0))
            actions = []
            for _ in range(MAX_STEPS):
                actions.append(action_from_reply(policy.act(observation), env.prompt_format))
                observation, reward, terminated, truncated, info = await env.step(actions[-1])
                if terminated or truncated:
                    outcomes.append((seed, info["success"], info["raw_reward"], actions))
                    break
            else:
                outcomes.append((seed, False, None, actions))
    finally:
        await env.close()
    assert all(success for _, success, _, _ in outcomes), outcomes
