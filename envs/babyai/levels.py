"""The 40 BabyAI levels of the reference suite, task numbering, option checks and simulators."""

from __future__ import annotations

import contextlib
import io
from typing import Any, Mapping, Sequence

from longhorizon.envs.base import Task

# The reference's order (easier goal families first: go to, open, pick up, put next, unlock,
# then the composite levels). Reference data_idx i plays level i % 40 + 1 with seed i // 40, so
# this order is part of the task ids and must not change.
LEVEL_NAMES: tuple[str, ...] = (
    "GoToRedBallGrey", "GoToRedBall", "GoToRedBallNoDists", "GoToObjS6", "GoToLocalS8N7",
    "GoToObjMazeS7", "GoToImpUnlock", "GoToSeqS5R2", "GoToRedBlueBall", "GoToDoor",
    "GoToObjDoor", "Open", "OpenRedDoor", "OpenDoorLoc", "OpenRedBlueDoorsDebug",
    "OpenDoorsOrderN4Debug", "Pickup", "UnblockPickup", "PickupLoc", "PickupDistDebug",
    "PickupAbove", "PutNextLocalS6N4", "PutNextS7N4Carrying", "Unlock", "UnlockLocalDist",
    "KeyInBox", "UnlockPickupDist", "BlockedUnlockPickup", "UnlockToUnlock", "ActionObjDoor",
    "FindObjS7", "KeyCorridorS6R3", "OneRoomS20", "MoveTwoAcrossS8N9", "SynthS5R2",
    "SynthLoc", "SynthSeq", "MiniBossLevel", "BossLevel", "BossLevelNoUnlock",
)
NUM_LEVELS = len(LEVEL_NAMES)

# minigrid 3 renamed GoToObjS6-v0 (the reference's id) to -v1; the level is the same.
_ENV_ID_OVERRIDES = {"GoToObjS6": "BabyAI-GoToObjS6-v1"}

def env_id(level: str) -> str:
    """The gymnasium id of a level, e.g. "BabyAI-GoToRedBall-v0"."""
    if level not in LEVEL_NAMES:
        raise ValueError(f"unknown BabyAI level {level!r}; known levels: {', '.join(LEVEL_NAMES)}")
    return _ENV_ID_OVERRIDES.get(level, f"BabyAI-{level}-v0")


def level_and_seed(data_idx: int) -> tuple[str, int]:
    """The reference's reading of a data_idx: level data_idx % 40 (0-based here), seed data_idx // 40."""
    if not isinstance(data_idx, int) or isinstance(data_idx, bool) or data_idx < 0:
        raise ValueError(f"a BabyAI data_idx must be a non-negative integer, got {data_idx!r}")
    return LEVEL_NAMES[data_idx % NUM_LEVELS], data_idx // NUM_LEVELS


def data_idx_of(level: str, seed: int) -> int:
    """The inverse of level_and_seed."""
    env_id(level)  # validates the name
    return seed * NUM_LEVELS + LEVEL_NAMES.index(level)


def resolve_levels(levels: Sequence[str] | None) -> tuple[str, ...]:
    """Level names from an option value: None for all 40, else names or gymnasium ids, any order.

    The result keeps the reference order so task lists do not depend on how the option was written.
    """
    if levels is None:
        return LEVEL_NAMES
    if isinstance(levels, str) or not isinstance(levels, Sequence):
        raise ValueError(f"babyai option levels must be a list of level names, got {levels!r}")
    wanted = set()
    for given in levels:
        if not isinstance(given, str):
            raise ValueError(f"babyai option levels must hold strings, got {given!r}")
        name = given
        if name.startswith("BabyAI-"):
            name = name[len("BabyAI-"):].rsplit("-v", 1)[0]
        env_id(name)
        wanted.add(name)
    if not wanted:
        raise ValueError("babyai option levels must name at least one level")
    return tuple(name for name in LEVEL_NAMES if name in wanted)


def check_options(
    levels: Sequence[str] | None, num_train_seeds: int, num_test_seeds: int, max_primitive_steps: int
) -> tuple[str, ...]:
    """Validate the env's option set (shared by env, tasks and policies); returns the levels."""
    for option, value in (
        ("num_train_seeds", num_train_seeds),
        ("num_test_seeds", num_test_seeds),
        ("max_primitive_steps", max_primitive_steps),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"babyai option {option} must be a positive integer, got {value!r}")
    return resolve_levels(levels)


def task_level_and_seed(task: Task) -> tuple[str, int]:
    """The level name and layout seed a BabyAI task names, with a clear error for bad data."""
    data = task.data if isinstance(task.data, Mapping) else {}
    level, seed = data.get("level"), data.get("seed")
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"babyai task {task.task_id!r} needs data['seed'] as a non-negative integer, got {seed!r}")
    if not isinstance(level, str):
        raise ValueError(f"babyai task {task.task_id!r} needs data['level'] naming a level, got {level!r}")
    env_id(level)
    return level, seed


class LevelSimulators:
    """One minigrid simulator per level, built on first use and reset for each episode."""

    def __init__(self) -> None:
        self._by_level: dict[str, Any] = {}

    def start(self, level: str, seed: int) -> Any:
        """The level's simulator, reset to the layout of `seed`."""
        import gymnasium
        import minigrid  # noqa: F401  (importing it registers the BabyAI ids with gymnasium)

        simulator = self._by_level.get(level)
        if simulator is None:
            simulator = gymnasium.make(env_id(level)).unwrapped
            self._by_level[level] = simulator
        # Level generation prints every rejected layout sample; that noise is not ours to show.
        with contextlib.redirect_stdout(io.StringIO()):
            simulator.reset(seed=seed)
        return simulator

    def close(self) -> None:
        for simulator in self._by_level.values():
            simulator.close()
        self._by_level.clear()


def mission_can_succeed(simulator: Any) -> bool:
    """False for a mission that minigrid's verifier fails whatever the agent does.

    Two strict door clauses in sequence ("open the red door, then open the blue door" or "... after
    you open ..." in OpenDoorsOrderN4Debug, about two thirds of its missions) are such: the toggle
    that opens the first door completes the first clause, and the verifier at once checks the same
    toggle against the second, strict clause, which sees a door it does not name and fails.
    """
    from minigrid.envs.babyai.core.verifier import AfterInstr, BeforeInstr, OpenInstr

    instructions = simulator.instrs
    if isinstance(instructions, BeforeInstr):
        first, second = instructions.instr_a, instructions.instr_b
    elif isinstance(instructions, AfterInstr):
        first, second = instructions.instr_b, instructions.instr_a
    else:
        return True
    if not (isinstance(first, OpenInstr) and isinstance(second, OpenInstr) and second.strict):
        return True
    # Only a door named by both clauses could satisfy the second check on the first toggle.
    return any(door is named for door in first.desc.obj_set for named in second.desc.obj_set)


def play_primitives(simulator: Any, primitives: Sequence[int]) -> tuple[float, bool, bool]:
    """Step primitives until they run out, the episode ends, or a move forward is blocked.

    Returns the last reward, terminated and truncated. Shared by the env and the oracle, which
    keeps its own copy of the simulator in step with the env's.
    """
    forward = 2
    reward, terminated, truncated = 0.0, False, False
    for primitive in primitives:
        position_before = tuple(simulator.agent_pos)
        _, reward, terminated, truncated, _ = simulator.step(primitive)
        if terminated or truncated:
            break
        if primitive == forward and tuple(simulator.agent_pos) == position_before:
            break
    return float(reward), bool(terminated), bool(truncated)
