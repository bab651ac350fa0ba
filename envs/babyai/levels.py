"""The 40 BabyAI levels of the reference suite, task numbering, option checks and simulators.

Each level is built as the reference builds it, so a seed gives the reference's layout and
mission. The reference makes "BabyAI-<name>-v0" from minigrid 2.3.1 (its pin is `minigrid<2.5.0`)
for each episode and resets it twice with the seed. Here minigrid 3 makes the same class with the
same arguments, with two adjustments: GoToObjS6 comes from another id (see _ENV_ID_OVERRIDES), and
the levels built on LevelGen generate missions as 2.3.1 did (see ReferenceMissions).
tests/test_babyai_levels.py checks every level on a few seeds against layouts recorded from
minigrid 2.3.1 by scripts/babyai-reference-layouts.
"""

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

# Where minigrid 3 registers the reference's level under another id. minigrid 2.3.1's
# "BabyAI-GoToObjS6-v0" is GoToObj with room_size=4 (a 4x4 grid, despite the name); minigrid 3
# replaced it by "-v1" with room_size=6, a different level, and registers the old one as GoToObjS4.
_ENV_ID_OVERRIDES = {"GoToObjS6": "BabyAI-GoToObjS4-v0"}


def env_id(level: str) -> str:
    """The gymnasium id (in the installed minigrid 3) that builds a level as the reference does.

    For every level but GoToObjS6 it is the reference's own id, e.g. "BabyAI-GoToRedBall-v0".
    """
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


class ReferenceMissions:
    """Mixin over a minigrid 3 LevelGen level: mission generation as minigrid 2.3.1 does it.

    minigrid 2.3.1 leaves `locked_room` as the last mission left it when a mission adds no locked
    room; minigrid 3 clears it first. The kept room belongs to an earlier grid, yet levels with
    implicit_unlock=False (SynthS5R2, SynthLoc, SynthSeq) still keep objects at its coordinates out
    of the instruction, so a mission, and through rejected samples the layout, can depend on the
    mission generated before it. Only the clearing differs from minigrid 3's own method.
    """

    def gen_mission(self) -> None:
        if self._rand_float(0, 1) < self.locked_room_prob:
            self.add_locked_room()
        self.connect_all()
        self.add_distractors(num_distractors=self.num_dists, all_unique=False)
        # The agent goes in after the objects, and not into this grid's locked room.
        while True:
            self.place_agent()
            if self.room_from_pos(*self.agent_pos) is not self.locked_room:
                break
        if not self.unblocking:
            self.check_objs_reachable()
        self.instrs = self.rand_instr(action_kinds=self.action_kinds, instr_kinds=self.instr_kinds)


def build_simulator(level: str) -> Any:
    """A new, not yet reset minigrid simulator (the unwrapped env) for a level, as the reference builds it."""
    import dataclasses
    import importlib

    import gymnasium
    import minigrid  # noqa: F401  (importing it registers the BabyAI ids with gymnasium)
    from minigrid.envs.babyai.core.levelgen import LevelGen

    spec = gymnasium.spec(env_id(level))
    module_name, _, class_name = spec.entry_point.partition(":")
    level_class = getattr(importlib.import_module(module_name), class_name)
    if issubclass(level_class, LevelGen):
        reference_class = type(f"Reference{class_name}", (ReferenceMissions, level_class), {})
        spec = dataclasses.replace(spec, entry_point=reference_class)
    return gymnasium.make(spec).unwrapped


class LevelSimulators:
    """One minigrid simulator per level, built on first use and reset for each episode."""

    def __init__(self) -> None:
        self._by_level: dict[str, Any] = {}

    def start(self, level: str, seed: int) -> Any:
        """The level's simulator, reset to the layout the reference plays for `seed`."""
        simulator = self._by_level.get(level)
        if simulator is None:
            simulator = build_simulator(level)
            self._by_level[level] = simulator
        # Level generation prints every rejected layout sample; that noise is not ours to show.
        with contextlib.redirect_stdout(io.StringIO()):
            if isinstance(simulator, ReferenceMissions):
                # The reference makes a new env for each episode and resets it twice with the seed;
                # the second mission starts from the locked room the first one left.
                simulator.locked_room = None
                simulator.reset(seed=seed)
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
