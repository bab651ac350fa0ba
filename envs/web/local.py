"""The "weblocal" env: WebArena-style tasks on real web applications run locally (Fossil, DokuWiki, a shop).

Each env instance owns its own copies of the applications (started on first use, reset from
their snapshots between episodes, stopped at close) and drives a real Chromium through
BrowserEnv. Tasks come from envs/web/apps/data/tasks_<site>.json: information seeking scored by
string match, state changes scored by checking the application's database or files (and often the
final URL). Scripted policies: "oracle" follows each task's recorded plan, "random" clicks around.

Options: sites (which applications, e.g. "shop,fossil"; default all three), and BrowserEnv's
num_browsers, action_timeout_s, navigation_timeout_s, max_observation_chars, multiaction.
"""

from __future__ import annotations

from typing import Any, Sequence

from longhorizon.common.config import bounded
from longhorizon.envs.base import EnvSpec, Task
from longhorizon.envs.web.apps.tasks import SITE_NAMES, load_tasks
from longhorizon.envs.web.env import BrowserEnv, BrowserOptions
from longhorizon.envs.web.observation import DEFAULT_SCREENSHOT_SIZE
from longhorizon.envs.web.apps.fossil import FossilSite
from longhorizon.envs.web.apps.dokuwiki import DokuWikiSite
from longhorizon.envs.web.apps.shop import ShopSite
from longhorizon.envs.web.policies import PlanOraclePolicy, RandomClickerPolicy

ENV_NAME = "weblocal"


def parse_sites(sites: str | Sequence[str] | None) -> tuple[str, ...]:
    """The site names an option value selects ("shop,fossil" or a list; None or "" or "all" for all)."""
    if sites is None or sites == "" or sites == "all":
        return SITE_NAMES
    names = [name.strip() for name in sites.split(",")] if isinstance(sites, str) else [str(name) for name in sites]
    unknown = [name for name in names if name not in SITE_NAMES]
    if unknown or not names:
        raise ValueError(f"unknown weblocal site(s) {unknown}; valid sites: {', '.join(SITE_NAMES)}")
    return tuple(dict.fromkeys(names))


def build_site(name: str) -> Any:
    """A new, unstarted instance of one local application."""
    if name == "fossil":
        return FossilSite()
    if name == "dokuwiki":
        return DokuWikiSite()
    if name == "shop":
        return ShopSite()
    raise ValueError(f"unknown weblocal site {name!r}; valid sites: {', '.join(SITE_NAMES)}")


def make_local_env(*, sites: str | Sequence[str] | None = None, num_browsers: int = 1, action_timeout_s: float = 5.0,
                   navigation_timeout_s: float = 20.0, max_observation_chars: int = 30000,
                   multiaction: bool = False, observation_modes: Sequence[str] = ("text",),
                   screenshot_size: Sequence[int] = DEFAULT_SCREENSHOT_SIZE, pool: Any = None) -> Any:
    return BrowserEnv(
        name=ENV_NAME, sites={name: build_site(name) for name in parse_sites(sites)}, pool=pool, num_browsers=num_browsers,
        action_timeout_s=action_timeout_s, navigation_timeout_s=navigation_timeout_s,
        max_observation_chars=max_observation_chars, multiaction=multiaction,
        observation_modes=observation_modes, screenshot_size=screenshot_size,
    )


def local_tasks(split: str, *, sites: str | Sequence[str] | None = None, **_browser_options: Any) -> list[Task]:
    return load_tasks(ENV_NAME, split, parse_sites(sites))


def oracle_policy(**options: Any) -> Any:
    return PlanOraclePolicy(**options)


def random_policy(**options: Any) -> Any:
    return RandomClickerPolicy(**options)


class WebLocalOptions(BrowserOptions):
    """weblocal: the shop, Fossil and DokuWiki applications run on this machine."""

    sites: str | list[str] | None = None
    """Which applications, e.g. "shop,fossil" or ["shop"]; none or "all": all three."""
    max_observation_chars: int = bounded(30000, ge=1)
    """Longest accessibility tree shown to the model; longer ones are cut."""


# The registry (envs/base.py) finds this env here by name.
SPEC = EnvSpec(name=ENV_NAME, factory=make_local_env, tasks=local_tasks,
               policies={"oracle": oracle_policy, "random": random_policy}, needs=("playwright",), extra="web", Options=WebLocalOptions)
