"""Play an environment in the terminal: read plain actions line by line, print what happens."""

from __future__ import annotations

import argparse
import ast
import sys
from typing import Any, Callable

import trio

from longhorizon.envs.base import SPLITS, env_names, list_tasks, make_env
from longhorizon.envs.service import build_task_table

QUIT_WORDS = ("quit", "exit")


def play(
    env_name: str,
    *,
    split: str = "test",
    task_index: int = 0,
    data_idx: int | None = None,
    seed: int = 0,
    options: dict | None = None,
    input_fn: Callable[[str], str] = input,
    print_fn: Callable[..., Any] = print,
) -> float:
    """Play one episode of task `task_index` of the split, or of the task that `env serve` (and
    AgentGym's clients) call `data_idx`; returns the total reward.

    Each line read is one action, typed plainly (no Thought:/Action: wrapper). "quit" or the end
    of input stops early.
    """
    options = dict(options or {})
    if data_idx is not None:
        task = task_by_data_idx(env_name, data_idx, options)
    else:
        tasks = list_tasks(env_name, split, **options)
        if not 0 <= task_index < len(tasks):
            raise ValueError(
                f"task index {task_index} is out of range: the {split} split of {env_name!r} has {len(tasks)} tasks"
            )
        task = tasks[task_index]
    env = make_env(env_name, **options)

    async def episode() -> float:
        total_reward = 0.0
        try:
            observation, _ = await env.reset(task, seed=seed)
            instructions = env.instructions()
            if instructions:
                print_fn(instructions)
                print_fn()
            named = f"data_idx {data_idx}, " if data_idx is not None else ""
            print_fn(f"[task {task.task_id} ({named}{task.category or split}), seed {seed}; type 'quit' to stop]")
            print_fn(observation)
            while True:
                # input_fn blocks the event loop, which is fine: this episode is its only task.
                try:
                    action = input_fn("> ")
                except EOFError:
                    print_fn()
                    break
                action = action.strip()
                if action.lower() in QUIT_WORDS:
                    break
                if not action:
                    continue
                observation, reward, terminated, truncated, info = await env.step(action)
                total_reward += reward
                print_fn(observation)
                status = "done" if terminated or truncated else "continue"
                invalid = ", invalid action" if info.get("invalid_action") else ""
                print_fn(f"[reward {reward:g}, total {total_reward:g}, {status}{invalid}]")
                if terminated or truncated:
                    print_fn("Success!" if info.get("success") else "The episode is over.")
                    break
        finally:
            await env.close()
        return total_reward

    return trio.run(episode)


def task_by_data_idx(env_name: str, data_idx: int, options: dict):
    """The task `env serve` numbers `data_idx` (the reference's own numbering where the env has
    one: BabyAI, SciWorld, TextCraft; otherwise train then test)."""
    table = build_task_table(env_name, options)
    task = table.by_data_idx.get(data_idx)
    if task is None:
        spans = ", ".join(f"{split} within {min(numbers)}-{max(numbers)}"
                          for split, numbers in table.data_idx_by_split.items() if numbers)
        raise ValueError(f"data_idx {data_idx} names no task of {env_name!r} ({len(table.by_data_idx)} tasks: "
                         f"{spans}; `env serve` lists them at GET /tasks)")
    return task


def _parse_option(text: str) -> tuple[str, Any]:
    key, separator, raw_value = text.partition("=")
    if not separator or not key.strip():
        raise argparse.ArgumentTypeError(f"options are KEY=VALUE, got {text!r}")
    try:
        value = ast.literal_eval(raw_value)
    except (ValueError, SyntaxError):
        value = raw_value  # a bare word is a string option
    return key.strip(), value


def main(argv: list[str] | None = None) -> int:
    """`longhorizon env play NAME [--split S] [--task I | --data-idx N] [--seed N] [--option KEY=VALUE ...]`."""
    parser = argparse.ArgumentParser(prog="longhorizon env play", description="Play an environment in the terminal.")
    parser.add_argument("env", help=f"environment name ({', '.join(env_names())}) or the dotted path "
                                    "package.module:attribute of an EnvSpec")
    parser.add_argument("--split", default="test", choices=SPLITS, help="task split (default: test)")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--task", type=int, default=0, help="index of the task in the split (default: 0)")
    which.add_argument("--data-idx", type=int, default=None,
                       help="the task `env serve` and AgentGym's clients number N (either split)")
    parser.add_argument("--seed", type=int, default=0, help="reset seed (default: 0)")
    parser.add_argument("--option", action="append", type=_parse_option, default=[], metavar="KEY=VALUE",
                        help="env option, e.g. max_depth=2 (repeatable)")
    arguments = parser.parse_args(argv)
    try:
        total_reward = play(arguments.env, split=arguments.split, task_index=arguments.task,
                            data_idx=arguments.data_idx, seed=arguments.seed, options=dict(arguments.option))
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    print(f"Total reward: {total_reward:g}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
