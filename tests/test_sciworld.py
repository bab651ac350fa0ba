"""SciWorld on the real ScienceWorld simulator: task list, rewards, invalid actions, policies, JVM recycling."""

import random

import psutil
import pytest
from longhorizon.envs.base import (
    Task,
    action_from_reply,
    list_tasks,
    make_env,
    make_policy,
)
from longhorizon.envs.checker import check_env
from longhorizon.envs.sciworld.catalog import (
    ACTION_TEMPLATES,
    REFERENCE_TASK_NAMES,
    SCIENCEWORLD_TASKS,
    UNLISTED_TEMPLATES,
    reference_data_index,
)
from longhorizon.envs.sciworld.env import clamped_score, step_reward
from longhorizon.envs.sciworld.simulator import (
    SimulatorProcess,
    canonical_choices,
    sort_listed_lines,
)

pytestmark = pytest.mark.slow

FIND_TASK = "find-non-living-thing"  # the shortest gold paths (about 5 steps)


@pytest.fixture(scope="module")
def simulator():
    process = SimulatorProcess()
    yield process
    process.close()


def task_of(name: str, variation: int, split: str = "train") -> Task:
    return Task(env_name="sciworld", task_id=f"{split}-{name}-{variation}", split=split, category=name,
                data={"task_name": name, "variation": variation})


def jvm_alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


async def play(env, policy_name: str, task: Task, max_steps: int = 200, seed: int = 0):
    policy = make_policy("sciworld", policy_name)
    observation, _ = await env.reset(task, seed=seed)
    policy.reset(task, observation, random.Random(seed))
    total_reward, steps = 0.0, []
    for _ in range(max_steps):
        action = action_from_reply(policy.act(observation), env.prompt_format)
        observation, reward, terminated, _, info = await env.step(action)
        total_reward += reward
        steps.append((action, observation, reward, terminated, info))
        if terminated:
            break
    return total_reward, steps


def test_task_list_follows_the_reference_and_the_simulator_splits(simulator):
    # The recorded split table must match the live simulator's own splits.
    for info in SCIENCEWORLD_TASKS:
        simulator.start_episode(info.name, 0)
        server = simulator._wrapper
        assert server.get_max_variations(info.name) == info.total_variations
        assert server.get_variations_train() == list(range(info.train_end))
        assert server.get_variations_test() == list(range(info.dev_end, info.total_variations))
    assert len(REFERENCE_TASK_NAMES) == 23 and "grow-plant" not in REFERENCE_TASK_NAMES
    train = list_tasks("sciworld", "train")
    test = list_tasks("sciworld", "test")
    assert len(train) == sum(info.train_end for info in SCIENCEWORLD_TASKS if info.name in REFERENCE_TASK_NAMES)
    assert not {task.task_id for task in train} & {task.task_id for task in test}
    assert train[0].data == {"task_name": "boil", "variation": 0, "data_idx": 0} and train[0].category == "boil"
    # melt follows boil's 30 variations in the reference's flat list.
    assert reference_data_index("melt", 3) == 33 and reference_data_index("grow-plant", 0) is None
    small = list_tasks("sciworld", "test", task_names=["melt", "boil"], max_variations_per_task=2)
    assert [task.task_id for task in small] == ["test-boil-21", "test-boil-22", "test-melt-21", "test-melt-22"]
    with pytest.raises(ValueError, match="unknown sciworld task"):
        list_tasks("sciworld", "train", task_names=["bake-a-cake"])
    with pytest.raises(ValueError, match="recycle_after_episodes"):
        make_env("sciworld", recycle_after_episodes=0)


def test_prompt_lists_the_simulator_action_templates(simulator):
    simulator.start_episode("boil", 0)
    assert set(simulator._wrapper.get_possible_actions()) == set(ACTION_TEMPLATES) | UNLISTED_TEMPLATES
    instructions = make_env("sciworld").instructions()
    assert "- focus on OBJ:" in instructions and "Action:" in instructions and "reset task" not in instructions


def test_rewards_sum_to_the_clamped_final_score():
    assert step_reward(0, 25) == 0.25 and step_reward(25, 100) == 0.75
    # A failing action drops the score below zero: the earlier credit is taken back.
    assert step_reward(25, -100) == -0.25 and clamped_score(-100) == 0 and clamped_score(140) == 100


def test_canonical_text_orders_lists_and_renumbers_choices():
    text = "In it, you see:\n\tthe agent\n\ta cup\n\t\ton it: b\n\t\ton it: a\nYou also see:\n\tA door"
    assert sort_listed_lines(text) == ("In it, you see:\n\ta cup\n\t\ton it: a\n\t\ton it: b\n\tthe agent\n"
                                       "You also see:\n\tA door")
    question = "Ambiguous request: Please enter the number:\n0:\tlook at door to z\n1:\tlook at door to a\n"
    canonical, translation = canonical_choices(question)
    assert canonical == "Ambiguous request: Please enter the number:\n0:\tlook at door to a\n1:\tlook at door to z\n"
    assert translation == {"0": "1", "1": "0"}


async def test_episode_invalid_actions_and_gold_path():
    env = make_env("sciworld", task_names=[FIND_TASK])
    try:
        observation, info = await env.reset(task_of(FIND_TASK, 3))
        assert observation.startswith("Your task is to find a(n) non-living thing")
        assert "This outside location is called the outside" in observation and info["score"] == 0 and info["success"] is False
        for bad in ("jump over the moon", "   ", 17):
            observation, reward, terminated, truncated, info = await env.step(bad)
            assert info["invalid_action"] is True and reward == 0.0 and not terminated and not truncated
        assert observation.startswith("An empty action")
        observation, *_ , info = await env.step("jump over the moon")
        assert observation == "No known action matches that input."
        total_reward, steps = await play(env, "oracle", task_of(FIND_TASK, 3))
        assert steps[-1][3] and steps[-1][4]["success"] and steps[-1][4]["score"] == 100
        assert total_reward == pytest.approx(1.0)
        with pytest.raises(RuntimeError, match="terminated"):
            await env.step("look around")
        # Focusing on the agent is a wrong focus when looking for a plant: the task fails.
        await env.reset(task_of("find-plant", 0))
        observation, reward, terminated, _, info = await env.step("focus on agent")
        assert terminated and info["score"] < 0 and not info["success"] and reward == 0.0
    finally:
        pid = env.jvm_pid
        await env.close()
    assert env.jvm_pid is None and not jvm_alive(pid)


async def test_oracle_reaches_score_100_on_a_sample_of_tasks():
    env = make_env("sciworld")
    sample = [task_of("boil", 5), task_of("power-component", 2), task_of("chemistry-mix-paint-secondary-color", 1),
              task_of("lifespan-shortest-lived", 40), task_of("find-animal", 200, "test")]
    try:
        for task in sample:
            total_reward, steps = await play(env, "oracle", task)
            assert steps[-1][4]["score"] == 100, (task.task_id, steps[-1][1])
            assert total_reward == pytest.approx(1.0)
    finally:
        await env.close()


async def test_recycles_the_jvm_after_n_episodes_and_after_a_crash():
    env = make_env("sciworld", task_names=[FIND_TASK], recycle_after_episodes=2)
    task = task_of(FIND_TASK, 0)
    try:
        await env.reset(task)
        first_pid = env.jvm_pid
        await env.reset(task)
        assert env.jvm_pid == first_pid
        await env.reset(task)
        second_pid = env.jvm_pid
        assert second_pid != first_pid and not jvm_alive(first_pid)
        # A JVM killed mid-episode is replaced, the episode replayed, and the step still answered.
        await env.step("open door to kitchen")
        observation_before, *_ = await env.step("look around")
        psutil.Process(second_pid).kill()
        psutil.Process(second_pid).wait(timeout=10)
        observation, _, _, _, info = await env.step("look around")
        assert env.jvm_pid not in (None, first_pid, second_pid) and env.simulators_started == 3
        assert observation == observation_before and "kitchen (that is open)" in observation
        assert not info["invalid_action"]
    finally:
        await env.close()


async def test_passes_the_env_checker_with_random_and_oracle():
    options = {"task_names": [FIND_TASK, "boil"], "max_variations_per_task": 2}
    await check_env("sciworld", options, num_tasks=3, max_steps=12)
    await check_env("sciworld", {"task_names": [FIND_TASK]}, num_tasks=1, max_steps=20, policy="oracle")
