"""A `train` run SIGKILLed, its launcher's process group or every process at once, then resumed
with `run.resume=true`: nothing of it is left running or on disk, and the resumed run's steps and
counters continue from its checkpoint as if it had stopped there."""

import os
import signal
import time
from pathlib import Path

import pytest

from longhorizon.common.metrics import read_metrics
from longhorizon.common.models import build_tiny_model
from longhorizon.learner.checkpoint import latest_checkpoint

from tests.test_system import (
    _alive,
    _all_pids,
    _overrides,
    _start,
    _scratch_folders,
    _wait_until,
    versions_after_each_step,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def byte_model(tmp_path_factory):
    """The tiny model of tests/test_system.py, whose runs these are."""
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-bytes", words=[f"w{i}" for i in range(260)])


def _descendants(root: int) -> set[int]:
    """Every process below `root`, read from /proc: the launcher's workers and their helpers."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except (FileNotFoundError, ProcessLookupError):
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = set(), {root}
    while frontier:
        children = {pid for pid, parent in parents.items() if parent in frontier} - found
        found |= children
        frontier = children
    return found


def _is_janitor(pid: int) -> bool:
    try:
        return b"--janitor" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return False


def _wait_past_a_checkpoint(run_dir, process, after_step=0) -> None:
    def past_a_checkpoint() -> bool:
        checkpoint, records = latest_checkpoint(run_dir), read_metrics(run_dir)
        # A step past a periodic checkpoint (every 4 steps), so a kill throws away trained work.
        return checkpoint is not None and bool(records) and records[-1]["step"] % 4 == 1 \
            and records[-1]["step"] > int(checkpoint.name.removeprefix("step_")) > after_step

    _wait_until(past_a_checkpoint, process, "a step past a checkpoint", timeout=300)


def _wait_for_nothing_left(pids, folders) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and ([pid for pid in pids if _alive(pid)]
                                           or [folder for folder in folders if folder.exists()]):
        time.sleep(0.2)
    assert not [pid for pid in pids if _alive(pid)], "processes left behind"
    assert not [folder for folder in folders if folder.exists()], "scratch folders left behind"


def _checkpoint_step(run_dir) -> int:
    return int(latest_checkpoint(run_dir).name.removeprefix("step_"))


def _assert_counters_close(records) -> None:
    last = records[-1]
    assert last["trajectories_accepted"] == (
        last["trajectories_trained"] + last["trajectories_dropped_with_group"] + last["trajectories_held"]
        + last["trajectories_lost_on_restart"]
    ), last


def test_a_run_killed_by_process_group_or_all_at_once_leaves_nothing_and_resumes_where_it_was(tmp_path, byte_model):
    """Two kills of one run. The launcher's process group (`kill -9 -PGID`, as a shell or a
    scheduler stops a job): the workers, in sessions of their own, learn of it from the kernel
    (their parent-death signal) and stop as on SIGTERM, the learner checkpointing its last step.
    Then every process at once (frozen first, so none sees another go: a lost node): the resumed
    run goes back to the periodic checkpoint and trains the lost steps again. Each time no process
    and no scratch folder is left (the folder janitors, in sessions of their own, delete the
    folders of processes killed without a chance to)."""
    run_dir = tmp_path / "killed"
    # Its own session, as a job under a scheduler: the group id is the launcher's pid.
    process = _start(_overrides(tmp_path, byte_model, "killed", 1000), start_new_session=True)
    try:
        _wait_past_a_checkpoint(run_dir, process)
        workers = _all_pids(run_dir)
        scratch_folders = list(_scratch_folders(run_dir).values())
        everything = _descendants(process.pid) | {process.pid}
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    _wait_for_nothing_left(everything, scratch_folders)
    records = read_metrics(run_dir)
    assert _checkpoint_step(run_dir) == records[-1]["step"]  # the learner's checkpoint on the way out
    assert "Traceback" not in (run_dir / "logs" / "learner.log").read_text()

    resumed = _start(_overrides(tmp_path, byte_model, "killed", 1000, ["run.resume=true"]), start_new_session=True)
    try:
        _wait_past_a_checkpoint(run_dir, resumed, after_step=records[-1]["step"])
        workers = _all_pids(run_dir)
        scratch_folders = list(_scratch_folders(run_dir).values())
        everything = _descendants(resumed.pid) | {resumed.pid}
        doomed = [pid for pid in everything if not _is_janitor(pid)]
        assert set(workers.values()) <= set(doomed)
        for pid in doomed:
            os.kill(pid, signal.SIGSTOP)
        for pid in doomed:
            os.kill(pid, signal.SIGKILL)
        resumed.wait(timeout=30)
    finally:
        if resumed.poll() is None:
            os.killpg(resumed.pid, signal.SIGKILL)
    _wait_for_nothing_left(everything, scratch_folders)
    checkpoint_step = _checkpoint_step(run_dir)
    killed_at = read_metrics(run_dir)[-1]["step"]
    assert killed_at > checkpoint_step  # trained steps the checkpoint does not hold

    total = killed_at + 2
    last_run = _start(_overrides(tmp_path, byte_model, "killed", total, ["run.resume=true"]), start_new_session=True)
    try:
        output, _ = last_run.communicate(timeout=300)
    finally:
        if last_run.poll() is None:
            os.killpg(last_run.pid, signal.SIGKILL)
    assert last_run.returncode == 0, output
    assert f"resuming from {run_dir / 'checkpoints' / f'step_{checkpoint_step:06d}'}" in output
    assert "Traceback" not in output
    records = read_metrics(run_dir)
    # The steps the kill threw away were trained again and recorded once.
    assert [r["step"] for r in records] == list(range(1, total + 1))
    assert [r["version"] for r in records] == versions_after_each_step(records)
    _assert_counters_close(records)
    # What the learner held at the checkpoint it resumed from was lost with it, and counted.
    assert records[-1]["trajectories_lost_on_restart"] >= records[checkpoint_step - 1]["trajectories_held"]
    assert not [pid for pid in _all_pids(run_dir).values() if _alive(pid)]
