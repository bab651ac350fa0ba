"""Scripted BabyAI policies: an oracle driven by minigrid's BabyAIBot, and a random one."""

from __future__ import annotations

import json
import random
from typing import Any, Sequence

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


class _BotStuck(Exception):
    """The bot kept searching without deciding."""


class OraclePolicy:
    """Follows minigrid's BabyAIBot on a private copy of the task's simulator.

    The copy is built from the task (level and seed) and advanced with exactly the primitives the
    env runs for each text action, so it stays in step with the env. The bot thinks in primitive
    actions; each becomes the text action with that expansion ("pickup <object> <n>" for the object
    in front). It solves every shipped level except ORACLE_UNSOLVED_LEVELS.
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
        self._last_primitive: int | None = None
        self._rng = random.Random(0)
        self._episode_over = False

    def reset(self, task: Task, first_observation: str, rng: random.Random) -> None:
        level, seed = task_level_and_seed(task)
        self._sim = self._simulators.start(level, seed)
        self._rng = rng
        self._episode_over = False
        self._start_bot()

    def act(self, observation: str) -> str:
        if self._sim is None:
            raise RuntimeError("babyai oracle: call reset() before act()")
        if self._episode_over:
            return react_reply("The episode is over.", CHECK_ACTIONS)
        view = read_view(self._sim, max_primitive_steps=self.max_primitive_steps)
        try:
            primitive = self._bot.replan(self._last_primitive)
        except Exception:  # _BotStuck, or the bot's own assertion failures on levels it cannot do
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
        _, terminated, truncated = play_primitives(self._sim, view.actions[action])
        self._episode_over = terminated or truncated
        return react_reply(f"The plan's next step is to {action}.", action)

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
