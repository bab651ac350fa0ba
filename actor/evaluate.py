"""Evaluate a policy on held-out tasks: success, mean score (Avg@n), per-category results and Pass@k."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from longhorizon.actor.engines.base import Engine
from longhorizon.actor.rollout import PLAIN_LOOP, AgentLoopSettings, EnvPool, run_episode
from longhorizon.envs.base import list_tasks, make_env
from longhorizon.actor.engines.factory import build_engine
from longhorizon.actor.metrics import mean_interval, mean_pass_at_k, wilson_interval, pass_at_k

if TYPE_CHECKING:
    from longhorizon.common.config import Config


@dataclass
class EvalResult:
    episodes: int
    success_rate: float
    mean_reward: float
    failed_episodes: int
    # Task id -> (successes, episodes played without an error) for that task.
    by_task: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)


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
    loop_settings: AgentLoopSettings = PLAIN_LOOP,
    samples_per_task: int = 1,
) -> EvalResult:
    """Play the first `episodes` tasks of `split` (cycling if there are fewer) with `engine`,
    `samples_per_task` episodes of each (worth more than one only when the engine samples), each
    as `loop_settings` say (the agent loop and what the model sees)."""
    tasks = list_tasks(env_name, split, **env_options)
    pool = EnvPool(lambda: make_env(env_name, **env_options))
    limiter = trio.CapacityLimiter(concurrency)
    results = []
    by_task: dict[str, list[int]] = {}

    async def one(index: int, sample: int) -> None:
        task = tasks[index % len(tasks)]
        number = index * samples_per_task + sample
        async with limiter:
            env = pool.acquire()
            result = await run_episode(
                env, engine, task, horizon_cap=horizon_cap,
                max_context_tokens=max_context_tokens, max_new_tokens=max_new_tokens,
                seed=seed + number, episode_id=f"eval-{number}", loop_settings=loop_settings,
            )
            pool.release(env, broken=bool(result.error))
            results.append(result)
            if not result.error:
                counts = by_task.setdefault(task.task_id, [0, 0])
                counts[0] += bool(result.success)
                counts[1] += 1

    async with trio.open_nursery() as nursery:
        for index in range(episodes):
            for sample in range(samples_per_task):
                nursery.start_soon(one, index, sample)
    await pool.close()
    played = [r for r in results if not r.error]
    count = max(len(played), 1)
    return EvalResult(
        episodes=len(results),
        success_rate=sum(r.success for r in played) / count,
        mean_reward=sum(r.reward for r in played) / count,
        failed_episodes=len(results) - len(played),
        by_task={task_id: (wins, tries) for task_id, (wins, tries) in sorted(by_task.items())},
    )


def evaluate_model_folder(config: "Config", model_folder: str | Path, episodes: int, *, samples_per_task: int = 1,
                          temperature: float = 0.0) -> dict:
    """Held-out success of a model folder (a checkpoint, or model.path) on the config's
    env.eval_split, as the offline recipes and experiments report it: its first `episodes`
    tasks, `samples_per_task` episodes each, greedy at temperature 0 and sampled
    (actor.sampling's other settings) above it; a JSON-ready dict."""
    # The engine that plays is a model engine whatever actor.engine says (a scripted oracle or an
    # endpoint played the data): the factory's `checkpoint` purpose picks it.
    if temperature > 0:
        sampling = config.actor.sampling.replace(temperature=temperature)
        config = config.replace(actor=config.actor.replace(sampling=sampling))
    engine = build_engine(config, "checkpoint", model_path=str(model_folder), greedy=temperature <= 0)

    async def play():
        try:
            return await evaluate(
                engine, config.env.name, dict(config.env.options), split=config.env.eval_split, episodes=episodes,
                horizon_cap=max(config.horizon.stages), max_new_tokens=config.actor.sampling.max_new_tokens,
                max_context_tokens=config.actor.max_context_tokens, seed=config.run.seed,
                loop_settings=AgentLoopSettings.from_actor(config.actor), samples_per_task=samples_per_task,
            )
        finally:
            await engine.close()

    result = trio.run(play)
    return {"split": config.env.eval_split, "episodes": result.episodes, "success_rate": result.success_rate,
            "mean_reward": result.mean_reward, "failed_episodes": result.failed_episodes,
            "samples_per_task": samples_per_task, "temperature": max(temperature, 0.0),
            "by_task": {task_id: list(counts) for task_id, counts in result.by_task.items()}}


def greedy(settings):
    """The same engine settings with greedy decoding (temperature 0)."""
    return dataclasses.replace(settings, sampling=settings.sampling.replace(temperature=0.0))


@dataclass
class EpisodeRecord:
    task_id: str
    category: str
    success: bool
    reward: float
    turns: int
    error: str
    cut_by: str = ""  # as EpisodeResult.cut_by


async def play_tasks(
    engine: Engine,
    env_name: str,
    env_options: dict,
    tasks: list,
    *,
    samples: int,
    horizon_cap: int,
    max_new_tokens: int,
    max_context_tokens: int = 4096,
    concurrency: int = 32,
    loop_settings: AgentLoopSettings = PLAIN_LOOP,
    on_episode: Callable[[EpisodeRecord], None] = lambda record: None,
) -> list[EpisodeRecord]:
    """`samples` episodes of every task (for Pass@k), run concurrently, each as `loop_settings`
    say; one record per episode, each also handed to `on_episode` as it ends (a progress bar)."""
    pool = EnvPool(lambda: make_env(env_name, **env_options))
    limiter = trio.CapacityLimiter(concurrency)
    records: list[EpisodeRecord] = []

    async def one(task, sample: int) -> None:
        async with limiter:
            env = pool.acquire()
            result = await run_episode(
                env, engine, task, horizon_cap=horizon_cap, max_context_tokens=max_context_tokens,
                max_new_tokens=max_new_tokens, seed=0, episode_id=f"eval-{task.task_id}-{sample}",
                loop_settings=loop_settings,
            )
            pool.release(env, broken=bool(result.error))
            record = EpisodeRecord(
                task.task_id, task.category, bool(result.success), result.reward, result.num_turns, result.error,
                result.cut_by,
            )
            records.append(record)
            on_episode(record)

    try:
        async with trio.open_nursery() as nursery:
            for task in tasks:
                for sample in range(samples):
                    nursery.start_soon(one, task, sample)
    finally:
        await pool.close()
    return records


def summarise(records: list[EpisodeRecord], samples: int, ks: list[int]) -> dict:
    """Success with a Wilson interval, mean score (Avg@n) with a normal interval, per-category
    success, and the unbiased Pass@k for each k <= samples."""
    from collections import defaultdict


    played = [r for r in records if not r.error]
    if not played:
        raise ValueError("no episode finished without an error")
    successes = sum(r.success for r in played)
    low, high = wilson_interval(successes, len(played))
    avg, avg_low, avg_high = mean_interval([r.reward for r in played])
    by_task: dict[str, list[EpisodeRecord]] = defaultdict(list)
    by_category: dict[str, list[EpisodeRecord]] = defaultdict(list)
    for record in played:
        by_task[record.task_id].append(record)
        by_category[record.category].append(record)
    complete = [runs for runs in by_task.values() if len(runs) == samples]
    summary = {
        "episodes": len(records),
        "failed_episodes": len(records) - len(played),
        "tasks": len(by_task),
        "samples_per_task": samples,
        "success_rate": successes / len(played),
        "success_rate_ci95": [low, high],
        f"avg@{samples}": avg,
        f"avg@{samples}_ci95": [avg_low, avg_high],
        "mean_turns": sum(r.turns for r in played) / len(played),
        "cut_by_horizon": sum(r.cut_by == "horizon" for r in played),
        "cut_by_context": sum(r.cut_by == "context" for r in played),
        "per_category": {
            category: {"episodes": len(runs), "success_rate": sum(r.success for r in runs) / len(runs),
                       "mean_score": sum(r.reward for r in runs) / len(runs)}
            for category, runs in sorted(by_category.items())
        },
    }
    for k in ks:
        if 1 <= k <= samples and complete:
            summary[f"pass@{k}"] = mean_pass_at_k([sum(r.success for r in runs) for runs in complete], samples, k)
    return summary


def bootstrap_mean_interval(
    values: list[float], *, resamples: int = 1000, seed: int = 0, confidence: float = 0.95
) -> tuple[float, float]:
    """Percentile bootstrap interval of a mean: resample the values (one per task) with replacement."""
    import numpy as np

    if not values:
        raise ValueError("no values")
    if resamples < 1:
        raise ValueError(f"need at least one resample, got {resamples}")
    data = np.asarray(values, dtype=np.float64)
    rng = np.random.default_rng(seed)
    means = data[rng.integers(0, len(data), size=(resamples, len(data)))].mean(axis=1)
    tail = (1.0 - confidence) / 2 * 100
    low, high = np.percentile(means, [tail, 100 - tail])
    return float(low), float(high)


def default_ks(samples: int) -> list[int]:
    """1, 2, 4, ... up to the number of samples per task, and that number itself."""
    ks = []
    k = 1
    while k <= samples:
        ks.append(k)
        k *= 2
    if ks[-1] != samples:
        ks.append(samples)
    return ks


def pass_at_k_curve(
    records: list[EpisodeRecord], samples: int, ks: list[int], *, resamples: int = 1000, seed: int = 0
) -> list[dict]:
    """Unbiased Pass@k for each k, with a bootstrap interval over tasks and per-category values.

    Only tasks with all `samples` episodes finished count (a failed episode would bias the estimator)."""
    from collections import defaultdict


    bad = [k for k in ks if not 1 <= k <= samples]
    if bad:
        raise ValueError(f"Pass@k needs 1 <= k <= samples per task ({samples}); got k={bad[0]}")
    by_task: dict[str, list[EpisodeRecord]] = defaultdict(list)
    for record in records:
        if not record.error:
            by_task[record.task_id].append(record)
    complete = {task: runs for task, runs in by_task.items() if len(runs) == samples}
    if not complete:
        raise ValueError(f"no task has all {samples} of its episodes finished without an error")
    points = []
    for k in ks:
        per_task = {task: pass_at_k(samples, sum(r.success for r in runs), k) for task, runs in complete.items()}
        values = list(per_task.values())
        low, high = bootstrap_mean_interval(values, resamples=resamples, seed=seed + k)
        by_category: dict[str, list[float]] = defaultdict(list)
        for task, value in per_task.items():
            by_category[complete[task][0].category].append(value)
        points.append({
            "k": k,
            "pass@k": sum(values) / len(values),
            "ci95": [low, high],
            "tasks": len(values),
            "per_category": {category: sum(v) / len(v) for category, v in sorted(by_category.items())},
        })
    return points
