"""The "longtail" env: episodes with long-tailed lengths, for throughput benchmarks (not learning).

The agent replies "continue ..." for as long as it likes, then "answer: <colour>"; the episode ends
at the answer, with reward 1 when the colour is the task's hidden one. How long an episode lasts is
decided by the scripted policy's own randomness: it draws a length from a two-part mixture (by
default most episodes take 1-3 turns, one in eight takes 15-30), so the members of one GRPO group
differ in length the way real agents do, and a synchronous batch waits on its slowest member. The
policy answers right with probability `answer_accuracy` (0.5 by default), so rewards vary within a
group and the learner gets real updates. Replies are 15-30 bytes, so a simulated per-token latency
in the scripted engine gives each turn a realistic cost.

Options (shared by the env, its tasks and its policies): short_turns, long_turns (inclusive
[min, max] turn counts of the two parts), long_fraction (share of long episodes), answer_accuracy.
"""

from __future__ import annotations

import random
import re
from typing import Mapping, Sequence

from longhorizon.common.config import Section, bounded
from longhorizon.envs.base import EnvSpec, Task

ENV_NAME = "longtail"
COLOURS = ("red", "green", "blue", "amber")
NUM_TRAIN_TASKS = 1000
NUM_TEST_TASKS = 100
DEFAULT_SHORT_TURNS = (1, 3)
DEFAULT_LONG_TURNS = (15, 30)
DEFAULT_LONG_FRACTION = 0.125
DEFAULT_ANSWER_ACCURACY = 0.5

_ANSWER_PATTERN = re.compile(r"^(?:final\s+)?answer\s*:?\s*(\S+)\s*$", re.IGNORECASE)


def _turn_range(option: str, value: object) -> tuple[int, int]:
    """A validated inclusive (min, max) turn range; accepts any two-item sequence (TOML gives lists)."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or len(value) != 2:
        raise ValueError(f"longtail option {option} must be [min_turns, max_turns], got {value!r}")
    low, high = value
    for bound in (low, high):
        if not isinstance(bound, int) or isinstance(bound, bool) or bound < 1:
            raise ValueError(f"longtail option {option} needs positive integer turn counts, got {value!r}")
    if low > high:
        raise ValueError(f"longtail option {option} must have min <= max, got {value!r}")
    return low, high


def _probability(option: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ValueError(f"longtail option {option} must be a number between 0 and 1, got {value!r}")
    return float(value)


class LengthDistribution:
    """The mixture episode lengths are drawn from: short episodes, and a long tail."""

    def __init__(
        self,
        *,
        short_turns: Sequence[int] = DEFAULT_SHORT_TURNS,
        long_turns: Sequence[int] = DEFAULT_LONG_TURNS,
        long_fraction: float = DEFAULT_LONG_FRACTION,
    ) -> None:
        self.short_turns = _turn_range("short_turns", short_turns)
        self.long_turns = _turn_range("long_turns", long_turns)
        self.long_fraction = _probability("long_fraction", long_fraction)

    def draw(self, rng: random.Random) -> int:
        """Turns of one episode, the final answer included: uniform within the part drawn."""
        low, high = self.long_turns if rng.random() < self.long_fraction else self.short_turns
        return rng.randint(low, high)

    def mean(self) -> float:
        short_mean = sum(self.short_turns) / 2
        long_mean = sum(self.long_turns) / 2
        return (1 - self.long_fraction) * short_mean + self.long_fraction * long_mean

    @property
    def max_turns(self) -> int:
        return max(self.short_turns[1], self.long_turns[1])


def _validated(
    short_turns: Sequence[int], long_turns: Sequence[int], long_fraction: float, answer_accuracy: float
) -> tuple[LengthDistribution, float]:
    lengths = LengthDistribution(short_turns=short_turns, long_turns=long_turns, long_fraction=long_fraction)
    return lengths, _probability("answer_accuracy", answer_accuracy)


def task_answer(task_id: str) -> str:
    """The hidden colour of a task, derived from its id alone."""
    return random.Random(f"longtail-task:{task_id}").choice(COLOURS)


def tasks(
    split: str,
    *,
    short_turns: Sequence[int] = DEFAULT_SHORT_TURNS,
    long_turns: Sequence[int] = DEFAULT_LONG_TURNS,
    long_fraction: float = DEFAULT_LONG_FRACTION,
    answer_accuracy: float = DEFAULT_ANSWER_ACCURACY,
) -> list[Task]:
    """1000 train or 100 test tasks; ids carry the split, so the two never share an id."""
    _validated(short_turns, long_turns, long_fraction, answer_accuracy)
    counts = {"train": NUM_TRAIN_TASKS, "test": NUM_TEST_TASKS}
    if split not in counts:
        raise ValueError(f"unknown split {split!r} for env {ENV_NAME!r}; valid splits: train, test")
    result = []
    for index in range(counts[split]):
        task_id = f"{split}-{index}"
        result.append(
            Task(env_name=ENV_NAME, task_id=task_id, split=split, category="longtail",
                 data={"answer": task_answer(task_id)})
        )
    return result


def first_observation(task_id: str) -> str:
    return f"Task {task_id}: reply 'continue' or, when done, 'answer: <colour>' ({', '.join(COLOURS)})."


# Observations are kept to a few bytes: they are not generated (no simulated latency) but the
# learner still trains on whole conversations, so every observation byte is learner cost only.
CONTINUE_OBSERVATION = "ok"


class LongTailEnv:
    """One episode at a time; reuse the object across episodes with reset.

    The reset seed is accepted and unused: everything random lives in the policy, and the task
    alone fixes the env's behaviour.
    """

    name = ENV_NAME
    prompt_format = "bare"

    def __init__(
        self,
        *,
        short_turns: Sequence[int] = DEFAULT_SHORT_TURNS,
        long_turns: Sequence[int] = DEFAULT_LONG_TURNS,
        long_fraction: float = DEFAULT_LONG_FRACTION,
        answer_accuracy: float = DEFAULT_ANSWER_ACCURACY,
    ) -> None:
        _validated(short_turns, long_turns, long_fraction, answer_accuracy)
        self._answer = ""
        self._turns = 0
        self._started = False
        self._finished = False

    def instructions(self) -> str:
        return ""

    async def reset(self, task: Task, *, seed: int | None = None) -> tuple[str, dict]:
        answer = task.data.get("answer") if isinstance(task.data, Mapping) else None
        if answer not in COLOURS:
            raise ValueError(
                f"longtail task {task.task_id!r} needs data['answer'] in {list(COLOURS)}, got {answer!r}"
            )
        self._answer = answer
        self._turns = 0
        self._started = True
        self._finished = False
        return first_observation(task.task_id), {"success": False, "invalid_action": False}

    async def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        if not self._started:
            raise RuntimeError("longtail env: call reset() before step()")
        if self._finished:
            raise RuntimeError("longtail env: the episode has terminated; call reset() to start another")
        self._turns += 1
        text = action.strip() if isinstance(action, str) else ""
        if text.lower().startswith("continue"):
            return CONTINUE_OBSERVATION, 0.0, False, False, _info(False, False)
        match = _ANSWER_PATTERN.match(text)
        if match is None or match.group(1).lower() not in COLOURS:
            observation = f"invalid action {text[:40]!r}: reply 'continue' or 'answer: <colour>'"
            return observation, 0.0, False, False, _info(False, True)
        self._finished = True
        correct = match.group(1).lower() == self._answer
        observation = "right answer" if correct else "wrong answer"
        return observation, 1.0 if correct else 0.0, True, False, _info(correct, False)

    async def close(self) -> None:
        self._started = False


def _info(success: bool, invalid_action: bool) -> dict:
    return {"success": success, "invalid_action": invalid_action}


class LongTailPolicy:
    """Draws its episode length from the mixture, says "continue" until then, then answers.

    The answer is the task's colour with probability answer_accuracy, else another colour.
    """

    def __init__(
        self,
        *,
        short_turns: Sequence[int] = DEFAULT_SHORT_TURNS,
        long_turns: Sequence[int] = DEFAULT_LONG_TURNS,
        long_fraction: float = DEFAULT_LONG_FRACTION,
        answer_accuracy: float = DEFAULT_ANSWER_ACCURACY,
    ) -> None:
        self.lengths, self.answer_accuracy = _validated(short_turns, long_turns, long_fraction, answer_accuracy)
        self.planned_turns = 1
        self.final_answer = COLOURS[0]
        self._turn = 0

    def reset(self, task: Task, first_observation: str, rng: random.Random) -> None:
        # Mixing the task id into the draws keeps two engines seeded alike (one per actor, each
        # on its own shard of tasks) from playing episodes of identical lengths.
        rng = random.Random(f"{task.task_id}:{rng.getrandbits(64)}")
        self.planned_turns = self.lengths.draw(rng)
        right = task.data.get("answer", COLOURS[0]) if isinstance(task.data, Mapping) else COLOURS[0]
        if rng.random() < self.answer_accuracy:
            self.final_answer = right
        else:
            self.final_answer = rng.choice([colour for colour in COLOURS if colour != right])
        self._turn = 0

    def act(self, observation: str) -> str:
        self._turn += 1
        if self._turn < self.planned_turns:
            return f"continue: step {self._turn} of the work"
        return f"final answer: {self.final_answer}"


class LongTailRandomPolicy:
    """Mostly continues, sometimes answers a random colour, now and then writes an invalid reply."""

    def __init__(
        self,
        *,
        short_turns: Sequence[int] = DEFAULT_SHORT_TURNS,
        long_turns: Sequence[int] = DEFAULT_LONG_TURNS,
        long_fraction: float = DEFAULT_LONG_FRACTION,
        answer_accuracy: float = DEFAULT_ANSWER_ACCURACY,
    ) -> None:
        _validated(short_turns, long_turns, long_fraction, answer_accuracy)
        self._rng = random.Random(0)

    def reset(self, task: Task, first_observation: str, rng: random.Random) -> None:
        self._rng = rng

    def act(self, observation: str) -> str:
        draw = self._rng.random()
        if draw < 0.7:
            return "continue: still working"
        if draw < 0.9:
            return f"answer: {self._rng.choice(COLOURS)}"
        return "let me think about this"


class LongTailOptions(Section):
    """longtail: episodes with long-tailed lengths, for throughput benchmarks."""

    short_turns: Sequence[int] = DEFAULT_SHORT_TURNS
    """[min, max] turns of a short episode, inclusive."""
    long_turns: Sequence[int] = DEFAULT_LONG_TURNS
    """[min, max] turns of a long episode, inclusive."""
    long_fraction: float = bounded(DEFAULT_LONG_FRACTION, ge=0, le=1)
    """Share of long episodes."""
    answer_accuracy: float = bounded(DEFAULT_ANSWER_ACCURACY, ge=0, le=1)
    """Probability that the scripted policy's answer is right."""


# The registry (envs/base.py) finds this env here by name.
SPEC = EnvSpec(
    name=ENV_NAME,
    factory=LongTailEnv,
    tasks=tasks,
    policies={"oracle": LongTailPolicy, "longtail": LongTailPolicy, "random": LongTailRandomPolicy},
    Options=LongTailOptions,
)
