"""The weblocal task set: loading and checking the task files in data/tasks_<site>.json, and the splits.

Each file holds a list of WebArena-style task configs (task_id, split, sites, category, intent,
start_url, require_reset, eval, oracle). They become `Task`s whose `data` is the config itself,
which is what BrowserEnv reads. Validation happens on load so a broken file fails at once, with
the task id and what is wrong.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable

from longhorizon.envs.base import SPLITS, Task
from longhorizon.envs.web.apps.serving import DATA_DIR

SITE_NAMES = ("fossil", "dokuwiki", "shop")
EVAL_TYPES = ("string_match", "url_match", "program_html", "state_check")
TARGET_ACTIONS = ("click", "fill", "select_option", "press", "hover", "focus", "clear", "check", "uncheck")
FREE_ACTIONS = ("goto", "go_back", "go_forward", "scroll", "stop", "wait", "noop")
STATE_CHECK_TYPES = {"fossil": ("sql",), "shop": ("sql",), "dokuwiki": ("page",)}


class TaskFileError(ValueError):
    """A task file that does not follow the format."""


def task_file(site: str) -> Path:
    return DATA_DIR / f"tasks_{site}.json"


def _fail(task_id: str, message: str) -> None:
    raise TaskFileError(f"task {task_id!r}: {message}")


def validate_config(config: dict[str, Any]) -> None:
    """Raise TaskFileError naming the first thing wrong with one task config."""
    task_id = str(config.get("task_id") or "?")
    for key in ("task_id", "split", "sites", "intent", "start_url", "eval", "oracle"):
        if key not in config:
            _fail(task_id, f"missing {key!r}")
    if config["split"] not in SPLITS:
        _fail(task_id, f"split must be one of {SPLITS}, got {config['split']!r}")
    sites = config["sites"]
    if not sites or any(site not in SITE_NAMES for site in sites):
        _fail(task_id, f"sites must be a non-empty list of {SITE_NAMES}, got {sites!r}")
    if not any(f"__{site.upper()}__" in config["start_url"] for site in sites):
        _fail(task_id, "start_url must start at one of the task's sites (a __SITE__ placeholder)")
    evaluation = config["eval"]
    types = evaluation.get("eval_types") or []
    if not types or any(kind not in EVAL_TYPES for kind in types):
        _fail(task_id, f"eval_types must be a non-empty list of {EVAL_TYPES}, got {types!r}")
    if "string_match" in types:
        answers = evaluation.get("reference_answers")
        if not isinstance(answers, dict) or not set(answers) & {"exact_match", "must_include", "fuzzy_match"}:
            _fail(task_id, "string_match needs reference_answers with exact_match, must_include or fuzzy_match")
    if "url_match" in types and not evaluation.get("reference_url"):
        _fail(task_id, "url_match needs a reference_url")
    if "state_check" in types:
        checks = evaluation.get("state_check") or []
        if not checks:
            _fail(task_id, "state_check needs at least one check")
        for check in checks:
            site = check.get("site") or (sites[0] if len(sites) == 1 else None)
            if site not in STATE_CHECK_TYPES or check.get("type") not in STATE_CHECK_TYPES[site]:
                _fail(task_id, f"state check {check!r} does not fit site {site!r}")
    plan = config["oracle"]
    if not isinstance(plan, list) or not plan or plan[-1][0] != "stop":
        _fail(task_id, "oracle must be a non-empty list of steps ending with a stop step")
    for step in plan:
        if not isinstance(step, list) or not step:
            _fail(task_id, f"oracle step {step!r} is not a list")
        action = step[0]
        if action in TARGET_ACTIONS:
            target = step[1] if len(step) > 1 else None
            if not isinstance(target, dict) or "role" not in target or "name" not in target:
                _fail(task_id, f"oracle step {step!r} needs a target with role and name")
        elif action not in FREE_ACTIONS:
            _fail(task_id, f"oracle step {step!r} uses unknown action {action!r}")


def _load_file(path: Path) -> list[dict[str, Any]]:
    try:
        configs = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise TaskFileError(f"task file {path} is missing") from None
    except json.JSONDecodeError as error:
        raise TaskFileError(f"task file {path} is not valid JSON: {error}") from None
    if not isinstance(configs, list):
        raise TaskFileError(f"task file {path} must hold a list of task configs")
    for config in configs:
        validate_config(config)
    return configs


@lru_cache(maxsize=None)
def load_configs(sites: tuple[str, ...] = SITE_NAMES) -> tuple[dict[str, Any], ...]:
    """Every task config of the given sites, in file order; task ids must be unique."""
    unknown = [site for site in sites if site not in SITE_NAMES]
    if unknown:
        raise ValueError(f"unknown site(s) {unknown}; valid sites: {', '.join(SITE_NAMES)}")
    configs: list[dict[str, Any]] = []
    seen: set[str] = set()
    for site in sites:
        for config in _load_file(task_file(site)):
            if config["task_id"] in seen:
                raise TaskFileError(f"task id {config['task_id']!r} appears twice")
            seen.add(config["task_id"])
            configs.append(config)
    return tuple(configs)


def load_tasks(env_name: str, split: str, sites: Iterable[str] = SITE_NAMES) -> list[Task]:
    """The tasks of one split for the given sites, in a stable order."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; valid splits: {', '.join(SPLITS)}")
    return [
        Task(env_name=env_name, task_id=config["task_id"], split=split, category=config.get("category", ""),
             data=config)
        for config in load_configs(tuple(sites)) if config["split"] == split
    ]
