"""The launcher and the processes it supervises: restart, Ctrl-C, resume, and hostile input.

Real processes over loopback ZeroMQ. The actors use the scripted engine on the codebook env with
a simulated per-token latency (so a run lasts long enough to interfere with it); the learner
trains a tiny model whose vocabulary covers the byte tokens the scripted engine writes.

Two actor processes where the actors are part of the story (a killed learner they follow back, a
killed actor while the other keeps playing); one in the runs about the learner's versions, sync
mode and the horizon, which one actor playing both groups of a step (actor.concurrent_groups = 2)
exercises alike, for a process fewer (an import of torch: seconds of CPU) on the suite's cores.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import zmq

from longhorizon.common.config import load_config
from longhorizon.common.metrics import read_metrics
from longhorizon.common.models import build_tiny_model
from longhorizon.learner.checkpoint import latest_checkpoint

pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parent.parent
ONE_ACTOR = "actor.num_actors=1"


@pytest.fixture(scope="module")
def byte_model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-bytes", words=[f"w{i}" for i in range(260)])


def _overrides(tmp_path, byte_model, name, steps, extra=()):
    return [
        f"run.output_dir={str(tmp_path)!r}", f"run.name={name!r}", f"run.total_steps={steps}",
        f"model.path={str(byte_model)!r}", "env.name='codebook'", "actor.engine='scripted'",
        "actor.scripted_policy='random'", "actor.simulated_token_latency_s=0.02", "actor.num_actors=2",
        "actor.group_size=4", "actor.concurrent_groups=2", "actor.heartbeat_s=0.5", "learner.groups_per_step=2",
        "learner.learning_rate=1e-3", "learner.checkpoint_every=4", "learner.max_staleness=4",
        "horizon.schedule='stepwise'", "horizon.stages=[2, 3, 4]", "horizon.stage_steps=3", *extra,
    ]


class _Launcher(subprocess.Popen):
    """`longhorizon train` as a child whose output is read as it comes. Left unread, the pipe fills
    after a few hundred progress lines (64 KiB) and the launcher blocks on its next line: it then
    supervises nothing, and a test waiting for a restart waits in vain."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._lines: list[str] = []
        self._reader = threading.Thread(target=lambda: self._lines.extend(self.stdout), daemon=True)
        self._reader.start()

    def output(self) -> str:
        return "".join(self._lines)

    def communicate(self, input=None, timeout=None):
        self.wait(timeout)
        self._reader.join(timeout=30)
        return self.output(), None


def _start(overrides, **popen_options):
    return _Launcher(
        [sys.executable, "-m", "longhorizon.launch.cli", "train", str(REPO_ROOT / "configs" / "codebook.toml"),
         *overrides, "--no-plots"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO_ROOT, **popen_options,
    )


def _ignore_interrupts():
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _wait_for_step(run_dir, step, process, timeout=90, key="step"):
    """Wait for a metrics record whose `key` (the step, or the version) reaches `step`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        records = read_metrics(run_dir)
        if records and records[-1][key] >= step:
            return records
        assert process.poll() is None, process.output()
        time.sleep(0.2)
    raise AssertionError(f"no {key} {step} within {timeout}s")


def _wait_until(condition, process, what, timeout=90):
    """Wait for `condition()`, failing if the launcher exits first or `timeout` passes."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert process.poll() is None, process.output()
        assert time.monotonic() < deadline, f"not {what} within {timeout}s"
        time.sleep(0.2)


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes.
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def _scratch_folders(run_dir) -> dict[str, Path]:
    """The scratch folder (TMPDIR) the launcher gave each process now running, by name."""
    return {name: Path(entry["scratch"]) for name, entry in json.loads((run_dir / "processes.json").read_text()).items()}


def _all_pids(run_dir):
    return {name: entry["pid"] for name, entry in json.loads((run_dir / "processes.json").read_text()).items()}


def versions_after_each_step(records) -> list[int]:
    """The version each async-mode record should carry: one more than the last whenever the step
    trained on any group, the same when every group was flat (the weights did not change)."""
    versions, version = [], 0
    for record in records:
        version += record["groups_used"] > 0
        versions.append(version)
    return versions


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_step_without_signal_makes_a_version_only_in_sync_mode(tmp_path, byte_model, mode):
    """The oracle wins every episode, so every group is flat and no step changes the weights. In
    async mode the version stays 0: nothing goes stale (max_staleness is 4, so the old rule, a
    version per step, shows staleness 1-4 here) and no weights are rebuilt or sent; the new stage
    still reaches the actors. Sync-mode actors play one batch per version, so there each step
    makes one."""
    process = _start(_overrides(tmp_path, byte_model, mode, 7, ["actor.scripted_policy='oracle'", f"run.mode={mode!r}",
                                                         ONE_ACTOR]))
    output, _ = process.communicate(timeout=180)
    assert process.returncode == 0, output
    records = read_metrics(tmp_path / mode)
    assert all(r["groups_used"] == 0 for r in records)
    assert [r["version"] for r in records] == ([0] * 7 if mode == "async" else list(range(1, 8)))
    assert all(r["staleness_max"] == 0 and r["groups_dropped_stale"] == 0 for r in records)
    # Stages of 3 steps: the cap rises after steps 3 and 6. The groups of the last step began
    # after the first rise (at most 2 were in flight then: the one actor's), so they played all 3 turns.
    assert [r["horizon_cap"] for r in records] == [2, 2, 3, 3, 3, 4, 4]
    assert records[-1]["episode_turns_mean"] == 3
    # By outcome: cut at 2 turns, the first step's groups all failed; the last step's all won.
    assert records[0]["groups_none_succeeded"] == records[0]["groups_skipped_zero_variance"] > 0
    assert records[-1]["groups_all_succeeded"] == records[-1]["groups_skipped_zero_variance"] > 0
    assert all(r["invalid_action_rate"] == 0 for r in records)
    # The train command ends with the run's report.
    assert "steps 7 (last 7)" in output and "of the groups were flat" in output


def test_sync_mode_trains_only_on_the_current_version(tmp_path, byte_model):
    """Also: weights sent by the path transport (a folder per version under the run) are removed
    once the run has ended: nothing reads them then, and a 135M model's are 514 MB each."""
    process = _start(_overrides(tmp_path, byte_model, "sync", 6,
                                ["run.mode='sync'", "learner.weights_transport='path'", ONE_ACTOR]))
    output, _ = process.communicate(timeout=180)
    assert process.returncode == 0, output
    records = read_metrics(tmp_path / "sync")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert all(r["staleness_max"] == 0 for r in records)
    assert all(r["groups_dropped_stale"] == 0 for r in records)
    assert any(r["weights_bytes"] > 0 for r in records)  # versions went out as folders
    assert not (tmp_path / "sync" / "weights").exists()


def test_a_killed_learner_is_restarted_and_actors_follow_it_back_then_ctrl_c_stops_every_process(tmp_path, byte_model):
    """Killed after a checkpoint that held trajectories (groups still filling), and two versions
    past it, the learner restarts from that checkpoint: what it held is counted lost, the steps
    after it are trained again and recorded once, and the actors, two versions ahead, must follow
    it back or every trajectory they send would be refused as made by the future. Then, in the
    same run (a run costs its processes' start-up), Ctrl-C: started as a script's background job
    is (SIGINT inherited as ignored, which Python keeps), the launcher must still stop on SIGINT,
    and stop every process, however many signals follow the first."""
    run_dir = tmp_path / "learner-restart"
    process = _start(_overrides(tmp_path, byte_model, "learner-restart", 1000, ["learner.checkpoint_every=4"]),
                     preexec_fn=_ignore_interrupts)
    held_at_checkpoint = {}

    def past_a_checkpoint_that_held_trajectories() -> bool:
        checkpoint, records = latest_checkpoint(run_dir), read_metrics(run_dir)
        if checkpoint is None or not records:
            return False
        saved = records[int(checkpoint.name.removeprefix("step_")) - 1]
        # Two versions on, and not within a step of the next checkpoint (every 4 steps), so the
        # kill cannot meet one being written.
        if saved["trajectories_held"] > 0 and records[-1]["version"] >= saved["version"] + 2 \
                and records[-1]["step"] < saved["step"] + 3:
            held_at_checkpoint.update(saved)
            return True
        return False

    try:
        _wait_until(past_a_checkpoint_that_held_trajectories, process, "two versions past a checkpoint holding "
                    "trajectories", timeout=300)
        first_pids = _all_pids(run_dir)
        killed_at_step = read_metrics(run_dir)[-1]["step"]
        # Something of the learner's in its temporary folder, which a SIGKILL leaves behind.
        killed_scratch = _scratch_folders(run_dir)["learner"]
        (killed_scratch / "leftover").mkdir()
        os.kill(first_pids["learner"], signal.SIGKILL)
        # The restarted learner trains past the steps it lost (at least 16 steps in all; the kill
        # comes when the run allows it, which has been anywhere from step 10 to step 350).
        _wait_until(lambda: _all_pids(run_dir)["learner"] != first_pids["learner"], process, "restarted")
        assert not killed_scratch.exists()  # deleted by the launcher before the restart
        _wait_for_step(run_dir, max(16, killed_at_step + 2), process)
        pids = {*first_pids.values(), *_all_pids(run_dir).values()}
        scratch_folders = list(_scratch_folders(run_dir).values())
        assert all(folder.is_dir() for folder in scratch_folders) and killed_scratch not in scratch_folders
        process.send_signal(signal.SIGINT)
        # Impatient: a second Ctrl-C, and a SIGTERM as an experiment sends after the terminal's
        # SIGINT; neither may cut the orderly stop short.
        time.sleep(0.5)
        process.send_signal(signal.SIGINT)
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 130, output
    assert "Traceback" not in output
    assert "restarting it from its latest checkpoint" in output
    # The user is told where the checkpoint written on the way out is, and how to go on from it.
    assert f"stopped; the latest checkpoint is {run_dir / 'checkpoints'}/step_" in output
    records = read_metrics(run_dir)
    # Steps after the checkpoint were trained again and recorded once.
    assert [r["step"] for r in records] == list(range(1, records[-1]["step"] + 1)) and len(records) >= 16
    assert [r["version"] for r in records] == versions_after_each_step(records)
    # Every trajectory accepted is accounted for across the restart: what the killed learner held
    # at its checkpoint counts as lost on restart (at least what its step's record held; more may
    # have arrived while the checkpoint was written).
    last = records[-1]
    assert last["trajectories_lost_on_restart"] >= held_at_checkpoint["trajectories_held"] > 0, last
    assert last["trajectories_accepted"] == (
        last["trajectories_trained"] + last["trajectories_dropped_with_group"] + last["trajectories_held"]
        + last["trajectories_lost_on_restart"]
    ), last
    # The actors were ahead of the restarted learner and went back to its version.
    assert "went back" in "".join((run_dir / "logs" / f"actor-{i}.log").read_text() for i in range(2))
    table = json.loads((run_dir / "processes.json").read_text())
    assert table["learner"]["restarts"] == 1
    for pid in pids:
        assert not _alive(pid), f"process {pid} left behind"
    assert not [folder for folder in scratch_folders if folder.exists()]


def test_a_killed_actor_is_restarted_then_sigterm_checkpoints_the_last_step_and_stops_every_process(tmp_path, byte_model):
    """One run for two stories (each run costs its processes' start-up): an actor SIGKILLed
    midway, with hostile input on the learner's trajectory socket from a process without the
    run's secret, is restarted while the learner keeps training; then SIGTERM to the launcher
    writes a checkpoint of the last step and stops every process, the restarted actor included."""
    run_dir = tmp_path / "terminate"
    process = _start(_overrides(tmp_path, byte_model, "terminate", 1000, ["learner.checkpoint_every=1000"]))
    try:
        _wait_for_step(run_dir, 3, process)
        first_pids = _all_pids(run_dir)
        os.kill(first_pids["actor-0"], signal.SIGKILL)
        config = load_config(run_dir / "config.toml")
        # Closed whatever happens: a context left for the garbage collector is terminated there,
        # in whichever later test that falls.
        context = zmq.Context()
        try:
            push = context.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 0)
            push.connect(f"tcp://127.0.0.1:{config.transport.trajectory_port}")
            for garbage in ([b"\x00garbage"], [b"\x81\xa4type\xa5bogus"], [os.urandom(1000), b"x"]):
                push.send_multipart(garbage)
            _wait_until(lambda: _all_pids(run_dir)["actor-0"] != first_pids["actor-0"], process, "restarted")
            restarted_at = read_metrics(run_dir)[-1]["step"]
            # The learner keeps going: more steps, and the stranger refused (its garbage never
            # reaches the decoder) and counted, not fatal.
            _wait_for_step(run_dir, restarted_at + 3, process)
            _wait_until(lambda: read_metrics(run_dir)[-1]["auth_refused"] >= 1, process, "the stranger refused")
        finally:
            context.destroy(linger=0)
        pids = {*first_pids.values(), *_all_pids(run_dir).values()}
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 128 + signal.SIGTERM, output
    assert "actor-0 exited with code -9; restarting" in output
    records = read_metrics(run_dir)
    last_step = records[-1]["step"]
    assert [r["step"] for r in records] == list(range(1, last_step + 1)) and last_step >= restarted_at + 3
    assert json.loads((run_dir / "processes.json").read_text())["actor-0"]["restarts"] >= 1
    assert (run_dir / "checkpoints" / f"step_{last_step:06d}" / "state.pt").is_file()
    for pid in pids:
        assert not _alive(pid), f"process {pid} left behind"


def test_the_adaptive_horizon_moves_through_its_stages_and_resumes_in_the_same_stage(tmp_path, byte_model):
    """min_gain = 1 makes every stage end as soon as it may (min_stage_steps = 4): the decision
    rule itself is tested in test_curriculum.py; here the moves must reach the actors' records,
    the metrics and a resumed run (stage and window restored from the checkpoint). The resumed
    run also continues the step and the version where the first one stopped: this is the resume
    test (a stepwise cap is a pure function of the step; the adaptive stage and window must come
    from the checkpoint, the stronger check)."""
    adaptive = ["horizon.schedule='adaptive'", "horizon.stages=[1, 2, 3]", "horizon.window=2",
                "horizon.min_stage_steps=4", "horizon.min_gain=1.0", "learner.checkpoint_every=3",
                "run.save_episodes=true", "learner.max_staleness=1", ONE_ACTOR]
    # max_staleness = 1: the last steps cannot all train on a backlog played under the last
    # stage's cap (groups are taken oldest first), so episodes at cap 3 are trained on for sure.
    expected_caps = [1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 3]

    first = _start(_overrides(tmp_path, byte_model, "adaptive", 6, adaptive))
    output, _ = first.communicate(timeout=180)
    assert first.returncode == 0, output
    assert [r["step"] for r in read_metrics(tmp_path / "adaptive")] == [1, 2, 3, 4, 5, 6]
    second = _start(_overrides(tmp_path, byte_model, "adaptive", 12, [*adaptive, "run.resume=true"]))
    output, _ = second.communicate(timeout=180)
    assert second.returncode == 0, output
    assert f"resuming from {tmp_path / 'adaptive' / 'checkpoints' / 'step_000006'}" in output

    run_dir = tmp_path / "adaptive"
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, 13))
    assert [r["version"] for r in records] == versions_after_each_step(records)
    assert "resumed from" in (run_dir / "logs" / "learner.log").read_text()
    assert [r["horizon_cap"] for r in records] == expected_caps
    decisions = {r["step"]: r["horizon_decision"] for r in records if "horizon_decision" in r}
    assert sorted(decisions) == [4, 8]
    assert decisions[8].startswith("step 8: ")  # the stay counted from step 4, across the resume
    # The actors played under each cap: 3-turn episodes are all cut at cap 1, none at cap 3. Judged
    # per episode (the episode files hold the cap each was played under): a step may train on
    # groups played under the last stage's cap for as long as they are within max_staleness.
    played = [json.loads(line) for path in sorted((run_dir / "episodes").glob("episodes-*.jsonl"))
              for line in path.read_text().splitlines()]
    truncated_by_cap = {}
    for episode in played:
        truncated_by_cap.setdefault(episode["metadata"]["horizon_cap"], set()).add(episode["truncated"])
    assert truncated_by_cap == {1: {True}, 2: {True}, 3: {False}}
    assert records[0]["truncated_rate"] == 1.0
    assert [r["cut_by_cap_rate"] for r in records] == [r["truncated_rate"] for r in records]  # the cap's cuts only
