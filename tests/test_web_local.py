"""weblocal in a real Chromium: oracle plans score success on every app, wrong end states score failure, reset restores."""

from __future__ import annotations

import random

import pytest

from longhorizon.envs.base import Task, action_from_reply, get_env_spec, list_tasks, make_policy
from longhorizon.envs.web.browser import BrowserPool
from longhorizon.envs.web.env import BrowserEnv
from longhorizon.envs.web.local import ENV_NAME, build_site

pytestmark = [pytest.mark.browser, pytest.mark.slow]

# Per app: an information task, state changes (several kinds of form) and a navigation task.
ORACLE_TASK_IDS = (
    "shop-000", "shop-016", "shop-020", "shop-025", "shop-028", "shop-030",
    "fossil-002", "fossil-016", "fossil-024", "fossil-026", "fossil-014",
    "dokuwiki-012", "dokuwiki-013", "dokuwiki-020", "dokuwiki-022", "dokuwiki-024",
)


@pytest.fixture(scope="module")
def pool():
    browser_pool = BrowserPool(1)
    yield browser_pool
    browser_pool.close()


@pytest.fixture(scope="module")
def tasks_by_id() -> dict[str, Task]:
    return {task.task_id: task for split in ("train", "test") for task in list_tasks(ENV_NAME, split)}


def local_env(pool: BrowserPool) -> BrowserEnv:
    return BrowserEnv(name=ENV_NAME, sites={name: build_site(name) for name in ("shop", "fossil", "dokuwiki")},
                      pool=pool)


async def play(env: BrowserEnv, task: Task, plan: list | None = None, max_steps: int = 30) -> tuple[float, dict]:
    """Reward and final info of one episode following the task's oracle plan (or `plan` instead)."""
    if plan is not None:
        task = Task(task.env_name, task.task_id, task.split, task.category, {**task.data, "oracle": plan})
    observation, _ = await env.reset(task)
    policy = make_policy(ENV_NAME, "oracle")
    policy.reset(task, observation, random.Random(0))
    for _ in range(max_steps):
        action = action_from_reply(policy.act(observation), env.prompt_format)
        observation, reward, terminated, truncated, info = await env.step(action)
        assert not info["invalid_action"], f"{task.task_id}: {action} was invalid:\n{observation[:2000]}"
        if terminated or truncated:
            return reward, info
    raise AssertionError(f"{task.task_id}: the plan did not end the episode")


async def test_oracle_plans_succeed_on_every_app(pool, tasks_by_id):
    assert set(get_env_spec(ENV_NAME).policies) == {"oracle", "random"}
    env = local_env(pool)
    try:
        for task_id in ORACLE_TASK_IDS:
            reward, info = await play(env, tasks_by_id[task_id])
            assert reward == 1.0 and info["success"], f"{task_id}: {info}"
    finally:
        await env.close()


def replace_step(plan: list, index: int, step: list) -> list:
    return [*plan[:index], step, *plan[index + 1:]]


async def test_wrong_final_state_or_answer_scores_failure(pool, tasks_by_id):
    env = local_env(pool)
    try:
        add_two = tasks_by_id["shop-016"]  # add 3 of a product to the cart; this plan adds 1
        plan = add_two.data["oracle"]
        fill_index = next(i for i, step in enumerate(plan) if step[0] == "fill" and step[1]["role"] == "spinbutton")
        wrong_quantity = replace_step(plan, fill_index, ["fill", plan[fill_index][1], "1"])
        close_ticket = tasks_by_id["fossil-016"]  # close as Fixed; this plan closes as Rejected
        plan = close_ticket.data["oracle"]
        resolution_index = next(i for i, step in enumerate(plan) if step[0] == "select_option"
                                and step[1]["name"] == "Resolution")
        wrong_resolution = replace_step(plan, resolution_index, ["select_option", plan[resolution_index][1], "Rejected"])
        edit_page = tasks_by_id["dokuwiki-013"]  # set Apollo's status; this plan saves the page unchanged
        plan = edit_page.data["oracle"]
        unchanged = [step for step in plan if step[0] != "fill"]
        info_task = tasks_by_id["dokuwiki-000"]
        wrong_answer = replace_step(info_task.data["oracle"], -1, ["stop", "4417"])
        stops_early = [["stop", "done"]]  # a state task whose agent does nothing at all
        for task, plan in ((add_two, wrong_quantity), (close_ticket, wrong_resolution), (edit_page, unchanged),
                           (info_task, wrong_answer), (tasks_by_id["fossil-024"], stops_early)):
            reward, info = await play(env, task, plan)
            assert reward == 0.0 and not info["success"], f"{task.task_id}: {info}"
    finally:
        await env.close()


async def test_reset_restores_the_snapshot_between_episodes(pool, tasks_by_id):
    env = local_env(pool)
    try:
        for task_id in ("shop-016", "fossil-017", "dokuwiki-017"):
            task = tasks_by_id[task_id]
            site = env.sites[task.data["sites"][0]]
            reward, _ = await play(env, task)
            assert reward == 1.0
            checks = task.data["eval"]["state_check"]
            assert all(site.check_state(check)[0] for check in checks)
            await env.reset(task)  # the episode after one that changed the site starts from the snapshot
            assert not all(site.check_state(check)[0] for check in checks), f"{task_id}: the change survived reset"
            # Played again from the snapshot the plan succeeds again (adding 3 to a cart that already holds 3 would not).
            reward, _ = await play(env, task)
            assert reward == 1.0
    finally:
        await env.close()


async def test_random_policy_plays_without_errors(pool, tasks_by_id):
    env = BrowserEnv(name=ENV_NAME, sites={"shop": build_site("shop")}, pool=pool)
    try:
        task = tasks_by_id["shop-016"]
        observation, _ = await env.reset(task)
        policy = make_policy(ENV_NAME, "random")
        policy.reset(task, observation, random.Random(3))
        for _ in range(8):
            observation, reward, terminated, truncated, info = await env.step(
                action_from_reply(policy.act(observation), env.prompt_format))
            assert isinstance(info["success"], bool) and reward == float(info["success"])
            if terminated or truncated:
                break
    finally:
        await env.close()


async def test_oracle_episodes_keep_the_env_contract():
    # With the oracle: a random walk reaches pages where the apps themselves show random content
    # (Fossil's suggested passwords), which no env could make repeatable.
    from longhorizon.envs.checker import check_env

    await check_env(ENV_NAME, {"sites": "fossil,shop"}, policy="oracle", num_tasks=2)
