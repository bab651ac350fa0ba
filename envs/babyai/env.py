"""The "babyai" env: minigrid's BabyAI levels as egocentric text with high-level actions.

Tasks follow the reference numbering: data_idx i plays level LEVEL_NAMES[i % 40] laid out by
seed i // 40. The test split holds seeds 0 .. num_test_seeds - 1, the train split the next
num_train_seeds seeds. The layout depends only on the task, so reset's seed changes nothing (the
simulator has no other randomness). Reward is minigrid's: 1 - 0.9 * steps / max_steps on success,
0 otherwise; the episode ends when minigrid terminates it or its own step limit runs out.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from longhorizon.envs.babyai.levels import (
    LevelSimulators,
    check_options,
    data_idx_of,
    play_primitives,
    task_level_and_seed,
)
from longhorizon.envs.babyai.policies import OraclePolicy, RandomPolicy
from longhorizon.envs.babyai.view import CHECK_ACTIONS, View, read_view, render_actions, render_view
from longhorizon.common.config import Section, bounded
from longhorizon.envs.base import EnvSpec, Task
from longhorizon.envs.tools import EnvTool, ToolSet, object_schema

ENV_NAME = "babyai"

INSTRUCTIONS = """\
You are an agent in a grid world of rooms, walls, doors and objects (keys, balls, boxes). Each \
episode gives you a goal, such as "go to the red ball" or "open the blue door". After every \
action you are told what you see (positions are counted in steps from you: in front, to your left \
or right), what you carry, and the list of actions available right now.

Actions (use one from the available list, written exactly as listed):
- turn left / turn right / move forward: one step.
- go to <object> <n>: walk next to the n-th seen object of that description and face it.
- pickup <object> <n>: go to that object and pick it up (you can carry one object).
- go through <door> <n>: walk through an open door.
- toggle and go through <door> <n>: open a closed door (a locked one needs its key) and walk through.
- toggle: open or close the door, or open the box, right in front of you.
- drop: put down what you carry in the empty cell in front of you.
- check available actions: list the actions again.
To go to a door counts as reaching it; to open a door you must toggle it.

Reply with your reasoning and one action, in exactly this format:
Thought:
<your reasoning>

Action:
<one action>"""


def first_observation(mission: str, view: View) -> str:
    """The goal line followed by the view."""
    return f"Your goal: {mission}\n{render_view(view)}"


def tasks(
    split: str,
    *,
    levels: Sequence[str] | None = None,
    num_train_seeds: int = 500,
    num_test_seeds: int = 5,
    max_primitive_steps: int = 64,
) -> list[Task]:
    """The split's tasks in data_idx order (seed by seed, each seed over the chosen levels)."""
    chosen = check_options(levels, num_train_seeds, num_test_seeds, max_primitive_steps)
    if split == "test":
        seeds = range(num_test_seeds)
    elif split == "train":
        seeds = range(num_test_seeds, num_test_seeds + num_train_seeds)
    else:
        raise ValueError(f"unknown split {split!r} for env {ENV_NAME!r}; valid splits: train, test")
    result = []
    for seed in seeds:
        for level in chosen:
            data_idx = data_idx_of(level, seed)
            result.append(
                Task(
                    env_name=ENV_NAME,
                    task_id=f"{split}-{data_idx}",
                    split=split,
                    category=level,
                    data={"level": level, "seed": seed, "data_idx": data_idx},
                )
            )
    return result



TOOL_INSTRUCTIONS = """\
You are an agent in a grid world of rooms, walls, doors and objects (keys, balls, boxes). Each \
episode gives you a goal, such as "go to the red ball" or "open the blue door". After every \
action you are told what you see (positions are counted in steps from you: in front, to your left \
or right), what you carry, and the list of actions available right now. Act with the tools, naming \
objects and doors exactly as that list does (e.g. "red ball 1"): you can carry one object; going to \
a door counts as reaching it; opening a door (a locked one needs its key) or a box is a toggle. \
Call one tool per turn."""


def _seen(description: str) -> dict:
    return object_schema({"target": {"type": "string", "description": description}})


def _command(action: str) -> str:
    return " ".join(action.lower().split()).rstrip(".")


def _exactly(command: str) -> Callable[[str], dict | None]:
    return lambda action: {} if _command(action) == command else None


def _after(prefix: str) -> Callable[[str], dict | None]:
    """The target of an action written `<prefix> <target>`."""
    def arguments_of(action: str) -> dict | None:
        command = _command(action)
        return {"target": command[len(prefix) + 1:]} if command.startswith(prefix + " ") else None
    return arguments_of


def babyai_tool_set() -> ToolSet:
    """BabyAI's actions as tools; the targets are the labels the list of available actions shows."""
    return ToolSet(TOOL_INSTRUCTIONS, (
        EnvTool("turn", "Turn left or right on the spot.",
                object_schema({"direction": {"type": "string", "enum": ["left", "right"]}}),
                lambda arguments: f"turn {arguments['direction']}",
                lambda action: {"direction": _command(action)[5:]} if _command(action) in ("turn left", "turn right")
                else None),
        EnvTool("move_forward", "Step one cell forward.", object_schema({}), lambda arguments: "move forward",
                _exactly("move forward")),
        EnvTool("go_to", "Walk next to a seen object or door and face it.",
                _seen("The object as listed, e.g. red ball 1."), lambda arguments: f"go to {arguments['target']}", _after("go to")),
        EnvTool("pickup", "Go to a seen object and pick it up.",
                _seen("The object as listed, e.g. yellow key 1."), lambda arguments: f"pickup {arguments['target']}", _after("pickup")),
        EnvTool("go_through", "Walk through an open door.",
                _seen("The door as listed, e.g. blue door 1."), lambda arguments: f"go through {arguments['target']}", _after("go through")),
        EnvTool("toggle_and_go_through", "Open a closed door and walk through it.",
                _seen("The door as listed, e.g. blue door 1."),
                lambda arguments: f"toggle and go through {arguments['target']}", _after("toggle and go through")),
        EnvTool("toggle", "Open or close the door, or open the box, right in front of you.",
                object_schema({}), lambda arguments: "toggle", _exactly("toggle")),
        EnvTool("drop", "Put down what you carry in the empty cell in front of you.",
                object_schema({}), lambda arguments: "drop", _exactly("drop")),
        EnvTool("check_available_actions", "List the actions available now.",
                object_schema({}), lambda arguments: CHECK_ACTIONS, _exactly(CHECK_ACTIONS)),
    ))


class BabyAIEnv:
    """One BabyAI episode at a time; reuse the object across episodes with reset."""

    name = ENV_NAME
    prompt_format = "react"

    def __init__(
        self,
        *,
        levels: Sequence[str] | None = None,
        num_train_seeds: int = 500,
        num_test_seeds: int = 5,
        max_primitive_steps: int = 64,
    ):
        check_options(levels, num_train_seeds, num_test_seeds, max_primitive_steps)
        self.max_primitive_steps = max_primitive_steps
        self._simulators = LevelSimulators()
        self._sim: Any = None
        self._view: View | None = None
        self._finished = False

    def instructions(self) -> str:
        return INSTRUCTIONS

    def tool_set(self) -> ToolSet:
        return babyai_tool_set()

    async def reset(self, task: Task, *, seed: int | None = None) -> tuple[str, dict]:
        level, layout_seed = task_level_and_seed(task)
        self._sim = self._simulators.start(level, layout_seed)
        self._finished = False
        self._view = read_view(self._sim, max_primitive_steps=self.max_primitive_steps)
        info = {"success": False, "invalid_action": False, "level": level, "mission": self._sim.mission}
        return first_observation(self._sim.mission, self._view), info

    async def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        if self._sim is None or self._view is None:
            raise RuntimeError("babyai env: call reset() before step()")
        if self._finished:
            raise RuntimeError("babyai env: the episode has ended; call reset() to start another")
        command = " ".join(action.lower().split()).rstrip(".") if isinstance(action, str) else ""
        primitives = self._view.actions.get(command)
        if primitives is None:
            shown = f'"{command}" is not' if command else "An empty action is not"
            observation = f"{shown} one of the available actions. {render_actions(self._view)}"
            return observation, 0.0, False, False, {"success": False, "invalid_action": True}
        if command == CHECK_ACTIONS:
            return render_view(self._view), 0.0, False, False, {"success": False, "invalid_action": False}
        reward, terminated, truncated = play_primitives(self._sim, primitives)
        self._view = read_view(self._sim, max_primitive_steps=self.max_primitive_steps)
        success = terminated and reward > 0
        observation = render_view(self._view)
        if success:
            observation = f"The task is completed.\n{observation}"
        elif terminated:
            observation = f"The task has failed.\n{observation}"
        elif truncated:
            observation = f"You have run out of steps.\n{observation}"
        self._finished = terminated or truncated
        info = {"success": success, "invalid_action": False, "primitive_steps": int(self._sim.step_count)}
        return observation, float(reward), terminated, truncated, info

    async def close(self) -> None:
        self._simulators.close()
        self._sim = None
        self._view = None


class BabyAIOptions(Section):
    """babyai: minigrid's BabyAI levels as egocentric text with high-level actions."""

    levels: Sequence[str] | None = None
    """BabyAI level names to play (e.g. ["GoToLocal", "KeyInBox"]); none: all 40 of the reference's."""
    num_train_seeds: int = bounded(500, ge=1)
    """Layout seeds per level in the train split."""
    num_test_seeds: int = bounded(5, ge=1)
    """Layout seeds per level in the test split (seeds 0 .. num_test_seeds - 1)."""
    max_primitive_steps: int = bounded(64, ge=1)
    """Most minigrid steps one high-level action may take (a "go to" walks several)."""


# The registry (envs/base.py) finds this env here by name.
SPEC = EnvSpec(
    name=ENV_NAME,
    factory=BabyAIEnv,
    tasks=tasks,
    policies={"oracle": OraclePolicy, "random": RandomPolicy},
    needs=("minigrid", "gymnasium"),
    extra="babyai",
    Options=BabyAIOptions,
)
