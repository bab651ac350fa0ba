"""Web env benchmark: Chromium launch, episode reset, step latency, steps/s with N parallel contexts, memory per context.

Runs MiniWoB++ pages (served from 127.0.0.1) in the system Chromium through the miniwob env, so
each figure includes what an episode really pays: a fresh browser context per reset, the page
load, and per step the action, the settle wait and the accessibility-tree observation. A step
toggles a checkbox of the click-checkboxes task (the episode never ends). Memory is the growth of
the browser processes' resident (RSS) and proportional (PSS, shared pages split between
processes) set sizes per extra live context. `--modes text,screenshot,som` times reset and step
again with each visual form computed besides the text (the screenshot; the set-of-marks image),
and gives each mode's browser memory with its one context live and the size of one observation.

Run: `longhorizon bench web [--contexts 1,2,4,8] [--seconds 5] [--resets 10] [--steps 30] [--browsers 1]
[--modes text,screenshot,som]`
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import trio

from longhorizon.launch.bench.memory import MIB, memory_use
from longhorizon.launch.bench.tables import BenchStopped, Column, parsed, print_table, run_as_command
from longhorizon.envs.web.policies import parse_nodes
from longhorizon.envs.base import list_tasks
from longhorizon.envs.web.browser import BrowserPool
from longhorizon.envs.web.miniwob import MiniWobEnv
from longhorizon.envs.web.observation import DEFAULT_SCREENSHOT_SIZE

PROG = "longhorizon bench web"

TASK = "click-checkboxes"
MODES = {"text": ["text"], "screenshot": ["text", "screenshot"], "som": ["text", "som"]}
"""What each benchmarked mode computes: the visual forms always come with the text."""


def _memory_mib(pids: list[int]) -> tuple[float, float]:
    """(RSS, PSS) in MiB of the browser processes and their children."""
    use = memory_use(pids, children=True, detailed=True)
    return use.rss_bytes / MIB, use.pss_bytes / MIB


def _checkbox(observation: str) -> str:
    boxes = [node.bid for node in parse_nodes(observation) if node.role == "checkbox"]
    if not boxes:
        raise RuntimeError(f"the {TASK} page shows no checkbox:\n{observation[:500]}")
    return boxes[0]


async def _bench(contexts: list[int], seconds: float, resets: int, steps: int, browsers: int,
                 modes: list[str]) -> dict[str, Any]:
    pool = BrowserPool(browsers)
    result: dict[str, Any] = {"task": TASK, "browsers": browsers, "seconds_per_run": seconds}
    try:
        started = time.perf_counter()
        await pool.launch()
        result["launch_s"] = (time.perf_counter() - started) / browsers
        idle_rss, idle_pss = _memory_mib(pool.browser_pids())
        result["idle_browser_rss_mib"], result["idle_browser_pss_mib"] = idle_rss / browsers, idle_pss / browsers

        tasks = list_tasks("miniwob", "train", task_names=[TASK], instances_per_task=max(resets, 1))
        result["modes"] = []
        for mode in ["text", *[mode for mode in modes if mode != "text"]]:  # text first: the top-level figures
            env = MiniWobEnv(task_names=[TASK], pool=pool)
            env.configure_observation(MODES[mode], DEFAULT_SCREENSHOT_SIZE)
            reset_times, step_times = [], []
            for task in tasks[:resets]:
                started = time.perf_counter()
                observation, info = await env.reset(task)
                reset_times.append(time.perf_counter() - started)
            box = _checkbox(observation)
            for _ in range(steps):
                started = time.perf_counter()
                observation, _, _, _, info = await env.step(f"click({box!r})")
                step_times.append(time.perf_counter() - started)
            # Memory with the mode's one context live: the browser's share above its idle figure,
            # and what one observation carries (its text and images).
            _, live_pss = _memory_mib(pool.browser_pids())
            await env.close()
            images = sum(len(info[key]) for key in ("screenshot", "som") if key in info)
            result["modes"].append({
                "mode": mode, "reset_ms_median": 1000 * statistics.median(reset_times),
                "reset_ms_mean": 1000 * statistics.fmean(reset_times),
                "step_ms_median": 1000 * statistics.median(step_times),
                "step_ms_p90": 1000 * sorted(step_times)[int(0.9 * (len(step_times) - 1))],
                "context_pss_mib": live_pss - idle_pss,
                "observation_kib": (len(observation.encode()) + images) / 1024,
            })
        result.update({key: value for key, value in result["modes"][0].items() if key != "mode"})

        result["parallel"] = []
        for count in contexts:
            envs = [MiniWobEnv(task_names=[TASK], pool=pool) for _ in range(count)]
            boxes = []
            for index, env in enumerate(envs):
                observation, _ = await env.reset(tasks[index % len(tasks)])
                boxes.append(_checkbox(observation))
            rss, pss = _memory_mib(pool.browser_pids())
            steps = [0] * count
            deadline = time.perf_counter() + seconds

            async def play(index: int) -> None:
                while time.perf_counter() < deadline:
                    await envs[index].step(f"click({boxes[index]!r})")
                    steps[index] += 1

            started = time.perf_counter()
            async with trio.open_nursery() as nursery:
                for index in range(count):
                    nursery.start_soon(play, index)
            elapsed = time.perf_counter() - started
            for env in envs:
                await env.close()
            result["parallel"].append({
                "contexts": count,
                "steps_per_s": sum(steps) / elapsed,
                "rss_per_context_mib": (rss - idle_rss) / count,
                "pss_per_context_mib": (pss - idle_pss) / count,
            })
    finally:
        await pool.aclose()
    return result


def print_report(result: dict[str, Any]) -> None:
    """A table for people (the command prints the result as JSON after it)."""
    print(f"web env on MiniWoB {result['task']} ({result['browsers']} browser(s), system Chromium)")
    print(f"  browser launch      {result['launch_s']:8.2f} s   (idle browser: RSS {result['idle_browser_rss_mib']:.0f} MiB,"
          f" PSS {result['idle_browser_pss_mib']:.0f} MiB)")
    print(f"  reset (new context) {result['reset_ms_median']:8.0f} ms median, {result['reset_ms_mean']:.0f} ms mean")
    print(f"  step (click + tree) {result['step_ms_median']:8.0f} ms median, {result['step_ms_p90']:.0f} ms p90")
    if len(result["modes"]) > 1:
        print_table([Column("mode", 10), Column("reset ms", 9, ".0f"), Column("step ms", 8, ".0f"), Column("step p90", 9, ".0f"),
                     Column("context PSS MiB", 16, ".1f"), Column("observation KiB", 16, ".1f")],
                    [[row["mode"], row["reset_ms_median"], row["step_ms_median"], row["step_ms_p90"],
                      row["context_pss_mib"], row["observation_kib"]] for row in result["modes"]],
                    indent="  ")
    print_table(
        [Column("contexts", 8), Column("steps/s", 9, ".1f"), Column("RSS/context MiB", 16, ".1f"),
         Column("PSS/context MiB", 16, ".1f")],
        [[row["contexts"], row["steps_per_s"], row["rss_per_context_mib"], row["pss_per_context_mib"]]
         for row in result["parallel"]],
        indent="  ",
    )


def _contexts(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def _check(args: argparse.Namespace) -> None:
    contexts = _contexts(args.contexts)  # a ValueError names a part that is not a number
    if not contexts or min(contexts) < 1 or min(args.seconds, args.resets, args.steps, args.browsers) <= 0:
        raise ValueError("contexts, seconds, resets, steps and browsers must be positive")
    unknown = [mode for mode in args.modes.split(",") if mode not in MODES]
    if unknown:
        raise ValueError(f"unknown mode(s) {unknown}; valid modes: {', '.join(MODES)}")


def run(argv: list[str]) -> dict[str, Any]:
    """Measure as the options say, print the table, return the result."""
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="1,2,4,8", help="comma-separated numbers of parallel contexts")
    parser.add_argument("--seconds", type=float, default=5.0, help="length of each parallel run")
    parser.add_argument("--resets", type=int, default=10, help="resets timed (each a new task instance)")
    parser.add_argument("--steps", type=int, default=30, help="steps timed one after another in one context")
    parser.add_argument("--browsers", type=int, default=1, help="Chromium processes in the pool")
    parser.add_argument("--modes", default="text", help="observation modes timed, of text,screenshot,som")
    args = parsed(parser, argv, check=_check)
    try:
        result = trio.run(_bench, _contexts(args.contexts), args.seconds, args.resets, args.steps, args.browsers,
                          args.modes.split(","))
    except RuntimeError as error:
        raise BenchStopped(1, str(error)) from error
    print_report(result)
    return result


def main(argv: list[str]) -> int:
    return run_as_command(PROG, run, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
