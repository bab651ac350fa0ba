"""Metrics out: one JSON line per learner step (the record plots and progress read) and TensorBoard."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

log = logging.getLogger(__name__)


class MetricsWriter:
    def __init__(self, run_dir: Path, *, tensorboard: bool = True) -> None:
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

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(record, default=_jsonable) + "\n")
        if self._tensorboard is not None:
            step = int(record.get("step", 0))
            for key, value in record.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                    self._tensorboard.add_scalar(key, value, step)
            self._tensorboard.flush()

    def close(self) -> None:
        self._file.close()
        if self._tensorboard is not None:
            self._tensorboard.close()


def _jsonable(value):
    if hasattr(value, "item"):
        return value.item()
    return str(value)


def read_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if line:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line being written right now
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


class MetricsFollower:
    """Reads the records appended to a run's metrics.jsonl since the last call, without parsing
    the whole file each time (a launcher polls it for hours). A file that shrank (a resumed
    learner removed the records after its checkpoint) is followed from its new end."""

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
        self._offset = self.path.stat().st_size if self.path.is_file() else 0

    def new_records(self) -> list[dict]:
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
        records = []
        for line in complete.decode("utf-8", errors="replace").splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return records
