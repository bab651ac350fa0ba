"""The async text environment protocol, scripted policies and the registry of environments.

Envs are found by name like every other part (common/plugins.py): the built-ins below, envs
registered in this process (`register_env`), the `longhorizon.envs` entry-point group (naming an
EnvSpec or a function returning one), or a dotted path `package.module:attribute` used as the
name (`env.name = "my_envs.maze:SPEC"`) for code on the Python path that is not installed.
"""

from __future__ import annotations

import inspect
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol, runtime_checkable

from longhorizon.common.config import ConfigError, Section, check_section
from longhorizon.common.plugins import PluginError, Registry
from longhorizon.envs.agents import parse_action

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
    """The agent loop the env's instructions are written for, used unless `actor.agent` picks
    another: "react" (the model writes Thought:/Action:), "bare" (the whole reply is the action)
    or a plug-in loop's name (envs/agents.py)."""

    def instructions(self) -> str:
        """System prompt: what the env is and the action syntax ("" for none)."""
        ...

    async def reset(self, task: Task, *, seed: int | None = None) -> tuple[str, dict]: ...

    async def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        """Returns observation, reward, terminated, truncated, info."""
        ...

    async def close(self) -> None: ...

    # Optional: `summary(self) -> str`, a short account of the episode so far (the state the task
    # needs, such as TextCraft's inventory), which actor.history_summary adds to each observation
    # for a model shown only the last turns. Not part of the protocol's isinstance check.


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
    needs: tuple[str, ...] = ()
    """Packages (import names) the env uses beyond longhorizon's core install, checked when the
    env is looked up, so a missing one is one clear error naming `extra` rather than an
    ImportError deep inside the first episode."""
    extra: str = ""
    """The longhorizon extra that installs `needs` (pip install 'longhorizon[EXTRA]')."""
    Options: type[Section] | None = None
    """The env's `env.options` as a config section (a `common.config.Section`: each option's
    type, default, range and docstring), checked before any env is built and listed by `config
    schema` and docs/config.md. Its fields are the factory's keyword options, with the same
    defaults. An env without one has its options checked by name against the factory's
    signature only."""


class MissingEnvPackage(ValueError):
    """An env whose packages are not installed; the message names the extra that installs them."""


def check_env_packages(spec: EnvSpec) -> None:
    """Raise MissingEnvPackage when a package `spec` needs is not importable."""
    import importlib.util

    missing = [package for package in spec.needs if importlib.util.find_spec(package) is None]
    if missing:
        install = f"pip install 'longhorizon[{spec.extra}]'" if spec.extra else f"pip install {' '.join(missing)}"
        verb = "is" if len(missing) == 1 else "are"
        raise MissingEnvPackage(f"env {spec.name!r} needs {', '.join(missing)}, which {verb} not installed: {install}")


# Each built-in env's module holds its EnvSpec as `SPEC`; the registry imports a module only when
# its env is first asked for, which keeps `import longhorizon.envs.base` cheap (TextCraft parses
# ~860 recipe files on first use).
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

def _check_env_part(name: str, part: Any) -> None:
    if not isinstance(part, EnvSpec) and not callable(part):
        raise TypeError(f"env {name!r} must be an EnvSpec or a function returning one, got {type(part).__name__}")


# Looked up in the order of common/plugins.py: registered in this process, built-in, the
# `longhorizon.envs` entry points (an EnvSpec or a function returning one), a dotted path.
ENVS: Registry = Registry(
    "env",
    "longhorizon.envs",
    {name: f"{module}:SPEC" for name, module in BUILTIN_ENV_MODULES.items()},
    check=_check_env_part,
)

# Specs built by calling a plug-in's function, once per name.
_built_specs: dict[str, EnvSpec] = {}


def register_env(spec: EnvSpec, *, replace: bool = False) -> EnvSpec:
    """Make an environment available by name; re-registering a name needs replace=True."""
    if not isinstance(spec, EnvSpec):
        raise TypeError(f"register_env expects an EnvSpec, got {type(spec).__name__}")
    if not spec.name or not isinstance(spec.name, str):
        raise ValueError("an EnvSpec needs a non-empty string name")
    if not replace and spec.name in env_names():
        try:
            existing = get_env_spec(spec.name)
        except (ValueError, TypeError):
            existing = None  # a plug-in of that name that does not load
        if existing is None or not _same_origin(existing, spec):
            raise ValueError(f"env {spec.name!r} is already registered (pass replace=True to override)")
    ENVS.register(spec.name, spec, replace=True)
    _built_specs.pop(spec.name, None)
    return spec


def _same_origin(first: EnvSpec, second: EnvSpec) -> bool:
    # A module imported twice (a reload) registers an equal spec again; that is not a conflict.
    def origin(function: Callable[..., Any]) -> tuple[str, str]:
        return getattr(function, "__module__", ""), getattr(function, "__qualname__", "")

    return origin(first.factory) == origin(second.factory)


def unregister_env(name: str) -> None:
    """Forget an env registered or loaded in this process (tests add throwaway envs and clean up
    after themselves); a built-in that was replaced comes back."""
    ENVS.unregister(name)
    _built_specs.pop(name, None)


def env_names() -> list[str]:
    """Every env name that get_env_spec accepts: built-in, registered or installed (dotted paths aside)."""
    return ENVS.names()


def get_env_spec(name: str) -> EnvSpec:
    """The env called `name`, or found at the dotted path `name` ("package.module:attribute")."""
    try:
        part = ENVS.get(name)
    except PluginError as error:  # callers (config checks, the CLI) report ValueErrors as bad input
        raise ValueError(str(error)) from error
    if isinstance(part, EnvSpec):
        spec = part
    else:
        spec = _built_specs.get(name)
        if spec is None:
            spec = part()
            if not isinstance(spec, EnvSpec):
                raise TypeError(f"env {name!r}: {part!r} returned {type(spec).__name__}, not an EnvSpec")
            _built_specs[name] = spec
    if spec.name != name and ":" not in name:  # a dotted path may name the spec anything
        # Tasks and trajectories carry the spec's name: it must find the same env again.
        raise ValueError(f"env {name!r} is an EnvSpec named {spec.name!r}; the two names must match")
    check_env_packages(spec)
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
    """The options an env accepts, with their defaults (its declared `Options`, or else its
    factory's signature)."""
    spec = get_env_spec(name)
    if spec.Options is not None:
        return {key: field.get_default(call_default_factory=True) for key, field in spec.Options.model_fields.items()}
    options: dict[str, Any] = {}
    for parameter in inspect.signature(spec.factory).parameters.values():
        if parameter.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD):
            options[parameter.name] = None if parameter.default is inspect.Parameter.empty else parameter.default
    return options


def _check_options(spec: EnvSpec, options: Mapping[str, Any]) -> dict[str, Any]:
    """The options as the env declares them: each name checked against the option set (a
    misspelt option fails loudly instead of silently falling back to a default), and with a
    declared `Options` section each value's type and range too. Returns the options to build
    with (only those given: the factory keeps its defaults)."""
    valid = set(spec.Options.model_fields) if spec.Options is not None else _accepted_options(spec.factory)
    if valid is None:
        return dict(options)
    for key in options:
        if key not in valid:
            listed = ", ".join(sorted(valid)) or "(none)"
            raise ValueError(f"unknown option {key!r} for env {spec.name!r}; valid options: {listed}")
    if spec.Options is None:
        return dict(options)
    try:
        checked = check_section(spec.Options, dict(options), "env.options")
    except ConfigError as error:
        raise ValueError(f"env {spec.name!r}: {error}") from None
    return {key: getattr(checked, key) for key in options}


def env_options_schemas() -> dict[str, dict]:
    """The JSON schema of each built-in env's declared options, by name (`longhorizon config
    schema`, docs/config.md); envs whose packages are missing or that declare none are left out."""
    schemas = {}
    for name in BUILTIN_ENV_MODULES:
        try:
            spec = get_env_spec(name)
        except (ValueError, TypeError, ImportError):
            continue
        if spec.Options is not None:
            schemas[name] = spec.Options.model_json_schema()
    return schemas


def make_env(name: str, **options: Any) -> Env:
    """A fresh env instance; reuse it across episodes through reset."""
    spec = get_env_spec(name)
    return spec.factory(**_check_options(spec, options))


def list_tasks(name: str, split: str, **options: Any) -> list[Task]:
    """The tasks of one split ("train" or "test") in a stable order."""
    spec = get_env_spec(name)
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r} for env {name!r}; valid splits: {', '.join(SPLITS)}")
    return spec.tasks(split, **_check_options(spec, options))


def make_policy(env_name: str, policy_name: str, **options: Any) -> ScriptedPolicy:
    """A scripted policy (e.g. "oracle", "random") for the env, built with the env's options."""
    spec = get_env_spec(env_name)
    factory = spec.policies.get(policy_name)
    if factory is None:
        listed = ", ".join(sorted(spec.policies)) or "(none)"
        raise ValueError(f"unknown policy {policy_name!r} for env {env_name!r}; valid policies: {listed}")
    return factory(**_check_options(spec, options))


def action_from_reply(reply: str, prompt_format: str) -> str:
    """The action inside a reply, read exactly as the actor reads it (one parser for both)."""
    return parse_action(reply, prompt_format)


def react_reply(thought: str, action: str) -> str:
    """A reply in the react format the envs with prompt_format "react" expect."""
    return f"Thought:\n{thought}\n\nAction:\n{action}"
