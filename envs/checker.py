"""Checks that a registered env keeps the Env contract: return types, determinism, reuse, close."""

from __future__ import annotations

import contextlib
import math
import random
import re
from dataclasses import dataclass
from typing import Any

from longhorizon.envs.agents import AgentLoopError, get_agent_loop
from longhorizon.envs.base import Env, Task, action_from_reply, get_env_spec, list_tasks, make_env, make_policy


# Envs that start their own local servers (the web apps) get a free port per instance, which shows
# in the URLs they observe; determinism is about everything else.
_LOOPBACK_PORT = re.compile(r"\b(127\.0\.0\.1|localhost):\d+")


def _comparable(observation: str) -> str:
    return _LOOPBACK_PORT.sub(r"\1:PORT", observation)


class EnvCheckError(AssertionError):
    """An env broke its contract; the message says which task, which step and how."""


@dataclass(frozen=True)
class _StepRecord:
    action: str
    observation: str
    reward: float
    terminated: bool
    truncated: bool
    success: bool
    invalid_action: bool


@dataclass(frozen=True)
class _Episode:
    first_observation: str
    steps: tuple[_StepRecord, ...]

    @property
    def terminated(self) -> bool:
        return bool(self.steps) and self.steps[-1].terminated


def _fail(context: str, problem: str) -> EnvCheckError:
    return EnvCheckError(f"{context}: {problem}")


def _check_info(info: Any, context: str) -> None:
    if not isinstance(info, dict):
        raise _fail(context, f"info must be a dict, got {type(info).__name__}")
    if not isinstance(info.get("success"), bool):
        raise _fail(context, f"info['success'] must be a bool, got {info.get('success')!r}")
    if "invalid_action" in info and not isinstance(info["invalid_action"], bool):
        raise _fail(context, f"info['invalid_action'] must be a bool, got {info['invalid_action']!r}")


async def _reset(env: Env, task: Task, seed: int, context: str) -> str:
    try:
        result = await env.reset(task, seed=seed)
    except Exception as error:
        raise _fail(context, f"reset raised {error!r}") from error
    if not isinstance(result, tuple) or len(result) != 2:
        raise _fail(context, f"reset must return (observation, info), got {result!r}")
    observation, info = result
    if not isinstance(observation, str):
        raise _fail(context, f"the first observation must be a str, got {type(observation).__name__}")
    _check_info(info, f"{context}, reset")
    return _comparable(observation)


async def _step(env: Env, action: str, context: str) -> _StepRecord:
    try:
        result = await env.step(action)
    except Exception as error:
        raise _fail(context, f"step({action!r}) raised {error!r}") from error
    if not isinstance(result, tuple) or len(result) != 5:
        raise _fail(context, f"step must return (observation, reward, terminated, truncated, info), got {result!r}")
    observation, reward, terminated, truncated, info = result
    if not isinstance(observation, str):
        raise _fail(context, f"the observation must be a str, got {type(observation).__name__}")
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        raise _fail(context, f"the reward must be a finite number, got {reward!r}")
    if not isinstance(terminated, bool) or not isinstance(truncated, bool):
        raise _fail(context, f"terminated and truncated must be bools, got {terminated!r}, {truncated!r}")
    _check_info(info, context)
    return _StepRecord(
        action=action,
        observation=_comparable(observation),
        reward=float(reward),
        terminated=terminated,
        truncated=truncated,
        success=info["success"],
        invalid_action=bool(info.get("invalid_action", False)),
    )


async def _play(
    env_name: str, env: Env, task: Task, seed: int, policy_name: str, options: dict, max_steps: int, context: str
) -> _Episode:
    """One episode driven by a fresh scripted policy whose randomness comes from `seed`."""
    policy = make_policy(env_name, policy_name, **options)
    observation = await _reset(env, task, seed, context)
    first_observation = observation
    policy.reset(task, observation, random.Random(seed))
    steps = []
    for step_index in range(max_steps):
        action = action_from_reply(policy.act(observation), env.prompt_format)
        record = await _step(env, action, f"{context}, step {step_index}")
        steps.append(record)
        observation = record.observation
        if record.terminated or record.truncated:
            break
    return _Episode(first_observation, tuple(steps))


async def _replay(env: Env, task: Task, seed: int, actions: list[str], context: str) -> _Episode:
    first_observation = await _reset(env, task, seed, context)
    steps = []
    for step_index, action in enumerate(actions):
        steps.append(await _step(env, action, f"{context}, step {step_index}"))
        if steps[-1].terminated or steps[-1].truncated:
            break
    return _Episode(first_observation, tuple(steps))


def _compare(expected: _Episode, actual: _Episode, context: str) -> None:
    if expected.first_observation != actual.first_observation:
        raise _fail(context, "the same task and seed gave different first observations:\n"
                             f"  first: {expected.first_observation[:200]!r}\n"
                             f"  then:  {actual.first_observation[:200]!r}")
    if len(expected.steps) != len(actual.steps):
        raise _fail(context, f"the same actions ended after {len(expected.steps)} and then {len(actual.steps)} steps")
    for index, (first, then) in enumerate(zip(expected.steps, actual.steps)):
        if first != then:
            raise _fail(context, f"step {index} ({first.action!r}) differed between identical runs:\n"
                                 f"  first: {first}\n  then:  {then}")


async def _check_finished_episode_refuses_steps(env: Env, episode: _Episode, context: str) -> None:
    last_observation = episode.steps[-1].observation
    try:
        await env.step(episode.steps[-1].action)
    except RuntimeError:
        return
    except Exception as error:
        raise _fail(context, f"step after termination must raise RuntimeError, raised {error!r}") from error
    raise _fail(context, f"step after termination must raise RuntimeError (last observation {last_observation[:80]!r})")


async def _close_twice(env: Env, context: str) -> None:
    for attempt in ("first", "second"):
        try:
            await env.close()
        except Exception as error:
            raise _fail(context, f"the {attempt} close() raised {error!r}; close must be idempotent") from error


async def check_env(
    env_name: str,
    options: dict | None = None,
    *,
    split: str = "train",
    num_tasks: int = 3,
    seed: int = 0,
    policy: str = "random",
    max_steps: int = 50,
) -> None:
    """Raise EnvCheckError on the first broken rule of the Env contract, else return None.

    For each of the first `num_tasks` tasks of the split: an episode played by the scripted
    policy must have well-typed returns and info["success"]; the same task, seed and actions must
    give identical observations and rewards on a fresh instance and again on the first instance
    after another reset; a terminated episode must refuse another step; close() must be
    idempotent. When no episode terminates under `policy`, one "oracle" episode (if the env has
    an oracle) checks termination instead.
    """
    options = dict(options or {})
    spec = get_env_spec(env_name)
    try:
        tasks = list_tasks(env_name, split, **options)
    except ValueError:
        raise  # a bad env name, split or option is the caller's mistake, not the env's
    except Exception as error:
        raise EnvCheckError(f"{env_name}: listing the {split} tasks raised {error!r}") from error
    if not tasks:
        raise EnvCheckError(f"{env_name}: the {split} split has no tasks")
    seen_ids = set()
    for task in tasks:
        # Tasks carry the spec's name, which a dotted path (`my_envs.maze:SPEC`) does not spell.
        if not isinstance(task, Task) or task.env_name != spec.name or task.split != split:
            raise EnvCheckError(f"{env_name}: task {task!r} is not a Task of this env and split")
        if task.task_id in seen_ids:
            raise EnvCheckError(f"{env_name}: task id {task.task_id!r} appears twice in the {split} split")
        seen_ids.add(task.task_id)

    first_env = make_env(env_name, **options)
    second_env = make_env(env_name, **options)
    for env in (first_env, second_env):
        try:
            get_agent_loop(env.prompt_format)
        except AgentLoopError as error:
            raise EnvCheckError(f"{env_name}: prompt_format must name an agent loop: {error}") from error
        if not isinstance(env.instructions(), str):
            raise EnvCheckError(f"{env_name}: instructions() must return a str")
    saw_termination = False
    try:
        for task_index, task in enumerate(tasks[:num_tasks]):
            task_seed = seed + task_index
            context = f"{env_name} task {task.task_id!r} seed {task_seed}"
            episode = await _play(env_name, first_env, task, task_seed, policy, options, max_steps, context)
            if episode.terminated:
                saw_termination = True
                await _check_finished_episode_refuses_steps(first_env, episode, context)
            actions = [record.action for record in episode.steps]
            fresh = await _replay(second_env, task, task_seed, actions, f"{context}, fresh instance")
            _compare(episode, fresh, f"{context}, fresh instance")
            reused = await _replay(first_env, task, task_seed, actions, f"{context}, same instance after reset")
            _compare(episode, reused, f"{context}, same instance after reset")
        if not saw_termination and "oracle" in spec.policies and policy != "oracle":
            context = f"{env_name} task {tasks[0].task_id!r} seed {seed} (oracle)"
            episode = await _play(env_name, first_env, tasks[0], seed, "oracle", options, max_steps, context)
            if not episode.terminated:
                raise _fail(context, f"the oracle did not finish within {max_steps} steps")
            await _check_finished_episode_refuses_steps(first_env, episode, context)
    except Exception:
        # Release the envs but keep the original failure as the one reported.
        for env in (first_env, second_env):
            with contextlib.suppress(Exception):
                await env.close()
        raise
    await _close_twice(first_env, f"{env_name} first instance")
    await _close_twice(second_env, f"{env_name} second instance")
