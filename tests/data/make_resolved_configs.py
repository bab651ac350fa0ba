"""Writes tests/data/resolved_configs.json: the bare defaults resolved, each key by its dotted path,
and what every bundled config resolves differently. tests/test_config.py compares today's loader with it, so a default
or a config that changes its meaning shows up in review instead of passing unseen.

    .venv/bin/python tests/data/make_resolved_configs.py
"""

from __future__ import annotations

import json
from pathlib import Path

from longhorizon.common.config import bundled_config_names, config_to_dict, load_config
from longhorizon.learner.algorithms import with_resolved_options

DEFAULTS = "(defaults)"
"""The entry for the config a run gets with no file at all."""


def flatten(table: dict, prefix: str = "") -> dict:
    """{"learner": {"learning_rate": 1e-5}} -> {"learner.learning_rate": 1e-5}, through every
    table (free-form ones like env.options too; an empty one leaves no key)."""
    flat = {}
    for key, value in table.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def resolved_configs() -> dict[str, dict]:
    """The defaults' resolved keys in full, and for each bundled config the keys whose resolved
    value differs from the default or that the defaults lack (a key it leaves out has the
    default's value). The chosen algorithm's options are resolved with their defaults."""
    defaults = flatten(config_to_dict(with_resolved_options(load_config(None))))
    configs = {DEFAULTS: defaults}
    for name in bundled_config_names():
        resolved = flatten(config_to_dict(with_resolved_options(load_config(name))))
        configs[name] = {key: value for key, value in resolved.items() if defaults.get(key, object()) != value}
    return configs


if __name__ == "__main__":
    target = Path(__file__).with_name("resolved_configs.json")
    target.write_text(json.dumps(resolved_configs(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {target}")
