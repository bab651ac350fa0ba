"""Scripted TextCraft policies: an oracle that plans from the listed recipes, and a random one."""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass

from longhorizon.envs.base import Task, react_reply
from longhorizon.envs.textcraft.recipes import RecipeBook, display_name, load_recipe_book

_RECIPE_LINE = re.compile(r"craft (\d+) (.+?) using (.+)")
_GOAL_LINE = re.compile(r"Goal: craft (.+?)\.?\s*$", re.MULTILINE)


@dataclass(frozen=True)
class ListedRecipe:
    """A recipe as the first observation shows it, with names as written."""

    result: str
    result_count: int
    ingredients: tuple[tuple[str, int], ...]


def parse_first_observation(observation: str) -> tuple[str, list[ListedRecipe]]:
    """The goal name and the listed recipes of a TextCraft first observation."""
    goal_match = _GOAL_LINE.search(observation)
    if goal_match is None:
        raise ValueError("not a TextCraft first observation: no 'Goal: craft ...' line")
    recipes = []
    for line in observation.splitlines():
        match = _RECIPE_LINE.fullmatch(line.strip())
        if match is None:
            continue
        ingredients = []
        for part in match.group(3).split(","):
            count, _, name = part.strip().partition(" ")
            ingredients.append((name, int(count)))
        recipes.append(ListedRecipe(match.group(2), int(match.group(1)), tuple(ingredients)))
    return goal_match.group(1).strip(), recipes


def _check_options(min_depth: int, max_depth: int, num_distractors: int) -> None:
    # The policies ignore the env's options but accept them, so one option set builds everything.
    for option, value in (("min_depth", min_depth), ("max_depth", max_depth), ("num_distractors", num_distractors)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"textcraft option {option} must be an integer, got {value!r}")


class OraclePolicy:
    """Solves a task by planning over the recipes listed in its first observation.

    Names are resolved with the recipe book (which items a group such as "planks" holds, which
    items are base); recipes come only from the observation. The plan fetches each base item in
    the amount needed and crafts every intermediate in as many batches as needed at once.
    """

    def __init__(self, *, min_depth: int = 1, max_depth: int = 4, num_distractors: int = 10):
        _check_options(min_depth, max_depth, num_distractors)
        self.book: RecipeBook = load_recipe_book()
        self._plan: list[tuple[str, str]] = []
        self._next = 0

    def reset(self, task: Task, first_observation: str, rng: random.Random) -> None:
        goal_name, listed = parse_first_observation(first_observation)
        self._plan = plan_actions(self.book, goal_name, listed)
        self._next = 0

    def act(self, observation: str) -> str:
        if self._next >= len(self._plan):
            return react_reply("My plan is finished; I check what I carry.", "inventory")
        thought, action = self._plan[self._next]
        self._next += 1
        return react_reply(thought, action)


def plan_actions(book: RecipeBook, goal_name: str, listed: list[ListedRecipe]) -> list[tuple[str, str]]:
    """(thought, command) pairs that craft the goal from nothing using only the listed recipes."""
    by_result: dict[str, list[ListedRecipe]] = {}
    for recipe in listed:
        resolved = book.resolve(recipe.result)
        if resolved is not None and resolved[0] == "item":
            by_result.setdefault(resolved[1], []).append(recipe)

    def accepted(name: str) -> list[str]:
        resolved = book.resolve(name)
        if resolved is None:
            return []
        kind, value = resolved
        return sorted(book.groups[value]) if kind == "group" else [value]

    depth_cache: dict[str, float] = {}

    def depth(item: str, visiting: frozenset[str] = frozenset()) -> float:
        if item in depth_cache:
            return depth_cache[item]
        if item in visiting:
            return math.inf
        if item not in by_result:
            return 0 if book.is_base(item) else math.inf
        best = min(recipe_depth(recipe, visiting | {item}) for recipe in by_result[item])
        if not math.isinf(best):
            # An infinite depth may only reflect the path being explored, so it is not cached.
            depth_cache[item] = best
        return best

    def recipe_depth(recipe: ListedRecipe, visiting: frozenset[str]) -> float:
        return 1 + max(min((depth(item, visiting) for item in accepted(name)), default=math.inf)
                       for name, _ in recipe.ingredients)

    def cheapest(name: str) -> str:
        return min(accepted(name), key=lambda item: (depth(item), item))

    goal_resolved = book.resolve(goal_name)
    if goal_resolved is None or goal_resolved[0] != "item" or math.isinf(depth(goal_resolved[1])):
        return []
    free_stock: dict[str, int] = {}
    steps: list[tuple[str, str]] = []

    def obtain(item: str, amount: int, purpose: str) -> None:
        """Add actions that make `amount` of `item` available, reserved for the caller."""
        from_stock = min(free_stock.get(item, 0), amount)
        free_stock[item] = free_stock.get(item, 0) - from_stock
        amount -= from_stock
        if amount == 0:
            return
        name = display_name(item)
        if item not in by_result:
            steps.append((f"{purpose} needs {amount} {name}, a base item, so I get it.", f"get {amount} {name}"))
            return
        recipe = min(by_result[item], key=lambda candidate: recipe_depth(candidate, frozenset()))
        batches = -(-amount // recipe.result_count)
        parts = []
        for ingredient_name, count in recipe.ingredients:
            ingredient = cheapest(ingredient_name)
            obtain(ingredient, count * batches, f"Crafting {name}")
            parts.append(f"{count * batches} {display_name(ingredient)}")
        made = recipe.result_count * batches
        steps.append(
            (f"I have what {name} takes, so I craft {made} of it.", f"craft {made} {name} using {', '.join(parts)}")
        )
        free_stock[item] = free_stock.get(item, 0) + made - amount

    obtain(goal_resolved[1], 1, "The goal")
    return steps


class RandomPolicy:
    """Plausible but aimless commands: gets of listed base items, listed recipes, inventory."""

    def __init__(self, *, min_depth: int = 1, max_depth: int = 4, num_distractors: int = 10):
        _check_options(min_depth, max_depth, num_distractors)
        self._rng = random.Random(0)
        self._recipes: list[ListedRecipe] = []
        self._base_needs: list[tuple[str, int]] = []

    def reset(self, task: Task, first_observation: str, rng: random.Random) -> None:
        _, self._recipes = parse_first_observation(first_observation)
        results = {recipe.result for recipe in self._recipes}
        self._base_needs = sorted(
            {(name, count) for recipe in self._recipes for name, count in recipe.ingredients if name not in results}
        )
        self._rng = rng

    def act(self, observation: str) -> str:
        roll = self._rng.random()
        if roll < 0.45 and self._base_needs:
            name, count = self._rng.choice(self._base_needs)
            return react_reply(f"Maybe I need {name}.", f"get {count} {name}")
        if roll < 0.9 and self._recipes:
            recipe = self._rng.choice(self._recipes)
            parts = ", ".join(f"{count} {name}" for name, count in recipe.ingredients)
            return react_reply(f"Let me try to craft {recipe.result}.",
                               f"craft {recipe.result_count} {recipe.result} using {parts}")
        return react_reply("Let me look at what I carry.", "inventory")
