"""The key reference (docs/config.md), written from the config's JSON schema: every table and key
with its type, default, allowed range and meaning, and each built-in algorithm's, engine's and
weights transport's options.

`longhorizon config reference` prints it; a test holds docs/config.md to it, so the reference
changes only where a key's declaration (its type, default, `bounded(...)` range or docstring in
common/config.py, or a part's `Options`) changes.
"""

from __future__ import annotations

import json
from typing import Any
from longhorizon.actor.engines.base import engine_options_schemas
from longhorizon.common.config import config_schema
from longhorizon.envs.agents import agent_options_schemas
from longhorizon.envs.base import env_options_schemas
from longhorizon.learner.weights import weights_options_schemas

_BOUNDS = (("minimum", ">= {}"), ("exclusiveMinimum", "> {}"), ("maximum", "<= {}"), ("exclusiveMaximum", "< {}"))


def _type_of(field: dict[str, Any]) -> str:
    if "enum" in field:
        return "one of " + ", ".join(f"`{json.dumps(choice)}`" for choice in field["enum"])
    if "const" in field:
        return f"`{json.dumps(field['const'])}`"
    if "anyOf" in field:
        return " or ".join(_type_of(option) for option in field["anyOf"])
    kind = field.get("type", "any")
    if kind == "array":
        items = field.get("items") or {}
        return f"list of {_type_of(items)}" if items else "list"
    return {"integer": "int", "number": "float", "boolean": "bool", "string": "str", "object": "table",
            "null": "unset"}.get(kind, kind)


def _default_of(field: dict[str, Any]) -> str:
    if "default" not in field:
        return "(required)" if field.get("type") != "object" else "`{}`"
    return "unset" if field["default"] is None else f"`{json.dumps(field['default'])}`"


def _range_of(field: dict[str, Any]) -> str:
    """The bounds of a number, or of the number an optional key may be."""
    bounds = [template.format(field[key]) for key, template in _BOUNDS if key in field]
    return ", ".join(bounds) or ", ".join(filter(None, (_range_of(option) for option in field.get("anyOf", []))))


def _cell(text: str) -> str:
    """One table cell: the docstring's lines joined, and `|` escaped."""
    return " ".join(line.strip() for line in text.splitlines()).replace("|", "\\|")


def _table(prefix: str, definition: dict[str, Any], definitions: dict[str, Any], sections: list[str]) -> None:
    """The rows of one table's keys, and after it (in `sections`) each table nested in it."""
    rows, nested = [], []
    for key, field in definition.get("properties", {}).items():
        if "$ref" in field:
            nested.append((f"{prefix}.{key}", definitions[field["$ref"].rsplit("/", 1)[-1]], field.get("description", "")))
            continue
        rows.append(f"| `{key}` | {_type_of(field)} | {_default_of(field)} | {_range_of(field)} | "
                    f"{_cell(field.get('description', ''))} |")
    text = [f"## [{prefix}]", ""]
    if definition.get("description"):
        text += [_cell(definition["description"]), ""]
    text += ["| key | type | default | range | meaning |", "|---|---|---|---|---|", *rows, ""]
    sections.append("\n".join(text))
    for nested_prefix, nested_definition, description in nested:
        _table(nested_prefix, {**nested_definition, "description": description or nested_definition.get("description", "")},
               definitions, sections)


def config_reference(schema: dict[str, Any], algorithm_options: dict[str, Any],
                     engine_options: dict[str, Any] | None = None,
                     weights_options: dict[str, Any] | None = None,
                     agent_options: dict[str, Any] | None = None,
                     env_options: dict[str, Any] | None = None) -> str:
    """The reference as Markdown, from `common.config.config_schema()` and each kind of part's
    declared options (`full_schema()` gathers them)."""
    definitions = schema.get("$defs", {})
    sections = [
        "# Config keys\n\n"
        "Every key of a run's TOML config, by table: its type, default, allowed range and meaning. A key\n"
        "that is not here, or a value of the wrong type or out of its range, is refused when the config\n"
        "is loaded, in one line naming it. `longhorizon config show CONFIG` prints a config with every\n"
        "default filled in; `longhorizon config schema` prints the JSON schema this page is written from\n"
        "(`longhorizon config reference > docs/config.md` writes the page again).\n"
    ]
    for table, field in schema.get("properties", {}).items():
        definition = definitions[field["$ref"].rsplit("/", 1)[-1]]
        _table(table, definition, definitions, sections)
    _option_tables(sections, "learner.algorithm_options",
                   "The keys of the algorithm `learner.algorithm` names, checked when it is made: another\n"
                   "algorithm's key is refused. A plug-in algorithm declares its own (docs/algorithms.md).\n",
                   algorithm_options)
    _option_tables(sections, "actor.engine_options",
                   "The keys of the engine `actor.engine` names, checked before any process starts. The openai\n"
                   "engine's can also be set as LONGHORIZON_OPENAI_<KEY> environment variables, which the config\n"
                   "overrides (docs/actor-types.md); the scripted engine takes none.\n",
                   engine_options or {})
    _option_tables(sections, "learner.weights_options",
                   "The keys of the weights transport `learner.weights_transport` names, checked before any\n"
                   "process starts; inline and path take none. A plug-in transport declares its own\n"
                   "(docs/design.md, extension points).\n",
                   weights_options or {})
    _option_tables(sections, "actor.agent_options",
                   "The keys of the agent loop `actor.agent` names, checked before any process starts; react\n"
                   "and bare take none. A plug-in loop declares its own (docs/actor-types.md).\n",
                   agent_options or {})
    _option_tables(sections, "env.options",
                   "The options of the env `env.name` names, checked before any env is built: an unknown option,\n"
                   "a value of the wrong type or out of range is refused. A plug-in env declares its own in its\n"
                   "EnvSpec's `Options`; an env that declares none has only its option names checked\n"
                   "against its factory.\n",
                   env_options or {})
    return "\n".join(sections)


def _option_tables(sections: list[str], key: str, about: str, by_part: dict[str, Any]) -> None:
    """A part's own keys (each algorithm's, engine's or transport's `Options`), one table per part."""
    sections.append(f"## [{key}]\n\n{about}")
    for part, options in by_part.items():
        rows = [f"| `{name}` | {_type_of(field)} | {_default_of(field)} | {_range_of(field)} | "
                f"{_cell(field.get('description', ''))} |" for name, field in options.get("properties", {}).items()]
        body = ["| key | type | default | range | meaning |", "|---|---|---|---|---|", *rows] if rows else ["No keys."]
        description = [_cell(options["description"]), ""] if options.get("description") else []
        sections.append("\n".join([f"### {part}", "", *description, *body, ""]))


def full_schema() -> dict[str, Any]:
    """The JSON schema of the config (`longhorizon config schema`), with each built-in part's
    declared options beside it: algorithms, engines, weights transports, agent loops and envs."""
    from longhorizon.learner.algorithms import options_schemas

    return {**config_schema(), "algorithm_options": options_schemas(), "engine_options": engine_options_schemas(),
            "weights_options": weights_options_schemas(), "agent_options": agent_options_schemas(),
            "env_options": env_options_schemas()}


def current_reference() -> str:
    """The reference of this installation's config and built-in parts."""
    schema = full_schema()
    parts = {key: schema.pop(key) for key in
             ("algorithm_options", "engine_options", "weights_options", "agent_options", "env_options")}
    return config_reference(schema, parts["algorithm_options"], parts["engine_options"], parts["weights_options"],
                            parts["agent_options"], parts["env_options"])
