"""One ScienceWorld simulator process (a JVM reached through py4j), with the few calls the env uses.

Every method blocks on the JVM; async callers run them in a worker thread. Steps go straight to the
simulator's server object: the Python wrapper's step() also computes the look, the inventory and the
~400 valid actions on every call (about 13 ms against 0.4 ms), which a model never sees.

The simulator lists the objects of a room, and the candidates of an ambiguous command, in an order
that changes from one load to the next (hash order inside the JVM). Observations are therefore
made canonical here: every run of equally indented list lines is sorted, and an ambiguity question's
candidates are sorted and renumbered, the reply's number being translated back for the simulator.
Then the same (task, variation) and the same commands always give the same text.

JVM lifetime: the scienceworld package starts the JVM through py4j's launch_gateway with
die_on_exit=True, i.e. `--die-on-broken-pipe`: the JVM reads its stdin, a pipe from this process,
and exits when the pipe closes. The kernel closes it however this process ends (SIGKILL
included, and whichever thread started the JVM), so no JVM outlives its owner; launch_gateway
takes no preexec_fn, and none is needed (tests/test_orphans.py checks it).
"""

from __future__ import annotations

import contextlib
import re
import subprocess
from dataclasses import dataclass

import psutil

FIRST_ACTION = "look around"
INVALID_ACTION_REPLY = "No known action matches that input."
AMBIGUOUS_PREFIX = "Ambiguous request"
_EXIT_WAIT_SECONDS = 5.0
_CHOICE_LINE = re.compile(r"^(\d+):\t(.*)$")


def _depth(line: str) -> int:
    return len(line) - len(line.lstrip("\t"))


def _sorted_lines(lines: list[str], depth: int) -> list[str]:
    """Lines at `depth` sorted as blocks (a line with the deeper lines under it), blocks sorted inside."""
    blocks: list[list[str]] = []
    for line in lines:
        if _depth(line) <= depth or not blocks:
            blocks.append([line])
        else:
            blocks[-1].append(line)
    ordered = [[block[0]] + _sorted_lines(block[1:], depth + 1) for block in blocks]
    return [line for block in sorted(ordered) for line in block]


def sort_listed_lines(text: str) -> str:
    """The text with every list (consecutive tab-indented lines) sorted, nested lists included."""
    result: list[str] = []
    run: list[str] = []
    for line in text.split("\n"):
        if _depth(line) > 0 and line.strip():
            run.append(line)
            continue
        result.extend(_sorted_lines(run, 1))
        run = []
        result.append(line)
    result.extend(_sorted_lines(run, 1))
    return "\n".join(result)


def canonical_choices(text: str) -> tuple[str, dict[str, str]]:
    """An ambiguity question with its candidates sorted and renumbered, and our number -> the simulator's."""
    header: list[str] = []
    candidates: list[tuple[str, str]] = []
    trailer: list[str] = []
    for line in text.split("\n"):
        match = _CHOICE_LINE.match(line)
        if match:
            candidates.append((match.group(2), match.group(1)))
        elif candidates:
            trailer.append(line)
        else:
            header.append(line)
    candidates.sort()
    numbered = [f"{index}:\t{candidate}" for index, (candidate, _) in enumerate(candidates)]
    translation = {str(index): original for index, (_, original) in enumerate(candidates)}
    return "\n".join(header + numbered + trailer), translation


@dataclass(frozen=True)
class SimulatorStep:
    """What one simulator step reports."""

    observation: str
    score: int
    """The simulator's score in percent: 0..100 while playing, negative after a failing action."""
    completed: bool
    moves: int


class SimulatorProcess:
    """A live ScienceWorld JVM. Reuse it across episodes with start_episode; close() ends the JVM."""

    def __init__(self) -> None:
        from scienceworld import ScienceWorldEnv

        # The wrapper's own step limit is never consulted: steps bypass it, the horizon cap rules.
        wrapper = ScienceWorldEnv.__new__(ScienceWorldEnv)
        try:
            wrapper.__init__("", envStepLimit=1_000_000)
        except BaseException:
            # The JVM died (or was killed) while starting. End what did start, and leave the
            # half-built wrapper nothing to close: its __del__ would fail without a gateway.
            gateway = getattr(wrapper, "_gateway", None)
            if gateway is not None:
                with contextlib.suppress(Exception):
                    gateway.shutdown()
                with contextlib.suppress(Exception):
                    gateway.java_process.kill()
            wrapper.close = lambda: None
            raise
        self._wrapper = wrapper
        self._java_process: subprocess.Popen = self._wrapper._gateway.java_process
        self._choice_translation: dict[str, str] = {}
        self.closed = False

    @property
    def pid(self) -> int:
        """The JVM's process id."""
        return int(self._java_process.pid)

    def rss_bytes(self) -> int:
        """The JVM's resident memory (0 once it has exited)."""
        try:
            return int(psutil.Process(self.pid).memory_info().rss)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return 0

    def is_alive(self) -> bool:
        return not self.closed and self._java_process.poll() is None

    def start_episode(self, task_name: str, variation: int, simplifications: str = "",
                      *, with_gold_path: bool = False) -> tuple[str, SimulatorStep]:
        """Load (task, variation) and look around, as the reference does: (task description, first step)."""
        self._wrapper.load(task_name, variation, simplifications, generateGoldPath=with_gold_path)
        self._choice_translation = {}
        description = str(self._wrapper.get_task_description())
        return description, self.step(FIRST_ACTION)

    def step(self, action: str) -> SimulatorStep:
        """Play one command; observations come back canonical (see the module docstring)."""
        server = self._wrapper.server
        command = self._choice_translation.get(action.strip(), action)
        self._choice_translation = {}
        observation = str(server.step(command))
        if observation.startswith(AMBIGUOUS_PREFIX):
            observation, self._choice_translation = canonical_choices(observation)
        else:
            observation = sort_listed_lines(observation)
        score = round(100 * float(server.getScore()))
        return SimulatorStep(observation, score, bool(server.getCompleted()), int(server.getNumMoves()))

    def valid_actions(self) -> list[str]:
        """Every action (template filled with visible objects) the simulator accepts right now."""
        return [str(action) for action in self._wrapper.get_valid_action_object_combinations()]

    def gold_actions(self) -> list[str]:
        """The simulator's winning action sequence; needs start_episode(..., with_gold_path=True)."""
        if not self._wrapper.goldPathGenerated:
            raise RuntimeError("no gold path: start the episode with with_gold_path=True")
        return [str(action) for action in self._wrapper.server.getGoldActionSequence()]

    def close(self) -> None:
        """Shut the JVM down and wait for it to exit (killing it if it lingers); idempotent."""
        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(Exception):
            self._wrapper.close()
        try:
            self._java_process.wait(timeout=_EXIT_WAIT_SECONDS)
        except subprocess.TimeoutExpired:
            self._java_process.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._java_process.wait(timeout=_EXIT_WAIT_SECONDS)
