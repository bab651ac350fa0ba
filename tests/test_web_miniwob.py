"""MiniWoB++ in a real Chromium: the task list, the oracles reaching reward 1, wrong answers, the time limit."""

from __future__ import annotations

import random
import re

import pytest

from longhorizon.envs.base import action_from_reply, get_env_spec, list_tasks, make_env, make_policy
from longhorizon.envs.checker import check_env
from longhorizon.envs.web.browser import BrowserPool
from longhorizon.envs.web.miniwob import (
    ALL_TASK_NAMES, ORACLE_TASKS, TASK_NAMES, TEST_SEED_BASE, UNREGISTERED, VISUAL_TASKS,
)
from longhorizon.envs.web.policies import parse_nodes
from tests.fakes import InterruptedEngine


def test_tasks_cover_every_registered_type_the_picture_ones_with_screenshots_in_both_splits():
    import gymnasium

    import miniwob  # noqa: F401  (registers the task types with gymnasium)

    registered = {name.removeprefix("miniwob/").removesuffix("-v1") for name in gymnasium.registry
                  if name.startswith("miniwob/") and not name.startswith("miniwob/flight.")}
    assert len(registered) == 125 and len(TASK_NAMES) == len(set(TASK_NAMES)) == 103
    assert set(TASK_NAMES) | set(VISUAL_TASKS) == set(ALL_TASK_NAMES) == registered
    assert not set(TASK_NAMES) & set(VISUAL_TASKS) and len(VISUAL_TASKS) == 22
    assert all(reason for reason in VISUAL_TASKS.values()) and not set(UNREGISTERED) & registered
    train = list_tasks("miniwob", "train", instances_per_task=2)
    test = list_tasks("miniwob", "test", instances_per_task=2)
    assert len(train) == len(test) == 2 * len(TASK_NAMES)
    assert {task.category for task in train} == {task.category for task in test} == set(TASK_NAMES)
    assert {task.data["seed"] for task in train} == {0, 1}
    assert {task.data["seed"] for task in test} == {TEST_SEED_BASE, TEST_SEED_BASE + 1}
    assert train[0].task_id == f"train-{TASK_NAMES[0]}-0" and train == list_tasks("miniwob", "train", instances_per_task=2)
    assert set(ORACLE_TASKS) <= set(TASK_NAMES) and len(ORACLE_TASKS) >= 5
    # The picture types, named, with an image in the observation; refused in words without one.
    visual = list_tasks("miniwob", "test", task_names=["click-color", "count-sides"], instances_per_task=1,
                        observation_modes=["text", "screenshot"])
    assert [(task.category, task.data["seed"]) for task in visual] == [("click-color", TEST_SEED_BASE),
                                                                       ("count-sides", TEST_SEED_BASE)]
    assert len(list_tasks("miniwob", "train", task_names=list(ALL_TASK_NAMES), observation_modes=["som"],
                          instances_per_task=1)) == 125
    with pytest.raises(ValueError, match=r"click-color show their problem only in a picture .*add \"screenshot\" or \"som\""):
        list_tasks("miniwob", "train", task_names=["click-button", "click-color"])
    with pytest.raises(ValueError, match="only in a picture"):
        make_env("miniwob", task_names=["click-color"], observation_modes=["text"])
    for bad in ({"task_names": ["chase-circle"]}, {"task_names": []}, {"instances_per_task": 0}, {"reward_mode": "shaped"},
                {"time_limit_s": -1}):
        with pytest.raises(ValueError):
            list_tasks("miniwob", "train", **bad)
    with pytest.raises(ValueError, match="unknown option"):
        make_env("miniwob", horizon=3)
    assert set(get_env_spec("miniwob").policies) == {"oracle", "random"}


@pytest.fixture(scope="module")
def pool():
    browser_pool = BrowserPool(1)
    yield browser_pool
    browser_pool.close()


async def _play(env, task, policy_name, options, max_steps=10):
    observation, _ = await env.reset(task)
    policy = make_policy("miniwob", policy_name, **options)
    policy.reset(task, observation, random.Random(0))
    for _ in range(max_steps):
        action = action_from_reply(policy.act(observation), env.prompt_format)
        observation, reward, terminated, truncated, info = await env.step(action)
        if terminated or truncated:
            return reward, info
    raise AssertionError(f"{task.task_id}: no end in {max_steps} steps")


def test_the_page_server_queues_the_connections_of_many_pages_loading_at_once():
    """Dozens of episodes load their pages together, each fetching several files. Connections the
    server has not accepted yet wait in the kernel's queue; past its length they are dropped and
    Chromium retries them seconds later, so page loads ran out their time (the queue was 5 long).
    Here the server accepts nothing, and 64 connections must still be made at once."""
    import functools
    import socket

    from longhorizon.envs.web.miniwob import _QuietHandler, _Server

    server = _Server(("127.0.0.1", 0), functools.partial(_QuietHandler, directory="."))
    connections = []
    try:
        for _ in range(64):
            connections.append(socket.create_connection(server.server_address, timeout=2))
    finally:
        for connection in connections:
            connection.close()
        server.server_close()
    assert len(connections) == 64


@pytest.mark.browser
async def test_instruction_wrong_answers_and_time_limit(pool):
    options = {"task_names": ["click-button"], "instances_per_task": 1, "pool": pool}
    env = make_env("miniwob", **options)
    try:
        (task,) = list_tasks("miniwob", "train", **options)
        observation, _ = await env.reset(task)
        goal = observation.splitlines()[0]
        assert goal.startswith('Goal: Click on the "') and goal.endswith('" button.')
        wanted = goal.split('"')[1]
        assert f"StaticText '{goal.removeprefix('Goal: ')}'" in observation  # the page's own #query text
        again, _ = await env.reset(task)
        assert again == observation  # the seed fixes the problem
        wrong = next(node for node in parse_nodes(observation) if node.role == "button" and node.name != wanted)
        observation, reward, terminated, _, info = await env.step(f"click({wrong.bid!r})")
        assert terminated and (reward, info["success"], info["raw_reward"]) == (-1.0, False, -1.0)

        await env.reset(task)
        _, reward, terminated, _, info = await env.step("stop()")
        assert terminated and (reward, info["success"]) == (0.0, False)
    finally:
        await env.close()

    hurried = make_env("miniwob", task_names=["click-button"], instances_per_task=1, time_limit_s=0.3,
                       reward_mode="success", pool=pool)
    try:
        observation, _ = await hurried.reset(task)
        _, reward, terminated, _, info = await hurried.step("noop(600)")
        assert terminated and reward == 0.0 and info["raw_reward"] == -1.0 and info["reward_reason"] == "timed out"
    finally:
        await hurried.close()


@pytest.mark.browser
async def test_winning_another_task_page_does_not_score_this_episode(pool):
    options = {"task_names": ["click-button"], "instances_per_task": 1, "pool": pool}
    env = make_env("miniwob", **options)
    try:
        (task,) = list_tasks("miniwob", "train", **options)
        await env.reset(task)
        observation, _, terminated, _, _ = await env.step("goto('__MINIWOB__/miniwob/click-test.html')")
        assert not terminated and "click-test.html" in observation
        # Start the foreign task through its cover, then win it.
        cover = re.search(r"\[(\w+)\] generic\n\s+StaticText 'START'", observation)
        assert cover is not None, observation
        observation, reward, terminated, _, info = await env.step(f"click({cover.group(1)!r})")
        assert not terminated and reward == 0.0, info
        button = next(node for node in parse_nodes(observation) if node.role == "button" and node.name == "Click Me!")
        observation, reward, terminated, _, info = await env.step(f"click({button.bid!r})")
        assert not terminated and reward == 0.0, info
        _, reward, terminated, _, info = await env.step("stop()")
        assert terminated and (reward, info["success"]) == (0.0, False), info
    finally:
        await env.close()


@pytest.mark.browser
async def test_miniwob_keeps_the_env_contract(pool):
    await check_env(
        "miniwob",
        {"task_names": ["click-button", "enter-text"], "instances_per_task": 1, "pool": pool, "action_timeout_s": 2.0},
        num_tasks=2, policy="random", max_steps=4,
    )


@pytest.mark.browser
async def test_rollout_reports_a_killed_browser_as_a_failed_episode_and_goes_on(pool):
    import psutil

    from longhorizon.actor.engines.base import EngineSettings
    from longhorizon.actor.engines.scripted import ScriptedEngine
    from longhorizon.actor.rollout import EnvPool, run_episode, run_group

    options = {"task_names": ["enter-text"], "instances_per_task": 1, "pool": pool}
    (task,) = list_tasks("miniwob", "train", **options)
    engine = ScriptedEngine(EngineSettings(env_name="miniwob", env_options=options, scripted_policy="oracle"))
    envs = EnvPool(lambda: make_env("miniwob", **options))
    rollout = {"horizon_cap": 8, "max_context_tokens": 100_000, "max_new_tokens": 64}
    try:
        received = []

        async def on_trajectory(trajectory):
            received.append(trajectory)

        group = await run_group(engine, envs, task, group_size=2, group_id="g0", actor_id="a0", seed=0,
                                on_trajectory=on_trajectory, **rollout)
        assert [(t.success, t.reward, t.error) for t in group] == [(True, 1.0, "")] * 2 and len(received) == 2

        def kill_browsers():
            for pid in pool.browser_pids():
                psutil.Process(pid).kill()

        env = envs.acquire()
        failed = await run_episode(env, InterruptedEngine(engine, turn=2, interrupt=kill_browsers), task,
                                   episode_id="killed", **rollout)
        assert "BrowserFailure" in failed.error and not failed.success and failed.num_turns == 2
        again = await run_episode(env, engine, task, episode_id="after", **rollout)  # the same env instance
        assert (again.error, again.success, again.reward) == ("", True, 1.0)
    finally:
        await envs.close()


@pytest.mark.browser
def test_bench_web_prints_a_table_then_json(capsys):
    import json

    from longhorizon.launch.bench.web import main

    assert main(["--contexts", "0"]) == 2
    assert main(["--contexts", "1,2", "--seconds", "0.5", "--resets", "1", "--steps", "3"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    result = json.loads(lines[-1])
    assert lines[0].startswith("web env on MiniWoB")
    assert [row["contexts"] for row in result["parallel"]] == [1, 2]
    assert all(row["steps_per_s"] > 0 and row["pss_per_context_mib"] > 0 for row in result["parallel"])
    assert result["launch_s"] > 0 and result["step_ms_median"] > 0 and result["reset_ms_median"] > 0
    # Each observation mode's time and memory: a screenshot costs a PNG per observation.
    assert main(["--contexts", "1", "--seconds", "0.2", "--resets", "1", "--steps", "2",
                 "--modes", "text,screenshot"]) == 0
    modes = {row["mode"]: row for row in json.loads(capsys.readouterr().out.strip().splitlines()[-1])["modes"]}
    assert modes["text"]["context_pss_mib"] > 0 and modes["screenshot"]["context_pss_mib"] > 0
    assert modes["screenshot"]["observation_kib"] > modes["text"]["observation_kib"] + 1
