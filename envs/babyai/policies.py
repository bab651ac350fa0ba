"""Scripted BabyAI policies: an oracle (scripted chores, then minigrid's BabyAIBot), and a random one."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from longhorizon.envs.babyai.levels import LevelSimulators, check_options, play_primitives, task_level_and_seed
from longhorizon.envs.babyai.view import (
    CHECK_ACTIONS,
    DROP,
    FORWARD,
    PICKUP,
    TOGGLE,
    TURN_LEFT,
    TURN_RIGHT,
    View,
    read_view,
    shortest_path_to_face,
)
from longhorizon.envs.base import Task, react_reply

_ACTIONS_PREFIX = "Available actions: "
_TEXT_OF_PRIMITIVE = {TURN_LEFT: "turn left", TURN_RIGHT: "turn right", FORWARD: "move forward",
                      TOGGLE: "toggle", DROP: "drop"}
# The bot can search forever on a few layouts; past this many path searches in one decision it
# is declared stuck, and the oracle takes a random step and starts a fresh bot.
_MAX_SEARCHES_PER_DECISION = 500


def available_actions(observation: str) -> list[str]:
    """The actions listed on the last "Available actions: [...]" line of an observation."""
    for line in reversed(observation.splitlines()):
        position = line.find(_ACTIONS_PREFIX)
        if position >= 0:
            try:
                listed = json.loads(line[position + len(_ACTIONS_PREFIX):])
            except json.JSONDecodeError as error:
                raise ValueError(f"malformed action list in BabyAI observation: {line!r}") from error
            return [action for action in listed if isinstance(action, str)]
    return []


Cell = tuple[int, int]


@dataclass(frozen=True)
class Chore:
    """A scripted step the bot cannot plan: walk until facing a cell `wanted` accepts, then `final`."""

    description: str
    wanted: Callable[[Any, Cell], bool]
    """(simulator, cell in front of the agent) -> whether this is the cell to act on."""
    final: int
    """The primitive done there, e.g. TOGGLE or DROP."""


def path_to_face(sim: Any, wanted: Callable[[Any, Cell], bool]) -> tuple[int, ...] | None:
    """Fewest turns and moves over the whole grid that leave the agent facing a wanted cell.

    The oracle knows the full map, unlike the agent, so cells out of view count as known. Returns
    () when the agent faces a wanted cell already, None when no such cell can be reached.
    """

    def in_grid(cell: Cell) -> bool:
        return 0 <= cell[0] < sim.grid.width and 0 <= cell[1] < sim.grid.height

    def walkable(cell: Cell) -> bool:
        if not in_grid(cell):
            return False
        world_object = sim.grid.get(*cell)
        return world_object is None or (world_object.can_overlap() and world_object.type != "lava")

    return shortest_path_to_face(sim, walkable, lambda cell: in_grid(cell) and wanted(sim, cell))


def _is_empty(sim: Any, cell: Cell) -> bool:
    return sim.grid.get(*cell) is None


def _holds(position: Cell) -> Callable[[Any, Cell], bool]:
    return lambda sim, cell: cell == position


def _doors_in_mission_order(instructions: Any) -> list[Any] | None:
    """The door objects a strict door-opening mission names, in the order they must be opened.

    None unless the mission is made only of "open the <door>" clauses, at least one strict (a
    strict clause fails on touching any other door, which the bot's exploration does).
    """
    from minigrid.envs.babyai.core.verifier import AfterInstr, BeforeInstr, OpenInstr

    if isinstance(instructions, OpenInstr):
        clauses = [instructions]
    elif isinstance(instructions, BeforeInstr):
        clauses = [instructions.instr_a, instructions.instr_b]
    elif isinstance(instructions, AfterInstr):
        clauses = [instructions.instr_b, instructions.instr_a]
    else:
        return None
    if not all(isinstance(clause, OpenInstr) for clause in clauses):
        return None
    if not any(clause.strict for clause in clauses) or not all(clause.desc.obj_set for clause in clauses):
        return None
    return [clause.desc.obj_set[0] for clause in clauses]


def scripted_chores(sim: Any) -> list[Chore]:
    """What to do before the bot can take over (or instead of it), from the episode's start state.

    - An object already in hand (PutNext...Carrying): put it down; the bot assumes empty hands.
    - A key hidden in a box (KeyInBox): open the box; the bot never opens boxes, so the key
      stays invisible to it. Once the key lies in the open, the bot fetches it and unlocks.
    - A strict door order (OpenDoorsOrder...Debug): open exactly the named doors in order; the
      bot explores by opening doors, and a strict mission fails on the first wrong one.
    """
    chores = []
    if sim.carrying is not None:
        chores.append(Chore(f"put down the {sim.carrying.color} {sim.carrying.type}", _is_empty, DROP))
    for x in range(sim.grid.width):
        for y in range(sim.grid.height):
            world_object = sim.grid.get(x, y)
            hidden = world_object.contains if world_object is not None and world_object.type == "box" else None
            if hidden is not None and hidden.type == "key":
                chores.append(Chore(f"open the {world_object.color} box", _holds((x, y)), TOGGLE))
    for door in _doors_in_mission_order(sim.instrs) or []:
        position = (int(door.cur_pos[0]), int(door.cur_pos[1]))
        chores.append(Chore(f"open the {door.color} door", _holds(position), TOGGLE))
    return chores


class _BotStuck(Exception):
    """The bot kept searching without deciding."""


class OraclePolicy:
    """Scripted chores where minigrid's BabyAIBot falls short, then the bot, on a private simulator.

    The private simulator is built from the task (level and seed) and advanced with exactly the
    primitives the env runs for each text action, so it stays in step with the env. The oracle
    first works through scripted_chores (planned on the full map), then follows the bot. Both
    think in primitive actions; each becomes the text action with that expansion ("pickup
    <object> <n>" for the object in front).
    """

    def __init__(
        self,
        *,
        levels: Sequence[str] | None = None,
        num_train_seeds: int = 500,
        num_test_seeds: int = 5,
        max_primitive_steps: int = 64,
    ):
        check_options(levels, num_train_seeds, num_test_seeds, max_primitive_steps)
        self.max_primitive_steps = max_primitive_steps
        self._simulators = LevelSimulators()
        self._sim: Any = None
        self._bot: Any = None
        self._chores: list[Chore] = []
        self._last_primitive: int | None = None
        self._rng = random.Random(0)
        self._episode_over = False

    def reset(self, task: Task, first_observation: str, rng: random.Random) -> None:
        level, seed = task_level_and_seed(task)
        self._sim = self._simulators.start(level, seed)
        self._rng = rng
        self._episode_over = False
        self._chores = scripted_chores(self._sim)
        self._bot = None
        self._last_primitive = None

    def act(self, observation: str) -> str:
        if self._sim is None:
            raise RuntimeError("babyai oracle: call reset() before act()")
        if self._episode_over:
            return react_reply("The episode is over.", CHECK_ACTIONS)
        view = read_view(self._sim, max_primitive_steps=self.max_primitive_steps)
        step = self._chore_step(view)
        if step is not None:
            action, reason = step
        else:
            action, reason = self._bot_step(view), "The plan's next step"
        _, terminated, truncated = play_primitives(self._sim, view.actions[action])
        self._episode_over = terminated or truncated
        return react_reply(f"{reason} is to {action}.", action)

    def _chore_step(self, view: View) -> tuple[str, str] | None:
        """The next text action of the current chore and why, or None once the chores are over.

        A chore that cannot be reached or said as a text action is abandoned with the rest, and
        the bot takes over from there.
        """
        if not self._chores:
            return None
        chore = self._chores[0]
        path = path_to_face(self._sim, chore.wanted)
        primitive = None if path is None else path[0] if path else chore.final
        action = self._text_action(primitive, view) if primitive is not None else None
        if action is None:
            self._chores.clear()
            return None
        if not path:
            self._chores.pop(0)
        return action, f"To {chore.description}, my next step"

    def _bot_step(self, view: View) -> str:
        if self._bot is None:
            self._start_bot()
        try:
            primitive = self._bot.replan(self._last_primitive)
        except Exception:  # _BotStuck, or the bot's own assertion failures on layouts it cannot do
            primitive = None
        action = self._text_action(int(primitive), view) if primitive is not None else None
        if action is None:
            # The bot is stuck or suggests something the text actions cannot say: step at random
            # and plan afresh from wherever that leads.
            action = self._rng.choice([name for name in ("turn left", "turn right", "move forward")
                                       if name in view.actions])
            primitive = view.actions[action][-1]
            self._start_bot()
        self._last_primitive = primitive
        return action

    def _start_bot(self) -> None:
        from minigrid.utils.baby_ai_bot import BabyAIBot

        bot = BabyAIBot(self._sim)
        search = bot._shortest_path
        counter = {"searches": 0}

        def bounded_search(*args: Any, **kwargs: Any) -> Any:
            counter["searches"] += 1
            if counter["searches"] > _MAX_SEARCHES_PER_DECISION:
                raise _BotStuck()
            return search(*args, **kwargs)

        replan = bot.replan

        def counted_replan(action_taken: Any = None) -> Any:
            counter["searches"] = 0
            return replan(action_taken)

        bot._shortest_path = bounded_search
        bot.replan = counted_replan
        self._bot = bot
        self._last_primitive = None

    def _text_action(self, primitive: int, view: View) -> str | None:
        """The available text action whose expansion is exactly this one primitive, if any."""
        if primitive == PICKUP:
            direction_x, direction_y = self._sim.dir_vec
            front = (int(self._sim.agent_pos[0] + direction_x), int(self._sim.agent_pos[1] + direction_y))
            for seen in view.objects:
                action = f"pickup {seen.label}"
                if seen.position == front and view.actions.get(action) == (PICKUP,):
                    return action
            return None
        action = _TEXT_OF_PRIMITIVE.get(primitive)
        return action if action is not None and action in view.actions else None


class RandomPolicy:
    """Picks uniformly among the actions the latest observation lists."""

    def __init__(
        self,
        *,
        levels: Sequence[str] | None = None,
        num_train_seeds: int = 500,
        num_test_seeds: int = 5,
        max_primitive_steps: int = 64,
    ):
        check_options(levels, num_train_seeds, num_test_seeds, max_primitive_steps)
        self._rng = random.Random(0)
        self._last_listed: list[str] = ["turn left", "turn right", "move forward"]

    def reset(self, task: Task, first_observation: str, rng: random.Random) -> None:
        self._rng = rng
        self._last_listed = available_actions(first_observation) or ["turn left", "turn right", "move forward"]

    def act(self, observation: str) -> str:
        # An error observation still lists the actions; keep the last list when one is missing.
        self._last_listed = available_actions(observation) or self._last_listed
        action = self._rng.choice(self._last_listed)
        return react_reply("I try something at random.", action)
