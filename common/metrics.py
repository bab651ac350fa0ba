"""A run's metrics: one JSON line per learner step in `metrics.jsonl` (and TensorBoard), written
here and read back here, whole (`read_metrics`: reports, plots, benchmarks, tests) or as it
grows (`MetricsFollower`: the launcher's progress line).

The lines are strict JSON: a value that is not a finite number (a NaN loss, an infinite gradient
norm) is written as null, and the record's `nonfinite_metrics` lists the keys that held one
(nested keys joined by dots), so a reader can tell "not finite" from "not recorded". Files written
before that, which hold bare `NaN` and `Infinity`, read back the same way.

TensorBoard and Weights & Biases get the numbers under grouped names (`train/loss`,
`rollout/reward_mean`, `system/tokens_per_s`: `metric_group`); metrics.jsonl keeps the flat keys.
W&B charts them against the learner step, logged in every row as `train/step` (`WandbLog`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import uuid
from pathlib import Path
from longhorizon.common.config import config_to_dict

log = logging.getLogger(__name__)


class MetricsWriter:
    """Writes a run's metric records: every record to metrics.jsonl, its finite numbers to
    TensorBoard and, with `logging.wandb.enabled` in `config`, to Weights & Biases (the resolved
    config is logged there once, when the writer opens)."""

    def __init__(self, run_dir: Path, *, tensorboard: bool = True, config=None) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", buffering=1)
        self._tensorboard = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tensorboard = SummaryWriter(str(Path(run_dir) / "tensorboard"))
            except Exception as exc:  # metrics still go to JSONL
                log.warning("TensorBoard logging disabled: %r", exc)
        self._wandb: WandbLog | None = None
        if config is not None and config.logging.wandb.enabled:
            try:
                self._wandb = start_wandb(config, Path(run_dir))
            except Exception as exc:  # metrics still go to JSONL and TensorBoard
                log.warning("Weights & Biases logging disabled: %r", exc)

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(strict_record(record), default=_jsonable, allow_nan=False) + "\n")
        if self._tensorboard is None and self._wandb is None:
            return
        step = int(record.get("step", 0))
        scalars = grouped_scalars(record)
        if self._tensorboard is not None:
            for key, value in scalars.items():
                self._tensorboard.add_scalar(key, value, step)
            self._tensorboard.flush()
        if self._wandb is not None:
            self._wandb.log(scalars, learner_step=step)

    def close(self) -> None:
        self._file.close()
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


METRIC_GROUPS = ("train", "rollout", "system", "eval")

# Which group a flat metrics.jsonl key belongs to, by its start or its end; the first rule that
# matches wins, and a key no rule names is a training figure (the trainer's own loss terms,
# whose names depend on the algorithm, all land there).
_GROUP_RULES: tuple[tuple[str, tuple[str, ...], tuple[str, ...]], ...] = (
    ("eval", ("eval_", "eval/"), ()),
    ("system", (
        "time", "version", "trajectories_", "groups_dropped_", "groups_resampled", "actors_",
        "actor_episodes_", "rejected_", "control_rejected_", "auth_", "weights_", "memory", "mem_",
        "rss", "cuda_", "gpu_", "broadcast", "queue", "buffer", "learner_step_seconds",
    ), ("_per_s", "_seconds", "_bytes", "_mb", "_gb", "_s")),
    ("rollout", (
        "reward", "success", "staleness", "episode", "turns", "truncated", "cut_by_cap", "horizon_",
        "groups_", "invalid_action", "failed_episodes", "target_", "history_breaks",
    ), ()),
)


def metric_group(name: str) -> str:
    """The group of a flat metric key: `train` (losses, entropy, KL, gradient norm, clipping,
    learning rate), `rollout` (rewards, success, turns, truncation, staleness, group outcomes),
    `system` (throughput, time, memory, weights bytes, data counters) or `eval`."""
    for group, starts, ends in _GROUP_RULES:
        if name.startswith(starts) or (ends and name.endswith(ends)):
            return group
    return "train"


def grouped_name(name: str) -> str:
    """The TensorBoard tag and W&B key of a flat metric key, e.g. `train/loss`."""
    return f"{metric_group(name)}/{name}"


def grouped_scalars(record: dict) -> dict[str, float]:
    """The record's finite numbers (booleans, text and nested tables left out) under grouped names;
    `step` is the x-axis, not a figure."""
    return {
        grouped_name(key): value for key, value in record.items()
        if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    }


WANDB_RUN_FILE = "wandb_run.json"
"""In the run folder: the W&B run's id and settings, so every process of the run (the learner,
a restarted learner, the launcher logging the plots) writes to one W&B run, and the W&B step its
next row takes (`next_step`)."""

# The keys of WANDB_RUN_FILE that are wandb.init's arguments.
_WANDB_INIT_KEYS = ("id", "project", "entity", "name", "tags", "mode", "dir")

WANDB_STEP_METRIC = "train/step"
"""The learner step, logged in every W&B row and set as the x-axis of every other metric."""

def wandb_mode(setting: str, environ: dict) -> str:
    """The W&B mode to use: WANDB_MODE when set, else `setting`, else online with an API key
    (WANDB_API_KEY) and offline without one."""
    chosen = environ.get("WANDB_MODE") or setting
    if chosen:
        return chosen
    return "online" if environ.get("WANDB_API_KEY") else "offline"


class WandbLog:
    """One process's rows in the run's W&B run.

    W&B keeps a row only if its own step is above every step the run has logged; a learner that
    resumes from a checkpoint trains the steps after it again, so the learner step cannot be W&B's
    step. Each row instead carries the learner step as `train/step`, which every chart uses as
    its x-axis, and takes the next W&B step, counted across the run's processes: the larger of
    what W&B reports (online, a resumed run continues from the server's last step) and the
    `next_step` in wandb_run.json (offline, a resumed run counts from 0 again, and the run's
    offline folders, synced in order, must continue one another). The steps trained again show
    twice against `train/step`: the first attempt's rows and the resumed learner's."""

    def __init__(self, run, run_dir: Path) -> None:
        self.run = run
        self.run_dir = Path(run_dir)
        self._next_step = max(int(run.step), _saved_next_step(_read_wandb_file(self.run_dir)))
        run.define_metric(WANDB_STEP_METRIC)
        run.define_metric("*", step_metric=WANDB_STEP_METRIC)

    def log(self, row: dict, *, learner_step: int) -> None:
        step = self._next_step
        self._next_step += 1
        # Saved before the row is logged: a crash in between skips a W&B step, never reuses one.
        _update_wandb_file(self.run_dir, next_step=self._next_step)
        self.run.log({WANDB_STEP_METRIC: learner_step, **row}, step=step)

    def finish(self) -> None:
        self.run.finish()


def start_wandb(config, run_dir: Path) -> WandbLog:
    """Start (or resume) the run's W&B run and log the resolved config."""
    import wandb


    settings = config.logging.wandb
    run_dir = Path(run_dir)
    saved = _read_wandb_file(run_dir)
    init = {
        "id": saved.get("id") or uuid.uuid4().hex[:12],
        "project": settings.project,
        "entity": settings.entity or None,
        "name": settings.name or config.run.name,
        "tags": list(settings.tags) or None,
        "mode": wandb_mode(settings.mode, dict(os.environ)),
        # Beside the run's other outputs, unless WANDB_DIR says where.
        "dir": os.environ.get("WANDB_DIR") or str(run_dir.resolve()),
    }
    run_dir.mkdir(parents=True, exist_ok=True)
    _update_wandb_file(run_dir, **init)
    # resume="allow": a restarted learner (or the plots' process) continues the same W&B run.
    return WandbLog(wandb.init(**init, config=config_to_dict(config), resume="allow"), run_dir)


def log_plots_to_wandb(run_dir: Path, paths: list[Path]) -> bool:
    """Log the plot images at `paths` to the run's W&B run (named in its `wandb_run.json`, which
    the learner writes when W&B logging is on); returns whether they were logged. Without that
    file, or without the wandb package, nothing is logged."""
    saved = _read_wandb_file(Path(run_dir))
    if not saved.get("id") or not paths:
        return False
    try:
        import wandb
    except ImportError:
        log.warning("%s names a W&B run but wandb is not installed: plots not logged", Path(run_dir) / WANDB_RUN_FILE)
        return False
    run = WandbLog(wandb.init(**{key: saved[key] for key in _WANDB_INIT_KEYS if key in saved}, resume="allow"), run_dir)
    try:
        # At the learner's last step, in a row after every row the learner logged.
        steps = [record["step"] for record in read_metrics(run_dir) if isinstance(record.get("step"), int)]
        run.log({f"plots/{Path(path).stem}": wandb.Image(str(path)) for path in paths},
                learner_step=steps[-1] if steps else 0)
    finally:
        run.finish()
    hint = offline_sync_hint(saved)
    if hint:  # W&B's own closing line names only this last folder, which holds the plots alone
        print(hint, file=sys.stderr, flush=True)
    return True


def offline_sync_hint(saved: dict) -> str | None:
    """For an offline W&B run written by several processes (the learner's metrics, a restarted
    learner's, the plots), the command that uploads all of its folders in order; None when it is
    not offline or has one folder."""
    if saved.get("mode") != "offline" or not saved.get("id") or not saved.get("dir"):
        return None
    # Folder names start with the time they were made, so sorted is the order they were written.
    folders = sorted(Path(saved["dir"]).glob(f"wandb/offline-run-*-{saved['id']}"))
    if len(folders) < 2:
        return None
    return (f"W&B offline: this run is in {len(folders)} folders (metrics, then plots); upload them all, in "
            f"order, with: wandb sync {' '.join(str(folder) for folder in folders)}")


def _read_wandb_file(run_dir: Path) -> dict:
    path = Path(run_dir) / WANDB_RUN_FILE
    if not path.is_file():
        return {}
    try:
        saved = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        log.warning("%s is not JSON (%s): a new W&B run is started", path, error)
        return {}
    return saved if isinstance(saved, dict) else {}


def _saved_next_step(saved: dict) -> int:
    step = saved.get("next_step")
    return step if isinstance(step, int) and not isinstance(step, bool) and step > 0 else 0


def _update_wandb_file(run_dir: Path, **values) -> None:
    """Set `values` in the run's wandb_run.json, keeping its other keys; written whole to a new file
    and renamed, so a crash midway leaves the earlier file."""
    path = Path(run_dir) / WANDB_RUN_FILE
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps({**_read_wandb_file(run_dir), **values}, indent=1) + "\n")
    partial.replace(path)


NONFINITE_KEY = "nonfinite_metrics"


def strict_record(record: dict) -> dict:
    """`record` with every non-finite number replaced by None, and the keys that held one listed
    under `nonfinite_metrics` (added to any list already there); the record itself is not changed."""
    names: list[str] = []
    clean = _finite_only(record, "", names)
    if names:
        earlier = clean.get(NONFINITE_KEY)
        clean[NONFINITE_KEY] = (list(earlier) if isinstance(earlier, list) else []) + [
            name for name in names if not (isinstance(earlier, list) and name in earlier)
        ]
    return clean


def _finite_only(value, path: str, names: list[str]):
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        names.append(path)
        return None
    if isinstance(value, dict):
        return {key: _finite_only(item, f"{path}.{key}" if path else str(key), names) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_only(item, f"{path}[{index}]", names) for index, item in enumerate(value)]
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0:  # numpy or torch scalars
        return _finite_only(value.item(), path, names)
    if hasattr(value, "tolist") and getattr(value, "ndim", 0) > 0:  # numpy arrays, tensors
        return _finite_only(value.tolist(), path, names)
    return value


def _jsonable(value):
    if hasattr(value, "item"):
        try:
            value = value.item()
        except (ValueError, RuntimeError):  # an array of several values
            return str(value)
        # What strict_record did not see (an odd container): still never NaN in the file.
        return value if not isinstance(value, float) or math.isfinite(value) else None
    return str(value)


def read_metrics(run_dir: Path, *, required: bool = False) -> list[dict]:
    """The run's per-step records from `run_dir/metrics.jsonl`, in the order they were written.

    A line that is not a JSON object is skipped with a logged note: a run killed mid-write leaves a
    cut-off last line (and a running one is writing its last line right now), which should not
    cost the rest. Without the file, or without a record in it, the result is empty; with
    `required` (a report or plot of a finished run) that raises FileNotFoundError or ValueError.
    Non-finite numbers (bare NaN / Infinity in files written before records were strict JSON)
    read back as None, named in the record's `nonfinite_metrics`, as `MetricsWriter` writes them.
    """
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        if required:
            raise FileNotFoundError(f"no metrics file at {path}")
        return []
    records = []
    with path.open(encoding="utf-8") as metrics_file:
        for line_number, line in enumerate(metrics_file, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                log.warning("%s:%d: skipped, not JSON (%s)", path, line_number, error)
                continue
            if not isinstance(record, dict):
                log.warning("%s:%d: skipped, not a JSON object", path, line_number)
                continue
            # Older files hold bare NaN / Infinity (Python's json reads them): read as written now.
            records.append(strict_record(record))
    if required and not records:
        raise ValueError(f"{path} holds no metric records")
    return records


def truncate_metrics(run_dir: Path, *, last_step: int) -> int:
    """Remove the records of steps after `last_step` (a run resuming from that step's checkpoint
    trains them again); returns how many records were removed. Written to a new file and renamed,
    so a crash midway never loses the records kept."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return 0
    kept, removed = [], 0
    for line in path.read_text().splitlines():
        try:
            step = json.loads(line).get("step", 0)
        except (json.JSONDecodeError, AttributeError):
            removed += bool(line.strip())  # a line cut short by the crash that stopped the run
            continue
        if isinstance(step, int) and step > last_step:
            removed += 1
        else:
            kept.append(line)
    if removed:
        partial = path.with_name(path.name + ".partial")
        partial.write_text("".join(line + "\n" for line in kept))
        partial.replace(path)
    return removed


class LineFollower:
    """Reads the whole lines appended to a file since the last call, without reading the file
    again each time (a launcher polls for hours). A file that shrank (a resumed learner removed
    the records after its checkpoint) is followed from its new end."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._offset = self.path.stat().st_size if self.path.is_file() else 0

    def new_lines(self) -> list[str]:
        try:
            with self.path.open("rb") as file:
                size = file.seek(0, 2)
                if size < self._offset:
                    self._offset = size
                file.seek(self._offset)
                chunk = file.read(size - self._offset)
        except FileNotFoundError:
            return []
        # Only whole lines: one being written right now is read next time.
        complete = chunk[: chunk.rfind(b"\n") + 1]
        self._offset += len(complete)
        return complete.decode("utf-8", errors="replace").splitlines()


class MetricsFollower(LineFollower):
    """The records appended to a run's metrics.jsonl since the last call."""

    def __init__(self, run_dir: Path) -> None:
        super().__init__(Path(run_dir) / "metrics.jsonl")

    def new_records(self) -> list[dict]:
        records = []
        for line in self.new_lines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return records
