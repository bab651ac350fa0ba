"""The codebook toy env: hand-built episodes, rewards, tasks, vocabulary and its scripted policies."""

import random

import pytest

from longhorizon.envs.base import Task, list_tasks, make_env, make_policy
from longhorizon.envs.toy.codebook import CodebookEnv, make_codebook, task_symbols, vocabulary


def hand_task(symbols: list[str]) -> Task:
    return Task(env_name="codebook", task_id="hand", split="train", data={"symbols": symbols})


def test_codebook_is_a_fixed_permutation_of_the_actions():
    codebook = make_codebook(num_symbols=4, num_actions=4, codebook_seed=0)
    assert sorted(codebook) == ["s0", "s1", "s2", "s3"]
    assert sorted(codebook.values()) == ["a0", "a1", "a2", "a3"]
    assert make_codebook(4, 4, 0) == codebook
    assert any(make_codebook(4, 4, seed) != codebook for seed in range(1, 6))


def test_more_symbols_than_actions_reuse_actions():
    codebook = make_codebook(num_symbols=5, num_actions=2, codebook_seed=3)
    assert set(codebook.values()) == {"a0", "a1"}
    assert len(codebook) == 5


async def test_hand_built_episode_gives_partial_credit_at_the_end():
    env = CodebookEnv()
    codebook = env.codebook
    wrong_for_s1 = next(action for action in ("a0", "a1", "a2", "a3") if action != codebook["s1"])
    observation, info = await env.reset(hand_task(["s2", "s1", "s3"]))
    assert observation == "s2"
    assert info["success"] is False

    observation, reward, terminated, truncated, info = await env.step(f"  {codebook['s2']}\n")
    assert (observation, reward, terminated, truncated) == ("s1", 0.0, False, False)
    assert info["correct"] is True and info["success"] is False

    observation, reward, terminated, truncated, info = await env.step(wrong_for_s1)
    assert (observation, reward, terminated, truncated) == ("s3", 0.0, False, False)
    assert info["correct"] is False and info["invalid_action"] is False

    observation, reward, terminated, truncated, info = await env.step(codebook["s3"])
    assert reward == pytest.approx(2 / 3)
    assert terminated is True and truncated is False
    assert info["success"] is False


async def test_all_right_is_success_with_reward_one():
    env = CodebookEnv()
    await env.reset(hand_task(["s0", "s0", "s3"]))
    for symbol in ("s0", "s0"):
        _, reward, terminated, _, _ = await env.step(env.codebook[symbol])
        assert (reward, terminated) == (0.0, False)
    _, reward, terminated, _, info = await env.step(env.codebook["s3"])
    assert (reward, terminated, info["success"]) == (1.0, True, True)


async def test_garbage_replies_are_wrong_not_errors():
    env = CodebookEnv(num_turns=2)
    await env.reset(hand_task(["s1", "s2"]))
    _, _, _, _, info = await env.step("Thought: no idea")
    assert info["correct"] is False
    _, reward, terminated, _, info = await env.step("")
    assert (reward, terminated, info["success"]) == (0.0, True, False)


async def test_step_outside_an_episode_raises():
    env = CodebookEnv(num_turns=1)
    with pytest.raises(RuntimeError, match="reset"):
        await env.step("a0")
    await env.reset(hand_task(["s0"]))
    await env.step("a0")
    with pytest.raises(RuntimeError, match="terminated"):
        await env.step("a0")
    observation, _ = await env.reset(hand_task(["s3"]))
    assert observation == "s3"
    await env.close()
    await env.close()


async def test_reset_rejects_a_task_with_wrong_symbols():
    env = CodebookEnv()
    with pytest.raises(ValueError, match="symbols"):
        await env.reset(hand_task(["s0", "s9", "s1"]))
    with pytest.raises(ValueError, match="symbols"):
        await env.reset(hand_task(["s0"]))


def test_tasks_are_deterministic_and_splits_disjoint():
    train = list_tasks("codebook", "train")
    test = list_tasks("codebook", "test")
    assert (len(train), len(test)) == (2000, 200)
    assert not {task.task_id for task in train} & {task.task_id for task in test}
    assert len({task.task_id for task in train}) == 2000
    assert train[17].task_id == "train-17"
    assert train[17].data["symbols"] == task_symbols("train-17", 3, 4)
    assert list_tasks("codebook", "train") == train
    long_tasks = list_tasks("codebook", "test", num_turns=5, num_symbols=6)
    assert all(len(task.data["symbols"]) == 5 for task in long_tasks)
    assert {symbol for task in long_tasks for symbol in task.data["symbols"]} == {f"s{index}" for index in range(6)}


def test_vocabulary_lists_every_word():
    assert vocabulary() == ["s0", "s1", "s2", "s3", "a0", "a1", "a2", "a3"]
    assert vocabulary(num_symbols=2, num_actions=3) == ["s0", "s1", "a0", "a1", "a2"]


def test_bad_options_are_rejected_clearly():
    with pytest.raises(ValueError, match="num_turns"):
        CodebookEnv(num_turns=0)
    with pytest.raises(ValueError, match="num_actions"):
        vocabulary(num_actions="4")


async def run_policy(policy_name: str, num_episodes: int, seed: int) -> float:
    env = make_env("codebook")
    tasks = list_tasks("codebook", "train")
    policy = make_policy("codebook", policy_name)
    rng = random.Random(seed)
    successes = 0
    for task in tasks[:num_episodes]:
        observation, _ = await env.reset(task)
        policy.reset(task, observation, rng)
        terminated = False
        while not terminated:
            observation, _, terminated, _, info = await env.step(policy.act(observation))
        successes += info["success"]
    return successes / num_episodes


async def test_oracle_always_succeeds():
    assert await run_policy("oracle", 200, seed=0) == 1.0


async def test_random_policy_succeeds_about_one_time_in_64():
    # (1/4)^3 = 1.56%; over 2000 episodes the binomial standard deviation is about 0.28%.
    success_rate = await run_policy("random", 2000, seed=1)
    assert 0.005 < success_rate < 0.03


def test_held_out_sequences_keep_every_test_sequence_out_of_training():
    from longhorizon.envs.toy.codebook import is_test_sequence, tasks

    train = [tuple(t.data["symbols"]) for t in tasks("train", held_out_sequences=True)]
    test = [tuple(t.data["symbols"]) for t in tasks("test", held_out_sequences=True)]
    assert not set(train) & set(test) and len(set(test)) >= 5 and len(set(train)) >= 40
    assert all(is_test_sequence(s) for s in test) and not any(is_test_sequence(s) for s in train)
    # By default the splits draw independently: with 64 sequences all test ones occur in training.
    assert set(tuple(t.data["symbols"]) for t in tasks("test")) <= set(tuple(t.data["symbols"]) for t in tasks("train"))
    # The option reaches the env and its policies like every other option.
    from longhorizon.envs.base import get_env_spec, make_env

    make_env("codebook", held_out_sequences=True)
    get_env_spec("codebook").policies["oracle"](held_out_sequences=True)
    with pytest.raises(ValueError, match="must be true or false"):
        tasks("test", held_out_sequences="yes")
    with pytest.raises(ValueError, match="no test sequence"):
        tasks("test", num_turns=1, num_symbols=1, held_out_sequences=True)
