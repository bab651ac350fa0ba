"""SciWorld memory and speed over a long run: JVM and Python RSS across many short random episodes.

Plays `episodes` short episodes of random valid actions on one SciWorldEnv that recycles its JVM
every `recycle_after_episodes` episodes, and samples the resident memory of the env's JVM, of the
random policy's reference JVM and of this Python process every `sample_every` episodes (just
before a recycle, when the env's JVM is at its largest). Steps/s counts env steps over the whole
run; env_steps_per_second counts only time spent inside env.step.

Run: `longhorizon bench sciworld-memory [--episodes N]`, or for every option
`python -m longhorizon.launch.bench.sciworld [--episodes N] [--steps-per-episode N]
[--recycle-after-episodes N] [--time-limit-s S]`; prints a table, then one line of JSON.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Sequence
from typing import Any

import trio

from longhorizon.launch.bench.memory import MIB, memory_use
from longhorizon.launch.bench.tables import Column, print_json, print_table
from longhorizon.envs.base import (
    action_from_reply,
    list_tasks,
    make_env,
    make_policy,
    )
from longhorizon.envs.sciworld.policies import shared_reference


async def _run(episodes: int, steps_per_episode: int, recycle_after_episodes: int, sample_every: int,
               task_names: Sequence[str] | None, seed: int, time_limit_s: float | None) -> dict[str, Any]:
    options = {"task_names": task_names, "recycle_after_episodes": recycle_after_episodes}
    tasks = list_tasks("sciworld", "train", **options)
    env = make_env("sciworld", **options)
    rng = random.Random(seed)
    samples: list[dict[str, Any]] = []
    steps = invalid_actions = episodes_done = 0
    env_seconds = reset_seconds = 0.0
    started = time.perf_counter()
    try:
        for episode in range(episodes):
            if time_limit_s is not None and time.perf_counter() - started > time_limit_s:
                break
            task = rng.choice(tasks)
            policy = make_policy("sciworld", "random", **options)
            reset_started = time.perf_counter()
            observation, _ = await env.reset(task, seed=seed + episode)
            reset_seconds += time.perf_counter() - reset_started
            policy.reset(task, observation, random.Random(seed + episode))
            for _ in range(steps_per_episode):
                action = action_from_reply(policy.act(observation), env.prompt_format)
                step_started = time.perf_counter()
                observation, _, terminated, _, info = await env.step(action)
                env_seconds += time.perf_counter() - step_started
                steps += 1
                invalid_actions += int(info.get("invalid_action", False))
                if terminated:
                    break
            episodes_done = episode + 1
            if episodes_done % sample_every == 0 or episodes_done == episodes:
                samples.append({
                    "episode": episodes_done,
                    "seconds": round(time.perf_counter() - started, 1),
                    "jvm_pid": env.jvm_pid,
                    "jvm_rss_mb": round(env.jvm_rss_bytes() / MIB, 1),
                    "reference_jvm_rss_mb": round(shared_reference().rss_bytes() / MIB, 1),
                    "python_rss_mb": round(memory_use().rss_bytes / MIB, 1),
                })
    finally:
        await env.close()
    total_seconds = time.perf_counter() - started
    jvm_rss = [sample["jvm_rss_mb"] for sample in samples]
    python_rss = [sample["python_rss_mb"] for sample in samples]
    return {
        "benchmark": "sciworld-memory",
        "episodes": episodes_done,
        "steps": steps,
        "steps_per_episode": steps_per_episode,
        "recycle_after_episodes": recycle_after_episodes,
        "jvms_started": env.simulators_started,
        "invalid_action_rate": round(invalid_actions / max(steps, 1), 3),
        "seconds": round(total_seconds, 1),
        "steps_per_second": round(steps / total_seconds, 1),
        "env_steps_per_second": round(steps / env_seconds, 1) if env_seconds else None,
        "mean_reset_ms": round(1000 * reset_seconds / max(episodes_done, 1), 1),
        "jvm_rss_mb_max": max(jvm_rss, default=None),
        "python_rss_mb_first": python_rss[0] if python_rss else None,
        "python_rss_mb_last": python_rss[-1] if python_rss else None,
        "samples": samples,
    }


def bench_sciworld_memory(
    episodes: int = 1000,
    *,
    steps_per_episode: int = 10,
    recycle_after_episodes: int = 50,
    sample_every: int = 50,
    task_names: Sequence[str] | None = None,
    seed: int = 0,
    time_limit_s: float | None = None,
) -> dict[str, Any]:
    """Run the benchmark (see the module docstring) and return its figures; stops early past time_limit_s."""
    for name, value in (("episodes", episodes), ("steps_per_episode", steps_per_episode),
                        ("recycle_after_episodes", recycle_after_episodes), ("sample_every", sample_every)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"bench_sciworld_memory: {name} must be an integer >= 1, got {value!r}")
    return trio.run(_run, episodes, steps_per_episode, recycle_after_episodes, sample_every, task_names, seed,
                    time_limit_s)


def print_report(result: dict[str, Any]) -> None:
    """The samples as a table and a summary line (the command prints the result as JSON after them)."""
    columns = ("episode", "seconds", "jvm_pid", "jvm_rss_mb", "reference_jvm_rss_mb", "python_rss_mb")
    print_table([Column(name, 20) for name in columns],
                [[sample[name] for name in columns] for sample in result["samples"]], separator="  ")
    print(f"{result['episodes']} episodes, {result['steps']} steps in {result['seconds']} s: "
          f"{result['steps_per_second']} steps/s overall, {result['env_steps_per_second']} env steps/s, "
          f"reset {result['mean_reset_ms']} ms, {result['jvms_started']} JVMs started")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=1000)
    parser.add_argument("--steps-per-episode", type=int, default=10)
    parser.add_argument("--recycle-after-episodes", type=int, default=50)
    parser.add_argument("--sample-every", type=int, default=50)
    parser.add_argument("--time-limit-s", type=float, default=None)
    arguments = parser.parse_args(argv)
    result = bench_sciworld_memory(
        arguments.episodes, steps_per_episode=arguments.steps_per_episode,
        recycle_after_episodes=arguments.recycle_after_episodes, sample_every=arguments.sample_every,
        time_limit_s=arguments.time_limit_s,
    )
    print_report(result)
    print_json(result)


if __name__ == "__main__":
    main()
