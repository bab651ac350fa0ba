"""Weights & Biases logging ([logging.wandb]): a short in-process run in offline mode, read back
from the files W&B writes, and the config checks around it."""

import json
import struct
from pathlib import Path

import pytest

from longhorizon.common.config import ConfigError, load_config
from longhorizon.common.metrics import WANDB_RUN_FILE, grouped_scalars, wandb_mode

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
    """The logged history by step, and the config the run started with, from an offline run file."""
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


def test_wandb_mode_follows_the_setting_then_the_key():
    assert wandb_mode("", {}) == "offline"
    assert wandb_mode("", {"WANDB_API_KEY": "k"}) == "online"
    assert wandb_mode("disabled", {"WANDB_API_KEY": "k"}) == "disabled"
    assert wandb_mode("online", {"WANDB_MODE": "offline"}) == "offline"


def test_config_checks_name_the_extra_and_the_modes(monkeypatch):
    import importlib.util

    from longhorizon.launch.local import validate_config

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


async def test_an_offline_run_logs_every_step_and_the_plots(tmp_path, tiny_codebook_model, monkeypatch):
    pytest.importorskip("wandb")
    import wandb

    from longhorizon.common.metrics import read_metrics
    from longhorizon.launch.local import train_in_process
    from longhorizon.launch.plot import plot_run

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-files"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    (tmp_path / "wandb-files").mkdir()
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
    run_files = sorted((tmp_path / "wandb-files").glob(f"wandb/offline-run-*-{saved['id']}/run-{saved['id']}.wandb"))
    assert len(run_files) == 2
    history, logged_config = offline_history(run_files[0])
    records = read_metrics(config.run_dir)
    assert [r["step"] for r in records] == [1, 2] and sorted(history) == [1, 2]
    for record in records:
        # Every finite number of the step's record, under its grouped name (W&B adds _step etc.).
        logged = {key: value for key, value in history[record["step"]].items() if not key.startswith("_")}
        assert logged == pytest.approx(grouped_scalars(record))
        assert {"rollout/reward_mean", "rollout/success_rate", "system/tokens_per_s"} <= set(logged)
    assert logged_config["run"]["name"] == "logged" and logged_config["run"]["total_steps"] == 2
    assert logged_config["logging"]["wandb"]["enabled"] is True
    # An image is logged as a table of its fields (type, file path, size, ...).
    plot_history = offline_history(run_files[1])[0]
    assert sorted(plot_history) == [3]  # after the learner's last step
    images = {key.removesuffix("/_type"): value for key, value in plot_history[3].items()
              if key.startswith("plots/") and key.endswith("/_type")}
    assert images["plots/reward"] == images["plots/success"] == "image-file", images
