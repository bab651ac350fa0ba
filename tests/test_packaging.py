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
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(source), "-w", str(tmp_path)],
        check=True, capture_output=True,
    )
    wheel = next(tmp_path.glob("longhorizon-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "longhorizon/common/wire.py" in names and "longhorizon/configs/quickstart.toml" in names
    assert not any(name.startswith(("common/", "envs/", "launch/", "tests/")) for name in names)

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)  # what an installer does for a pure-Python wheel
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
