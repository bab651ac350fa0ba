"""The longtail env: hand-played episodes, its length mixture's tail, its policies, the checker."""

import random
from collections import Counter

import pytest

from longhorizon.actor.engines.base import EngineSettings
from longhorizon.actor.engines.scripted import ScriptedEngine
from longhorizon.actor.rollout import EnvPool, run_group
from longhorizon.envs.base import Task, env_names, get_env_spec, list_tasks, make_env, make_policy
from longhorizon.envs.checker import check_env
from longhorizon.envs.toy.longtail import COLOURS, LengthDistribution, LongTailEnv, LongTailPolicy, task_answer


def hand_task(answer: str = "blue") -> Task:
    return Task(env_name="longtail", task_id="hand", split="train", data={"answer": answer})


async def test_continue_then_right_answer_ends_with_reward_one():
    env = LongTailEnv()
    observation, info = await env.reset(hand_task("blue"))
    assert "answer: <colour>" in observation and info == {"success": False, "invalid_action": False}
    for _ in range(3):
        assert await env.step("continue: step 1 of the work") == (
            "ok", 0.0, False, False, {"success": False, "invalid_action": False}
        )
    observation, reward, terminated, truncated, info = await env.step("final answer: Blue ")
    assert (observation, reward, terminated, truncated, info["success"]) == ("right answer", 1.0, True, False, True)
    with pytest.raises(RuntimeError):
        await env.step("continue")


async def test_wrong_colour_ends_with_reward_zero_and_bad_replies_do_not_end():
    env = LongTailEnv()
    await env.reset(hand_task("red"))
    for bad_reply in ("let me think", "answer: purple", ""):
        observation, reward, terminated, truncated, info = await env.step(bad_reply)
        assert (reward, terminated, truncated, info["invalid_action"]) == (0.0, False, False, True)
        assert observation.startswith("invalid action")
    observation, reward, terminated, _, info = await env.step("answer: green")
    assert (observation, reward, terminated, info["success"]) == ("wrong answer", 0.0, True, False)


async def test_step_before_reset_and_bad_task_data_are_clear_errors():
    env = LongTailEnv()
    with pytest.raises(RuntimeError, match="reset"):
        await env.step("continue")
    with pytest.raises(ValueError, match="data\\['answer'\\]"):
        await env.reset(hand_task("purple"))


def test_tasks_are_stable_split_apart_and_carry_their_answer():
    train = list_tasks("longtail", "train")
    test = list_tasks("longtail", "test")
    assert (len(train), len(test)) == (1000, 100)
    assert not {t.task_id for t in train} & {t.task_id for t in test}
    assert all(t.data["answer"] == task_answer(t.task_id) for t in train)
    assert list_tasks("longtail", "train") == train
    # Answers are spread over the colours, so no constant answer is right everywhere.
    assert set(Counter(t.data["answer"] for t in train)) == set(COLOURS)


def test_bad_options_name_the_option():
    with pytest.raises(ValueError, match="long_turns"):
        make_env("longtail", long_turns=[30, 15])
    with pytest.raises(ValueError, match="long_fraction"):
        make_env("longtail", long_fraction=1.5)
    with pytest.raises(ValueError, match="answer_accuracy"):
        make_policy("longtail", "oracle", answer_accuracy=-0.1)
    with pytest.raises(ValueError, match="unknown option"):
        make_env("longtail", long_tail=0.2)


def test_length_mixture_has_a_long_tail():
    lengths = LengthDistribution()
    rng = random.Random(7)
    draws = [lengths.draw(rng) for _ in range(20000)]
    assert set(draws) <= set(range(1, 4)) | set(range(15, 31))
    long_share = sum(d >= 15 for d in draws) / len(draws)
    assert long_share == pytest.approx(0.125, abs=0.01)
    assert max(draws) == 30 and min(draws) == 1
    # Mean (1-0.125)*2 + 0.125*22.5 = 4.5625, while the median stays at a short episode.
    assert lengths.mean() == pytest.approx(4.5625)
    assert sum(draws) / len(draws) == pytest.approx(4.5625, abs=0.15)
    assert sorted(draws)[len(draws) // 2] <= 3


def test_length_mixture_is_an_option():
    rng = random.Random(0)
    only_long = LengthDistribution(long_fraction=1.0, long_turns=[5, 6])
    assert {only_long.draw(rng) for _ in range(200)} == {5, 6}
    only_short = LengthDistribution(long_fraction=0.0, short_turns=(2, 2))
    assert {only_short.draw(rng) for _ in range(200)} == {2}
    assert only_short.max_turns == 30


async def play(policy: LongTailPolicy, task: Task, seed: int) -> tuple[list[str], float]:
    env = LongTailEnv()
    observation, _ = await env.reset(task)
    policy.reset(task, observation, random.Random(seed))
    replies = []
    while True:
        reply = policy.act(observation)
        replies.append(reply)
        observation, reward, terminated, _, _ = await env.step(reply)
        if terminated:
            return replies, reward


async def test_policy_plays_its_drawn_length_with_short_replies_and_is_deterministic():
    task = list_tasks("longtail", "train")[3]
    policy = make_policy("longtail", "oracle")
    for seed in range(40):
        replies, reward = await play(policy, task, seed)
        assert len(replies) == policy.planned_turns
        assert all(10 <= len(reply.encode()) <= 30 for reply in replies)
        assert reward == float(policy.final_answer == task.data["answer"])
        assert (await play(make_policy("longtail", "oracle"), task, seed)) == (replies, reward)


async def test_group_members_differ_in_length_and_reward_varies():
    task = list_tasks("longtail", "train")[0]
    outcomes = [await play(LongTailPolicy(), task, seed) for seed in range(400)]
    lengths = [len(replies) for replies, _ in outcomes]
    rewards = [reward for _, reward in outcomes]
    assert sum(rewards) / len(rewards) == pytest.approx(0.5, abs=0.07)
    assert len(set(lengths)) > 10
    assert any(length >= 15 for length in lengths)


async def test_groups_through_the_scripted_engine_differ_in_length_and_reward():
    engine = ScriptedEngine(EngineSettings(env_name="longtail", scripted_policy="oracle", seed=3))
    pool = EnvPool(lambda: make_env("longtail"))
    task = list_tasks("longtail", "train")[5]
    lengths, rewards, largest_token_id = [], [], 0
    for group in range(6):
        trajectories = await run_group(
            engine, pool, task, group_size=8, group_id=f"g{group}", actor_id="actor-0", horizon_cap=30,
            max_context_tokens=4096, max_new_tokens=64, seed=group, on_trajectory=_ignore,
        )
        assert all(t.terminated and not t.error for t in trajectories)
        lengths += [t.num_turns for t in trajectories]
        rewards += [t.reward for t in trajectories]
        largest_token_id = max([largest_token_id] + [int(t.token_ids.max()) for t in trajectories])
    assert len(set(lengths)) >= 3 and max(lengths) >= 15
    assert set(rewards) == {0.0, 1.0}
    # Byte-tokenizer ids only (bytes and three specials): the bench model's vocabulary covers them.
    assert largest_token_id < 259


async def _ignore(trajectory) -> None:
    pass


async def test_checker_passes_for_both_policies():
    assert "longtail" in env_names()
    assert {"oracle", "random"} <= set(get_env_spec("longtail").policies)
    await check_env("longtail")
    await check_env("longtail", policy="oracle", num_tasks=5)
    await check_env("longtail", {"long_fraction": 0.5, "long_turns": [4, 8]}, split="test", policy="oracle")
