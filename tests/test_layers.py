"""The import layers of docs/design.md hold: common <- envs <- actor, common <- learner, launch on top.

Every module's imports are read from its syntax tree, those inside functions included (deferred
imports keep `longhorizon --help` fast, and they must not hide the graph), and so is every string
that names one of the package's modules (`python -m longhorizon.x.y`, `importlib.import_module`).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "longhorizon"

# Each top-level folder and the folders it may import from (besides itself).
MAY_IMPORT = {
    "common": set(),
    "envs": {"common"},
    "actor": {"envs", "common"},
    "learner": {"common"},
    "launch": {"actor", "learner", "envs", "common"},
}


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([PACKAGE, *parts])


def imported_modules(path: Path, root: Path) -> list[tuple[int, str]]:
    """(line, module) for every import in the file and every string that is a module path of ours."""
    tree = ast.parse(path.read_text(), filename=str(path))
    name = module_name(path, root)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                found.append((node.lineno, ".".join(base + ([node.module] if node.module else []))))
            else:
                found.append((node.lineno, node.module or ""))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value
            if text.startswith(PACKAGE + ".") and text.replace(".", "").replace("_", "").isalnum():
                found.append((node.lineno, text))
    return [(line, module) for line, module in found if module.split(".")[0] == PACKAGE]


def source_files() -> list[Path]:
    return sorted(path for folder in MAY_IMPORT for path in (ROOT / folder).rglob("*.py"))


def layer_violations(files, root: Path = ROOT) -> list[str]:
    problems = []
    for path in files:
        layer = path.relative_to(root).parts[0]
        for line, module in imported_modules(path, root):
            parts = module.split(".")
            target = parts[1] if len(parts) > 1 else None
            if target is None or target == layer or target not in MAY_IMPORT:
                continue
            if target not in MAY_IMPORT[layer]:
                problems.append(f"{path.relative_to(root)}:{line}: {layer}/ imports {module} ({target}/ is not below it)")
    return problems


def test_no_module_imports_against_the_layers():
    problems = layer_violations(source_files())
    assert not problems, "imports against the layers of docs/design.md:\n" + "\n".join(problems)


def test_the_layers_have_no_cycle():
    # The rule itself must be a partial order, or the test above would admit a cycle.
    def reaches(start, goal, seen=()):
        return any(nxt == goal or (nxt not in seen and reaches(nxt, goal, (*seen, nxt))) for nxt in MAY_IMPORT[start])

    assert not [layer for layer in MAY_IMPORT if reaches(layer, layer)]


@pytest.mark.parametrize("source, expected", [
    ("from longhorizon.actor.rollout import run_episode\n", 1),
    ("def f():\n    from longhorizon.launch import cli\n", 1),
    ("def f():\n    from ..actor import worker\n", 1),
    ("import subprocess\nsubprocess.run(['python', '-m', 'longhorizon.launch.worker'])\n", 1),
    ("from longhorizon.common.wire import Trajectory\nfrom . import buffer\n", 0),
    ('"""Docs may name longhorizon.actor.rollout in a sentence."""\n', 0),
])
def test_the_check_sees_deferred_relative_and_string_imports(tmp_path, source, expected):
    # A learner module that imports upwards in each way the check must catch, and two that do not.
    folder = tmp_path / "learner"
    folder.mkdir()
    (folder / "probe.py").write_text(source)
    assert len(layer_violations([folder / "probe.py"], root=tmp_path)) == expected
