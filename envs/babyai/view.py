"""Egocentric text for a minigrid state, and the high-level actions that state allows.

Everything here reads the simulator's current state and changes nothing. High-level actions are
expanded into primitive minigrid actions by a breadth-first search over the cells the agent sees
now (its 7x7 view, walls occluding); cells it cannot see count as blocked.
"""

from __future__ import annotations

import json
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

# minigrid's primitive action numbers (minigrid.core.actions.Actions).
TURN_LEFT, TURN_RIGHT, FORWARD, PICKUP, DROP, TOGGLE = 0, 1, 2, 3, 4, 5

# (dx, dy) for minigrid's directions 0..3: east, south, west, north.
_DIRECTION_VECTORS = ((1, 0), (0, 1), (-1, 0), (0, -1))
_DESCRIBED_TYPES = ("key", "ball", "box", "door", "goal", "lava")
_PICKABLE_TYPES = ("key", "ball", "box")
CHECK_ACTIONS = "check available actions"


@dataclass(frozen=True)
class SeenObject:
    """An object in the agent's view, named and numbered as the observation shows it."""

    label: str
    """Description plus number, e.g. "red ball 1" or "grey closed door 2"."""
    kind: str
    position: tuple[int, int]
    steps_ahead: int
    steps_right: int
    """Negative means to the left."""


@dataclass(frozen=True)
class View:
    """What the agent sees and what it may do, with each action's primitive expansion."""

    objects: tuple[SeenObject, ...]
    wall_ahead: int | None
    """Steps to the wall straight ahead, when the first thing ahead in view is a wall."""
    carrying: str | None
    actions: dict[str, tuple[int, ...]]
    """Action text -> primitive minigrid actions, in the order the observation lists them."""


def object_description(world_object: Any) -> str:
    """"red ball", or for doors "red locked door" / "red closed door" / "red open door"."""
    if world_object.type == "door":
        state = "locked" if world_object.is_locked else "open" if world_object.is_open else "closed"
        return f"{world_object.color} {state} door"
    return f"{world_object.color} {world_object.type}"


def _visible_cells(sim: Any) -> dict[tuple[int, int], tuple[int, int]]:
    """Absolute cell -> (steps ahead, steps right) for every cell the agent can see now."""
    _, visible = sim.gen_obs_grid()
    view_size = sim.agent_view_size
    agent_x, agent_y = (int(value) for value in sim.agent_pos)
    forward_x, forward_y = _DIRECTION_VECTORS[sim.agent_dir]
    right_x, right_y = _DIRECTION_VECTORS[(sim.agent_dir + 1) % 4]
    cells = {}
    # In gen_obs_grid's frame the agent sits at (view_size // 2, view_size - 1) facing up.
    for column in range(view_size):
        for row in range(view_size):
            if not visible[column, row]:
                continue
            ahead, right = view_size - 1 - row, column - view_size // 2
            x = agent_x + forward_x * ahead + right_x * right
            y = agent_y + forward_y * ahead + right_y * right
            if 0 <= x < sim.width and 0 <= y < sim.height:
                cells[(x, y)] = (ahead, right)
    return cells


def _passable(world_object: Any) -> bool:
    return world_object is None or (world_object.can_overlap() and world_object.type != "lava")


def shortest_path_to_face(
    sim: Any,
    passable: Callable[[tuple[int, int]], bool],
    is_target: Callable[[tuple[int, int]], bool],
) -> tuple[int, ...] | None:
    """Fewest turns and moves (primitive actions) that leave the agent facing a target cell.

    Breadth-first over (x, y, direction) states: moving forward needs a passable cell ahead.
    Returns () when the agent faces a target already, None when no target can be reached.
    """
    start = (int(sim.agent_pos[0]), int(sim.agent_pos[1]), int(sim.agent_dir))
    came_from: dict[tuple[int, int, int], tuple[tuple[int, int, int], int] | None] = {start: None}
    frontier = deque([start])
    while frontier:
        state = frontier.popleft()
        x, y, direction = state
        dx, dy = _DIRECTION_VECTORS[direction]
        front = (x + dx, y + dy)
        if is_target(front):
            path = []
            while came_from[state] is not None:
                state, action = came_from[state]
                path.append(action)
            return tuple(reversed(path))
        successors = (
            ((front[0], front[1], direction), FORWARD),
            ((x, y, (direction - 1) % 4), TURN_LEFT),
            ((x, y, (direction + 1) % 4), TURN_RIGHT),
        )
        for successor, action in successors:
            if successor in came_from or (action == FORWARD and not passable(front)):
                continue
            came_from[successor] = (state, action)
            frontier.append(successor)
    return None


def _path_to_face(sim: Any, walkable: set[tuple[int, int]], target: tuple[int, int]) -> tuple[int, ...] | None:
    """Fewest turns and moves over the visible walkable cells that leave the agent facing `target`."""
    return shortest_path_to_face(sim, walkable.__contains__, lambda cell: cell == target)


def read_view(sim: Any, *, max_primitive_steps: int = 64) -> View:
    """The agent's view of `sim` (an unwrapped minigrid env) and the actions available in it."""
    cells = _visible_cells(sim)
    agent = (int(sim.agent_pos[0]), int(sim.agent_pos[1]))
    walkable = {cell for cell in cells if _passable(sim.grid.get(*cell))} | {agent}

    found = []
    for cell, (ahead, right) in cells.items():
        world_object = sim.grid.get(*cell)
        if cell != agent and world_object is not None and world_object.type in _DESCRIBED_TYPES:
            found.append((abs(ahead) + abs(right), ahead, right, cell, world_object))
    found.sort(key=lambda entry: entry[:3])
    counts: dict[str, int] = {}
    objects = []
    for _, ahead, right, cell, world_object in found:
        description = object_description(world_object)
        counts[description] = counts.get(description, 0) + 1
        objects.append(SeenObject(f"{description} {counts[description]}", world_object.type, cell, ahead, right))

    wall_ahead = None
    forward_x, forward_y = _DIRECTION_VECTORS[sim.agent_dir]
    for steps in range(1, sim.agent_view_size):
        cell = (agent[0] + forward_x * steps, agent[1] + forward_y * steps)
        if cell not in cells:
            break
        world_object = sim.grid.get(*cell)
        if world_object is not None:
            if world_object.type == "wall":
                wall_ahead = steps
            break

    carried = sim.carrying
    front = (agent[0] + forward_x, agent[1] + forward_y)
    front_object = sim.grid.get(*front) if 0 <= front[0] < sim.width and 0 <= front[1] < sim.height else None
    actions: dict[str, tuple[int, ...]] = {"turn left": (TURN_LEFT,), "turn right": (TURN_RIGHT,)}
    if front in cells and _passable(front_object):
        actions["move forward"] = (FORWARD,)
    for seen in objects:
        path = _path_to_face(sim, walkable, seen.position)
        if path is None or len(path) > max_primitive_steps:
            continue
        actions[f"go to {seen.label}"] = path
        world_object = sim.grid.get(*seen.position)
        if seen.kind in _PICKABLE_TYPES and carried is None:
            actions[f"pickup {seen.label}"] = path + (PICKUP,)
        if seen.kind == "door":
            if world_object.is_open:
                actions[f"go through {seen.label}"] = path + (FORWARD, FORWARD)
            elif not world_object.is_locked or (
                carried is not None and carried.type == "key" and carried.color == world_object.color
            ):
                actions[f"toggle and go through {seen.label}"] = path + (TOGGLE, FORWARD, FORWARD)
    if front_object is not None and front_object.type in ("door", "box"):
        actions["toggle"] = (TOGGLE,)
    if carried is not None and front in cells and front_object is None:
        actions["drop"] = (DROP,)
    actions[CHECK_ACTIONS] = ()
    return View(
        objects=tuple(objects),
        wall_ahead=wall_ahead,
        carrying=f"{carried.color} {carried.type}" if carried is not None else None,
        actions=actions,
    )


def _steps(count: int) -> str:
    return f"{count} step" if count == 1 else f"{count} steps"


def relative_position(steps_ahead: int, steps_right: int) -> str:
    """"2 steps in front of you and 1 step to your left", etc."""
    sideways = ""
    if steps_right:
        side = "right" if steps_right > 0 else "left"
        sideways = f"{_steps(abs(steps_right))} to your {side}"
    if steps_ahead and sideways:
        return f"{_steps(steps_ahead)} in front of you and {sideways}"
    return f"{_steps(steps_ahead)} in front of you" if steps_ahead else sideways


def render_actions(view: View) -> str:
    """The action list line, each action quoted as a JSON string."""
    return "Available actions: [" + ", ".join(json.dumps(action) for action in view.actions) + "]"


def render_view(view: View) -> str:
    """Egocentric sentences about the view, what the agent carries, and the available actions."""
    lines = []
    if view.objects:
        for seen in view.objects:
            lines.append(f"You see {seen.label}, {relative_position(seen.steps_ahead, seen.steps_right)}.")
    else:
        lines.append("You see no objects.")
    if view.wall_ahead is not None:
        lines.append(f"There is a wall {_steps(view.wall_ahead)} in front of you.")
    lines.append(f"You are carrying a {view.carrying}." if view.carrying else "You are not carrying anything.")
    lines.append(render_actions(view))
    return "\n".join(lines)
