"""Every MiniWoB oracle solves its task type in a real Chromium, on test seeds.

The suite plays one seed per type (the three test seeds taken in turn across the types, about 3
minutes for the 82 types on 2 cores); `LONGHORIZON_ORACLE_SEEDS=3` plays all three for every type
(about 10 minutes on a quiet machine), as was done when each oracle was written.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

from longhorizon.envs.base import Task, action_from_reply, make_env, make_policy
from longhorizon.envs.web.browser import BrowserPool
from longhorizon.envs.web.miniwob import ORACLE_TASKS, TASK_NAMES
from longhorizon.envs.web.miniwob_oracles import WITHOUT_ORACLE

from tests.data.make_miniwob_seeds import ORACLE_TEST_SEEDS as SEEDS
from tests.data.make_miniwob_seeds import TASKS as FIVE_SEED_TYPES
from tests.data.make_miniwob_seeds import first_oracle_seed

SEEDS_PER_TYPE = int(os.environ.get("LONGHORIZON_ORACLE_SEEDS", "1"))
# BrowserGym's instruction for each type's first seed here (tests/data/make_miniwob_seeds.py):
# checked as the oracle plays, so tests/test_web_miniwob_seeds.py need not load those pages again.
RECORDED = {(record["task"], record["seed"]): record["instruction"] for record in json.loads(
    (Path(__file__).parent / "data" / "miniwob_seeds.json").read_text(encoding="utf-8"))["records"]}


def seeds_for(name: str) -> tuple[int, ...]:
    """The seeds a type is played on: SEEDS_PER_TYPE of SEEDS, starting at the type's turn."""
    first = SEEDS.index(first_oracle_seed(name))
    return tuple(SEEDS[(first + offset) % len(SEEDS)] for offset in range(min(SEEDS_PER_TYPE, len(SEEDS))))
MAX_STEPS = 40


def test_the_recording_holds_each_oracle_types_first_seed():
    # The seven types recorded on five seeds of their own are checked by the seeds test, and
    # focus-text's instruction is the same for every seed.
    once = [name for name in ORACLE_TASKS if name not in FIVE_SEED_TYPES and name != "focus-text"]
    missing = [name for name in once if (name, seeds_for(name)[0]) not in RECORDED]
    assert not missing, f"re-record with tests/data/make_miniwob_seeds.py: no instruction for {missing}"


def test_every_offered_type_has_an_oracle_or_a_reason():
    assert len(ORACLE_TASKS) >= 60
    assert set(ORACLE_TASKS) | set(WITHOUT_ORACLE) == set(TASK_NAMES)
    assert not set(ORACLE_TASKS) & set(WITHOUT_ORACLE)
    assert all(len(reason) > 20 for reason in WITHOUT_ORACLE.values())
    with pytest.raises(ValueError, match="no MiniWoB oracle"):
        make_policy("miniwob", "oracle").reset(
            Task("miniwob", "x", "test", "click-color", {"task": "click-color", "seed": 0}), "Goal: x", random.Random(0))


def test_an_action_that_timed_out_is_tried_again_twice_then_the_oracle_goes_on():
    page = """Goal: Enter "Jess" into the text field and press Submit.
URL: http://127.0.0.1:8000/miniwob/enter-text.html
Tabs: [0] 'Enter Text Task' (active)
{error}[1] RootWebArea 'Enter Text Task'
  [11] generic
    StaticText 'Enter "Jess" into the text field and press Submit.'
    [17] textbox{value}
    [18] button 'Submit'
"""
    policy = make_policy("miniwob", "oracle")
    policy.reset(Task("miniwob", "train-enter-text-6", "train", "enter-text", {"task": "enter-text", "seed": 6}),
                 page.format(error="", value=""), random.Random(0))

    def act(error: str) -> str:
        return action_from_reply(policy.act(page.format(error=error, value=" value='Jess' focused")), "react")

    assert action_from_reply(policy.act(page.format(error="", value="")), "react") == "fill('17', 'Jess')"
    assert act("") == "click('18')"
    timed_out = "Error: click('18') failed: click: Timeout 5000ms exceeded.\n"
    assert act(timed_out) == act(timed_out) == "click('18')"
    assert act(timed_out) == "stop()"  # the third time: on, as if the click had run
    # Another error is the action's own fault: nothing is repeated.
    policy.reset(Task("miniwob", "train-enter-text-6", "train", "enter-text", {"task": "enter-text", "seed": 6}),
                 page.format(error="", value=""), random.Random(0))
    policy.act(page.format(error="", value=""))
    policy.act(page.format(error="", value=" value='Jess' focused"))
    assert act("Error: click('18') failed: no element with id 18.\n") == "stop()"


@pytest.fixture(scope="module")
def pool():
    browser_pool = BrowserPool(1)
    yield browser_pool
    browser_pool.close()


@pytest.mark.browser
@pytest.mark.slow
@pytest.mark.parametrize("name", ORACLE_TASKS)
async def test_oracle_solves_its_type(pool, name):
    # A 60 s page timer leaves room on a busy machine.
    env = make_env("miniwob", task_names=[name], pool=pool, time_limit_s=60.0)
    outcomes = []
    try:
        for seed in seeds_for(name):
            task = Task("miniwob", f"test-{name}-{seed}", "test", name, {"task": name, "seed": seed})
            observation, _ = await env.reset(task)
            if (name, seed) in RECORDED:  # the instruction BrowserGym shows for this seed
                assert observation.splitlines()[0].removeprefix("Goal: ") == RECORDED[name, seed], seed
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
