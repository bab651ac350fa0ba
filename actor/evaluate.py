"""Evaluate a policy on held-out tasks: success rate and mean reward over episodes run concurrently."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import trio

from longhorizon.actor.engines.base import Engine
from longhorizon.actor.rollout import EnvPool, run_episode


@dataclass
class EvalResult:
    episodes: int
    success_rate: float
    mean_reward: float
    failed_episodes: int


async def evaluate(
    engine: Engine,
    env_name: str,
    env_options: dict,
    *,
    split: str = "test",
    episodes: int = 100,
    horizon_cap: int,
    max_new_tokens: int,
    max_context_tokens: int = 4096,
    concurrency: int = 32,
    seed: int = 0,
) -> EvalResult:
    """Play the first `episodes` tasks of `split` (cycling if there are fewer) with `engine`."""
    from longhorizon.envs.base import list_tasks, make_env

    tasks = list_tasks(env_name, split, **env_options)
    pool = EnvPool(lambda: make_env(env_name, **env_options))
    limiter = trio.CapacityLimiter(concurrency)
    results = []

    async def one(index: int) -> None:
        async with limiter:
            env = pool.acquire()
            result = await run_episode(
                env, engine, tasks[index % len(tasks)], horizon_cap=horizon_cap,
                max_context_tokens=max_context_tokens, max_new_tokens=max_new_tokens,
                seed=seed + index, episode_id=f"eval-{index}",
            )
            pool.release(env, broken=bool(result.error))
            results.append(result)

    async with trio.open_nursery() as nursery:
        for index in range(episodes):
            nursery.start_soon(one, index)
    await pool.close()
    played = [r for r in results if not r.error]
    count = max(len(played), 1)
    return EvalResult(
        episodes=len(results),
        success_rate=sum(r.success for r in played) / count,
        mean_reward=sum(r.reward for r in played) / count,
        failed_episodes=len(results) - len(played),
    )


def greedy(settings):
    """The same engine settings with greedy decoding (temperature 0)."""
    return dataclasses.replace(settings, sampling=dataclasses.replace(settings.sampling, temperature=0.0))
