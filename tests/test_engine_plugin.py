"""Engines from outside the repository: a package registers one under the `longhorizon.engines`
entry point (or is named by a dotted path as `actor.engine`), declares what it can do, and
`longhorizon eval` plays episodes with it; the example package in examples/transcript-engine,
installed with pip into a temporary folder, does the same."""

import importlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from longhorizon.actor.engines.base import ENGINES, EngineCapabilities, EngineError, capabilities_of, engine_class
from longhorizon.common.config import ConfigError, load_config

REPO_ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = REPO_ROOT / "examples" / "transcript-engine"

# An env's scripted oracle that also counts the turns it played, so the tests can tell that its
# code, not a built-in's, played. It plays no model and takes no LoRA adapters, and says so.
COUNTING_ORACLE = """
from longhorizon.actor.engines.base import EngineCapabilities
from longhorizon.actor.engines.scripted import ScriptedEngine

turns = []


class CountingOracle(ScriptedEngine):
    capabilities = EngineCapabilities(uses_model=False, needs_local_model=False, takes_lora=False, samples=False)

    async def generate(self, request):
        turns.append(request.episode_id)
        return await super().generate(request)
"""


@pytest.fixture
def engine_plugin(install_plugin):
    names = []

    def install(package: str, entry_point: str | None):
        if entry_point is None:
            install_plugin(package, COUNTING_ORACLE)
            names.append(f"{package}:CountingOracle")
        else:
            install_plugin(package, COUNTING_ORACLE, {"longhorizon.engines": {entry_point: f"{package}:CountingOracle"}})
            names.append(entry_point)
        return importlib.import_module(package), names[-1]

    yield install
    for name in names:  # the registry keeps what it loaded; the package is gone after the test
        ENGINES.unregister(name)


@pytest.mark.parametrize("found_by", ["entry point", "dotted path"])
def test_longhorizon_eval_plays_with_an_engine_from_outside(engine_plugin, found_by, tmp_path, capsys):
    from longhorizon.launch.recipes.eval import main

    module, name = engine_plugin("outside_engines", "counting-oracle" if found_by == "entry point" else None)
    # model.path names no model: the engine's capabilities say it plays none, so none is looked for.
    code = main([str(REPO_ROOT / "configs" / "codebook.toml"), f"actor.engine={name!r}",
                 "model.path='not-a-model'", "actor.scripted_policy='oracle'", "--tasks", "4"])
    output = capsys.readouterr()
    assert code == 0, output.err
    summary = json.loads(output.out.strip().splitlines()[-1])
    assert summary["engine"] == name and summary["success_rate"] == 1.0
    assert len(module.turns) == 4 * 3  # codebook episodes take three turns


def test_the_factory_and_the_launchers_ask_the_declared_capabilities(engine_plugin):
    from longhorizon.actor.engines.factory import build_engine
    from longhorizon.launch.checks import validate_config

    module, name = engine_plugin("capable_engines", "counting-oracle-2")
    assert capabilities_of(engine_class(name)) == module.CountingOracle.capabilities
    base = ["env.name='codebook'", f"actor.engine={name!r}", "model.path='not-a-model'"]
    engine = build_engine(load_config(None, base), "train")  # no model resolved for it
    assert isinstance(engine, module.CountingOracle)
    with pytest.raises(ConfigError, match=f"learner.lora sends adapters only, which the '{name}' engine cannot take"):
        validate_config(load_config(None, [*base, "learner.lora={rank = 2, target_modules = ['q_proj']}"]))
    with pytest.raises(ConfigError, match="no scripted policy 'psychic'"):  # its own settings check
        validate_config(load_config(None, [*base, "actor.scripted_policy='psychic'"]))


def test_the_builtins_declare_what_the_recipes_used_to_read_from_their_names():
    hf, vllm, openai, scripted = (capabilities_of(engine_class(n)) for n in ("hf", "vllm", "openai", "scripted"))
    assert hf.needs_local_model and hf.takes_lora and "collective" in hf.lora_transports()
    assert vllm.takes_lora and "collective" in vllm.weight_transports and "collective" not in vllm.lora_transports()
    assert openai.uses_model and not openai.needs_local_model and not openai.takes_lora
    assert not scripted.uses_model and not scripted.samples and "collective" not in scripted.weight_transports


def test_what_is_not_an_engine_is_refused_and_unknown_names_list_what_exists(install_plugin):
    install_plugin("not_engines", "make = 3\n\nclass Odd:\n    capabilities = {'samples': True}\n")
    with pytest.raises(EngineError, match="must be a class"):
        engine_class("not_engines:make")
    with pytest.raises(EngineError, match="must be an EngineCapabilities"):
        engine_class("not_engines:Odd")
    with pytest.raises(EngineError, match="unknown engine 'hff'; available: hf, openai, scripted, vllm"):
        engine_class("hff")


def test_an_older_plugin_without_capabilities_keeps_working():
    class Legacy:
        needs_model = False

    assert capabilities_of(Legacy) == EngineCapabilities(needs_local_model=False)


# -- the example package, pip-installed ------------------------------------------------------------


@pytest.fixture(scope="module")
def example_dir(tmp_path_factory):
    """The example installed with pip into its own folder (the shared venv is left untouched)."""
    work = tmp_path_factory.mktemp("plugin")
    source = work / "source"
    shutil.copytree(EXAMPLE, source)  # pip builds in the source tree; keep the repository clean
    target = work / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--target", str(target), str(source)],
        check=True, capture_output=True, timeout=120,
    )
    return target


def test_the_installed_example_is_found_by_name_and_plays(example_dir, tmp_path, monkeypatch):
    import trio

    from longhorizon.actor.engines.base import EngineSettings, engine_names, make_engine
    from longhorizon.actor.evaluate import play_tasks, summarise
    from longhorizon.envs.base import list_tasks

    with pytest.raises(EngineError, match="unknown engine 'transcript'"):
        make_engine("transcript", EngineSettings())  # not installed yet
    monkeypatch.syspath_prepend(str(example_dir))
    importlib.invalidate_caches()
    assert "transcript" in engine_names()

    transcript = tmp_path / "turns.jsonl"
    monkeypatch.setenv("LONGHORIZON_TRANSCRIPT_PATH", str(transcript))
    engine = make_engine("transcript", EngineSettings(env_name="textcraft", scripted_policy="oracle"))
    assert type(engine).__module__ == "longhorizon_transcript_engine"
    tasks = list_tasks("textcraft", "test")[:12]

    async def play():
        try:
            return await play_tasks(engine, "textcraft", {}, tasks, samples=1, horizon_cap=40, max_new_tokens=256)
        finally:
            await engine.close()

    records = trio.run(play)
    summary = summarise(records, 1, [1])
    assert summary["success_rate"] == 1.0 and summary["failed_episodes"] == 0  # the oracle, played through it
    turns = [json.loads(line) for line in transcript.read_text().splitlines()]
    assert len(turns) == sum(r.turns for r in records)
    assert {t["task_id"] for t in turns} == {task.task_id for task in tasks}
    assert all(t["reply"] and t["observation"] for t in turns)
    ENGINES.unregister("transcript")


def test_longhorizon_eval_selects_the_example_by_name(example_dir, tmp_path):
    transcript = tmp_path / "eval-turns.jsonl"
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(example_dir), os.environ.get("PYTHONPATH", "")])}
    completed = subprocess.run(
        [sys.executable, "-m", "longhorizon.launch.cli", "eval", str(REPO_ROOT / "configs" / "codebook.toml"),
         "actor.engine='transcript'", "model.path='not-a-model'", "--tasks", "5",
         "--engine-option", "inner=scripted", "--engine-option", f"path={transcript}"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path, env=environment,
    )
    assert completed.returncode == 0, completed.stderr
    summary = json.loads(completed.stdout.strip().splitlines()[-1])
    assert summary["engine"] == "transcript" and summary["success_rate"] == 1.0
    assert len(transcript.read_text().splitlines()) == 5 * 3  # codebook episodes take three turns
