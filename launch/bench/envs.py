"""Environment benchmark: env steps per second in-process and through the HTTP env service, same run.

Each env plays episodes with its `random` scripted policy (the policy's replies are parsed into
actions as the actor does; only env calls are timed). Then the same episodes run through
`longhorizon env serve` (started here on 127.0.0.1) and a RemoteEnv, so the difference is what the
service costs per step.

Run: `longhorizon bench envs [--env NAME ...] [--env-seconds S]`; prints a table, then one line of JSON.
"""

from __future__ import annotations

import random
import time
from typing import Any

import trio

from longhorizon.envs.agents import ActionParseError, parse_action
from longhorizon.launch.bench.tables import Column, print_table
from longhorizon.envs.base import make_policy, list_tasks, make_env
from longhorizon.envs.remote import RemoteEnv
from longhorizon.envs.server import EnvServer
from longhorizon.envs.service import ServiceSettings

DEFAULT_ENVS = ("codebook", "textcraft", "babyai")


async def _play(make_env, env_name: str, tasks: list, *, seconds: float, max_turns: int, seed: int) -> dict:
    env = make_env()
    rng = random.Random(seed)
    steps = resets = 0
    env_seconds = 0.0
    deadline = time.perf_counter() + seconds
    try:
        while time.perf_counter() < deadline:
            task = tasks[rng.randrange(len(tasks))]
            policy = make_policy(env_name, "random")
            started = time.perf_counter()
            observation, _ = await env.reset(task, seed=resets)
            env_seconds += time.perf_counter() - started
            resets += 1
            policy.reset(task, observation, random.Random(rng.random()))
            for _ in range(max_turns):
                reply = policy.act(observation)
                try:
                    action = parse_action(reply, env.prompt_format)
                except ActionParseError:
                    continue
                started = time.perf_counter()
                observation, _, terminated, truncated, _ = await env.step(action)
                env_seconds += time.perf_counter() - started
                steps += 1
                if terminated or truncated:
                    break
    finally:
        await env.close()
    return {"steps": steps, "resets": resets, "env_seconds": env_seconds}


def bench_env_steps(env_names=DEFAULT_ENVS, *, seconds: float = 5.0, max_turns: int = 20, seed: int = 0) -> dict:
    """Steps/s (env calls only, resets included in the time) per env, in-process and over HTTP."""
    result: dict[str, Any] = {"seconds_per_run": seconds}
    for name in env_names:
        tasks = list_tasks(name, "train")
        local = trio.run(
            lambda: _play(lambda: make_env(name), name, tasks, seconds=seconds, max_turns=max_turns, seed=seed)
        )
        with EnvServer(ServiceSettings(env_name=name)) as server:
            remote_tasks = list_tasks("remote", "train", url=server.url, env=name)
            remote = trio.run(
                lambda: _play(
                    lambda: RemoteEnv(url=server.url, env=name), name, remote_tasks,
                    seconds=seconds, max_turns=max_turns, seed=seed,
                )
            )
        for where, figures in (("in_process", local), ("http", remote)):
            calls = figures["steps"] + figures["resets"]
            result[f"{name}_{where}_steps"] = figures["steps"]
            result[f"{name}_{where}_steps_per_s"] = calls / max(figures["env_seconds"], 1e-9)
            result[f"{name}_{where}_ms_per_call"] = 1000 * figures["env_seconds"] / max(calls, 1)
    result["envs"] = list(env_names)
    return result


def print_report(result: dict) -> None:
    """A table for people (the command prints the result as JSON after it)."""
    print(f"env calls (reset + step) per second, random policy, {result['seconds_per_run']:.0f} s per run")
    print_table(
        [Column("env", 10, left=True), Column("in-process/s", 13, ".1f"), Column("ms/call", 8, ".3f"),
         Column("http/s", 9, ".1f"), Column("ms/call", 8, ".3f")],
        [[name, result[f"{name}_in_process_steps_per_s"], result[f"{name}_in_process_ms_per_call"],
          result[f"{name}_http_steps_per_s"], result[f"{name}_http_ms_per_call"]] for name in result["envs"]],
    )
