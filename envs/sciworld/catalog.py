"""The SciWorld task list: ScienceWorld's tasks, their variation splits, and the action templates.

The reference (AgentGym's SciWorld service) flattens every (task, variation) pair of the tasks it
keeps into one list indexed by `data_idx`, in the simulator's task order (1-1, 1-2, ... 10-2) and
variation order. It leaves out seven tasks: 5-1 and 5-2 (growing plants and fruit), 9-1 to 9-3
(inclined planes) and 10-1 and 10-2 (Mendelian genetics), the longest ones (gold paths of 50 to
180 steps). They stay available by naming them in `task_names`.

The simulator's own variation splits are contiguous ranges, recorded here so listing tasks needs no
JVM (tests check the table against the simulator): variations [0, train_end) are for training,
[train_end, dev_end) for development, [dev_end, total) for testing. Our "train" split is the
simulator's train range, our "test" split its test range; the dev range is not used.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from longhorizon.envs.base import Task

ENV_NAME = "sciworld"


@dataclass(frozen=True)
class SciWorldTaskInfo:
    """One ScienceWorld task and where its variation splits begin and end."""

    task_id: str
    """The paper's numbering, e.g. "1-1"."""
    name: str
    """The simulator's task name, e.g. "boil"."""
    train_end: int
    dev_end: int
    total_variations: int


SCIENCEWORLD_TASKS: tuple[SciWorldTaskInfo, ...] = (
    SciWorldTaskInfo("1-1", "boil", 14, 21, 30),
    SciWorldTaskInfo("1-2", "melt", 14, 21, 30),
    SciWorldTaskInfo("1-3", "freeze", 14, 21, 30),
    SciWorldTaskInfo("1-4", "change-the-state-of-matter-of", 14, 21, 30),
    SciWorldTaskInfo("2-1", "use-thermometer", 270, 405, 540),
    SciWorldTaskInfo("2-2", "measure-melting-point-known-substance", 218, 327, 436),
    SciWorldTaskInfo("2-3", "measure-melting-point-unknown-substance", 150, 225, 300),
    SciWorldTaskInfo("3-1", "power-component", 10, 15, 20),
    SciWorldTaskInfo("3-2", "power-component-renewable-vs-nonrenewable-energy", 10, 15, 20),
    SciWorldTaskInfo("3-3", "test-conductivity", 450, 675, 900),
    SciWorldTaskInfo("3-4", "test-conductivity-of-unknown-substances", 300, 450, 600),
    SciWorldTaskInfo("4-1", "find-living-thing", 150, 225, 300),
    SciWorldTaskInfo("4-2", "find-non-living-thing", 150, 225, 300),
    SciWorldTaskInfo("4-3", "find-plant", 150, 225, 300),
    SciWorldTaskInfo("4-4", "find-animal", 150, 225, 300),
    SciWorldTaskInfo("5-1", "grow-plant", 62, 93, 126),
    SciWorldTaskInfo("5-2", "grow-fruit", 62, 93, 126),
    SciWorldTaskInfo("6-1", "chemistry-mix", 16, 24, 32),
    SciWorldTaskInfo("6-2", "chemistry-mix-paint-secondary-color", 18, 27, 36),
    SciWorldTaskInfo("6-3", "chemistry-mix-paint-tertiary-color", 18, 27, 36),
    SciWorldTaskInfo("7-1", "lifespan-longest-lived", 62, 93, 125),
    SciWorldTaskInfo("7-2", "lifespan-shortest-lived", 62, 93, 125),
    SciWorldTaskInfo("7-3", "lifespan-longest-lived-then-shortest-lived", 62, 93, 125),
    SciWorldTaskInfo("8-1", "identify-life-stages-1", 6, 9, 14),
    SciWorldTaskInfo("8-2", "identify-life-stages-2", 4, 6, 10),
    SciWorldTaskInfo("9-1", "inclined-plane-determine-angle", 84, 126, 168),
    SciWorldTaskInfo("9-2", "inclined-plane-friction-named-surfaces", 692, 1038, 1386),
    SciWorldTaskInfo("9-3", "inclined-plane-friction-unnamed-surfaces", 80, 120, 162),
    SciWorldTaskInfo("10-1", "mendelian-genetics-known-plant", 60, 90, 120),
    SciWorldTaskInfo("10-2", "mendelian-genetics-unknown-plant", 240, 360, 480),
)

TASKS_BY_NAME: dict[str, SciWorldTaskInfo] = {info.name: info for info in SCIENCEWORLD_TASKS}

REFERENCE_EXCLUDED_TASK_IDS = frozenset({"5-1", "5-2", "9-1", "9-2", "9-3", "10-1", "10-2"})

REFERENCE_TASK_NAMES: tuple[str, ...] = tuple(
    info.name for info in SCIENCEWORLD_TASKS if info.task_id not in REFERENCE_EXCLUDED_TASK_IDS
)

# The simulator's action templates (get_possible_actions()) with what each does. "reset task" is
# left out: it wipes the progress made so far and never helps an agent.
ACTION_TEMPLATES: dict[str, str] = {
    "look around": "describe the room you are in",
    "look at OBJ": "describe an object in detail",
    "look in OBJ": "describe what a container holds",
    "read OBJ": "read a book or note",
    "inventory": "list what you carry",
    "task": "repeat the task description",
    "go OBJ": "move to a location through an open door, e.g. go to kitchen",
    "open OBJ": "open a door or container",
    "close OBJ": "close a door or container",
    "activate OBJ": "switch a device on",
    "deactivate OBJ": "switch a device off",
    "connect OBJ to OBJ": "join two electrical terminals",
    "disconnect OBJ": "undo an object's electrical connections",
    "pick up OBJ": "put an object in your inventory",
    "put down OBJ": "drop an object from your inventory",
    "move OBJ to OBJ": "place an object in or on a container",
    "pour OBJ in OBJ": "pour a liquid into a container",
    "dunk OBJ in OBJ": "dip a container into a liquid",
    "mix OBJ": "chemically mix the contents of a container",
    "use OBJ on OBJ": "use a tool or device on an object, e.g. a thermometer on a substance",
    "eat OBJ": "eat a food",
    "flush OBJ": "flush a toilet",
    "focus on OBJ": "declare the object the task is about (a wrong focus ends the task as failed)",
    "wait": "let 10 time steps pass",
    "wait1": "let 1 time step pass",
}
UNLISTED_TEMPLATES = frozenset({"reset task"})

# The simulator's simplifications ("easy" turns on all of them); simplifications is a comma-separated
# subset, "" (the reference's choice) for none.
SIMPLIFICATIONS = ("easy", "teleportAction", "selfWateringFlowerPots", "openContainers", "openDoors",
                   "noElectricalAction")


def resolve_task_names(task_names: Sequence[str] | None) -> tuple[str, ...]:
    """The chosen task names in simulator order; None means the reference's 23 tasks."""
    if task_names is None:
        return REFERENCE_TASK_NAMES
    if isinstance(task_names, str) or not isinstance(task_names, Sequence):
        raise ValueError(f"sciworld option task_names must be a list of task names, got {task_names!r}")
    if not task_names:
        raise ValueError("sciworld option task_names must name at least one task")
    unknown = [name for name in task_names if name not in TASKS_BY_NAME]
    if unknown:
        raise ValueError(f"unknown sciworld task(s) {unknown}; valid: {', '.join(TASKS_BY_NAME)}")
    chosen = set(task_names)
    return tuple(info.name for info in SCIENCEWORLD_TASKS if info.name in chosen)


def check_options(
    task_names: Sequence[str] | None,
    max_variations_per_task: int | None,
    simplifications: str,
    recycle_after_episodes: int,
) -> tuple[str, ...]:
    """Validate the env's option set (shared by the env, the task list and the policies)."""
    chosen = resolve_task_names(task_names)
    if max_variations_per_task is not None and (
        not isinstance(max_variations_per_task, int) or isinstance(max_variations_per_task, bool)
        or max_variations_per_task < 1
    ):
        raise ValueError(f"sciworld option max_variations_per_task must be None or an integer >= 1, "
                         f"got {max_variations_per_task!r}")
    if not isinstance(simplifications, str):
        raise ValueError(f"sciworld option simplifications must be a comma-separated string, got {simplifications!r}")
    unknown = [part for part in simplifications.split(",") if part and part not in SIMPLIFICATIONS]
    if unknown:
        raise ValueError(f"unknown sciworld simplification(s) {unknown}; valid: {', '.join(SIMPLIFICATIONS)}")
    if not isinstance(recycle_after_episodes, int) or isinstance(recycle_after_episodes, bool) \
            or recycle_after_episodes < 1:
        raise ValueError(f"sciworld option recycle_after_episodes must be an integer >= 1, "
                         f"got {recycle_after_episodes!r}")
    return chosen


def reference_data_index(task_name: str, variation: int) -> int | None:
    """The reference's data_idx of a (task, variation) pair, or None for a task it leaves out."""
    index = 0
    for info in SCIENCEWORLD_TASKS:
        if info.task_id in REFERENCE_EXCLUDED_TASK_IDS:
            continue
        if info.name == task_name:
            return index + variation
        index += info.total_variations
    return None


def split_variations(info: SciWorldTaskInfo, split: str) -> range:
    """The simulator's variations of one task that make up our split."""
    if split == "train":
        return range(info.train_end)
    if split == "test":
        return range(info.dev_end, info.total_variations)
    raise ValueError(f"unknown split {split!r} for env {ENV_NAME!r}; valid splits: train, test")


def tasks(
    split: str,
    *,
    task_names: Sequence[str] | None = None,
    max_variations_per_task: int | None = None,
    simplifications: str = "",
    recycle_after_episodes: int = 50,
) -> list[Task]:
    """The split's (task, variation) pairs, task by task in simulator order, variations ascending.

    max_variations_per_task keeps the first variations of each task (a small, balanced set).
    """
    chosen = check_options(task_names, max_variations_per_task, simplifications, recycle_after_episodes)
    result = []
    for name in chosen:
        info = TASKS_BY_NAME[name]
        variations = split_variations(info, split)
        if max_variations_per_task is not None:
            variations = variations[:max_variations_per_task]
        for variation in variations:
            result.append(
                Task(
                    env_name=ENV_NAME,
                    task_id=f"{split}-{name}-{variation}",
                    split=split,
                    category=name,
                    data={"task_name": name, "variation": variation,
                          "data_idx": reference_data_index(name, variation)},
                )
            )
    return result


def task_name_and_variation(task: Task) -> tuple[str, int]:
    """The (task name, variation) a Task asks for, checked against the simulator's ranges."""
    data = task.data if isinstance(task.data, Mapping) else {}
    name = data.get("task_name")
    variation = data.get("variation")
    if not isinstance(name, str) or name not in TASKS_BY_NAME:
        raise ValueError(f"sciworld task {task.task_id!r} needs data['task_name'] naming a ScienceWorld task, "
                         f"got {name!r}")
    total = TASKS_BY_NAME[name].total_variations
    if not isinstance(variation, int) or isinstance(variation, bool) or not 0 <= variation < total:
        raise ValueError(f"sciworld task {task.task_id!r}: data['variation'] must be an integer in [0, {total}) "
                         f"for {name!r}, got {variation!r}")
    return name, variation
