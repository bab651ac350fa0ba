"""The command line and the launcher's checks: clear one-line errors before any process starts."""

import subprocess
import sys
from pathlib import Path

import pytest

from longhorizon.common.config import load_config
from longhorizon.launch.cli import main
from longhorizon.launch.checks import validate_config
from longhorizon.launch.launchers.supervise import format_progress


@pytest.mark.parametrize(
    "override, message",
    [
        ("env.name=nope", "unknown env 'nope'"),
        ("env.options.foo=1", "unknown option 'foo'"),
        ("env.options.num_turns=0", "env 'codebook': env.options.num_turns must be >= 1, got 0"),
        ("env.options.held_out_sequences=1", "env 'codebook': env.options.held_out_sequences: expected bool, got 1"),
        ("learner.loss=ppo", "learner.algorithm_options.loss must be one of decoupled_ppo, truncated_is, none, got 'ppo'"),
        ("horizon.stages=[3, 2]", "strictly increasing"),
        ("actor.engine=nonexistent", "unknown engine 'nonexistent'"),
        ("actor.group_size=1", "group_size"),
        ("run.mode=fast", "run.mode"),
        ("learner.warmup_steps=-1", "learner.warmup_steps must be >= 0"),
        ("learner.entropy_coef=-0.01", "learner.entropy_coef must be >= 0"),
        ("learner.max_abs_reward=0", r"learner.max_abs_reward must be in \(0, 1e12\]"),
        ("learner.max_nonfinite_steps=0", "learner.max_nonfinite_steps must be >= 1"),
        ("run.target_success=1.5", r"run.target_success must be in \[0, 1\]"),
        ("run.target_window=0", "run.target_window must be >= 1"),
        ("learner.gradient_checkpointing=sometimes", 'learner.gradient_checkpointing must be true, false or "auto"'),
        ("actor.engine_options.devise='cpu'", "unknown config key actor.engine_options.devise .*valid keys: device"),
    ],
)
def test_validate_config_names_the_problem(override, message):
    with pytest.raises(ValueError, match=message):
        validate_config(load_config(None, ["env.name=codebook", override]))


def test_cli_reports_errors_in_one_line(capsys):
    config = Path(__file__).resolve().parent.parent / "configs" / "codebook.toml"
    assert main(["train", str(config), "learner.learnin_rate=1"]) == 2
    error = capsys.readouterr().err
    assert error.startswith("longhorizon: error: unknown config key learner.learnin_rate")
    assert "Traceback" not in error


COLLECTIVE = "learner.weights_transport='collective'"


@pytest.mark.parametrize(
    "overrides, message",
    [
        ([COLLECTIVE, "learner.weights_options.bucket_mb=0"], "learner.weights_options.bucket_mb must be >= 1, got 0"),
        ([COLLECTIVE, "learner.weights_bucket_mb=0"], "learner.weights_options.bucket_mb must be >= 1, got 0"),
        ([COLLECTIVE, "learner.weights_options.timeout_s=0"], "learner.weights_options.timeout_s must be > 0, got 0"),
        ([COLLECTIVE, "learner.weights_options.backend='mpi'"],
         "learner.weights_options.backend must be one of auto, gloo, nccl, got 'mpi'"),
        ([COLLECTIVE, "learner.weights_options.bucket=64"],
         "unknown config key learner.weights_options.bucket in [learner.weights_options]; valid keys: backend, "
         "bucket_mb, timeout_s"),
        ([COLLECTIVE, "learner.weights_bucket_mb=64", "learner.weights_options.bucket_mb=32"],
         "learner.weights_bucket_mb and learner.weights_options.bucket_mb are both set: keep one"),
        (["learner.weights_transport='path'", "learner.weights_options.bucket_mb=64"],
         "learner.weights_options sets bucket_mb (read by collective), but learner.weights_transport = 'path' "
         "declares no options of its own: remove them"),
    ],
)
def test_cli_refuses_a_weights_transports_bad_options_in_one_line(tmp_path, capsys, overrides, message):
    """A transport's options are checked before any process starts, with the config's one-line
    errors; the collective's older spelling too, and a transport without options takes none."""
    config = Path(__file__).resolve().parent.parent / "configs" / "codebook.toml"
    assert main(["train", str(config), f"run.output_dir={str(tmp_path)!r}", *overrides]) == 2
    assert capsys.readouterr().err == f"longhorizon: error: {message}\n"
    assert not any(tmp_path.iterdir())  # nothing was started


def test_help_is_fast_and_imports_nothing_heavy():
    probe = (
        "import sys; from longhorizon.launch.cli import build_parser; build_parser();"
        "heavy = [m for m in ('torch', 'transformers', 'zmq', 'matplotlib') if m in sys.modules];"
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", probe], check=True)


def test_progress_line():
    line = format_progress(
        {"step": 3, "reward_mean": 0.5, "success_rate": 0.25, "horizon_cap": 4, "horizon_stage": 1,
         "staleness_mean": 1.5, "episodes_per_s": 2.0, "tokens_per_s": 100.0, "groups_used": 2,
         "groups_skipped_zero_variance": 1},
        10,
    )
    assert "step    3/10" in line and "success 25.0%" in line and "horizon 4 (stage 1)" in line


def test_a_fresh_run_moves_an_earlier_one_aside(tmp_path):
    from longhorizon.launch.launchers.supervise import prepare_run_dir

    config = load_config(None, [f"run.output_dir={str(tmp_path)!r}", "run.name='x'"])
    first = prepare_run_dir(config, progress=lambda line: None)
    (first / "metrics.jsonl").write_text('{"step": 1}\n')
    messages = []
    second = prepare_run_dir(config, progress=messages.append)
    assert second == first and not (second / "metrics.jsonl").exists()
    assert len(list(tmp_path.glob("x.*"))) == 1 and "moved it" in messages[0]
    (second / "metrics.jsonl").write_text('{"step": 1}\n')
    resumed = load_config(None, [f"run.output_dir={str(tmp_path)!r}", "run.name='x'", "run.resume=true"])
    assert (prepare_run_dir(resumed) / "metrics.jsonl").exists()


def test_the_learners_warnings_reach_the_terminal_as_one_line_each():
    from longhorizon.launch.launchers.supervise import learner_warnings

    lines = [
        "2026-12-02 13:00:00,001 learner INFO longhorizon.learner.worker: step 3 trained",
        "2026-12-02 13:01:00,002 learner WARNING longhorizon.learner.worker: waiting 60s for groups: 0/2 ready",
        "2026-12-02 13:02:00,003 learner ERROR longhorizon.launch.worker: 3 non-finite steps in a row",
        "  a continuation line",
    ]
    assert learner_warnings(lines) == ["learner: waiting 60s for groups: 0/2 ready",
                                       "learner: 3 non-finite steps in a row"]


def test_a_failed_learner_is_named_by_the_exception_that_ended_it(tmp_path):
    from longhorizon.launch.launchers.supervise import last_error

    log = tmp_path / "learner.log"
    assert last_error(log) == ""
    log.write_text("2026 learner INFO x: started\nTraceback (most recent call last):\n  File \"a.py\", line 1\n"
                   "    raise OSError(28)\nOSError: [Errno 28] No space left on device\n")
    assert last_error(log) == "OSError: [Errno 28] No space left on device"
    # Inside trio's exception groups the innermost traceback names the cause.
    log.write_text(
        "  + Exception Group Traceback (most recent call last):\n"
        "  |   File \"w.py\", line 5, in main\n"
        "  | ExceptionGroup: Exceptions from Trio nursery (1 sub-exception)\n"
        "  +-+---------------- 1 ----------------\n"
        "    | Traceback (most recent call last):\n"
        "    |   File \"b.py\", line 2, in save\n"
        "    | PermissionError: [Errno 13] Permission denied: 'runs/x/checkpoints'\n"
        "    +------------------------------------\n")
    assert last_error(log) == "PermissionError: [Errno 13] Permission denied: 'runs/x/checkpoints'"
    # A rank of a learner with several ranks: torch.distributed prefixes what its excepthook writes.
    log.write_text(
        "2026 learner-rank1 INFO x: rank 1 of 2 joined\n"
        "[rank1]:   + Exception Group Traceback (most recent call last):\n"
        "[rank1]:   | ExceptionGroup: Exceptions from Trio nursery (1 sub-exception)\n"
        "[rank1]:   +-+---------------- 1 ----------------\n"
        "[rank1]:     | Traceback (most recent call last):\n"
        "[rank1]:     |   File \"c.py\", line 3, in barrier\n"
        "[rank1]:     | RuntimeError: Connection reset by peer\n"
        "[rank1]:     +------------------------------------\n")
    assert last_error(log) == "RuntimeError: Connection reset by peer"


def test_an_output_folder_that_cannot_be_written_is_one_line(tmp_path, capsys):
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    config = Path(__file__).resolve().parent.parent / "configs" / "codebook.toml"
    assert main(["train", str(config), f"run.output_dir={not_a_folder}"]) == 2
    # The last line (building the tiny model first may print progress before it).
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("longhorizon: error: [Errno 20] Not a directory") and "run.output_dir" in last


def test_a_run_refused_before_it_starts_leaves_no_folder(tmp_path, capsys):
    config = Path(__file__).resolve().parent.parent / "configs" / "codebook.toml"
    for refused in ("model.path=/no/such/model", "env.name=nope"):
        assert main(["train", str(config), f"run.output_dir={tmp_path / 'runs'}", refused]) == 2
        assert "longhorizon: error:" in capsys.readouterr().err
        assert not (tmp_path / "runs").exists()


def test_the_progress_line_shows_the_rate_over_the_last_steps_not_the_last_step_alone():
    from longhorizon.launch.launchers.supervise import Rates, ThroughputWindow

    window = ThroughputWindow(steps=2)
    assert window.add({"time": 10.0, "trajectories_received": 40, "generated_tokens_received": 400}) is None
    assert window.add({"time": 20.0, "trajectories_received": 80, "generated_tokens_received": 1200}) == (4.0, 80.0)
    # A step during which nothing arrived (it trained on groups already there) keeps the rates.
    assert window.add({"time": 30.0, "trajectories_received": 80, "generated_tokens_received": 1200}) == (2.0, 40.0)
    # (120-80)/(40-20) episodes and (2000-1200)/(40-20) tokens a second
    assert window.add({"time": 40.0, "trajectories_received": 120, "generated_tokens_received": 2000}) == (2.0, 40.0)
    assert window.add({"step": 1}) is None  # records from before the counter
    # Both figures are over the same window, not tokens over the step alone beside episodes over five.
    line = format_progress({"step": 5, "episodes_per_s": 0.0, "tokens_per_s": 3.0}, 10, Rates(2.5, 45.0))
    assert "  2.50 ep/s |    45.0 tok/s" in line
    # Records from before the learner counted tokens: the step's own figure.
    assert "  2.50 ep/s |     3.0 tok/s" in format_progress({"step": 5, "tokens_per_s": 3.0}, 10, Rates(2.5, None))
    old = ThroughputWindow()
    old.add({"time": 1.0, "trajectories_received": 4})
    assert old.add({"time": 2.0, "trajectories_received": 8}) == (4.0, None)


def test_a_restarted_learner_starts_the_rate_again_and_shows_none_for_its_first_step():
    """A learner restarted from its step-5 checkpoint resumes its clock (120 s) and counts (200)
    from there, and receives at once what the actors queued while it loaded: mixed with the
    records before the kill (up to 160 s and 300 episodes) the window would show 10/5 = 2 episodes
    a second from nothing the actors did."""
    from longhorizon.launch.launchers.supervise import ThroughputWindow

    window = ThroughputWindow()
    for time, count in ((100.0, 150), (120.0, 200), (140.0, 250), (160.0, 300)):
        window.add({"time": time, "trajectories_received": count})
    first = {"step": 6, "time": 125.0, "trajectories_received": 260, "episodes_per_s": 12.0, "learner_started": True}
    assert window.add(first) is None
    assert "     - ep/s |       - tok/s" in format_progress(first, 10, None)
    assert window.add({"step": 7, "time": 135.0, "trajectories_received": 280}) == (2.0, None)
    fresh = {"step": 1, "time": 5.0, "trajectories_received": 8, "episodes_per_s": 1.6, "learner_started": True}
    assert "     - ep/s" in format_progress(fresh, 10, ThroughputWindow().add(fresh))


def _raises_in_a_trio_task(exception: BaseException):
    """A command's main that, like eval, runs trio in this process and meets `exception` in a
    task: trio hands it on wrapped in an exception group."""
    import trio

    async def fail():
        raise exception

    async def run():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(fail)
            nursery.start_soon(trio.sleep_forever)

    def command_main(argv):
        trio.run(run)

    return command_main


def test_ctrl_c_in_a_trio_command_is_a_quiet_exit_130(monkeypatch, capsys):
    import longhorizon.launch.recipes.eval

    monkeypatch.setattr(longhorizon.launch.recipes.eval, "main", _raises_in_a_trio_task(KeyboardInterrupt()))
    assert main(["eval", "codebook"]) == 130
    captured = capsys.readouterr()
    assert captured.err == "longhorizon: interrupted\n" and "Traceback" not in captured.out


def test_a_user_error_inside_a_trio_command_is_one_line(monkeypatch, capsys):
    import longhorizon.launch.recipes.eval
    from longhorizon.common.config import ConfigError

    monkeypatch.setattr(longhorizon.launch.recipes.eval, "main", _raises_in_a_trio_task(ConfigError("env.name 'nope' is unknown")))
    assert main(["eval", "codebook"]) == 2
    assert capsys.readouterr().err == "longhorizon: error: env.name 'nope' is unknown\n"
    # Anything else keeps its traceback: it is the report.
    monkeypatch.setattr(longhorizon.launch.recipes.eval, "main", _raises_in_a_trio_task(RuntimeError("a bug")))
    with pytest.raises(BaseExceptionGroup):
        main(["eval", "codebook"])


def test_the_worker_under_torchrun_says_a_config_error_in_one_line(capsys):
    from longhorizon.launch.worker import main as worker_main

    with pytest.raises(SystemExit) as exit_status:
        worker_main(["learner", "--config", "runs/x/config.toml"])
    assert exit_status.value.code == 2
    error = capsys.readouterr().err
    assert error.startswith("longhorizon-worker: error: config file not found: runs/x/config.toml")
    assert "Traceback" not in error
    # It takes overrides as train does, checked as train checks them.
    config = Path(__file__).resolve().parent.parent / "configs" / "codebook.toml"
    with pytest.raises(SystemExit) as exit_status:
        worker_main(["learner", "--config", str(config), "learner.num_rankz=4"])
    assert exit_status.value.code == 2
    assert "unknown config key learner.num_rankz" in capsys.readouterr().err



LAUNCHED: list = []


def recording_launcher(config, *, progress=print) -> int:
    """A launcher from outside the package: it records what it was asked to run."""
    LAUNCHED.append(config.run.name)
    progress(f"launched {config.run.name}")
    return 7


def test_a_launcher_from_outside_the_package_runs_the_job(capsys):
    """run.launcher names a launcher by dotted path (or entry point, or registration) like every
    other part; the command returns its exit code."""
    from longhorizon.launch.launchers.supervise import LAUNCHERS, launch

    config = load_config(None, ["env.name=codebook", "run.name='plugged'",
                                "run.launcher='tests.test_launch:recording_launcher'"])
    lines: list[str] = []
    assert launch(config, progress=lines.append) == 7
    assert LAUNCHED == ["plugged"] and lines == ["launched plugged"]
    LAUNCHERS.register("recording", recording_launcher)
    try:
        assert launch(config.replace(run=config.run.replace(launcher="recording")), progress=lines.append) == 7
    finally:
        LAUNCHERS.unregister("recording")
    assert LAUNCHED == ["plugged", "plugged"]


def test_a_launcher_that_cannot_launch_is_a_config_error():
    from longhorizon.common.config import ConfigError
    from longhorizon.launch.launchers.supervise import launch

    with pytest.raises(ConfigError, match="run.launcher: launcher 'tests.test_launch:LAUNCHED' must be callable"):
        launch(load_config(None, ["env.name=codebook", "run.launcher='tests.test_launch:LAUNCHED'"]))


class _ScriptedRank:
    """A learner rank for the supervision loop: each start takes the next exit code from its
    script (None: still running), and a failure's traceback goes into its log as a rank writes it."""

    role = "learner"

    def __init__(self, index: int, codes: list, log: Path) -> None:
        self.index, self.codes, self.log = index, codes, log
        self.restarts, self.started_at, self.starts, self.code = 0, 0.0, 0, None

    @property
    def name(self) -> str:
        return "learner" if self.index == 0 else f"learner-rank{self.index}"

    def start(self, *, resume: bool = False) -> None:
        self.code = self.codes[self.starts]
        self.starts += 1
        if self.code not in (None, 0):
            with self.log.open("a") as log:
                log.write(f"[rank{self.index}]:     | Traceback (most recent call last):\n"
                          f"[rank{self.index}]:     | RuntimeError: lost rank 0 (start {self.starts})\n")

    def poll(self):
        return self.code

    def terminate(self) -> None:
        self.code = -15 if self.code is None else self.code

    kill = terminate

    def wait(self, timeout) -> bool:
        return True

    def give_up(self) -> None:
        pass

    def describe(self) -> dict:
        return {"restarts": self.restarts}


def test_a_failed_rank_is_named_with_the_error_in_its_own_log(tmp_path):
    """With several ranks the console names the rank that failed and the error from that rank's
    log (learner-rankN.log, its lines prefixed by torch.distributed), not learner.log's."""
    from longhorizon.launch.launchers.supervise import supervise

    config = load_config(None, ["run.total_steps=2"])
    (tmp_path / "logs").mkdir()
    ranks = [_ScriptedRank(0, [None, None], tmp_path / "logs" / "learner.log"),
             _ScriptedRank(1, [1, 1], tmp_path / "logs" / "learner-rank1.log")]
    lines: list[str] = []
    assert supervise(config, tmp_path, ranks, [], progress=lines.append, learner_restarts=1) == 1
    assert lines == [
        "the learner's rank 1 exited with code 1 (RuntimeError: lost rank 0 (start 1)); restarting it from its "
        "latest checkpoint (1/1)",
        "the learner's rank 1 failed with exit code 1: RuntimeError: lost rank 0 (start 2); "
        f"see {tmp_path / 'logs' / 'learner-rank1.log'}",
    ]
    assert [rank.starts for rank in ranks] == [2, 2]


def two_ranks_one_failing(config, *, progress=print) -> int:
    """A launcher from outside the package whose learner's rank 1 fails on every start."""
    from longhorizon.launch.launchers.supervise import prepare_run_dir, supervise

    run_dir = prepare_run_dir(config, progress=progress)
    ranks = [_ScriptedRank(0, [None, None], run_dir / "logs" / "learner.log"),
             _ScriptedRank(1, [1, 1], run_dir / "logs" / "learner-rank1.log")]
    return supervise(config, run_dir, ranks, [], progress=progress, learner_restarts=1)


def test_the_api_names_the_failed_rank_as_the_console_does(tmp_path):
    """`train()` raises with the failing rank and its error (from the run folder's failure.txt),
    not with learner.log's tail, which holds nothing here; a later run that ends well clears it."""
    import longhorizon as lh
    from longhorizon.launch.launchers.supervise import failure_of

    overrides = [f"run.output_dir={str(tmp_path)!r}", "run.name='two-ranks'",
                 "run.launcher='tests.test_launch:two_ranks_one_failing'"]
    lines: list[str] = []
    with pytest.raises(lh.RunFailed) as failed:
        lh.train("codebook", overrides, progress=lines.append)
    run_dir = tmp_path / "two-ranks"
    assert failed.value.exit_code == 1
    assert str(failed.value) == (
        f"training ended with exit code 1: {lines[-1]} (logs in {run_dir / 'logs'})")
    assert lines[-1].startswith("the learner's rank 1 failed with exit code 1: RuntimeError: lost rank 0 (start 2)")
    # Resumed, the run's learner finishes: the earlier failure is not reported as this run's.
    from longhorizon.launch.launchers.supervise import supervise

    config = lh.load_config("codebook", [*overrides, "run.resume=true"])
    ranks = [_ScriptedRank(0, [0], run_dir / "logs" / "learner.log")]
    assert failure_of(run_dir) is not None
    assert supervise(config, run_dir, ranks, [], progress=lines.append) == 0
    assert failure_of(run_dir) is None
