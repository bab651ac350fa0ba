"""Run a training job on this machine: one learner and N actor processes, supervised.

The launcher resolves the config (free ports filled in), prepares the model once, starts the
processes, restarts an actor that dies, restarts a learner that dies from its latest checkpoint,
prints one progress line per learner step, and on Ctrl-C or SIGTERM stops every process it
started (the learner first writes a checkpoint of its last step). Children also get SIGTERM from
the kernel if the launcher itself dies (PR_SET_PDEATHSIG), so no process is left behind.
`train_in_process` wires the same components together in one process over the in-process
transport, for tests and debugging.
"""

from __future__ import annotations

import dataclasses
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from longhorizon.common.config import Config, ConfigError, dump_toml
from longhorizon.common.metrics import MetricsFollower

_MAX_RESTARTS_PER_ACTOR = 20
_MAX_LEARNER_RESTARTS = 3
_MIN_SECONDS_BETWEEN_STARTS = 2.0
# Actors stop within seconds; the learner may be writing its final checkpoint.
_ACTOR_STOP_GRACE_S = 10.0
_LEARNER_STOP_GRACE_S = 120.0


class StopRequested(Exception):
    """The launcher got SIGTERM: stop the run as on Ctrl-C."""


def _raise_stop_requested(signum, frame) -> None:
    raise StopRequested(f"signal {signum}")


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
    return dataclasses.replace(config, transport=dataclasses.replace(transport, **ports))


def validate_config(config: Config) -> None:
    """Cheap checks before any process starts, so a wrong name fails once with a clear message
    instead of crashing every actor in a restart loop."""
    from longhorizon.actor.engines.base import load_engine_class
    from longhorizon.envs.base import get_env_spec, list_tasks
    from longhorizon.learner.broadcast import WEIGHTS_TRANSPORTS
    from longhorizon.learner.buffer import PARTIAL_GROUP_POLICIES
    from longhorizon.learner.curriculum import make_horizon_schedule
    from longhorizon.common.models import ModelError, resolve_device
    from longhorizon.learner.losses import POLICY_LOSS_NAMES
    from longhorizon.learner.trainer import PRECISIONS
    from longhorizon.learner.worker import check_sampling_for_training

    def require(condition: bool, message: str) -> None:
        if not condition:
            raise ConfigError(message)

    require(config.run.mode in ("async", "sync"), f"run.mode must be async or sync, got {config.run.mode!r}")
    require(config.run.total_steps > 0, "run.total_steps must be positive")
    require(config.actor.num_actors > 0, "actor.num_actors must be positive")
    require(config.actor.group_size >= 2, "actor.group_size must be at least 2 (GRPO compares episodes)")
    require(config.learner.loss in POLICY_LOSS_NAMES,
            f"learner.loss {config.learner.loss!r} is not one of {', '.join(POLICY_LOSS_NAMES)}")
    require(config.learner.advantage in ("grpo", "rloo"), "learner.advantage must be grpo or rloo")
    require(config.learner.weights_transport in WEIGHTS_TRANSPORTS,
            f"learner.weights_transport must be one of {', '.join(WEIGHTS_TRANSPORTS)}")
    require(config.learner.partial_groups in PARTIAL_GROUP_POLICIES,
            f"learner.partial_groups must be one of {', '.join(PARTIAL_GROUP_POLICIES)}")
    require(config.learner.max_tokens_per_micro_batch > 0, "learner.max_tokens_per_micro_batch must be positive")
    require(config.learner.precision in PRECISIONS, f"learner.precision must be one of {', '.join(PRECISIONS)}")
    require(config.learner.logprob_chunk_tokens >= 0, "learner.logprob_chunk_tokens must be >= 0 (0: whole logits)")
    try:
        resolve_device(config.learner.device)
    except ModelError as error:
        raise ConfigError(f"learner.device: {error}") from None
    require(config.actor.max_context_tokens > config.actor.sampling.max_new_tokens,
            "actor.max_context_tokens must be larger than actor.sampling.max_new_tokens")
    try:
        check_sampling_for_training(config)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    get_env_spec(config.env.name)
    if not list_tasks(config.env.name, config.env.train_split, **dict(config.env.options)):
        raise ConfigError(f"env {config.env.name!r} has no {config.env.train_split!r} tasks")
    load_engine_class(config.actor.engine)
    if config.actor.engine == "scripted" and config.actor.scripted_policy not in get_env_spec(config.env.name).policies:
        raise ConfigError(
            f"env {config.env.name!r} has no scripted policy {config.actor.scripted_policy!r}; "
            f"available: {', '.join(sorted(get_env_spec(config.env.name).policies))}"
        )
    make_horizon_schedule(config.horizon.schedule, config.horizon.stages, config.horizon.stage_steps)


def prepare_run_dir(config: Config, *, progress=print) -> Path:
    run_dir = config.run_dir
    if not config.run.resume and ((run_dir / "metrics.jsonl").exists() or (run_dir / "checkpoints").exists()):
        # A fresh run must not append to an old run's metrics or resume from its checkpoints.
        kept = run_dir.with_name(f"{run_dir.name}.{time.strftime('%Y%m%d-%H%M%S')}")
        run_dir.rename(kept)
        progress(f"an earlier run was in {run_dir}; moved it to {kept} (run.resume=true continues a run)")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "logs").mkdir(exist_ok=True)
    (run_dir / "config.toml").write_text(dump_toml(config))
    return run_dir


def format_progress(record: dict, total_steps: int) -> str:
    return (
        f"step {record.get('step', 0):>4}/{total_steps}"
        f" | reward {record.get('reward_mean', 0.0):6.3f}"
        f" | success {record.get('success_rate', 0.0):5.1%}"
        f" | horizon {record.get('horizon_cap', 0)} (stage {record.get('horizon_stage', 0)})"
        f" | staleness {record.get('staleness_mean', 0.0):4.2f}"
        f" | {record.get('episodes_per_s', 0.0):6.2f} ep/s"
        f" | {record.get('tokens_per_s', 0.0):7.1f} tok/s"
        f" | groups {record.get('groups_used', 0)} used, {record.get('groups_skipped_zero_variance', 0)} flat"
    )


class _Child:
    def __init__(self, role: str, index: int, config_path: Path, log_path: Path) -> None:
        self.role, self.index = role, index
        self.config_path, self.log_path = config_path, log_path
        self.process: subprocess.Popen | None = None
        self.restarts = 0
        self.started_at = 0.0

    @property
    def name(self) -> str:
        return "learner" if self.role == "learner" else f"actor-{self.index}"

    def start(self, *, resume: bool = False) -> None:
        command = [
            sys.executable, "-m", "longhorizon.launch.worker", self.role,
            "--config", str(self.config_path), "--index", str(self.index),
        ]
        if resume:
            command.append("--resume")
        self.started_at = time.monotonic()
        log_file = self.log_path.open("ab")
        # A session of its own: the launcher decides the order of shutdown on Ctrl-C.
        self.process = subprocess.Popen(
            command, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        log_file.close()

    def poll(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def terminate(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()


def _write_process_table(run_dir: Path, children: list[_Child]) -> None:
    """Record who runs where (`processes.json`): for people, and for tests that kill an actor."""
    import json

    table = {
        child.name: {"pid": child.process.pid if child.process else None, "restarts": child.restarts}
        for child in children
    }
    partial = run_dir / "processes.json.partial"
    partial.write_text(json.dumps(table, indent=2))
    partial.replace(run_dir / "processes.json")


def _stop_all(children: list[_Child]) -> None:
    """SIGTERM to every child, then SIGKILL to any still running after its grace period."""
    for child in children:
        child.terminate()
    started = time.monotonic()
    for child in children:
        if child.process is None:
            continue
        grace = _LEARNER_STOP_GRACE_S if child.role == "learner" else _ACTOR_STOP_GRACE_S
        try:
            child.process.wait(timeout=max(0.1, started + grace - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()
            child.process.wait()


def launch_local(config: Config, *, progress=print) -> int:
    """Run a training job in processes; returns the exit code (0 when training finished)."""
    from longhorizon.common.models import resolve_model_path

    validate_config(config)
    config = with_ports(config)
    run_dir = prepare_run_dir(config, progress=progress)
    config_path = run_dir / "config.toml"
    # Convert or build the model once here, not in every process at the same time.
    resolve_model_path(config.model.path, config.model.cache_dir)
    learner = _Child("learner", 0, config_path, run_dir / "logs" / "learner.log")
    actors = [
        _Child("actor", index, config_path, run_dir / "logs" / f"actor-{index}.log")
        for index in range(config.actor.num_actors)
    ]
    children = [learner, *actors]
    progress(f"run directory: {run_dir}  (logs in {run_dir / 'logs'})")
    progress(
        f"starting 1 learner and {len(actors)} actor(s): env {config.env.name}, engine {config.actor.engine}, "
        f"model {config.model.path}, mode {config.run.mode}, {config.run.total_steps} steps"
    )
    metrics = MetricsFollower(run_dir)
    # Signal handlers can only be set from the main thread (a launcher run from a test's thread
    # keeps the default).
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous_handler = signal.signal(signal.SIGTERM, _raise_stop_requested) if in_main_thread else None
    try:
        for child in children:
            child.start()
        _write_process_table(run_dir, children)
        while True:
            time.sleep(0.5)
            for record in metrics.new_records():
                progress(format_progress(record, config.run.total_steps))
            learner_code = learner.poll()
            if learner_code is not None:
                if learner_code == 0 or learner.restarts >= _MAX_LEARNER_RESTARTS:
                    break
                learner.restarts += 1
                progress(
                    f"the learner exited with code {learner_code}; restarting it from its latest "
                    f"checkpoint ({learner.restarts}/{_MAX_LEARNER_RESTARTS})"
                )
                learner.start(resume=True)
                _write_process_table(run_dir, children)
                continue
            for actor in actors:
                code = actor.poll()
                if code is None or actor.process is None:
                    continue
                if code == 0:  # stopped by the learner: training is ending
                    continue
                if actor.restarts >= _MAX_RESTARTS_PER_ACTOR:
                    progress(f"{actor.name} exited with {code} too often; not restarting")
                    actor.process = None
                    continue
                if time.monotonic() - actor.started_at < _MIN_SECONDS_BETWEEN_STARTS:
                    continue  # crashing at start-up: wait a little before trying again
                actor.restarts += 1
                progress(f"{actor.name} exited with code {code}; restarting ({actor.restarts})")
                actor.start()
                _write_process_table(run_dir, children)
    except (KeyboardInterrupt, StopRequested) as stop:
        if in_main_thread:  # a repeated SIGTERM must not cut the orderly stop short
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        progress(f"{'interrupted' if isinstance(stop, KeyboardInterrupt) else 'stop requested'}: "
                 "stopping all processes (the learner writes a checkpoint first)")
        _stop_all(children)
        return 130 if isinstance(stop, KeyboardInterrupt) else 128 + signal.SIGTERM
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, previous_handler)
    # The learner finished (or failed): actors were sent Stop; give them a moment, then end them.
    deadline = time.monotonic() + 15
    for actor in actors:
        while actor.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
    _stop_all(children)
    for record in metrics.new_records():
        progress(format_progress(record, config.run.total_steps))
    if learner_code != 0:
        progress(f"the learner failed with exit code {learner_code}; see {run_dir / 'logs' / 'learner.log'}")
        return learner_code or 1
    return 0


async def train_in_process(config: Config, *, model_path: str | None = None, engines=None):
    """Learner and actors as trio tasks in this process over the in-process transport."""
    import trio

    from longhorizon.actor.worker import run_actor
    from longhorizon.common.transport import InProcessNetwork
    from longhorizon.learner.worker import run_learner

    validate_config(config)
    prepare_run_dir(config)
    network = InProcessNetwork()
    async with trio.open_nursery() as nursery:
        for index in range(config.actor.num_actors):
            engine = engines[index] if engines else None
            nursery.start_soon(
                lambda i=index, e=engine: run_actor(config, i, network.actor_endpoints(f"actor-{i}"), engine=e)
            )
        learner = await run_learner(config, network.learner_endpoints(), model_path=model_path)
        # Actors return once they receive Stop; anything still running is cancelled.
        with trio.move_on_after(10):
            while len(nursery.child_tasks) > 0:
                await trio.sleep(0.05)
        nursery.cancel_scope.cancel()
    return learner

