"""Weights & Biases logging ([logging.wandb]): a short in-process run in offline mode, read back
from the files W&B writes, and the config checks around it."""

import json
import struct
from pathlib import Path

import pytest

from longhorizon.common.config import ConfigError, load_config
from longhorizon.common.metrics import WANDB_RUN_FILE, WANDB_STEP_METRIC, grouped_scalars, wandb_mode

REPO_ROOT = Path(__file__).resolve().parent.parent


def wandb_records(path: Path):
    """The protobuf records of an offline W&B run file (`run-<id>.wandb`): a 7-byte header, then
    records in the LevelDB log layout (32 KiB blocks; each piece has a 7-byte header of checksum,
    length and kind: 1 whole, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    block, position, pieces = 32768, 7, b""
    while position + 7 <= len(data):
        left_in_block = block - position % block
        if left_in_block < 7:  # a block's tail too short for a header is padding
            position += left_in_block
            continue
        _checksum, length, kind = struct.unpack("<IHB", data[position:position + 7])
        if kind == 0 and length == 0:  # zeroed padding to the end of the block
            position += left_in_block
            continue
        chunk = data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (1, 4):
            raw, pieces = pieces + chunk, b""
            record = wandb_internal_pb2.Record()
            record.ParseFromString(raw)
            yield record
        else:
            pieces += chunk


def offline_history(run_file: Path) -> tuple[dict[int, dict], dict]:
    """The logged history by W&B step, and the config the run started with, from an offline run file."""
    history: dict[int, dict] = {}
    config: dict = {}
    for record in wandb_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            history.setdefault(record.history.step.num, {}).update(items)
        elif kind == "run":  # the config given to wandb.init
            config.update({item.key: json.loads(item.value_json) for item in record.run.config.update})
    return history, config


def offline_step_metrics(run_file: Path) -> dict[str, str]:
    """The x-axis each metric (or glob) was given with define_metric, from an offline run file."""
    return {
        record.metric.name or record.metric.glob_name: record.metric.step_metric
        for record in wandb_records(run_file) if record.WhichOneof("record_type") == "metric"
    }


def offline_run_files(wandb_dir: Path, run_id: str) -> list[Path]:
    """The run's offline run files, one per process that logged to it, oldest first (the folder
    names start with the time)."""
    return sorted(wandb_dir.glob(f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb"))


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch) -> Path:
    """W&B offline, its files in a folder of the test's own; yields that folder."""
    pytest.importorskip("wandb")
    import wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-files"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    (tmp_path / "wandb-files").mkdir()
    yield tmp_path / "wandb-files"
    wandb.teardown()


def test_wandb_mode_follows_the_setting_then_the_key():
    assert wandb_mode("", {}) == "offline"
    assert wandb_mode("", {"WANDB_API_KEY": "k"}) == "online"
    assert wandb_mode("disabled", {"WANDB_API_KEY": "k"}) == "disabled"
    assert wandb_mode("online", {"WANDB_MODE": "offline"}) == "offline"


def test_config_checks_name_the_extra_and_the_modes(monkeypatch):
    import importlib.util

    from longhorizon.launch.checks import validate_config

    base = ["env.name='codebook'", "actor.engine='scripted'", "logging.wandb.enabled=true"]
    with pytest.raises(ConfigError, match="logging.wandb.mode must be one of online, offline, disabled"):
        validate_config(load_config(None, [*base, "logging.wandb.mode='cloud'"]))
    with pytest.raises(ConfigError, match="run.keep_checkpoints must be >= 1"):
        validate_config(load_config(None, [*base, "run.keep_checkpoints=0"]))
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real_find_spec(name, *a))
    with pytest.raises(ConfigError, match=r"pip install 'longhorizon\[wandb\]'"):
        validate_config(load_config(None, base))
    validate_config(load_config(None, base[:2]))  # off: wandb is not needed


def test_a_restarted_learner_logs_its_steps_again_in_new_wandb_rows(tmp_path, offline_wandb):
    # The learner checkpointed step 1, logged steps 1-3, died, and a new learner resumes from the
    # checkpoint: it logs steps 2-4 (metrics.jsonl drops the first attempt's 2 and 3). W&B keeps a
    # row only above the run's last W&B step, so every row takes a new one, its learner step in
    # train/step, and the two processes' offline files continue one another.
    import wandb

    from longhorizon.common.metrics import MetricsWriter

    config = load_config(None, ["env.name='codebook'", "run.name='restarted'", "logging.wandb.enabled=true"])
    run_dir = tmp_path / "run"

    def record(step: int, attempt: int) -> dict:
        return {"step": step, "loss": step + attempt / 10, "reward_mean": -step, "tokens_per_s": 100.0 * attempt}

    for attempt, steps in ((1, [1, 2, 3]), (2, [2, 3, 4])):
        writer = MetricsWriter(run_dir, tensorboard=False, config=config)
        for step in steps:
            writer.write(record(step, attempt))
        writer.close()
    wandb.teardown()  # the W&B service writes the last records of the run files as it stops

    saved = json.loads((run_dir / WANDB_RUN_FILE).read_text())
    assert saved["name"] == "restarted" and saved["next_step"] == 6
    first, second = offline_run_files(offline_wandb, saved["id"])  # one W&B run, two processes
    rows = {**offline_history(first)[0], **offline_history(second)[0]}
    assert sorted(offline_history(first)[0]) == [0, 1, 2] and sorted(offline_history(second)[0]) == [3, 4, 5]
    expected = [record(1, 1), record(2, 1), record(3, 1), record(2, 2), record(3, 2), record(4, 2)]
    for wandb_step, sent in enumerate(expected):
        logged = {key: value for key, value in rows[wandb_step].items() if not key.startswith("_")}
        assert logged == pytest.approx({WANDB_STEP_METRIC: sent["step"], **grouped_scalars(sent)})
    for run_file in (first, second):  # each process sets the x-axis again, for its own rows
        assert offline_step_metrics(run_file) == {WANDB_STEP_METRIC: "", "*": WANDB_STEP_METRIC}


def test_the_next_wandb_step_is_the_larger_of_the_saved_and_the_reported(tmp_path):
    from longhorizon.common.metrics import WandbLog

    class FakeRun:  # what WandbLog uses of a wandb run
        def __init__(self, step):
            self.step, self.rows, self.metrics = step, [], []

        def define_metric(self, name, step_metric=None):
            self.metrics.append((name, step_metric))

        def log(self, row, step):
            self.rows.append((step, row))

    (tmp_path / WANDB_RUN_FILE).write_text(json.dumps({"id": "abc", "next_step": 7}))
    offline = FakeRun(step=0)  # an offline run resumed in a new process counts from 0
    WandbLog(offline, tmp_path).log({"train/loss": 1.0}, learner_step=3)
    assert offline.rows == [(7, {WANDB_STEP_METRIC: 3, "train/loss": 1.0})]
    assert offline.metrics == [(WANDB_STEP_METRIC, None), ("*", WANDB_STEP_METRIC)]
    online = FakeRun(step=20)  # online, W&B says where the run's rows reached
    WandbLog(online, tmp_path).log({}, learner_step=4)
    assert online.rows == [(20, {WANDB_STEP_METRIC: 4})]
    assert json.loads((tmp_path / WANDB_RUN_FILE).read_text()) == {"id": "abc", "next_step": 21}


async def test_an_offline_run_logs_every_step_and_the_plots(tmp_path, tiny_codebook_model, offline_wandb, capsys):
    import wandb

    from longhorizon.common.metrics import read_metrics
    from longhorizon.launch.launchers.local import train_in_process
    from longhorizon.launch.plot import plot_run

    config = load_config(REPO_ROOT / "configs" / "codebook.toml", [
        f"run.output_dir={str(tmp_path)!r}", "run.name='logged'", "run.total_steps=2",
        f"model.path={str(tiny_codebook_model)!r}", "actor.num_actors=1", "actor.group_size=4",
        "learner.groups_per_step=2", "logging.wandb.enabled=true", "logging.wandb.tags=['test']",
    ])
    await train_in_process(config)
    plot_run(config.run_dir)
    wandb.teardown()  # the W&B service writes the last records of the run files as it stops

    saved = json.loads((config.run_dir / WANDB_RUN_FILE).read_text())
    assert saved["name"] == "logged" and saved["mode"] == "offline" and saved["tags"] == ["test"]
    # The learner's process and the plots' (here the same process) wrote one run each, same id.
    run_files = offline_run_files(offline_wandb, saved["id"])
    assert len(run_files) == 2
    # W&B's own last line names the plots' folder alone: the user is told to upload both, in order.
    hint = capsys.readouterr().err
    folders = sorted(str(path.parent) for path in run_files)
    assert "W&B offline: this run is in 2 folders (metrics, then plots)" in hint
    assert f"wandb sync {folders[0]} {folders[1]}" in hint
    history, logged_config = offline_history(run_files[0])
    records = read_metrics(config.run_dir)
    assert [r["step"] for r in records] == [1, 2] and sorted(history) == [0, 1]  # W&B's steps count rows
    for wandb_step, record in enumerate(records):
        # Every finite number of the step's record, under its grouped name, and the learner step
        # (W&B adds _step, _runtime, _timestamp).
        logged = {key: value for key, value in history[wandb_step].items() if not key.startswith("_")}
        assert logged == pytest.approx({WANDB_STEP_METRIC: record["step"], **grouped_scalars(record)})
        assert {"rollout/reward_mean", "rollout/success_rate", "system/tokens_per_s"} <= set(logged)
    assert logged_config["run"]["name"] == "logged" and logged_config["run"]["total_steps"] == 2
    assert logged_config["logging"]["wandb"]["enabled"] is True
    # An image is logged as a table of its fields (type, file path, size, ...).
    plot_history = offline_history(run_files[1])[0]
    assert sorted(plot_history) == [2]  # the row after the learner's rows, at its last step
    assert plot_history[2][WANDB_STEP_METRIC] == 2
    images = {key.removesuffix("/_type"): value for key, value in plot_history[2].items()
              if key.startswith("plots/") and key.endswith("/_type")}
    assert images["plots/reward"] == images["plots/success"] == "image-file", images
