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
    assert len(FIXTURE) >= 35 and len({record["task"] for record in FIXTURE}) >= 7
    pool = BrowserPool(1)
    env = make_env("miniwob", task_names=sorted({record["task"] for record in FIXTURE}), pool=pool)
    try:
        got, want = [], []
        for record in FIXTURE:
            task = Task(env_name="miniwob", task_id=f"seed-{record['task']}-{record['seed']}", split="train",
                        category=record["task"], data={"task": record["task"], "seed": record["seed"]})
            observation, _ = await env.reset(task)
            got.append((record["task"], record["seed"], observation.splitlines()[0].removeprefix("Goal: ")))
            want.append((record["task"], record["seed"], record["instruction"]))
        assert got == want
    finally:
        await env.close()
        pool.close()


def _browsergym_instructions(cases: list[tuple[str, int]]) -> list[str]:
    """Replays BrowserGym's MiniWoB start-up (as tests/data/make_miniwob_seeds.py does) in its own
    browser, with its 500x320 viewport: the instruction it shows for each (task, seed)."""
    return [instruction for instruction, _ in browsergym_pages(cases)]


def browsergym_pages(cases: list[tuple[str, int]], read_js: str | None = None) -> list[tuple[str, object]]:
    """(instruction, what `read_js` evaluates to on the started page, None without it) for each
    (task, seed), from the replay of BrowserGym's start-up `_browsergym_instructions` describes."""
    from playwright.sync_api import sync_playwright

    from longhorizon.envs.web.browser import CHROMIUM_ARGS, DEFAULT_CHROMIUM
    from longhorizon.envs.web.miniwob import StaticServer, miniwob_html_dir

    server = StaticServer(miniwob_html_dir())
    instructions = []
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=DEFAULT_CHROMIUM, args=list(CHROMIUM_ARGS))
            try:
                page = browser.new_page(viewport={"width": 500, "height": 320})
                for task, seed in cases:
                    page.goto(f"{server.url}/miniwob/{task}.html")
                    number = int(np.random.RandomState(seed).randint(0, 1_000_000))
                    page.evaluate(f"Math.seedrandom({number}); core.EPISODE_MAX_TIME = 1000000; core.startEpisodeReal();")
                    page.wait_for_function("() => WOB_TASK_READY")
                    utterance = page.evaluate("() => core.getUtterance()")
                    if isinstance(utterance, dict):
                        utterance = utterance["utterance"]
                    read = page.evaluate(read_js) if read_js else None
                    instructions.append((" ".join(str(utterance).split()), read))
            finally:
                browser.close()
    finally:
        server.stop()
    return instructions


@pytest.mark.browser
@pytest.mark.slow
async def test_types_beyond_the_recorded_ones_give_browsergym_instruction_too():
    import trio

    from longhorizon.envs.web.miniwob import TASK_NAMES

    recorded = {record["task"] for record in FIXTURE}
    # One seed a type, a train seed and a test seed in turn, keeps the run to a few minutes.
    names = [name for name in TASK_NAMES if name not in recorded and name != "focus-text"]
    cases = [(name, (0, 1_000_000)[index % 2]) for index, name in enumerate(names)]
    want = await trio.to_thread.run_sync(_browsergym_instructions, cases)
    pool = BrowserPool(1)
    env = make_env("miniwob", task_names=sorted({name for name, _ in cases}), pool=pool)
    try:
        got = []
        for name, seed in cases:
            task = Task(env_name="miniwob", task_id=f"seed-{name}-{seed}", split="train", category=name,
                        data={"task": name, "seed": seed})
            observation, _ = await env.reset(task)
            got.append(observation.splitlines()[0].removeprefix("Goal: "))
        mismatched = [(case, mine, theirs) for case, mine, theirs in zip(cases, got, want) if mine != theirs]
        assert not mismatched, mismatched
    finally:
        await env.close()
        pool.close()
