"""The "codebook" env: a tiny multi-turn task a randomly initialised model learns on CPU.

A hidden codebook (fixed by codebook_seed) maps each symbol word (s0, s1, ...) to one action word
(a0, a1, ...). Each turn shows one symbol; the reply must be its action word. After num_turns
replies the episode ends with reward = fraction answered right. The words are kept minimal so a
word-level tokenizer built from vocabulary() covers everything the env says or accepts.

By default the two splits draw their symbol sequences independently, so with few sequences (64 at
3 turns of 4 symbols) most test sequences also occur in training. `held_out_sequences = true`
puts a sequence in the test split when a hash of it falls in the test bucket (about one in five)
and draws train tasks from the others: then no test sequence is ever trained on, and held-out
success measures whether the policy learned the codebook rather than the sequences.
"""

from __future__ import annotations

import hashlib
import random
from typing import Mapping

from longhorizon.common.config import Section, bounded
from longhorizon.envs.base import EnvSpec, Task

ENV_NAME = "codebook"
NUM_TRAIN_TASKS = 2000
NUM_TEST_TASKS = 200
# One sequence in TEST_BUCKETS belongs to the test split (held_out_sequences, and codechain's chains).
TEST_BUCKETS = 5
# Draws before concluding that no sequence falls in a split (a hit takes about 5 on average).
MAX_SPLIT_DRAWS = 1000


def _check_sizes(num_turns: int, num_symbols: int, num_actions: int) -> None:
    for option, value in (("num_turns", num_turns), ("num_symbols", num_symbols), ("num_actions", num_actions)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"codebook option {option} must be a positive integer, got {value!r}")


def symbol_words(num_symbols: int) -> list[str]:
    return [f"s{index}" for index in range(num_symbols)]


def action_words(num_actions: int) -> list[str]:
    return [f"a{index}" for index in range(num_actions)]


def vocabulary(*, num_turns: int = 3, num_symbols: int = 4, num_actions: int = 4, codebook_seed: int = 0,
               held_out_sequences: bool = False) -> list[str]:
    """Every word the env can emit or accept: the symbols, then the actions."""
    _check_sizes(num_turns, num_symbols, num_actions)
    return symbol_words(num_symbols) + action_words(num_actions)


def make_codebook(num_symbols: int, num_actions: int, codebook_seed: int) -> dict[str, str]:
    """Symbol word -> the action word that answers it, fixed by codebook_seed."""
    shuffled_actions = action_words(num_actions)
    random.Random(f"codebook-map:{codebook_seed}").shuffle(shuffled_actions)
    # Cycling through a shuffled list uses every action before any repeats, so with as many
    # actions as symbols the codebook is a permutation and no action is a safe constant guess.
    return {symbol: shuffled_actions[index % num_actions] for index, symbol in enumerate(symbol_words(num_symbols))}


def is_test_sequence(symbols: list[str] | tuple[str, ...]) -> bool:
    """Whether a symbol sequence belongs to the test split (a stable hash, not Python's hash)."""
    digest = hashlib.sha256(" ".join(symbols).encode()).digest()
    return int.from_bytes(digest[:8], "big") % TEST_BUCKETS == 0


def task_symbols(task_id: str, num_turns: int, num_symbols: int, split: str | None = None) -> list[str]:
    """The symbol shown at each turn of a task, derived from its id alone; with `split`, drawn
    until the sequence falls in that split (held_out_sequences)."""
    rng = random.Random(f"codebook-task:{task_id}")
    words = symbol_words(num_symbols)
    for _ in range(MAX_SPLIT_DRAWS if split else 1):
        symbols = [words[rng.randrange(num_symbols)] for _ in range(num_turns)]
        if split is None or is_test_sequence(symbols) == (split == "test"):
            return symbols
    raise ValueError(f"codebook: no {split} sequence exists with num_turns={num_turns} and "
                     f"num_symbols={num_symbols} under held_out_sequences; raise either")


def tasks(
    split: str, *, num_turns: int = 3, num_symbols: int = 4, num_actions: int = 4, codebook_seed: int = 0,
    held_out_sequences: bool = False,
) -> list[Task]:
    """2000 train or 200 test tasks; ids carry the split, so the two never share an id (and with
    held_out_sequences, never a symbol sequence)."""
    _check_sizes(num_turns, num_symbols, num_actions)
    if not isinstance(held_out_sequences, bool):
        raise ValueError(f"codebook option held_out_sequences must be true or false, got {held_out_sequences!r}")
    counts = {"train": NUM_TRAIN_TASKS, "test": NUM_TEST_TASKS}
    if split not in counts:
        raise ValueError(f"unknown split {split!r} for env {ENV_NAME!r}; valid splits: train, test")
    result = []
    for index in range(counts[split]):
        task_id = f"{split}-{index}"
        result.append(
            Task(
                env_name=ENV_NAME,
                task_id=task_id,
                split=split,
                category=f"turns-{num_turns}",
                data={"symbols": task_symbols(task_id, num_turns, num_symbols, split if held_out_sequences else None)},
            )
        )
    return result


class CodebookEnv:
    """One codebook episode at a time; reuse the object across episodes with reset."""

    name = ENV_NAME
    prompt_format = "bare"

    def __init__(self, *, num_turns: int = 3, num_symbols: int = 4, num_actions: int = 4, codebook_seed: int = 0,
                 held_out_sequences: bool = False):
        _check_sizes(num_turns, num_symbols, num_actions)
        self.num_turns = num_turns
        self.num_symbols = num_symbols
        self.codebook = make_codebook(num_symbols, num_actions, codebook_seed)
        self._symbols: list[str] = []
        self._turn = 0
        self._num_right = 0
        self._started = False
        self._finished = False

    def instructions(self) -> str:
        # No system prompt: the tiny model's tokenizer only knows the env's own words.
        return ""

    async def reset(self, task: Task, *, seed: int | None = None) -> tuple[str, dict]:
        symbols = task.data.get("symbols") if isinstance(task.data, Mapping) else None
        if (
            not isinstance(symbols, (list, tuple))
            or len(symbols) != self.num_turns
            or any(symbol not in self.codebook for symbol in symbols)
        ):
            raise ValueError(
                f"codebook task {task.task_id!r} needs data['symbols'] with {self.num_turns} words from "
                f"{sorted(self.codebook)}, got {symbols!r}"
            )
        self._symbols = list(symbols)
        self._turn = 0
        self._num_right = 0
        self._started = True
        self._finished = False
        return self._symbols[0], {"success": False, "invalid_action": False}

    async def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        if not self._started:
            raise RuntimeError("codebook env: call reset() before step()")
        if self._finished:
            raise RuntimeError("codebook env: the episode has terminated; call reset() to start another")
        expected = self.codebook[self._symbols[self._turn]]
        correct = isinstance(action, str) and action.strip() == expected
        self._num_right += int(correct)
        self._turn += 1
        if self._turn < self.num_turns:
            info = {"success": False, "invalid_action": False, "correct": correct}
            return self._symbols[self._turn], 0.0, False, False, info
        self._finished = True
        reward = self._num_right / self.num_turns
        success = self._num_right == self.num_turns
        return "", reward, True, False, {"success": success, "invalid_action": False, "correct": correct}

    async def close(self) -> None:
        self._started = False


class CodebookOraclePolicy:
    """Always answers with the codebook's action."""

    def __init__(self, *, num_turns: int = 3, num_symbols: int = 4, num_actions: int = 4, codebook_seed: int = 0,
                 held_out_sequences: bool = False):
        _check_sizes(num_turns, num_symbols, num_actions)
        self.codebook = make_codebook(num_symbols, num_actions, codebook_seed)

    def reset(self, task: Task, first_observation: str, rng: random.Random) -> None:
        pass

    def act(self, observation: str) -> str:
        return self.codebook.get(observation.strip(), "a0")


class CodebookRandomPolicy:
    """Answers with a uniformly random action word."""

    def __init__(self, *, num_turns: int = 3, num_symbols: int = 4, num_actions: int = 4, codebook_seed: int = 0,
                 held_out_sequences: bool = False):
        _check_sizes(num_turns, num_symbols, num_actions)
        self.actions = action_words(num_actions)
        self._rng = random.Random(0)

    def reset(self, task: Task, first_observation: str, rng: random.Random) -> None:
        self._rng = rng

    def act(self, observation: str) -> str:
        return self._rng.choice(self.actions)


class CodebookOptions(Section):
    """codebook: a tiny multi-turn task a randomly initialised model learns on CPU."""

    num_turns: int = bounded(3, ge=1)
    """Symbols shown per episode, one per turn."""
    num_symbols: int = bounded(4, ge=1)
    """Symbol words in the codebook."""
    num_actions: int = bounded(4, ge=1)
    """Action words the codebook maps symbols to."""
    codebook_seed: int = 0
    """Fixes the hidden codebook."""
    held_out_sequences: bool = False
    """Test sequences never occur in training (a hash puts about one in five in the test split)."""


# The registry (envs/base.py) finds this env here by name.
SPEC = EnvSpec(
    name=ENV_NAME,
    factory=CodebookEnv,
    tasks=tasks,
    policies={"oracle": CodebookOraclePolicy, "random": CodebookRandomPolicy},
    Options=CodebookOptions,
)
