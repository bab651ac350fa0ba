"""The "webarena" env: WebArena's own task-config JSON files run against sites whose URLs the user gives.

WebArena's sites (shop, shop admin, forum, GitLab, map, Wikipedia) run as the user's own
containers; we cannot start, reset or inspect them. Options:

- `config`: a task-config JSON file (one config, or a list such as WebArena's test.raw.json) or a
  folder of them (config_files/0.json, 1.json, ...).
- `sites`: placeholder -> URL, e.g. {"__SHOPPING__": "http://host:7770", "__GITLAB__": "http://host:8023"}.
  WebArena's placeholders are __SHOPPING__, __SHOPPING_ADMIN__, __REDDIT__, __GITLAB__, __MAP__,
  __WIKIPEDIA__. Tasks that need a site without a URL are left out of the task list.
- `storage_state_dir`: where the login cookie files named by the configs' "storage_state"
  ("./.auth/shopping_state.json") live; WebArena's browser_env/auto_login.py writes them. A task
  that names a file that is not there fails at reset (missing_login="error") or runs logged out
  (missing_login="ignore").

Supported from the config: intent, start_url (with " |AND| " for several tabs), sites,
storage_state, and the evaluators string_match (exact_match, must_include, fuzzy_match scored by
normalised containment: no LLM judge), url_match ("GOLD in PRED") and program_html with JavaScript
locators. Not supported: program_html targets that call WebArena's Python helpers ("func:...");
such tasks are left out unless skip_unsupported=False (they then score 0). Ignored: require_reset
(external sites have no reset: reset them yourself between state-changing tasks), geolocation,
viewport_size. The browser may only load the given sites' origins.

Splits: WebArena ships one list; a stable hash of the task id puts one task in five in "test"
(all_test=True puts every task in "test", for evaluation).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence

from longhorizon.common.config import bounded
from longhorizon.envs.base import EnvSpec, Task
from longhorizon.envs.web.browser import origin_of
from longhorizon.envs.web.env import PLACEHOLDER, BrowserEnv, BrowserOptions, placeholder
from longhorizon.envs.web.observation import DEFAULT_SCREENSHOT_SIZE
from longhorizon.envs.web.evaluators import unsupported_features
from longhorizon.envs.web.policies import PlanOraclePolicy, RandomClickerPolicy

log = logging.getLogger(__name__)

ENV_NAME = "webarena"
WEBARENA_PLACEHOLDERS = ("__SHOPPING__", "__SHOPPING_ADMIN__", "__REDDIT__", "__GITLAB__", "__MAP__", "__WIKIPEDIA__")
MISSING_LOGIN_MODES = ("error", "ignore")
TEST_SHARE_DIVISOR = 5


class ExternalSite:
    """A site someone else runs: a URL the browser may visit, nothing to start, reset or inspect."""

    def __init__(self, name: str, base_url: str) -> None:
        origin = origin_of(base_url)
        if not origin:
            raise ValueError(f"site {name!r}: {base_url!r} is not an http(s) URL")
        self.name = name
        self._base_url = base_url.rstrip("/")
        self._origin = origin

    @property
    def base_url(self) -> str:
        return self._base_url

    @property
    def allowed_origins(self) -> tuple[str, ...]:
        return (self._origin,)

    def start(self) -> None:
        pass

    def reset(self) -> None:
        pass  # an external site has no reset: its owner resets it

    def check_state(self, check: Mapping[str, Any]) -> tuple[bool, str]:
        raise ValueError(f"site {self.name!r} is external: it has no state checks")

    def stop(self) -> None:
        pass


def site_name(key: str) -> str:
    """"__SHOPPING_ADMIN__" or "shopping_admin" -> "shopping_admin" (WebArena's names in "sites")."""
    name = key.strip()
    if name.startswith("__") and name.endswith("__") and len(name) > 4:
        name = name[2:-2]
    if not name or not name.replace("_", "").isalnum():
        raise ValueError(f"not a site placeholder: {key!r} (expected e.g. '__SHOPPING__')")
    return name.lower()


def _check_sites(sites: Any) -> dict[str, str]:
    if not isinstance(sites, Mapping) or not sites:
        raise ValueError(
            "webarena needs option sites = {placeholder: URL}, e.g. {\"__SHOPPING__\": \"http://host:7770\"}; "
            f"WebArena's placeholders: {', '.join(WEBARENA_PLACEHOLDERS)}"
        )
    resolved = {}
    for key, url in sites.items():
        if not isinstance(url, str) or not origin_of(url):
            raise ValueError(f"webarena site {key!r}: {url!r} is not an http(s) URL")
        resolved[site_name(key)] = url.rstrip("/")
    return resolved


def _check_options(missing_login: Any) -> None:
    if missing_login not in MISSING_LOGIN_MODES:
        raise ValueError(f"unknown missing_login {missing_login!r}; valid: {', '.join(MISSING_LOGIN_MODES)}")


def _numeric_first(path: Path) -> tuple[int, str]:
    return (int(path.stem), "") if path.stem.isdigit() else (1 << 62, path.name)


@lru_cache(maxsize=8)
def _load_configs_cached(path: str, modified: float) -> tuple[str, ...]:
    root = Path(path)
    files = sorted(root.glob("*.json"), key=_numeric_first) if root.is_dir() else [root]
    configs: dict[str, str] = {}
    for file in files:
        try:
            loaded = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, ValueError) as error:
            raise ValueError(f"cannot read WebArena task config {file}: {error}") from error
        for config in loaded if isinstance(loaded, list) else [loaded]:
            if not isinstance(config, dict) or "task_id" not in config or "intent" not in config:
                raise ValueError(f"{file}: not a WebArena task config (needs task_id and intent): {str(config)[:120]}")
            configs.setdefault(str(config["task_id"]), json.dumps(config))
    return tuple(configs.values())


def load_configs(config: str | Path) -> list[dict]:
    """The task configs of a JSON file (one config or a list) or of a folder of them, by task id."""
    if not config:
        raise ValueError("webarena needs option config: a task-config JSON file or a folder of them")
    path = Path(config).expanduser()
    if not path.exists():
        raise ValueError(f"webarena config {str(path)!r} does not exist")
    loaded = [json.loads(text) for text in _load_configs_cached(str(path.resolve()), path.stat().st_mtime)]
    return sorted(loaded, key=lambda item: (0, int(item["task_id"])) if str(item["task_id"]).isdigit() else (1, str(item["task_id"])))


def split_of(task_id: str) -> str:
    digest = hashlib.sha256(f"webarena:{task_id}".encode()).digest()
    return "test" if int.from_bytes(digest[:8], "big") % TEST_SHARE_DIVISOR == 0 else "train"


def task_problems(config: Mapping[str, Any], site_urls: Mapping[str, str]) -> list[str]:
    """Why a config cannot run here: sites without a URL, unknown placeholders, unsupported evals."""
    problems = []
    needed = set(config.get("sites") or [])
    text = json.dumps({key: config.get(key) for key in ("start_url", "eval")})
    needed |= {name.lower() for name in PLACEHOLDER.findall(text)}
    missing = sorted(site for site in needed if site not in site_urls)
    if missing:
        problems.append(f"no URL for site(s) {missing}")
    problems.extend(unsupported_features(config.get("eval") or {}))
    return problems


def tasks(split: str, *, config: str = "", sites: Mapping[str, str] | None = None, storage_state_dir: str | None = None,
          missing_login: str = "error", skip_unsupported: bool = True, all_test: bool = False,
          **_browser_options: Any) -> list[Task]:
    """The configs that can run against the given sites, in the split, ordered by task id."""
    site_urls = _check_sites(sites)
    _check_options(missing_login)
    if split not in ("train", "test"):
        raise ValueError(f"unknown split {split!r} for env {ENV_NAME!r}; valid splits: train, test")
    result = []
    left_out = 0
    for item in load_configs(config):
        task_id = str(item["task_id"])
        if ("test" if all_test else split_of(task_id)) != split:
            continue
        problems = task_problems(item, site_urls)
        if problems and (skip_unsupported or any(problem.startswith("no URL") for problem in problems)):
            left_out += 1
            continue
        category = str((item.get("sites") or ["web"])[0])
        result.append(Task(env_name=ENV_NAME, task_id=task_id, split=split, category=category, data=item))
    if left_out:
        log.info("webarena: %d %s task(s) left out (sites without URL or unsupported evaluators)", left_out, split)
    return result


class WebArenaEnv(BrowserEnv):
    """WebArena task configs against the user's sites; every given site is reachable in every task."""

    def __init__(
        self,
        *,
        config: str = "",
        sites: Mapping[str, str] | None = None,
        storage_state_dir: str | None = None,
        missing_login: str = "error",
        skip_unsupported: bool = True,
        all_test: bool = False,
        num_browsers: int = 1,
        action_timeout_s: float = 5.0,
        navigation_timeout_s: float = 30.0,
        max_observation_chars: int = 30000,
        multiaction: bool = False,
        observation_modes: Sequence[str] = ("text",),
        screenshot_size: Sequence[int] = DEFAULT_SCREENSHOT_SIZE,
        pool: Any = None,
    ) -> None:
        site_urls = _check_sites(sites)
        _check_options(missing_login)
        super().__init__(
            name=ENV_NAME,
            sites={name: ExternalSite(name, url) for name, url in site_urls.items()},
            pool=pool, num_browsers=num_browsers, action_timeout_s=action_timeout_s,
            navigation_timeout_s=navigation_timeout_s, max_observation_chars=max_observation_chars,
            multiaction=multiaction, observation_modes=observation_modes, screenshot_size=screenshot_size,
        )
        self.storage_state_dir = Path(storage_state_dir).expanduser() if storage_state_dir else None
        self.missing_login = missing_login

    async def _prepare_sites(self, task: Task, config: Mapping[str, Any]) -> tuple[list[str], dict[str, str]]:
        problems = task_problems(config, {name: site.base_url for name, site in self.sites.items()})
        if any(problem.startswith("no URL") for problem in problems):
            raise ValueError(f"webarena task {task.task_id}: {'; '.join(problems)}")
        # Tasks may cross sites (a map task that reads Wikipedia): every given site is allowed.
        origins = [origin for site in self.sites.values() for origin in site.allowed_origins]
        return origins, {placeholder(name): site.base_url for name, site in self.sites.items()}

    def _session_options(self, task: Task, config: Mapping[str, Any]):
        storage_state = config.get("storage_state")
        if not storage_state:
            return self.session_options
        candidates = []
        if self.storage_state_dir is not None:
            candidates = [self.storage_state_dir / storage_state, self.storage_state_dir / Path(storage_state).name]
        found = next((path for path in candidates if path.is_file()), None)
        if found is None:
            if self.missing_login == "ignore":
                log.warning("webarena task %s: login file %s not found; running logged out", task.task_id, storage_state)
                return self.session_options
            raise ValueError(
                f"webarena task {task.task_id} needs the login cookies {storage_state!r}: create them with "
                "WebArena's browser_env/auto_login.py and pass their folder as storage_state_dir "
                "(or missing_login='ignore' to run logged out)"
            )
        return dataclasses.replace(self.session_options, storage_state=str(found))


def _plan_oracle(**options: Any) -> PlanOraclePolicy:
    return PlanOraclePolicy()


def _random(**options: Any) -> RandomClickerPolicy:
    return RandomClickerPolicy()


class WebArenaOptions(BrowserOptions):
    """webarena: WebArena's task configs against sites whose URLs the user gives (module docstring)."""

    config: str = ""
    """A task-config JSON file (one config or a list, such as test.raw.json) or a folder of them."""
    sites: dict[str, str] | None = None
    """Placeholder -> URL, e.g. {"__SHOPPING__": "http://host:7770"}; tasks needing a site without a URL are left out."""
    storage_state_dir: str | None = None
    """Where the login cookie files the configs name live."""
    missing_login: Literal["error", "ignore"] = "error"
    """A task whose login file is missing: fail at reset (`error`) or run logged out (`ignore`)."""
    skip_unsupported: bool = True
    """Leave out tasks whose evaluators call WebArena's Python helpers (else they score 0)."""
    all_test: bool = False
    """Every task in the test split (for evaluation) instead of one in five."""
    navigation_timeout_s: float = bounded(30.0, gt=0)
    """Most seconds a page may take to load."""
    max_observation_chars: int = bounded(30000, ge=1)
    """Longest accessibility tree shown to the model; longer ones are cut."""


# The registry (envs/base.py) finds this env here by name.
SPEC = EnvSpec(
    name=ENV_NAME,
    factory=WebArenaEnv,
    tasks=tasks,
    policies={"oracle": _plan_oracle, "random": _random},
    needs=("playwright",),
    extra="web",
    Options=WebArenaOptions,
)
