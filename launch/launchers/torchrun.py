"""Run a training job whose learner ranks torchrun starts: `longhorizon train CONFIG run.launcher=torchrun`.

The launcher starts `torchrun` (torch.distributed.run, from this interpreter) with the learner's
ranks of the usual worker (`python -m longhorizon.launch.worker learner`), and the actors as the
local launcher does; the supervision loop (supervise.py) prints the progress line, restarts a dead
actor and stops everything on Ctrl-C or SIGTERM. torchrun restarts the ranks: when one dies it
stops them all and starts them again, at most `torchrun.max_restarts` times, each start
continuing from the latest checkpoint (the workers get `--resume`; the first start finds none). A
learner torchrun gave up on ends the run. torchrun restarts the ranks after any failure, also one a
restart only repeats (exit code 3, which the local launcher does not restart). All ranks write to
logs/learner.log.

Across the nodes of an allocation the same command runs once on each node, with
`torchrun.num_nodes`, that node's `torchrun.node_rank` and `torchrun.rendezvous_endpoint` (HOST:PORT
on node 0); each node starts `learner.num_ranks / num_nodes` ranks. torchrun's static rendezvous
numbers the ranks node by node, so rank 0, which binds the learner's sockets, is on node 0: node 0
runs the actors and the progress line as on one machine, every other node runs only its ranks and
returns when they end. The run directory must be on storage all the nodes share (each rank writes
its part of every checkpoint).

torchrun does not ask to die with its parent, so it is started through a bootstrap that asks the
kernel for SIGTERM when the launcher dies (PR_SET_PDEATHSIG); the ranks ask the same of torchrun.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from longhorizon.common.auth import auth_environments
from longhorizon.common.config import Config, ConfigError, dump_toml
from longhorizon.common.models import resolve_model_path
from longhorizon.common.processes import remove_tied_folder, stop_process, tied_folder
from longhorizon.common.transport import is_loopback_host
from longhorizon.launch.checks import validate_config
from longhorizon.launch.launchers.local import WorkerProcess, actor_processes
from longhorizon.launch.launchers.supervise import free_port, prepare_run_dir, supervise, with_ports

SHUTDOWN_TIMEOUT_S = 100
"""Seconds torchrun gives the ranks between its SIGTERM and SIGKILL, in which rank 0 writes the
final checkpoint with every rank's help: within the supervision loop's grace for the learner."""

_BOOTSTRAP = """\
import sys
from longhorizon.common.processes import die_with_parent
die_with_parent(parent_pid=int(sys.argv.pop(1)))
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main
try:
    main()
except SignalException as stop:
    sys.exit(128 + int(stop.sigval))
except ChildFailedError as failure:
    rank, first = failure.get_first_failure()
    print(f"torchrun: gave up on the learner: rank {rank} exited with code {first.exitcode}", file=sys.stderr)
    sys.exit(first.exitcode if first.exitcode > 0 else 128 - first.exitcode)
"""
"""`python -c _BOOTSTRAP LAUNCHER_PID TORCHRUN_ARGUMENTS...`: torchrun, ended by the kernel with the
launcher. A stop it was asked for, or ranks it gave up on, end it without its own traceback, so
the last traceback in the learner's log is the failing rank's, which the launcher reports; its
exit code is the rank's."""


def rendezvous_address(endpoint: str) -> tuple[str, int]:
    """`HOST:PORT` as (host, port); ConfigError naming the key otherwise."""
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"torchrun.rendezvous_endpoint = {endpoint!r} is not HOST:PORT (node 0's address and a free port)")
    return host.strip("[]"), int(port)


def check_torchrun_settings(config: Config) -> None:
    """The [torchrun] table against the learner's ranks, before anything starts."""
    settings = config.torchrun
    if settings.node_rank >= settings.num_nodes:
        raise ConfigError(f"torchrun.node_rank = {settings.node_rank} but torchrun.num_nodes = {settings.num_nodes}: "
                          "node ranks run from 0 to num_nodes - 1")
    if config.learner.num_ranks % settings.num_nodes:
        raise ConfigError(f"learner.num_ranks = {config.learner.num_ranks} does not split evenly over torchrun.num_nodes = "
                          f"{settings.num_nodes}: each node runs num_ranks / num_nodes ranks")
    if settings.num_nodes == 1:
        if settings.rendezvous_endpoint:
            raise ConfigError("torchrun.rendezvous_endpoint is for several nodes (torchrun.num_nodes > 1); on one node "
                              "the ranks meet on a free port of 127.0.0.1: leave it empty")
        return
    if not settings.rendezvous_endpoint:
        raise ConfigError(f"torchrun.num_nodes = {settings.num_nodes} needs torchrun.rendezvous_endpoint: HOST:PORT on "
                          "node 0, the same on every node")
    host, _ = rendezvous_address(settings.rendezvous_endpoint)
    if is_loopback_host(host):
        raise ConfigError(f"torchrun.rendezvous_endpoint = {settings.rendezvous_endpoint!r} is a loopback address, "
                          "which the other nodes cannot reach: use node 0's address")


def _torchrun_command(config: Config, config_path: Path, host: str, port: int) -> list[str]:
    settings = config.torchrun
    return [
        sys.executable, "-c", _BOOTSTRAP, str(os.getpid()),
        f"--nnodes={settings.num_nodes}", f"--node-rank={settings.node_rank}",
        f"--nproc-per-node={config.learner.num_ranks // settings.num_nodes}",
        # Static: node k's ranks are k * ranks per node onwards, so rank 0 is on node 0.
        "--rdzv-backend=static", f"--master-addr={host}", f"--master-port={port}",
        f"--max-restarts={settings.max_restarts}", f"--shutdown-timeout={SHUTDOWN_TIMEOUT_S}",
        "-m", "longhorizon.launch.worker", "learner", "--config", str(config_path), "--resume",
    ]


class TorchrunLearner(WorkerProcess):
    """The learner as the supervision loop sees it: one torchrun process, which starts this node's
    ranks and restarts them itself."""

    def __init__(self, torchrun_command: list[str], config_path: Path, log_path: Path, *, env: dict[str, str]) -> None:
        super().__init__("learner", 0, config_path, log_path, env=env)
        self.torchrun_command = torchrun_command

    def command(self, *, resume: bool) -> list[str]:
        return self.torchrun_command  # every start of a rank resumes from the latest checkpoint


def _this_node(config: Config) -> Config:
    """The config as validate_config should see it on this node: its GPUs hold its ranks only."""
    ranks_here = config.learner.num_ranks // config.torchrun.num_nodes
    return config.replace(learner=config.learner.replace(num_ranks=ranks_here))


def launch_torchrun(config: Config, *, progress=print) -> int:
    """Run a training job with the learner under torchrun; returns the exit code (0 when training
    finished)."""
    check_torchrun_settings(config)
    validate_config(_this_node(config))
    settings = config.torchrun
    # Each node turns the model name into a folder once, before its ranks load it.
    resolve_model_path(config.model.path, config.model.cache_dir)
    credentials_by_role = auth_environments(config.transport)
    if settings.node_rank > 0:
        return _run_other_node(config, credentials_by_role["learner"], progress)
    config = with_ports(config)
    run_dir = prepare_run_dir(config, progress=progress)
    config_path = run_dir / "config.toml"
    if settings.num_nodes == 1:
        # As the local launcher's ranks: gloo over loopback. torchrun's store listens on every
        # address of the machine on a free port, a limit of torch.
        host, port, network = "127.0.0.1", free_port(), {"GLOO_SOCKET_IFNAME": "lo"}
    else:
        (host, port), network = rendezvous_address(settings.rendezvous_endpoint), {}
    learner = TorchrunLearner(
        _torchrun_command(config, config_path, host, port), config_path, run_dir / "logs" / "learner.log",
        env={**network, **credentials_by_role["learner"]},
    )
    actors = actor_processes(config, config_path, run_dir, credentials_by_role["actor"])
    progress(f"run directory: {run_dir}  (logs in {run_dir / 'logs'})")
    nodes_text = f" over {settings.num_nodes} nodes" if settings.num_nodes > 1 else ""
    progress(
        f"starting torchrun with a learner of {config.learner.num_ranks} rank(s){nodes_text} and {len(actors)} actor(s): "
        f"env {config.env.name}, engine {config.actor.engine}, model {config.model.path}, mode {config.run.mode}, "
        f"{config.run.total_steps} steps"
    )
    return supervise(config, run_dir, [learner], actors, progress=progress, learner_restarts=0)


def _run_other_node(config: Config, credentials: dict[str, str], progress) -> int:
    """A node other than node 0: its ranks under torchrun, their output on this terminal; returns
    torchrun's exit code, or 128 + the signal that stopped it."""
    settings = config.torchrun
    # Node 0 writes the run directory's config.toml; this node's ranks read their own copy.
    folder = Path(tied_folder("longhorizon-torchrun-"))
    config_path = folder / "config.toml"
    config_path.write_text(dump_toml(config))
    host, port = rendezvous_address(settings.rendezvous_endpoint)
    progress(f"node {settings.node_rank} of {settings.num_nodes}: starting {config.learner.num_ranks // settings.num_nodes} "
             f"learner rank(s) that meet node 0 at {settings.rendezvous_endpoint}; node 0 shows the progress")
    process = subprocess.Popen(
        _torchrun_command(config, config_path, host, port), stdin=subprocess.DEVNULL, start_new_session=True,
        env={**os.environ, **credentials},
    )
    stopped_by: list[int] = []

    def stop(signum, frame) -> None:
        # Once only: a second SIGTERM would cut torchrun's wait for the final checkpoint short.
        if not stopped_by:
            stopped_by.append(signum)
            process.send_signal(signal.SIGTERM)

    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = {signum: signal.signal(signum, stop) for signum in (signal.SIGINT, signal.SIGTERM)} if in_main_thread else {}
    try:
        code = process.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        stop_process(process, SHUTDOWN_TIMEOUT_S + 20)
        remove_tied_folder(folder)
    return 128 + stopped_by[0] if stopped_by else code
