"""Run a training job on this machine: one learner and N actor processes, supervised.

The launcher resolves the config (free ports filled in), prepares the model once, starts the
processes, restarts an actor that dies, restarts a learner that dies from its latest checkpoint,
prints one progress line per learner step, and on Ctrl-C or SIGTERM stops every process it
started (the learner first writes a checkpoint of its last step). Workers are forked from the
launcher's fork server (fork_server.py, `run.fork_server`) or started fresh; either way they get
SIGTERM from the kernel if the launcher itself dies (PR_SET_PDEATHSIG, through the server when
forked: it ends with the launcher), so no process is left behind.
`train_in_process` wires the same components together in one process over the in-process
transport, for tests and debugging.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from longhorizon.common.config import Config
from longhorizon.launch.checks import validate_config
from longhorizon.launch.launchers.fork_server import (
    ForkedProcess, ForkServer, ForkServerError, fork_server_supported, preload_for, shared_fork_server,
)
from longhorizon.launch.launchers.supervise import SubprocessControl, prepare_run_dir, process_name, supervise, with_ports
from longhorizon.learner.distributed import STORE_FILE_VARIABLE
from longhorizon.common.models import resolve_model_path
from longhorizon.common.auth import auth_environments
from longhorizon.actor.worker import run_actor
from longhorizon.common.transport import InProcessNetwork


class WorkerProcess(SubprocessControl):
    """One worker process (`python -m longhorizon.launch.worker ROLE`) on this machine, its output
    appended to its log."""

    def __init__(
        self, role: str, index: int, config_path: Path, log_path: Path, *, env: dict[str, str] | None = None,
        fork_server: Callable[[], ForkServer] | None = None, fork_preload: Sequence[str] = (),
    ) -> None:
        self.role, self.index = role, index
        self.config_path, self.log_path = config_path, log_path
        # Variables added to the launcher's environment for this process (secrets never go in
        # the config file, which is written to the run directory).
        self.env = dict(env or {})
        # What gives the fork server to fork the process from at each start (run.fork_server), and
        # what it should import for it; None: a fresh interpreter.
        self.fork_server, self.fork_preload = fork_server, list(fork_preload)
        self.process: subprocess.Popen | ForkedProcess | None = None
        self.restarts = 0
        self.started_at = 0.0

    @property
    def name(self) -> str:
        return process_name(self.role, self.index)

    def worker_arguments(self, *, resume: bool) -> list[str]:
        arguments = [self.role, "--config", str(self.config_path), "--index", str(self.index)]
        return [*arguments, "--resume"] if resume else arguments

    def command(self, *, resume: bool) -> list[str]:
        return [sys.executable, "-m", "longhorizon.launch.worker", *self.worker_arguments(resume=resume)]

    def start(self, *, resume: bool = False) -> None:
        self.started_at = time.monotonic()
        environment = {**os.environ, **self.env, **self.scratch_environment(self.name)}
        with self.log_path.open("ab") as log_file:
            if self.fork_server is not None:
                try:
                    self.process = self.fork_server().spawn(
                        self.worker_arguments(resume=resume), env=environment, log_file=log_file,
                        name=f"lh-{self.name}", preload=self.fork_preload,
                    )
                    return
                except ForkServerError as error:
                    # Started the plain way instead: slower, otherwise the same.
                    log_file.write(f"[launcher] {error}; starting {self.name} as a new process\n".encode())
                    log_file.flush()
            # A session of its own: the launcher decides the order of shutdown on Ctrl-C.
            self.process = subprocess.Popen(
                self.command(resume=resume), stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True, env=environment,
            )

    def poll(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def give_up(self) -> None:
        self.end_leftovers()
        self.process = None

    def describe(self) -> dict:
        return {"pid": self.process.pid if self.process else None, "restarts": self.restarts,
                "scratch": None if self.scratch_dir is None else str(self.scratch_dir)}


def _learner_ranks(config: Config, config_path: Path, run_dir: Path, **fork: Any) -> list[WorkerProcess]:
    """The learner's processes: one, or `learner.num_ranks` ranks that find rank 0 through
    torch.distributed's environment variables (as torchrun would set them)."""
    num_ranks = config.learner.num_ranks
    if num_ranks == 1:
        return [WorkerProcess("learner", 0, config_path, run_dir / "logs" / "learner.log", **fork)]
    # On one machine the ranks meet through a file and gloo talks over the loopback interface:
    # nothing of the learner's process group listens beyond this machine.
    rendezvous = {
        STORE_FILE_VARIABLE: str(run_dir / ".ranks-store"), "GLOO_SOCKET_IFNAME": "lo",
        "MASTER_ADDR": "127.0.0.1", "WORLD_SIZE": str(num_ranks),
    }
    return [
        WorkerProcess(
            "learner", rank, config_path,
            run_dir / "logs" / ("learner.log" if rank == 0 else f"learner-rank{rank}.log"),
            env={**rendezvous, "RANK": str(rank), "LOCAL_RANK": str(rank)}, **fork,
        )
        for rank in range(num_ranks)
    ]


def actor_processes(config: Config, config_path: Path, run_dir: Path, env: dict[str, str], **fork: Any) -> list[WorkerProcess]:
    """The run's actors, each with `env` (the actors' credentials) added to its environment;
    `fork` as WorkerProcess takes it."""
    return [
        WorkerProcess("actor", index, config_path, run_dir / "logs" / f"actor-{index}.log", env=env, **fork)
        for index in range(config.actor.num_actors)
    ]


def _remove_ranks_store(run_dir: Path) -> None:
    """A new set of ranks needs a fresh meeting file: the old one holds the last group's keys."""
    (run_dir / ".ranks-store").unlink(missing_ok=True)


def launch_local(config: Config, *, progress=print) -> int:
    """Run a training job in processes; returns the exit code (0 when training finished)."""
    validate_config(config)
    config = with_ports(config)
    # Convert or build the model once here, not in every process at the same time; a model that
    # is not there fails before the run's folder is made.
    model_folder = resolve_model_path(config.model.path, config.model.cache_dir)
    fork: dict[str, Any] = {}
    if config.run.fork_server and fork_server_supported():
        shared_fork_server()  # started now: it imports while the launcher prepares the run
        fork = {"fork_server": shared_fork_server, "fork_preload": preload_for(model_folder)}
    run_dir = prepare_run_dir(config, progress=progress)
    config_path = run_dir / "config.toml"
    _remove_ranks_store(run_dir)
    # This run's CurveZMQ keys or secret (common/auth.py), in each process's environment only
    # (never in a file).
    credentials_by_role = auth_environments(config.transport)
    learner_ranks = _learner_ranks(config, config_path, run_dir, **fork)
    for rank in learner_ranks:
        rank.env.update(credentials_by_role["learner"])
    actors = actor_processes(config, config_path, run_dir, credentials_by_role["actor"], **fork)
    progress(f"run directory: {run_dir}  (logs in {run_dir / 'logs'})")
    ranks_text = "" if len(learner_ranks) == 1 else f" of {len(learner_ranks)} ranks"
    progress(
        f"starting 1 learner{ranks_text} and {len(actors)} actor(s): env {config.env.name}, engine {config.actor.engine}, "
        f"model {config.model.path}, mode {config.run.mode}, {config.run.total_steps} steps"
    )
    try:
        return supervise(
            config, run_dir, learner_ranks, actors, progress=progress,
            before_learner_restart=lambda: _remove_ranks_store(run_dir),
        )
    finally:
        _remove_ranks_store(run_dir)


async def train_in_process(config: Config, *, model_path: str | None = None, engines=None):
    """Learner and actors as trio tasks in this process over the in-process transport."""
    import trio

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

