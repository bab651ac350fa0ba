"""Play every weblocal task's oracle plan through the real env and report which ones score success.

    python -m longhorizon.envs.web.apps.verify_oracles [--sites shop,fossil] [--split train|test|all] [--task ID]

Prints one line per task, then a summary; the last line is one JSON object. Exit code 1 if any fail.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

import trio

from longhorizon.envs.base import Task, action_from_reply, list_tasks, make_env, make_policy

MAX_STEPS = 40


def reference_answers(task: Task) -> list[str]:
    answers = (task.data.get("eval") or {}).get("reference_answers") or {}
    if "exact_match" in answers:
        return [str(answers["exact_match"])]
    return [str(answer) for answer in answers.get("must_include") or answers.get("fuzzy_match") or []]


async def play(env, policy, task: Task) -> tuple[bool, float, int, str]:
    """(success, reward, steps, detail) of one oracle episode."""
    observation, info = await env.reset(task)
    policy.reset(task, observation, random.Random(0))
    for step in range(1, MAX_STEPS + 1):
        action = action_from_reply(policy.act(observation), env.prompt_format)
        if action.startswith(("stop(", "send_msg_to_user(")):
            # A recorded answer only proves something if the page the plan ends on shows it.
            hidden = [answer for answer in reference_answers(task) if answer.lower() not in observation.lower()]
            if hidden:
                return False, 0.0, step, f"the final page does not show {hidden}"
        observation, reward, terminated, truncated, info = await env.step(action)
        if info.get("invalid_action"):
            return False, 0.0, step, f"invalid action {action}: {observation.splitlines()[2:3]}"
        if terminated or truncated:
            detail = getattr(policy, "problem", "") or json.dumps(info.get("eval_details"), default=str)[:300]
            return bool(info.get("success")), float(reward), step, detail
    return False, 0.0, MAX_STEPS, "ran out of steps"


async def verify(sites: str, splits: list[str], only: str | None) -> list[dict]:
    results = []
    env = make_env("weblocal", sites=sites)
    try:
        for split in splits:
            for task in list_tasks("weblocal", split, sites=sites):
                if only and task.task_id != only:
                    continue
                started = time.monotonic()
                success, reward, steps, detail = await play(env, make_policy("weblocal", "oracle"), task)
                results.append({"task_id": task.task_id, "split": split, "success": success, "reward": reward,
                                "steps": steps, "seconds": round(time.monotonic() - started, 2)})
                mark = "ok  " if success else "FAIL"
                print(f"{mark} {task.task_id:14s} {steps:3d} steps {results[-1]['seconds']:6.2f} s"
                      f"{'' if success else '  ' + detail}", flush=True)
    finally:
        await env.close()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="verify_oracles", description=__doc__.splitlines()[0])
    parser.add_argument("--sites", default="all", help="comma-separated sites (default all)")
    parser.add_argument("--split", default="all", choices=("train", "test", "all"))
    parser.add_argument("--task", default=None, help="only this task id")
    args = parser.parse_args(argv)
    splits = ["train", "test"] if args.split == "all" else [args.split]
    started = time.monotonic()
    results = trio.run(verify, args.sites, splits, args.task)
    passed = sum(result["success"] for result in results)
    print(f"{passed}/{len(results)} oracle plans scored success in {time.monotonic() - started:.1f} s")
    print(json.dumps({"tasks": len(results), "passed": passed,
                      "failed": [result["task_id"] for result in results if not result["success"]]}))
    return 0 if passed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
