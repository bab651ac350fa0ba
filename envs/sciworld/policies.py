"""Scripted SciWorld policies: an oracle that plays the simulator's gold path, and a random one.

Both read the simulator through one process-wide reference JVM, started on first use and shared
by every policy in the process (one JVM per policy would cost ~0.5 GB and a second each). The
oracle asks it for the gold path once per episode. The random policy mirrors its own episode on it
to list the valid actions: the simulator is deterministic, so replaying the same commands from the
same (task, variation) reaches the env's state. When several random episodes interleave, the
reference replays the requesting episode from its start.
"""

from __future__ import annotations

import atexit
import random
import re
import threading
from collections.abc import Sequence

from longhorizon.envs.base import Task, react_reply
from longhorizon.envs.sciworld.catalog import (
    UNLISTED_TEMPLATES,
    check_options,
    task_name_and_variation,
)
from longhorizon.envs.sciworld.simulator import (
    AMBIGUOUS_PREFIX,
    FIRST_ACTION,
    SimulatorProcess,
)

_NUMBERED_CHOICE = re.compile(r"^(\d+):", re.MULTILINE)


class ReferenceSimulator:
    """A JVM that answers questions about episodes (gold paths, valid actions); thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._simulator: SimulatorProcess | None = None
        # (task, variation, simplifications) and the commands played since its start, or None.
        self._position: tuple[tuple[str, int, str], tuple[str, ...]] | None = None

    def gold_actions(self, task_name: str, variation: int, simplifications: str = "") -> list[str]:
        """The simulator's winning command sequence for a fresh episode of (task, variation)."""
        def read(simulator: SimulatorProcess) -> list[str]:
            self._position = None
            simulator.start_episode(task_name, variation, simplifications, with_gold_path=True)
            return simulator.gold_actions()

        return self._call(read)

    def valid_actions_after(
        self, task_name: str, variation: int, simplifications: str, commands: Sequence[str]
    ) -> list[str]:
        """The valid actions, sorted, once `commands` have been played from the episode's start."""
        episode = (task_name, variation, simplifications)
        commands = tuple(commands)

        def read(simulator: SimulatorProcess) -> list[str]:
            played: tuple[str, ...] = ()
            if self._position is not None and self._position[0] == episode \
                    and commands[:len(self._position[1])] == self._position[1]:
                played = self._position[1]
            else:
                self._position = None
                simulator.start_episode(task_name, variation, simplifications)
            for command in commands[len(played):]:
                simulator.step(command)
            self._position = (episode, commands)
            # The JVM's order is not stable across processes; sorting keeps seeded choices reproducible.
            return sorted(set(simulator.valid_actions()))

        return self._call(read)

    def rss_bytes(self) -> int:
        """The reference JVM's resident memory, 0 when none runs."""
        simulator = self._simulator
        return simulator.rss_bytes() if simulator is not None else 0

    def close(self) -> None:
        with self._lock:
            if self._simulator is not None:
                self._simulator.close()
            self._simulator = None
            self._position = None

    def _call(self, read):
        with self._lock:
            for attempt in range(2):
                if self._simulator is None or not self._simulator.is_alive():
                    self._simulator = SimulatorProcess()
                    self._position = None
                try:
                    return read(self._simulator)
                except ValueError:
                    raise
                except Exception:
                    # A broken JVM is replaced once; a second failure is reported to the caller.
                    self._simulator.close()
                    self._simulator = None
                    self._position = None
                    if attempt == 1:
                        raise
            raise AssertionError("unreachable")


_shared_reference: ReferenceSimulator | None = None
_shared_reference_lock = threading.Lock()


def shared_reference() -> ReferenceSimulator:
    """The process's reference simulator, started on first use and closed at exit."""
    global _shared_reference
    with _shared_reference_lock:
        if _shared_reference is None:
            _shared_reference = ReferenceSimulator()
            atexit.register(_shared_reference.close)
        return _shared_reference


class OraclePolicy:
    """Plays the simulator's gold path for the task, then looks around if asked for more."""

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
        self._plan: list[str] = []
        self._next = 0

    def reset(self, task: Task, first_observation: str, rng: random.Random) -> None:
        name, variation = task_name_and_variation(task)
        self._plan = shared_reference().gold_actions(name, variation, self.simplifications)
        self._next = 0

    def act(self, observation: str) -> str:
        if self._next >= len(self._plan):
            return react_reply("I have played the whole plan; let me look around.", FIRST_ACTION)
        action = self._plan[self._next]
        self._next += 1
        return react_reply(f"Step {self._next} of {len(self._plan)} of my plan.", action)


class RandomPolicy:
    """Picks uniformly among the simulator's valid actions (a listed number when asked to choose)."""

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
        self._episode: tuple[str, int] | None = None
        self._commands: list[str] = []
        self._rng = random.Random(0)

    def reset(self, task: Task, first_observation: str, rng: random.Random) -> None:
        self._episode = task_name_and_variation(task)
        self._commands = []
        self._rng = rng

    def act(self, observation: str) -> str:
        if self._episode is None:
            raise RuntimeError("sciworld random policy: call reset() before act()")
        choices = _NUMBERED_CHOICE.findall(observation) if observation.startswith(AMBIGUOUS_PREFIX) else []
        if choices:
            command = self._rng.choice(choices)
            thought = "Any of these will do."
        else:
            name, variation = self._episode
            valid = shared_reference().valid_actions_after(name, variation, self.simplifications, self._commands)
            valid = [action for action in valid if action not in UNLISTED_TEMPLATES] or [FIRST_ACTION]
            command = self._rng.choice(valid)
            thought = "Let me try something."
        self._commands.append(command)
        return react_reply(thought, command)
