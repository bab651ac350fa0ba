"""MiniWoB seeds match BrowserGym's: the page-seed rule, and the recorded instructions per task and seed."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from longhorizon.envs.base import Task, make_env
from longhorizon.envs.web.browser import BrowserPool
from longhorizon.envs.web.miniwob import page_seed

FIXTURE = json.loads((Path(__file__).parent / "data" / "miniwob_seeds.json").read_text(encoding="utf-8"))["records"]


def test_page_seed_is_the_first_randint_of_numpy_random_state():
    # First RandomState(seed).randint(0, 1_000_000) draws (numpy's legacy stream, which it keeps fixed).
    assert [page_seed(seed) for seed in (0, 1, 2, 3, 1_000_000, 2**32 - 1)] == [
        985772, 128037, 875688, 71530, 396722, 944547]
    for seed in (*range(50), 1_000_000, 1_000_049, 123_456_789):
        assert page_seed(seed) == np.random.RandomState(seed).randint(0, 1_000_000)
    assert type(page_seed(7)) is int  # reaches the page as a JS number, not a string
    assert {(record["seed"], record["page_seed"]) for record in FIXTURE} == {
        (record["seed"], page_seed(record["seed"])) for record in FIXTURE}


@pytest.mark.parametrize("bad", [-1, 2**32, 1.5, "3", True, None])
def test_page_seed_rejects_what_numpy_cannot_seed(bad):
    with pytest.raises(ValueError, match="MiniWoB seed"):
        page_seed(bad)


async def test_a_task_with_a_bad_seed_fails_before_opening_a_page():
    env = make_env("miniwob", task_names=["click-button"], pool=object())  # any use of the pool would fail
    task = Task(env_name="miniwob", task_id="train-click-button-x", split="train", category="click-button",
                data={"task": "click-button", "seed": -5})
    with pytest.raises(ValueError, match="MiniWoB seed"):
        await env.reset(task)


@pytest.mark.browser
@pytest.mark.slow
async def test_reset_gives_browsergym_instruction_for_each_task_and_seed():
    """Five seeds of seven types and one seed of every other text type, as BrowserGym's start-up
    gave them (recorded by tests/data/make_miniwob_seeds.py). The pair recorded for a type with an
    oracle is the one tests/test_web_miniwob_oracles.py plays first, and that test compares its
    instruction as it plays: those pages are not loaded a second time here."""
    from longhorizon.envs.web.miniwob import ORACLE_TASKS, TASK_NAMES
    from tests.data.make_miniwob_seeds import first_oracle_seed

    # focus-text's instruction is the same for every seed; a type added without a new recording fails here.
    assert {record["task"] for record in FIXTURE} == set(TASK_NAMES) - {"focus-text"}
    assert sum(record["seed"] >= 1_000_000 for record in FIXTURE) >= 40  # test seeds too
    played_by_oracles = {(name, first_oracle_seed(name)) for name in ORACLE_TASKS}
    records = [record for record in FIXTURE if (record["task"], record["seed"]) not in played_by_oracles]
    assert len(records) >= 40 and len(FIXTURE) - len(records) >= 70
    pool = BrowserPool(1)
    env = make_env("miniwob", task_names=sorted({record["task"] for record in records}), pool=pool)
    try:
        got, want = [], []
        for record in records:
            task = Task(env_name="miniwob", task_id=f"seed-{record['task']}-{record['seed']}", split="train",
                        category=record["task"], data={"task": record["task"], "seed": record["seed"]})
            observation, _ = await env.reset(task)
            got.append((record["task"], record["seed"], observation.splitlines()[0].removeprefix("Goal: ")))
            want.append((record["task"], record["seed"], record["instruction"]))
        assert got == want
    finally:
        await env.close()
        pool.close()
