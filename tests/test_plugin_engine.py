"""A third-party actor type: the example package in examples/transcript-engine is installed into a
temporary folder, found through the `longhorizon.engines` entry point, and plays real episodes."""

import importlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = REPO_ROOT / "examples" / "transcript-engine"


@pytest.fixture(scope="module")
def plugin_dir(tmp_path_factory):
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


def test_the_installed_engine_is_found_by_name_and_plays(plugin_dir, tmp_path, monkeypatch):
    import trio

    from longhorizon.actor.engines.base import EngineError, EngineSettings, engine_names, make_engine
    from longhorizon.actor.evaluate import play_tasks, summarise
    from longhorizon.envs.base import list_tasks

    with pytest.raises(EngineError, match="unknown engine 'transcript'"):
        make_engine("transcript", EngineSettings())  # not installed yet
    monkeypatch.syspath_prepend(str(plugin_dir))
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


def test_longhorizon_eval_selects_the_plugin_by_name(plugin_dir, tmp_path):
    transcript = tmp_path / "eval-turns.jsonl"
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(plugin_dir), os.environ.get("PYTHONPATH", "")])}
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
