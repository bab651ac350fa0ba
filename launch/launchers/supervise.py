"""What every launcher shares: ports, the run directory, the progress line, and the supervision loop.

A launcher (launch/launchers/local.py on one machine, launch/launchers/torchrun.py with the
learner's ranks under torchrun, launch/launchers/ray.py on a Ray cluster) turns the config into
processes, each an object with the small interface `supervise` drives (`RoleProcess` below), and
hands them to `supervise`. The loop is the same everywhere: start every process, print one
progress line per learner step from `metrics.jsonl`, restart a dead actor, restart the whole
learner (all its ranks) from its latest checkpoint, stop everything in order on Ctrl-C or SIGTERM
(the learner writes a checkpoint of its last step first), and keep `processes.json` (who runs
where, how often restarted) up to date. What differs between launchers is how a process is
started and where its files land; a launcher that must fetch files from other machines passes
`collect`, which the loop calls before it reads the metrics.
"""

from __future__ import annotations
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections import deque
from pathlib import Path
from typing import Callable, NamedTuple, Protocol, Sequence

from longhorizon.common.config import Config, ConfigError, dump_toml
from longhorizon.common.metrics import LineFollower, MetricsFollower
from longhorizon.common.plugins import PluginError, Registry
from longhorizon.common.processes import remove_tied_folder, tied_folder


class Launcher(Protocol):
    """A launcher: runs a training job from its config (processes started, supervised and stopped)
    and returns the exit code. `progress` receives each line for the user (a step's progress)."""

    def __call__(self, config: Config, *, progress: Callable[[str], None] = print) -> int: ...


def _check_launcher_part(name: str, part: object) -> None:
    if not callable(part):
        raise TypeError(f"launcher {name!r} must be callable as launcher(config, progress=...) -> exit code")


LAUNCHERS: Registry[Launcher] = Registry(
    "launcher", "longhorizon.launchers",
    {"local": "longhorizon.launch.launchers.local:launch_local", "ray": "longhorizon.launch.launchers.ray:launch_ray",
     "torchrun": "longhorizon.launch.launchers.torchrun:launch_torchrun"},
    check=_check_launcher_part,
)
"""`run.launcher` names one: the built-ins, one registered in this process, an installed package's
entry point in the `longhorizon.launchers` group, or a dotted path."""

_MAX_RESTARTS_PER_ACTOR = 20
MAX_LEARNER_RESTARTS = 3
_MIN_SECONDS_BETWEEN_STARTS = 2.0
EXIT_DO_NOT_RESTART = 3
"""A learner's exit code for a failure a restart from the checkpoint would only repeat (too many
non-finite updates in a row): the launcher stops the run instead of restarting it."""
# Actors stop within seconds; the learner may be writing its final checkpoint.
_ACTOR_STOP_GRACE_S = 10.0
_LEARNER_STOP_GRACE_S = 120.0
_POLL_INTERVAL_S = 0.5
FAILURE_FILE = "failure.txt"
"""The run folder's record of why the learner failed: the line the console printed last."""


class StopRequested(Exception):
    """The launcher got SIGTERM: stop the run as on Ctrl-C."""


class _StopOnSignal:
    """The launcher's SIGINT and SIGTERM handler: the first signal raises (KeyboardInterrupt or
    StopRequested) to begin the orderly stop; later ones are ignored, so that a second Ctrl-C, or
    the SIGTERM an experiment sends after the terminal's SIGINT reached the whole process group,
    cannot cut that stop short (workers orphaned, the final steps and the resume hint unsaid).
    The stop itself ends whatever happens: workers that outlive their grace are killed."""

    def __init__(self) -> None:
        self.stopping = False

    def __call__(self, signum, frame) -> None:
        if self.stopping:
            return
        self.stopping = True
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise StopRequested(f"signal {signum}")


class RoleProcess(Protocol):
    """One learner rank or one actor as the supervision loop sees it, wherever it runs."""

    role: str  # "learner" or "actor"
    index: int  # the rank, or the actor's index
    restarts: int
    started_at: float  # time.monotonic() of the last start

    @property
    def name(self) -> str: ...

    def start(self, *, resume: bool = False) -> None: ...

    def poll(self) -> int | None:
        """None while running (or never started, or given up); else the exit code."""

    def terminate(self) -> None:
        """SIGTERM: an actor stops, the learner checkpoints its last step and stops."""

    def kill(self) -> None: ...

    def wait(self, timeout: float | None) -> bool:
        """True once the process has ended (or was never started)."""

    def give_up(self) -> None:
        """Stop restarting this process: it failed too often."""

    def describe(self) -> dict:
        """Its entry in processes.json: pid, restarts, and where it runs when that is not here."""


class SubprocessControl:
    """Stop and wait for the worker subprocess in `self.process` (None before it starts), and
    keep its scratch folder: shared by the local launcher's children and the Ray launcher's
    process hosts.

    Each start gets a new scratch folder as the worker's TMPDIR (`scratch_environment`), so what
    the worker and its helpers make with tempfile (an engine's weights, a local model server's
    files, a browser's profile) lands there. A worker killed with SIGKILL deletes nothing, so the
    parent deletes the folder once the worker has ended: when it starts the next one, and when it
    has waited for the last one to stop. The folder is a `tied_folder`: if the parent dies too (a
    Ray host killed with SIGKILL, a launcher killed), its janitor deletes it."""

    process: subprocess.Popen | None = None
    scratch_dir: Path | None = None

    def scratch_environment(self, name: str) -> dict[str, str]:
        """A new scratch folder for the worker about to start (the last one's deleted); the
        variables that make it the worker's temporary folder."""
        self.end_leftovers()
        self.remove_scratch()
        self.scratch_dir = Path(tied_folder(f"longhorizon-{name}-tmp-"))
        return {"TMPDIR": str(self.scratch_dir)}

    def end_leftovers(self) -> None:
        """SIGKILL what an ended worker left running in its process group.

        Workers start in sessions of their own, so the group holds the worker and whatever it
        started without a session of its own: vLLM's engine and model processes, which outlive
        an actor killed with SIGKILL (or by the kernel's OOM killer) with the model's memory and
        a shared-memory segment. Linux keeps a process group's id from being reused while the
        group has members, so the signal reaches only what the worker left."""
        process = self.process
        if process is None or process.returncode is None:
            return
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass  # nothing left

    def remove_scratch(self) -> None:
        """Delete the scratch folder of a worker that has ended."""
        folder, self.scratch_dir = self.scratch_dir, None
        if folder is None:
            return
        shutil.rmtree(folder, ignore_errors=True)
        # A helper of the dead worker may still be writing there for a moment (its watchdog's
        # grace period): what is left stays with the janitor, which deletes it when this
        # process ends.
        if not folder.exists():
            remove_tied_folder(folder)

    def terminate(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()

    def wait(self, timeout: float | None) -> bool:
        if self.process is not None:
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                return False
            self.end_leftovers()
        self.remove_scratch()
        return True


def process_name(role: str, index: int) -> str:
    """The name of a process in logs, progress lines and processes.json."""
    if role == "learner":
        return "learner" if index == 0 else f"learner-rank{index}"
    return f"actor-{index}"


def launcher_of(config: Config) -> Launcher:
    """The launcher `run.launcher` names; ConfigError (with the names there are) otherwise."""
    try:
        return LAUNCHERS.get(config.run.launcher)
    except (PluginError, TypeError) as error:
        raise ConfigError(f"run.launcher: {error}") from None


def launch(config: Config, *, progress=print) -> int:
    """Run a training job with the launcher `run.launcher` names; returns the exit code."""
    return launcher_of(config)(config, progress=progress)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def with_ports(config: Config) -> Config:
    """Fill unset (0) ports with free ones so actors and learner agree on addresses."""
    transport = config.transport
    ports = {
        name: getattr(transport, name) or free_port(transport.host)
        for name in ("trajectory_port", "broadcast_port", "control_port")
    }
    return config.replace(transport=transport.replace(**ports))


def fresh_run_dir(run_dir: Path, note: Callable[[str], None] = print,
                  markers: Sequence[str] = ("metrics.jsonl", "checkpoints")) -> Path:
    """`run_dir`, made and ready for a new run: when it holds one of `markers` (an earlier run's
    outputs), that run is moved aside under a time stamp, so the new run neither appends to its
    metrics nor resumes from its checkpoints, and nothing of it is lost."""
    if any((run_dir / marker).exists() for marker in markers):
        stamp = time.strftime("%Y%m%d-%H%M%S")
        kept = run_dir.with_name(f"{run_dir.name}.{stamp}")
        count = 1
        while kept.exists():  # runs within the same second
            count += 1
            kept = run_dir.with_name(f"{run_dir.name}.{stamp}-{count}")
        run_dir.rename(kept)
        note(f"an earlier run was in {run_dir}; moved it to {kept}")
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def prepare_run_dir(config: Config, *, progress=print) -> Path:
    """The run directory of a training run, with its logs folder and its config.toml written."""
    run_dir = config.run_dir
    if config.run.resume:
        from longhorizon.learner.checkpoint import latest_checkpoint

        run_dir.mkdir(parents=True, exist_ok=True)
        latest = latest_checkpoint(run_dir)
        progress(f"resuming from {latest}" if latest is not None else
                 f"run.resume=true, but {run_dir / 'checkpoints'} holds no checkpoint: starting from step 0")
    else:
        fresh_run_dir(run_dir, lambda line: progress(f"{line} (run.resume=true continues a run)"))
    (run_dir / "logs").mkdir(exist_ok=True)
    # Whole or absent: the workers, and anyone watching the run, read it while the launcher runs.
    partial = run_dir / "config.toml.partial"
    partial.write_text(dump_toml(config))
    os.replace(partial, run_dir / "config.toml")
    return run_dir


class Rates(NamedTuple):
    episodes_per_s: float
    tokens_per_s: float | None  # None for records from before the learner counted tokens


class ThroughputWindow:
    """Episodes and generated tokens per second over the last few steps' records, from the
    learner's running counts of what it received and its clock: a step trained on groups that
    arrived during the one before it shows the rate the actors keep, not 0."""

    def __init__(self, steps: int = 5) -> None:
        self._points: deque[tuple[float, float, float | None]] = deque(maxlen=steps + 1)

    def add(self, record: dict) -> Rates | None:
        """The rates up to `record`, or None while there is no earlier record to measure from. A
        learner process's first record (`learner_started`) starts the window again: a restarted
        learner's clock and counts continue from its checkpoint, not from the last record shown."""
        if "trajectories_received" not in record or "time" not in record:
            return None
        if record.get("learner_started"):
            self._points.clear()
        tokens = record.get("generated_tokens_received")
        self._points.append((float(record["time"]), float(record["trajectories_received"]),
                             None if tokens is None else float(tokens)))
        (first_time, first_count, first_tokens), (last_time, last_count, last_tokens) = self._points[0], self._points[-1]
        if last_time <= first_time or last_count < first_count:  # one point, or a resumed run's counters
            return None
        seconds = last_time - first_time
        tokens_per_s = (None if first_tokens is None or last_tokens is None or last_tokens < first_tokens
                        else (last_tokens - first_tokens) / seconds)
        return Rates((last_count - first_count) / seconds, tokens_per_s)


def format_progress(record: dict, total_steps: int, rates: Rates | None = None) -> str:
    """One line per step. `rates` (a `ThroughputWindow`'s) replace the step's own figures, which
    count only what arrived during that step."""
    episodes_per_s = record.get("episodes_per_s", 0.0) if rates is None else rates.episodes_per_s
    tokens_per_s = record.get("tokens_per_s", 0.0) if rates is None or rates.tokens_per_s is None else rates.tokens_per_s
    if rates is None and record.get("learner_started"):
        # The learner's first step counts what queued while it loaded: no rate to show yet.
        rate_text = "     - ep/s |       - tok/s"
    else:
        rate_text = f"{episodes_per_s:6.2f} ep/s | {tokens_per_s:7.1f} tok/s"
    return (
        f"step {record.get('step', 0):>4}/{total_steps}"
        f" | reward {record.get('reward_mean', 0.0):6.3f}"
        f" | success {record.get('success_rate', 0.0):5.1%}"
        f" | horizon {record.get('horizon_cap', 0)} (stage {record.get('horizon_stage', 0)})"
        f" | staleness {record.get('staleness_mean', 0.0):4.2f}"
        f" | {rate_text}"
        f" | groups {record.get('groups_used', 0)} used, {record.get('groups_skipped_zero_variance', 0)} flat"
    )


def _learner_exit(learner_ranks: list[RoleProcess]) -> tuple[int | None, RoleProcess]:
    """(None while the learner runs, 0 once rank 0 finished, else the first failing rank's code;
    the rank whose log tells why: the failing one, else rank 0)."""
    codes = [rank.poll() for rank in learner_ranks]
    for rank, code in zip(learner_ranks, codes):
        if code not in (None, 0):
            return code, rank
    return (0 if codes[0] == 0 else None), learner_ranks[0]


def _failed_rank_name(rank: RoleProcess, learner_ranks: list[RoleProcess]) -> str:
    """How the console names a failed learner: by its rank when a rank other than the first
    failed (that rank's log, not learner.log, tells why)."""
    index = learner_ranks.index(rank)
    return "the learner" if index == 0 else f"the learner's rank {index}"


def failure_of(run_dir: Path) -> str | None:
    """Why the run's learner failed, as the console said it (the failing rank and its error), or
    None when no failure was recorded (the run finished, was stopped, or is another launcher's)."""
    path = run_dir / FAILURE_FILE
    return path.read_text().strip() if path.is_file() else None


def _log_of(run_dir: Path, process: RoleProcess) -> Path:
    return run_dir / "logs" / f"{process.name}.log"


def _write_process_table(run_dir: Path, children: list[RoleProcess]) -> None:
    """Record who runs where (`processes.json`): for people, and for tests that kill an actor."""
    table = {child.name: child.describe() for child in children}
    partial = run_dir / "processes.json.partial"
    partial.write_text(json.dumps(table, indent=2))
    partial.replace(run_dir / "processes.json")


def _stop_all(children: list[RoleProcess]) -> None:
    """SIGTERM to every child, then SIGKILL to any still running after its grace period."""
    for child in children:
        child.terminate()
    started = time.monotonic()
    for child in children:
        grace = _LEARNER_STOP_GRACE_S if child.role == "learner" else _ACTOR_STOP_GRACE_S
        if not child.wait(max(0.1, started + grace - time.monotonic())):
            child.kill()
            child.wait(None)


_LOG_LINE = re.compile(r"^\S+ \S+ (?P<role>\S+) (?P<level>WARNING|ERROR|CRITICAL) \S+: (?P<message>.*)$")


def learner_warnings(lines: list[str]) -> list[str]:
    """The learner's warnings and errors among new lines of its log, as `learner: MESSAGE`: what it
    waits for (no groups yet, actors lost) reaches the terminal, not only logs/learner.log."""
    notes = []
    for line in lines:
        match = _LOG_LINE.match(line)
        if match:
            notes.append(f"{match['role']}: {match['message']}")
    return notes


_RANK_PREFIX = re.compile(r"^\[rank\d+\]: ?")


def last_error(log: Path) -> str:
    """The exception line that ends the last traceback in `log` ("" when there is none)."""
    try:
        with log.open("rb") as file:
            file.seek(max(0, file.seek(0, 2) - 64 * 1024))  # the end of a long log is enough
            lines = file.read().decode("utf-8", errors="replace").splitlines()
    except OSError:
        return ""
    # A learner rank's traceback comes through torch.distributed's excepthook, which starts each
    # line with "[rankN]: ".
    lines = [_RANK_PREFIX.sub("", line, count=1) for line in lines]
    # The last traceback is the innermost one; inside trio's exception groups its lines carry a
    # prefix of spaces, "|" and "+", the same on every line of that traceback.
    start = None
    for index, line in enumerate(lines):
        if line.lstrip(" |+-").startswith("Traceback (most recent call last)"):
            start = index
    if start is None:
        return ""
    prefix = len(lines[start]) - len(lines[start].lstrip(" |+-"))
    for line in lines[start + 1:]:
        body = line[prefix:]
        if body and not body[0].isspace() and body[0] not in "|+":
            return body.strip()
    return ""


def supervise(
    config: Config,
    run_dir: Path,
    learner_ranks: list[RoleProcess],
    actors: list[RoleProcess],
    *,
    progress=print,
    before_learner_restart: Callable[[], None] = lambda: None,
    collect: Callable[..., None] = lambda final=False: None,
    learner_restarts: int = MAX_LEARNER_RESTARTS,
) -> int:
    """Start the processes and watch them until the learner finishes; returns the exit code (0
    when training finished, 130 on Ctrl-C, 143 on SIGTERM, else the learner's failing code).

    `before_learner_restart` runs between stopping a failed learner's ranks and starting them
    again; `collect(final=False)` brings what the processes wrote elsewhere (logs, metrics,
    checkpoints) into `run_dir`, and with final=True everything that is left. `learner_restarts`
    is how often the loop starts a failed learner again: 0 where the learner's process restarts
    its ranks itself (torchrun)."""
    children = [*learner_ranks, *actors]
    learner = learner_ranks[0]
    (run_dir / FAILURE_FILE).unlink(missing_ok=True)  # a resumed run's earlier failure is not its own
    metrics = MetricsFollower(run_dir)
    throughput = ThroughputWindow()
    learner_log = run_dir / "logs" / "learner.log"
    learner_notes = LineFollower(learner_log)
    # Signal handlers can only be set from the main thread (a launcher run from a test's thread
    # keeps the default).
    in_main_thread = threading.current_thread() is threading.main_thread()
    stop_on_signal = _StopOnSignal()
    previous_handler = signal.signal(signal.SIGTERM, stop_on_signal) if in_main_thread else None
    # A process started in the background of a non-interactive shell inherits SIGINT ignored,
    # and Python then leaves it ignored: a Ctrl-C or `kill -INT` would go unheard. Listen anyway.
    previous_interrupt_handler = signal.signal(signal.SIGINT, stop_on_signal) if in_main_thread else None
    last_step = 0  # the latest learner step the console has shown
    try:
        for child in children:
            child.start()
        _write_process_table(run_dir, children)
        while True:
            time.sleep(_POLL_INTERVAL_S)
            collect()
            for record in metrics.new_records():
                last_step = record.get("step", last_step)
                progress(format_progress(record, config.run.total_steps, throughput.add(record)))
            for note in learner_warnings(learner_notes.new_lines()):
                progress(note)
            learner_code, failed_rank = _learner_exit(learner_ranks)
            if learner_code is not None:
                if learner_code == 0 or learner.restarts >= learner_restarts:
                    break
                if learner_code == EXIT_DO_NOT_RESTART:
                    progress("the learner stopped on an error a restart would repeat; not restarting it "
                             f"(the error is at the end of {_log_of(run_dir, failed_rank)})")
                    break
                learner.restarts += 1
                collect()  # the failed rank's last log lines, where they are written on another node
                cause = last_error(_log_of(run_dir, failed_rank))
                progress(
                    f"{_failed_rank_name(failed_rank, learner_ranks)} exited with code {learner_code}"
                    f"{f' ({cause})' if cause else ''}; restarting it from its latest checkpoint "
                    f"({learner.restarts}/{learner_restarts})"
                )
                # Ranks live and die together: the others cannot go on without the lost one.
                _stop_all(learner_ranks)
                before_learner_restart()
                for rank in learner_ranks:
                    rank.start(resume=True)
                _write_process_table(run_dir, children)
                continue
            for actor in actors:
                code = actor.poll()
                if code is None:
                    continue
                if code == 0:  # stopped by the learner: training is ending
                    continue
                if code == EXIT_DO_NOT_RESTART:  # refused by the learner: a restart would be too
                    progress(f"{actor.name} stopped on an error a restart would repeat; not restarting it "
                             f"(see {run_dir / 'logs' / f'{actor.name}.log'})")
                    actor.give_up()
                    continue
                if actor.restarts >= _MAX_RESTARTS_PER_ACTOR:
                    progress(f"{actor.name} exited with {code} too often; not restarting")
                    actor.give_up()
                    continue
                if time.monotonic() - actor.started_at < _MIN_SECONDS_BETWEEN_STARTS:
                    continue  # crashing at start-up: wait a little before trying again
                actor.restarts += 1
                progress(f"{actor.name} exited with code {code}; restarting ({actor.restarts})")
                actor.start()
                _write_process_table(run_dir, children)
    except (KeyboardInterrupt, StopRequested) as stop:
        stop_on_signal.stopping = True  # a stop raised otherwise than by a signal: ignore the next ones too
        saving = ("the learner checkpoints its last step first" if last_step
                  else "no learner step has finished yet, so there is nothing to checkpoint")
        progress(f"{'interrupted' if isinstance(stop, KeyboardInterrupt) else 'stop requested'}: "
                 f"stopping all processes ({saving})")
        _stop_all(children)
        collect(final=True)
        for record in metrics.new_records():
            progress(format_progress(record, config.run.total_steps, throughput.add(record)))
        from longhorizon.learner.checkpoint import latest_checkpoint

        latest = latest_checkpoint(run_dir)
        if latest is not None:
            progress(f"stopped; the latest checkpoint is {latest}: the same command with run.resume=true "
                     "continues from it")
        else:
            progress("stopped before the first checkpoint: nothing to resume from")
        return 130 if isinstance(stop, KeyboardInterrupt) else 128 + signal.SIGTERM
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, previous_handler)
            signal.signal(signal.SIGINT, previous_interrupt_handler)
    # The learner finished (or failed): actors were sent Stop; give them a moment, then end them.
    deadline = time.monotonic() + 15
    for actor in actors:
        while actor.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
    _stop_all(children)
    collect(final=True)
    for record in metrics.new_records():
        progress(format_progress(record, config.run.total_steps, throughput.add(record)))
    if learner_code == 0:
        # The run is over and every process has stopped: the path transport's last version is
        # read by no one (the checkpoints hold the model; a resumed run publishes its own).
        shutil.rmtree(run_dir / "weights", ignore_errors=True)
    if learner_code != 0:
        failed_log = _log_of(run_dir, failed_rank)
        cause = last_error(failed_log)
        failure = (f"{_failed_rank_name(failed_rank, learner_ranks)} failed with exit code {learner_code}"
                   f"{f': {cause}' if cause else ''}; see {failed_log}")
        (run_dir / FAILURE_FILE).write_text(failure + "\n")
        progress(failure)
        return learner_code or 1
    return 0
