"""The "codechain" env: codebook chains of many lengths, for horizon-curriculum experiments.

A task is a chain of symbols, one shown per turn; each reply must be the symbol's action word from
a hidden codebook (as in the codebook env). The first `basic_turns` turns of every chain show
*basic* symbols; every later turn shows a *deep* symbol, which no turn before it ever shows. Chain
lengths are spread evenly over [min_turns, max_turns], so:

- easy tasks (length <= basic_turns) need only the basic symbols, and are what a random policy
  sometimes solves, so short episodes teach the basics;
- a hard task of length L can only be solved with a horizon cap >= L, and a policy never trained
  past turn `basic_turns` never saw a deep symbol: a short fixed cap plateaus;
- the reward is progress along the chain, like ScienceWorld's score: 1/L for each reply that
  extends an unbroken run of right replies from the start, paid as it is earned (so an episode cut
  by the cap keeps what it earned); success is the whole chain right. A wrong reply does not end
  the episode, so under a long cap an untrained policy plays long episodes whose every later turn
  shares a reward it had no part in;
- every turn is the same kind of sub-step, so what short tasks teach carries over to long ones.

The test split holds chains that never occur in training: a chain belongs to the test split when
a hash of its symbols falls in the test bucket, and train tasks are drawn from the other chains.
"""

from __future__ import annotations

import random
from typing import Mapping

from longhorizon.common.config import Section, bounded
from longhorizon.envs.base import EnvSpec, Task
from longhorizon.envs.toy.codebook import MAX_SPLIT_DRAWS, action_words
from longhorizon.envs.toy.codebook import is_test_sequence as is_test_chain

ENV_NAME = "codechain"
NUM_TRAIN_TASKS = 2000
NUM_TEST_TASKS = 200


def _check_options(
    min_turns: int, max_turns: int, basic_turns: int, num_basic_symbols: int, num_deep_symbols: int, num_actions: int
) -> None:
    for option, value in (
        ("min_turns", min_turns), ("max_turns", max_turns), ("basic_turns", basic_turns),
        ("num_basic_symbols", num_basic_symbols), ("num_deep_symbols", num_deep_symbols), ("num_actions", num_actions),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"codechain option {option} must be a positive integer, got {value!r}")
    if min_turns > max_turns:
        raise ValueError(f"codechain needs min_turns <= max_turns, got {min_turns} > {max_turns}")


def basic_symbol_words(num_basic_symbols: int) -> list[str]:
    return [f"s{index}" for index in range(num_basic_symbols)]


def deep_symbol_words(num_basic_symbols: int, num_deep_symbols: int) -> list[str]:
    return [f"s{index}" for index in range(num_basic_symbols, num_basic_symbols + num_deep_symbols)]


def vocabulary(
    *, min_turns: int = 2, max_turns: int = 8, basic_turns: int = 3, num_basic_symbols: int = 4,
    num_deep_symbols: int = 4, num_actions: int = 4, codebook_seed: int = 0,
) -> list[str]:
    """Every word the env can emit or accept: the basic symbols, the deep symbols, then the actions."""
    _check_options(min_turns, max_turns, basic_turns, num_basic_symbols, num_deep_symbols, num_actions)
    return (basic_symbol_words(num_basic_symbols) + deep_symbol_words(num_basic_symbols, num_deep_symbols)
            + action_words(num_actions))


def make_codebook(num_basic_symbols: int, num_deep_symbols: int, num_actions: int, codebook_seed: int) -> dict[str, str]:
    """Symbol word -> its action word. Basic and deep symbols each cycle through a shuffled list of
    the actions, so neither group has an action that is a safe constant guess."""
    codebook = {}
    for group, words in (("basic", basic_symbol_words(num_basic_symbols)),
                         ("deep", deep_symbol_words(num_basic_symbols, num_deep_symbols))):
        shuffled_actions = action_words(num_actions)
        random.Random(f"codechain-map:{group}:{codebook_seed}").shuffle(shuffled_actions)
        codebook.update({symbol: shuffled_actions[index % num_actions] for index, symbol in enumerate(words)})
    return codebook


def chain_length(task_id: str, min_turns: int, max_turns: int) -> int:
    """Task lengths cycle through min_turns..max_turns, so every length has the same share."""
    index = int(task_id.rsplit("-", 1)[1])
    return min_turns + index % (max_turns - min_turns + 1)


def _draw_chain(rng: random.Random, length: int, basic_turns: int, basic: list[str], deep: list[str]) -> list[str]:
    return [rng.choice(basic if turn < basic_turns else deep) for turn in range(length)]


def task_chain(
    task_id: str, split: str, *, length: int, basic_turns: int, num_basic_symbols: int, num_deep_symbols: int,
) -> list[str]:
    """The symbols of a task, derived from its id alone: drawn until the chain falls in its split."""
    rng = random.Random(f"codechain-task:{task_id}")
    basic = basic_symbol_words(num_basic_symbols)
    deep = deep_symbol_words(num_basic_symbols, num_deep_symbols)
    for _ in range(MAX_SPLIT_DRAWS):
        symbols = _draw_chain(rng, length, basic_turns, basic, deep)
        if is_test_chain(symbols) == (split == "test"):
            return symbols
    # Only a handful of distinct chains of this length exist, and none (or all) hash into the test
    # bucket: the split cannot hold any out.
    raise ValueError(
        f"codechain: no {split} chain of length {length} exists with {num_basic_symbols} basic and "
        f"{num_deep_symbols} deep symbols; raise min_turns or the number of symbols"
    )


def tasks(
    split: str, *, min_turns: int = 2, max_turns: int = 8, basic_turns: int = 3, num_basic_symbols: int = 4,
    num_deep_symbols: int = 4, num_actions: int = 4, codebook_seed: int = 0,
) -> list[Task]:
    """2000 train or 200 test tasks, lengths evenly spread; no chain occurs in both splits."""
    _check_options(min_turns, max_turns, basic_turns, num_basic_symbols, num_deep_symbols, num_actions)
    counts = {"train": NUM_TRAIN_TASKS, "test": NUM_TEST_TASKS}
    if split not in counts:
        raise ValueError(f"unknown split {split!r} for env {ENV_NAME!r}; valid splits: train, test")
    result = []
    for index in range(counts[split]):
        task_id = f"{split}-{index}"
        length = chain_length(task_id, min_turns, max_turns)
        symbols = task_chain(
            task_id, split, length=length, basic_turns=basic_turns,
            num_basic_symbols=num_basic_symbols, num_deep_symbols=num_deep_symbols,
        )
        result.append(Task(
            env_name=ENV_NAME, task_id=task_id, split=split,
            category=f"{'easy' if length <= basic_turns else 'hard'}-{length:02d}",
            data={"symbols": symbols},
        ))
    return result


class CodechainEnv:
    """One chain episode at a time; reuse the object across episodes with reset."""

    name = ENV_NAME
    prompt_format = "bare"

    def __init__(
        self, *, min_turns: int = 2, max_turns: int = 8, basic_turns: int = 3, num_basic_symbols: int = 4,
        num_deep_symbols: int = 4, num_actions: int = 4, codebook_seed: int = 0,
    ):
        _check_options(min_turns, max_turns, basic_turns, num_basic_symbols, num_deep_symbols, num_actions)
        self.codebook = make_codebook(num_basic_symbols, num_deep_symbols, num_actions, codebook_seed)
        self.max_turns = max_turns
        self._symbols: list[str] = []
        self._turn = 0
        self._all_right = True
        self._started = False
        self._finished = False

    def instructions(self) -> str:
        # No system prompt: the tiny model's tokenizer only knows the env's own words.
        return ""

    async def reset(self, task: Task, *, seed: int | None = None) -> tuple[str, dict]:
        symbols = task.data.get("symbols") if isinstance(task.data, Mapping) else None
        if (
            not isinstance(symbols, (list, tuple))
            or not 1 <= len(symbols) <= self.max_turns
            or any(symbol not in self.codebook for symbol in symbols)
        ):
            raise ValueError(
                f"codechain task {task.task_id!r} needs data['symbols']: 1 to {self.max_turns} words from "
                f"{sorted(self.codebook)}, got {symbols!r}"
            )
        self._symbols = list(symbols)
        self._turn = 0
        self._all_right = True
        self._started = True
        self._finished = False
        return self._symbols[0], {"success": False, "invalid_action": False}

    async def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        if not self._started:
            raise RuntimeError("codechain env: call reset() before step()")
        if self._finished:
            raise RuntimeError("codechain env: the episode has terminated; call reset() to start another")
        correct = isinstance(action, str) and action.strip() == self.codebook[self._symbols[self._turn]]
        self._all_right = self._all_right and correct
        reward = 1.0 / len(self._symbols) if self._all_right else 0.0
        self._turn += 1
        # A wrong reply does not end the episode: failing episodes run their full length, as the
        # long failing episodes of real agents do.
        if self._turn < len(self._symbols):
            return self._symbols[self._turn], reward, False, False, {
                "success": False, "invalid_action": False, "correct": correct}
        self._finished = True
        success = self._all_right
        return "", reward, True, False, {"success": success, "invalid_action": False, "correct": correct}

    async def close(self) -> None:
        self._started = False


class CodechainOraclePolicy:
    """Always answers with the codebook's action."""

    def __init__(self, **options):
        self.codebook = CodechainEnv(**options).codebook

    def reset(self, task: Task, first_observation: str, rng: random.Random) -> None:
        pass

    def act(self, observation: str) -> str:
        return self.codebook.get(observation.strip(), "a0")


class CodechainBasicOnlyPolicy:
    """Knows the basic symbols only (what a short horizon can teach) and guesses a fixed action for
    deep ones: solves the easy tasks and, by chance, only some hard ones."""

    def __init__(self, *, num_basic_symbols: int = 4, **options):
        codebook = CodechainEnv(num_basic_symbols=num_basic_symbols, **options).codebook
        self.codebook = {symbol: codebook[symbol] for symbol in basic_symbol_words(num_basic_symbols)}

    def reset(self, task: Task, first_observation: str, rng: random.Random) -> None:
        pass

    def act(self, observation: str) -> str:
        return self.codebook.get(observation.strip(), "a0")


class CodechainRandomPolicy:
    """Answers with a uniformly random action word."""

    def __init__(self, *, num_actions: int = 4, **options):
        CodechainEnv(num_actions=num_actions, **options)  # validates the options
        self.actions = action_words(num_actions)
        self._rng = random.Random(0)

    def reset(self, task: Task, first_observation: str, rng: random.Random) -> None:
        self._rng = rng

    def act(self, observation: str) -> str:
        return self._rng.choice(self.actions)


class CodechainOptions(Section):
    """codechain: codebook chains of many lengths, for horizon-curriculum experiments."""

    min_turns: int = bounded(2, ge=1)
    """Shortest chain."""
    max_turns: int = bounded(8, ge=1)
    """Longest chain (at least min_turns); chain lengths spread evenly between the two."""
    basic_turns: int = bounded(3, ge=1)
    """Turns that show basic symbols; every later turn shows a deep one."""
    num_basic_symbols: int = bounded(4, ge=1)
    """Basic symbol words."""
    num_deep_symbols: int = bounded(4, ge=1)
    """Deep symbol words, shown only after turn basic_turns."""
    num_actions: int = bounded(4, ge=1)
    """Action words the codebook maps symbols to."""
    codebook_seed: int = 0
    """Fixes the hidden codebook."""


# The registry (envs/base.py) finds this env here by name.
SPEC = EnvSpec(
    name=ENV_NAME,
    factory=CodechainEnv,
    tasks=tasks,
    policies={"oracle": CodechainOraclePolicy, "basic-only": CodechainBasicOnlyPolicy,
              "random": CodechainRandomPolicy},
    Options=CodechainOptions,
)
