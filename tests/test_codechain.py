"""The codechain env: deterministic tasks, a held-out split of unseen chains, hard tasks that need
the long cap, progress rewards, and its scripted policies."""

from collections import Counter

import pytest

from longhorizon.actor.engines.base import EngineSettings, make_engine
from longhorizon.actor.rollout import run_episode
from longhorizon.envs.base import Task, list_tasks, make_env, make_policy
from longhorizon.envs.checker import check_env
from longhorizon.envs.toy.codechain import (
    CodechainEnv, basic_symbol_words, deep_symbol_words, is_test_chain, make_codebook, vocabulary,
)

BASIC = basic_symbol_words(4)
DEEP = deep_symbol_words(4, 4)


def _chains(split: str, **options) -> list[tuple[str, ...]]:
    return [tuple(task.data["symbols"]) for task in list_tasks("codechain", split, **options)]


def _hand_task(symbols: list[str]) -> Task:
    return Task(env_name="codechain", task_id="hand", split="train", data={"symbols": symbols})


def test_tasks_are_deterministic_and_lengths_evenly_spread():
    assert list_tasks("codechain", "train") == list_tasks("codechain", "train")
    assert list_tasks("codechain", "test") == list_tasks("codechain", "test")
    lengths = Counter(len(chain) for chain in _chains("train"))
    assert sorted(lengths) == [2, 3, 4, 5, 6, 7, 8]
    assert max(lengths.values()) - min(lengths.values()) <= 1
    assert _chains("train", codebook_seed=1) == _chains("train")  # the codebook seed changes answers, not tasks


def test_no_test_chain_occurs_in_training():
    train, test = _chains("train"), _chains("test")
    assert len(train) == 2000 and len(test) == 200
    assert not set(train) & set(test)
    assert all(is_test_chain(chain) for chain in test)
    assert not any(is_test_chain(chain) for chain in train)
    # Every length is tested, so held-out success covers easy and hard tasks.
    assert {len(chain) for chain in test} == set(range(2, 9))
    categories = {task.category for task in list_tasks("codechain", "test")}
    assert {"easy-02", "easy-03", "hard-04", "hard-08"} <= categories


def test_deep_symbols_appear_only_after_the_basic_turns():
    for chain in _chains("train") + _chains("test"):
        assert all(symbol in BASIC for symbol in chain[:3])
        assert all(symbol in DEEP for symbol in chain[3:])


def test_codebook_uses_every_action_in_each_symbol_group():
    codebook = make_codebook(4, 4, 4, codebook_seed=0)
    assert sorted(codebook[symbol] for symbol in BASIC) == ["a0", "a1", "a2", "a3"]
    assert sorted(codebook[symbol] for symbol in DEEP) == ["a0", "a1", "a2", "a3"]
    assert make_codebook(4, 4, 4, codebook_seed=0) == codebook
    assert vocabulary() == [*BASIC, *DEEP, "a0", "a1", "a2", "a3"]


async def test_reward_is_progress_until_the_first_mistake():
    env = CodechainEnv()
    answer = env.codebook
    wrong_for_s1 = next(action for action in ("a0", "a1", "a2", "a3") if action != answer["s1"])
    observation, info = await env.reset(_hand_task(["s0", "s1", "s2", "s4"]))
    assert observation == "s0" and info["success"] is False
    rewards = []
    for action in (answer["s0"], wrong_for_s1, answer["s2"], answer["s4"]):
        observation, reward, terminated, truncated, info = await env.step(action)
        rewards.append(reward)
    assert rewards == [0.25, 0.0, 0.0, 0.0]  # the episode ran on after the mistake, unpaid
    assert terminated is True and truncated is False and info["success"] is False

    await env.reset(_hand_task(["s3", "s5"]))
    _, first, _, _, _ = await env.step(f" {answer['s3']}\n")
    _, second, terminated, _, info = await env.step(answer["s5"])
    assert (first, second, terminated, info["success"]) == (0.5, 0.5, True, True)


async def test_bad_tasks_and_steps_outside_an_episode_raise():
    env = CodechainEnv()
    with pytest.raises(RuntimeError, match="reset"):
        await env.step("a0")
    with pytest.raises(ValueError, match="data\\['symbols'\\]"):
        await env.reset(_hand_task(["s0", "s9"]))
    with pytest.raises(ValueError, match="1 to 8 words"):
        await env.reset(_hand_task(["s0"] * 9))
    await env.reset(_hand_task(["s0"]))
    await env.step("a0")
    with pytest.raises(RuntimeError, match="terminated"):
        await env.step("a0")


def test_bad_options_name_the_fix():
    with pytest.raises(ValueError, match="min_turns <= max_turns"):
        CodechainEnv(min_turns=5, max_turns=4)
    with pytest.raises(ValueError, match="basic_turns must be a positive integer"):
        CodechainEnv(basic_turns=0)
    with pytest.raises(ValueError, match="env.options.basic_turns must be >= 1, got 0"):
        list_tasks("codechain", "train", basic_turns=0)
    with pytest.raises(ValueError, match=r"no test chain of length \d+ exists"):
        list_tasks("codechain", "test", min_turns=1, num_basic_symbols=2)


async def test_checker_passes():
    await check_env("codechain")
    await check_env("codechain", policy="oracle")


def _engine(policy: str):
    return make_engine("scripted", EngineSettings(env_name="codechain", env_options={}, scripted_policy=policy))


async def _play(engine, task, cap):
    return await run_episode(make_env("codechain"), engine, task, horizon_cap=cap, max_context_tokens=1000,
                             max_new_tokens=4)


async def test_hard_tasks_need_a_cap_as_long_as_the_chain():
    oracle = _engine("oracle")
    for task in list_tasks("codechain", "test")[:21]:
        length = len(task.data["symbols"])
        full = await _play(oracle, task, cap=length)
        assert full.success and full.terminated and full.num_turns == length
        if length > 2:
            cut = await _play(oracle, task, cap=length - 1)
            assert not cut.success and cut.truncated and cut.num_turns == length - 1
            assert cut.reward == pytest.approx((length - 1) / length)  # progress earned before the cut


async def test_a_policy_that_knows_only_the_basic_symbols_fails_the_hard_tasks():
    basic_only = _engine("basic-only")
    results = {"easy": [], "hard": []}
    for task in list_tasks("codechain", "test"):
        result = await _play(basic_only, task, cap=8)
        results[task.category.split("-")[0]].append(result.success)
    assert all(results["easy"])
    # It guesses a0 for every deep symbol: right only for the one deep symbol a0 answers.
    assert sum(results["hard"]) / len(results["hard"]) < 0.15


def test_policies_accept_the_env_options():
    options = {"min_turns": 3, "max_turns": 5, "basic_turns": 2}
    for name in ("oracle", "basic-only", "random"):
        make_policy("codechain", name, **options)
