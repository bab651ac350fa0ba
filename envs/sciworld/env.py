"""The "sciworld" env: ScienceWorld science procedures, one long-lived JVM per env object.

Reward: the simulator scores progress from 0 to 100 (negative after a failing action such as
focusing on the wrong object). Each step's reward is the change of the score clamped to [0, 100],
divided by 100, so an episode's rewards sum to its final clamped score / 100, in [0, 1]: the
learner sums turn rewards, and GRPO compares those sums within a group. info["score"] carries the
simulator's raw score (what the reference reports, averaged) and info["success"] is score == 100.
An episode terminates when the simulator marks the task completed or the score turns negative.

JVM lifecycle: the simulator's memory grows over a long run (the reference had to restart it), so
the env starts a fresh JVM after `recycle_after_episodes` episodes, and at once after any JVM
error (a step that fails is retried once on a fresh JVM after replaying the episode so far; the
simulator is deterministic). Every JVM call runs in a worker thread, off the trio loop.

The layout of a task depends only on its (task, variation): reset's seed changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import trio
from longhorizon.common.config import Section, bounded
from longhorizon.envs.base import EnvSpec, Task
from longhorizon.envs.tools import EnvTool, ToolSet, object_schema
from longhorizon.envs.sciworld.catalog import (
    ACTION_TEMPLATES,
    ENV_NAME,
    check_options,
    task_name_and_variation,
    tasks,
)
from longhorizon.envs.sciworld.policies import OraclePolicy, RandomPolicy
from longhorizon.envs.sciworld.simulator import (
    INVALID_ACTION_REPLY,
    SimulatorProcess,
    SimulatorStep,
)

_Result = TypeVar("_Result")

INSTRUCTIONS = """\
You are an agent in ScienceWorld, a text simulation of a house with a kitchen, a workshop, a \
greenhouse and more, where you carry out science procedures: boiling, measuring, building \
circuits, finding and classifying living things, mixing chemicals. Each episode gives you a task; \
after every action you are told what happened.

Actions (OBJ is an object or place as the observations name it):
{templates}
Doors must be open before you can go through them. When an action could mean several objects, you \
are shown a numbered list: reply with just the number.

Reply with your reasoning and one action, in exactly this format:
Thought:
<your reasoning>

Action:
<one action>""".format(templates="\n".join(f"- {template}: {meaning}" for template, meaning in ACTION_TEMPLATES.items()))


TOOL_INSTRUCTIONS = """\
You are an agent in ScienceWorld, a text simulation of a house with a kitchen, a workshop, a \
greenhouse and more, where you carry out science procedures: boiling, measuring, building \
circuits, finding and classifying living things, mixing chemicals. Each episode gives you a task; \
after every action you are told what happened. Act with the act tool, one action per call, written \
as one of these templates (OBJ is an object or place as the observations name it):
{templates}
Doors must be open before you can go through them. When an action could mean several objects, you \
are shown a numbered list: act with just the number. Call one tool per turn.""".format(
    templates="\n".join(f"- {template}: {meaning}" for template, meaning in ACTION_TEMPLATES.items()))


def sciworld_tool_set() -> ToolSet:
    """One tool: ScienceWorld's actions are open-ended text over its templates."""
    return ToolSet(TOOL_INSTRUCTIONS, (EnvTool(
        "act", "Do one action, written as one of the action templates (or the number of a choice).",
        object_schema({"action": {"type": "string", "description": "e.g. open door to kitchen"}}),
        lambda arguments: arguments["action"], lambda action: {"action": action.strip()}),))


def clamped_score(score: int) -> int:
    """The part of a simulator score that counts as reward: failures count as 0, never below."""
    return min(max(score, 0), 100)


def step_reward(previous_clamped: int, score: int) -> float:
    """The reward for a step that moved the score to `score` (sums to the final clamped score / 100)."""
    return (clamped_score(score) - previous_clamped) / 100


class SciWorldEnv:
    """One ScienceWorld episode at a time on a JVM kept across episodes; reuse it with reset."""

    name = ENV_NAME
    prompt_format = "react"

    def __init__(
        self,
        *,
        task_names: Sequence[str] | None = None,
        max_variations_per_task: int | None = None,
        simplifications: str = "",
        recycle_after_episodes: int = 50,
    ):
        check_options(task_names, max_variations_per_task, simplifications, recycle_after_episodes)
        self.simplifications = simplifications
        self.recycle_after_episodes = recycle_after_episodes
        self.simulators_started = 0
        """How many JVMs this env has started (recycling and recovery included)."""
        self._simulator: SimulatorProcess | None = None
        self._episodes_on_simulator = 0
        self._task: tuple[str, int] | None = None
        self._actions: list[str] = []
        self._credited_score = 0
        self._score = 0
        self._finished = False

    def instructions(self) -> str:
        return INSTRUCTIONS

    def tool_set(self) -> ToolSet:
        return sciworld_tool_set()

    @property
    def jvm_pid(self) -> int | None:
        """The process id of the live JVM, None before the first reset and after close."""
        return self._simulator.pid if self._simulator is not None else None

    def jvm_rss_bytes(self) -> int:
        """The live JVM's resident memory, 0 when none runs."""
        return self._simulator.rss_bytes() if self._simulator is not None else 0

    async def reset(self, task: Task, *, seed: int | None = None) -> tuple[str, dict]:
        name, variation = task_name_and_variation(task)

        def start() -> tuple[str, SimulatorStep]:
            needs_fresh = (self._simulator is None or not self._simulator.is_alive()
                           or self._episodes_on_simulator >= self.recycle_after_episodes)
            if needs_fresh:
                self._recycle()
            self._episodes_on_simulator += 1
            return self._with_recovery(lambda simulator: simulator.start_episode(name, variation, self.simplifications),
                                       replay=False)

        self._task = None  # a reset that fails leaves no episode to step
        # Abandoned (not waited for) if the rollout's env-call timeout fires: a hung JVM must not
        # hold the episode; the env is then closed as broken, which ends that JVM.
        description, first = await trio.to_thread.run_sync(start, abandon_on_cancel=True)
        self._task = (name, variation)
        self._actions = []
        # Some tasks score a little for the starting state; the first step pays it, so the
        # episode's rewards still sum to the final score.
        self._credited_score = 0
        self._score = first.score
        self._finished = False
        info = {"success": False, "invalid_action": False, "score": first.score,
                "task_name": name, "variation": variation}
        return f"{description}\n{first.observation}", info

    async def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        if self._task is None:
            raise RuntimeError("sciworld env: call reset() before step()")
        if self._finished:
            raise RuntimeError("sciworld env: the episode has terminated; call reset() to start another")
        command = " ".join(action.split()) if isinstance(action, str) else ""
        if not command:
            return ("An empty action does nothing. Reply with one action, such as: look around", 0.0, False, False,
                    {"success": False, "invalid_action": True, "score": self._score})
        result = await trio.to_thread.run_sync(
            lambda: self._with_recovery(lambda simulator: simulator.step(command), replay=True),
            abandon_on_cancel=True,  # as in reset
        )
        # Replays must include every command the simulator saw: one may answer a numbered question.
        self._actions.append(command)
        reward = step_reward(self._credited_score, result.score)
        self._credited_score = clamped_score(result.score)
        success = result.score >= 100
        terminated = result.completed or success or result.score < 0
        self._finished = terminated
        self._score = result.score
        info = {"success": success, "invalid_action": result.observation.strip() == INVALID_ACTION_REPLY,
                "score": result.score, "moves": result.moves}
        return result.observation, reward, terminated, False, info

    async def valid_actions(self) -> list[str]:
        """Every action the simulator accepts right now, sorted (the env service's /action_hint)."""
        if self._task is None or self._simulator is None:
            raise RuntimeError("sciworld env: call reset() before asking for valid actions")
        simulator = self._simulator
        return sorted(await trio.to_thread.run_sync(simulator.valid_actions))

    async def close(self) -> None:
        simulator, self._simulator = self._simulator, None
        self._task = None
        if simulator is not None:
            await trio.to_thread.run_sync(simulator.close)

    def _recycle(self) -> None:
        """Close the current JVM (if any) and start a fresh one. Runs in a worker thread."""
        if self._simulator is not None:
            self._simulator.close()
            self._simulator = None
        self._simulator = SimulatorProcess()
        self.simulators_started += 1
        self._episodes_on_simulator = 0

    def _with_recovery(self, call: Callable[[SimulatorProcess], _Result], *, replay: bool) -> _Result:
        """Run a JVM call; on a JVM failure start a fresh JVM, restore the episode, and try once more."""
        assert self._simulator is not None
        try:
            return call(self._simulator)
        except ValueError:
            raise  # a task or option the simulator rejects: the caller's mistake, not the JVM's
        except Exception as first_error:
            try:
                self._recycle()
                self._episodes_on_simulator = 1
                if replay:
                    self._replay_episode()
                return call(self._simulator)
            except Exception as second_error:
                # The next reset must not trust this JVM.
                if self._simulator is not None:
                    self._simulator.close()
                raise RuntimeError(f"sciworld simulator failed twice (first: {first_error!r}; "
                                   f"after a fresh JVM: {second_error!r})") from second_error

    def _replay_episode(self) -> None:
        assert self._simulator is not None and self._task is not None
        name, variation = self._task
        self._simulator.start_episode(name, variation, self.simplifications)
        for command in self._actions:
            self._simulator.step(command)


class SciWorldOptions(Section):
    """sciworld: ScienceWorld's science procedures, scored by the simulator's progress."""

    task_names: Sequence[str] | None = None
    """ScienceWorld task names to play; none: all 30."""
    max_variations_per_task: int | None = bounded(None, ge=1)
    """Most variations taken per task and split; none: all of them."""
    simplifications: str = ""
    """Comma-separated ScienceWorld simplifications, e.g. "easy" or "teleportAction,openDoors"."""
    recycle_after_episodes: int = bounded(50, ge=1)
    """Episodes played on one JVM before a fresh one starts (the simulator's memory grows)."""


# The registry (envs/base.py) finds this env here by name.
SPEC = EnvSpec(
    name=ENV_NAME,
    factory=SciWorldEnv,
    tasks=tasks,
    policies={"oracle": OraclePolicy, "random": RandomPolicy},
    needs=("scienceworld",),
    extra="sciworld",
    Options=SciWorldOptions,
)
