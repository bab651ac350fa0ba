"""A plain-data summary of a BabyAI layout (grid, agent, objects, mission) for comparing builds.

This module imports nothing but the standard library and reads only attributes that minigrid 2.x
and 3.x share, so the script that records the reference layouts can load it by file path inside a
separate environment holding the reference's minigrid.
"""

from __future__ import annotations

from typing import Any

# One character per cell kind, so a grid reads as a list of short strings.
CELL_CHARS = {
    None: " ",
    "wall": "#",
    "floor": "F",
    "door": "D",
    "key": "K",
    "ball": "A",
    "box": "B",
    "goal": "G",
    "lava": "L",
}


def _thing(obj: Any) -> list[str]:
    return [obj.type, obj.color]


def _door_state(door: Any) -> str:
    if door.is_open:
        return "open"
    return "locked" if door.is_locked else "closed"


def describe_layout(simulator: Any) -> dict[str, Any]:
    """The layout of a reset minigrid simulator (the unwrapped env) as JSON-ready data.

    Holds the size, the agent's position and direction, what it carries, the mission, minigrid's
    step limit, every cell's kind row by row, and each non-wall object with its colour, position,
    a door's state and a box's contents.
    """
    width, height = int(simulator.grid.width), int(simulator.grid.height)
    rows = []
    objects = []
    for y in range(height):
        row = []
        for x in range(width):
            obj = simulator.grid.get(x, y)
            kind = None if obj is None else obj.type
            if kind not in CELL_CHARS:
                raise ValueError(f"cell ({x}, {y}) holds an object of unknown type {kind!r}")
            row.append(CELL_CHARS[kind])
            if obj is None or kind == "wall":
                continue
            entry: dict[str, Any] = {"type": kind, "color": obj.color, "pos": [x, y]}
            if kind == "door":
                entry["state"] = _door_state(obj)
            if kind == "box":
                entry["contains"] = None if obj.contains is None else _thing(obj.contains)
            objects.append(entry)
        rows.append("".join(row))
    carrying = simulator.carrying
    return {
        "width": width,
        "height": height,
        "agent_pos": [int(value) for value in simulator.agent_pos],
        "agent_dir": int(simulator.agent_dir),
        "carrying": None if carrying is None else _thing(carrying),
        "mission": str(simulator.mission),
        "max_steps": int(simulator.max_steps),
        "grid": rows,
        "objects": objects,
    }
