"""A learner of two ranks in real processes: started by the launcher, or by plain torchrun.

Scripted actors on the codebook env (as in test_system.py) feed a tiny model trained by two gloo
ranks. A killed rank brings the whole learner back from its latest checkpoint, and a stop signal
then still writes the final checkpoint, which needs every rank; torchrun can start the ranks itself.

One actor process in each run instead of test_system.py's two: the learner's ranks are under test
here, and each process fewer is one fewer import of torch (several seconds of CPU) on the suite's
busy cores. One scripted actor plays the two groups a step needs (actor.concurrent_groups = 2).
"""

import json
import os
import signal
import subprocess
import sys

import pytest

from longhorizon.common.config import dump_toml, load_config
from longhorizon.common.metrics import read_metrics
from longhorizon.launch.launchers.supervise import with_ports
from tests.test_system import REPO_ROOT, _all_pids, _alive, _overrides, _start, _wait_for_step, _wait_until, byte_model  # noqa: F401

pytestmark = pytest.mark.slow

ONE_ACTOR = "actor.num_actors=1"


def test_a_killed_rank_restarts_the_whole_learner_and_sigterm_then_writes_the_final_checkpoint(tmp_path, byte_model):
    """One run for two stories. Rank 1 killed after step 5: both ranks start again from the
    checkpoint of step 4. Then SIGTERM to the launcher: the restarted learner ends its step and
    writes the final checkpoint, which needs every rank, and nothing is left running. (Each story
    had a run of its own, the learner's two ranks and two actors started for each.)"""
    run_dir = tmp_path / "rank-restart"
    process = _start(_overrides(tmp_path, byte_model, "rank-restart", 1000, ["learner.num_ranks=2", ONE_ACTOR]))
    learner_log = run_dir / "logs" / "learner.log"
    try:
        _wait_for_step(run_dir, 5, process)  # the checkpoint of step 4 is written
        first_pids = _all_pids(run_dir)
        assert set(first_pids) == {"learner", "learner-rank1", "actor-0"}
        os.kill(first_pids["learner-rank1"], signal.SIGKILL)
        # The resumed learner drops the records past its checkpoint before it says so: a step
        # past 5 from here on is the restarted ranks'.
        _wait_until(lambda: "resumed from" in learner_log.read_text(), process, "resumed", timeout=120)
        _wait_for_step(run_dir, 6, process)
        final_pids = _all_pids(run_dir)
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 128 + signal.SIGTERM, output
    assert "restarting it from its latest checkpoint" in output
    records = read_metrics(run_dir)
    last_step = records[-1]["step"]
    assert [r["step"] for r in records] == list(range(1, last_step + 1)) and last_step >= 6
    assert "resumed from" in learner_log.read_text() and "step_000004" in learner_log.read_text()
    assert final_pids["learner"] != first_pids["learner"]  # both ranks were started again
    assert final_pids["learner-rank1"] != first_pids["learner-rank1"]
    assert json.loads((run_dir / "processes.json").read_text())["learner"]["restarts"] == 1
    checkpoint = run_dir / "checkpoints" / f"step_{last_step:06d}"
    assert (checkpoint / "state.pt").is_file() and (checkpoint / "sharded" / ".metadata").is_file()
    assert not (run_dir / ".ranks-store").exists()
    for pid in {*first_pids.values(), *final_pids.values()}:
        assert not _alive(pid), f"process {pid} left behind"


def test_the_learner_runs_under_plain_torchrun(tmp_path, byte_model):
    """The user brings the launcher: torchrun starts the two ranks, the actors are started by
    hand, all from one config file with fixed ports. (torchrun's own rendezvous store listens on
    every address of the machine, a limit of torch; everything here connects through 127.0.0.1.)"""
    config = with_ports(load_config(
        REPO_ROOT / "configs" / "codebook.toml",
        _overrides(tmp_path, byte_model, "torchrun", 4, ["learner.num_ranks=2", ONE_ACTOR]),
    ))
    run_dir = config.run_dir
    run_dir.mkdir(parents=True)
    config_file = run_dir / "config.toml"
    config_file.write_text(dump_toml(config))
    from longhorizon.launch.launchers.supervise import free_port

    # On loopback every process of the run presents the same secret, as `longhorizon train` sets.
    from longhorizon.common.auth import RUN_SECRET_VARIABLE, RunSecret

    environment = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", RUN_SECRET_VARIABLE: RunSecret.make().value}
    learner = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2",
         "--master-addr=127.0.0.1", f"--master-port={free_port()}",
         "-m", "longhorizon.launch.worker", "learner", "--config", str(config_file)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO_ROOT, env=environment,
    )
    actors = [
        subprocess.Popen(
            [sys.executable, "-m", "longhorizon.launch.worker", "actor", "--config", str(config_file), "--index", str(i)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO_ROOT, env=environment,
        )
        for i in range(config.actor.num_actors)
    ]
    try:
        output, _ = learner.communicate(timeout=240)
        actor_codes = [actor.wait(timeout=60) for actor in actors]
    finally:
        for process in (learner, *actors):
            if process.poll() is None:
                process.kill()
                process.wait()
    assert learner.returncode == 0, output
    assert actor_codes == [0]  # stopped by the learner at the end
    assert "rank 1 of 2 joined" in output
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert (run_dir / "checkpoints" / "step_000004" / "sharded").is_dir()
