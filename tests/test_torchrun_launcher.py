"""The torchrun launcher (`run.launcher = "torchrun"`): a short run whose two learner ranks torchrun
starts, and the [torchrun] settings that make no sense refused in one line before anything starts."""

import json
from pathlib import Path

import pytest

from longhorizon.common.config import ConfigError, load_config
from longhorizon.common.metrics import read_metrics
from longhorizon.launch.launchers.supervise import launch

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_torchrun_starts_two_ranks_that_train_and_write_the_final_checkpoint(tmp_path, tiny_codebook_model):
    config = load_config(REPO_ROOT / "configs" / "codebook.toml", [
        f"run.output_dir={str(tmp_path)!r}", "run.name='torchrun'", f"model.path={str(tiny_codebook_model)!r}",
        "run.launcher='torchrun'", "learner.num_ranks=2", "run.total_steps=2", "actor.num_actors=1",
        "actor.group_size=4", "actor.concurrent_groups=2", "learner.groups_per_step=2",
    ])
    lines: list[str] = []
    assert launch(config, progress=lines.append) == 0, "\n".join(lines)
    run_dir = config.run_dir
    assert "starting torchrun with a learner of 2 rank(s) and 1 actor(s)" in "\n".join(lines)
    assert [record["step"] for record in read_metrics(run_dir)] == [1, 2]
    checkpoint = run_dir / "checkpoints" / "step_000002"
    assert (checkpoint / "state.pt").is_file() and (checkpoint / "sharded" / ".metadata").is_file()
    # torchrun's two ranks, not the local launcher's: one log holds both, written by ranks whose
    # environment torchrun made.
    log = (run_dir / "logs" / "learner.log").read_text()
    assert "rank 1 of 2 joined" in log and " learner-rank1 INFO " in log and " learner-rank0 INFO " in log
    assert not (run_dir / "logs" / "learner-rank1.log").exists()
    assert set(json.loads((run_dir / "processes.json").read_text())) == {"learner", "actor-0"}


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["torchrun.node_rank=1"], r"torchrun.node_rank = 1 but torchrun.num_nodes = 1: node ranks run from 0 to num_nodes - 1"),
        (["torchrun.rendezvous_endpoint='10.0.0.1:29500'"], r"torchrun.rendezvous_endpoint is for several nodes"),
        (["learner.num_ranks=3", "torchrun.num_nodes=2", "torchrun.rendezvous_endpoint='10.0.0.1:29500'"],
         r"learner.num_ranks = 3 does not split evenly over torchrun.num_nodes = 2"),
        (["learner.num_ranks=2", "torchrun.num_nodes=2"], r"torchrun.num_nodes = 2 needs torchrun.rendezvous_endpoint"),
        (["learner.num_ranks=2", "torchrun.num_nodes=2", "torchrun.rendezvous_endpoint='node0'"],
         r"torchrun.rendezvous_endpoint = 'node0' is not HOST:PORT"),
        (["learner.num_ranks=2", "torchrun.num_nodes=2", "torchrun.rendezvous_endpoint='127.0.0.1:29500'"],
         r"is a loopback address, which the other nodes cannot reach"),
    ],
)
def test_settings_that_make_no_sense_are_one_line_before_anything_starts(tmp_path, overrides, message):
    config = load_config(None, [f"run.output_dir={str(tmp_path / 'runs')!r}", "env.name=codebook",
                                "run.launcher='torchrun'", *overrides])
    with pytest.raises(ConfigError, match=message) as refused:
        launch(config)
    assert "\n" not in str(refused.value)
    assert not (tmp_path / "runs").exists()
