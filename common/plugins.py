"""Registries of plug-ins: one per kind of part (algorithm, weights transport, engine, env, agent loop).

A part is found by name in this order:
1. parts registered in this process (`registry.register(name, part)`; tests and notebooks),
2. the built-ins, named as `module:attribute` and imported on first use (so that looking up one
   part never imports the others' heavy dependencies),
3. the part's entry-point group (`longhorizon.algorithms`, ...), which is how an installed package
   outside this repository adds one,
4. a dotted path `package.module:attribute` written in place of the name, for code on the Python
   path that is not installed.

Built-ins go through the same lookup as any plug-in; an entry point may not reuse a built-in's
name (the error names both), so a config's meaning never depends on what else is installed.
"""

from __future__ import annotations

import importlib
import re
from importlib.metadata import entry_points
from typing import Any, Callable, Generic, Mapping, TypeVar

T = TypeVar("T")

# `package.module:attribute`, the form entry points use.
_DOTTED_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


class PluginError(LookupError):
    """A part cannot be found or loaded; the message says which names exist."""


def load_dotted(path: str) -> Any:
    """The object `package.module:attribute` names."""
    if not _DOTTED_PATH.match(path):
        raise PluginError(f"{path!r} is not a dotted path of the form package.module:attribute")
    module_name, _, attribute = path.partition(":")
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as error:
        raise PluginError(f"cannot import {module_name!r} (from {path!r}): {error}") from error
    for part in attribute.split("."):
        try:
            target = getattr(target, part)
        except AttributeError as error:
            raise PluginError(f"{module_name!r} has no attribute {attribute!r} (from {path!r})") from error
    return target


class Registry(Generic[T]):
    """The parts of one kind, by name.

    `kind` names the part in messages ("engine"); `group` is its entry-point group; `builtins`
    maps each built-in name to `module:attribute`; `check`, when given, is called on every part
    found and raises TypeError when the object is not such a part.
    """

    def __init__(self, kind: str, group: str, builtins: Mapping[str, str],
                 check: Callable[[str, Any], None] | None = None) -> None:
        self.kind = kind
        self.group = group
        self._builtins = dict(builtins)
        self._registered: dict[str, T] = {}
        self._loaded: dict[str, T] = {}
        self._check = check

    def register(self, name: str, part: T, *, replace: bool = False) -> T:
        """Make `part` available under `name` in this process."""
        if not name or not isinstance(name, str):
            raise ValueError(f"a {self.kind} needs a non-empty string name")
        if not replace and (name in self._registered or name in self._builtins):
            raise ValueError(f"{self.kind} {name!r} is already registered (pass replace=True to override)")
        self._checked(name, part)
        self._registered[name] = part
        self._loaded.pop(name, None)
        return part

    def unregister(self, name: str) -> None:
        self._registered.pop(name, None)
        self._loaded.pop(name, None)

    def builtin_names(self) -> list[str]:
        return sorted(self._builtins)

    def names(self) -> list[str]:
        """Every name `get` accepts (dotted paths aside)."""
        return sorted(set(self._registered) | set(self._builtins) | {ep.name for ep in self._entry_points()})

    def get(self, name: str) -> T:
        """The part called `name` (or found at the dotted path `name`)."""
        if name in self._registered:
            return self._registered[name]
        if name in self._loaded:
            return self._loaded[name]
        if name in self._builtins:
            part = self._checked(name, load_dotted(self._builtins[name]))
        elif _DOTTED_PATH.match(name):
            part = self._checked(name, load_dotted(name))
        else:
            matches = [ep for ep in self._entry_points() if ep.name == name]
            if not matches:
                raise PluginError(f"unknown {self.kind} {name!r}; available: {', '.join(self.names()) or '(none)'}")
            if len(matches) > 1:
                sources = ", ".join(sorted(ep.value for ep in matches))
                raise PluginError(f"{self.kind} {name!r} is offered by more than one installed package: {sources}")
            try:
                loaded = matches[0].load()
            except Exception as error:  # an installed plug-in that fails to import: say which
                raise PluginError(f"{self.kind} {name!r} ({matches[0].value}) failed to load: {error}") from error
            part = self._checked(name, loaded)
        self._loaded[name] = part
        return part

    def _entry_points(self) -> list:
        found = list(entry_points(group=self.group))
        clashes = [ep for ep in found if ep.name in self._builtins and ep.value != self._builtins[ep.name]]
        if clashes:
            raise PluginError(
                f"the {self.group} entry point {clashes[0].name!r} ({clashes[0].value}) reuses the name of the "
                f"built-in {self.kind} ({self._builtins[clashes[0].name]}); give the plug-in another name"
            )
        return [ep for ep in found if ep.name not in self._builtins]

    def _checked(self, name: str, part: Any) -> Any:
        if self._check is not None:
            self._check(name, part)
        return part
