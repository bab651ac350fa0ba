"""Run a training job on a Ray cluster: `longhorizon train CONFIG run.launcher=ray`.

The launcher connects to a running cluster (`ray.address`) and places each learner rank and each
actor as a `ProcessHost`: a Ray actor that holds the resources [ray] asks for that role (CPUs,
GPUs, custom resources that pin a role to some nodes) and runs the usual worker process
(`python -m longhorizon.launch.worker ROLE`) on its node, as the local launcher runs it on this
machine. The supervision loop is the local launcher's (launch/launchers/supervise.py), so the progress line,
the restart policy and processes.json are the same; processes.json also names each process's node.

Addresses come from the nodes: the learner's host picks free ports on its node's IP, and the
actors connect to that IP. The learner's ranks are one placement group packed on one node, where
they meet through a file and talk gloo over loopback, as on one machine.

Nothing needs a shared filesystem. The worker's config travels as text; each host sends its
process's log here, where it lands in `<run dir>/logs/`. The learner writes its checkpoints,
metrics and episodes either straight into the run directory (`ray.run_storage = "shared"`, when
the learner's node sees it) or into a folder on its own node, from which the host sends each new
or grown file here (`"node"`); the progress line reads the metrics here either way.

The run's credentials (CurveZMQ keys for a learner off loopback, the run's secret on loopback;
common/auth.py) reach each worker in its environment, passed to its host as an argument of the
call that starts it: never written to disk, and not part of what Ray keeps to recreate the host
after a crash.

Two layers restart things: Ray restarts a host whose process or node died (the host is recreated
with the same resources, possibly on another node), and the loop restarts the worker process
inside its host, counting restarts as the local launcher does.
"""

from __future__ import annotations
import logging
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from longhorizon.common.config import Config, ConfigError, dump_toml
from longhorizon.common.processes import remove_tied_folder, tied_folder
from longhorizon.launch.launchers.supervise import SubprocessControl, prepare_run_dir, process_name, supervise
from longhorizon.learner.weights import publisher_class
from longhorizon.common.auth import auth_environments, auth_mechanism
from longhorizon.common.models import resolve_model_path
from longhorizon.launch.checks import validate_config
from longhorizon.learner.distributed import STORE_FILE_VARIABLE

RUN_STORAGES = ("auto", "shared", "node")
INSTALL_HINT = "install it with `pip install -e '.[ray]'` (`make setup` does), on this machine and every node"
_COPY_BUDGET_BYTES = 32 * 1024 * 1024
"""The most file and log bytes one host sends in one call: large checkpoints arrive in pieces."""
_CALL_TIMEOUT_S = 120.0
"""A call to a host that has not returned after this long is treated as a lost host."""
_HOST_LOST = 1
"""The exit code the loop sees for a process whose host (Ray actor, or its node) died."""
# Files the launcher writes itself in the run directory; the learner's copy never overrides them.
_LAUNCHER_FILES = ("logs", "config.toml", "processes.json")


def import_ray():
    """The ray module, or a clear error naming the fix when it is not installed."""
    try:
        import ray
    except ImportError as error:
        raise ConfigError(f"run.launcher = 'ray' needs Ray, which is not installed ({error}): {INSTALL_HINT}") from None
    return ray


def check_ray_settings(config: Config) -> None:
    """The [ray] table on its own and against the learner's settings, before connecting."""
    settings = config.ray
    if not settings.address:
        raise ConfigError("ray.address is empty: use auto, HOST:PORT of the head node, or ray://HOST:PORT")
    for role in ("learner", "actor"):
        for kind in ("num_cpus", "num_gpus"):
            if getattr(settings, f"{role}_{kind}") < 0:
                raise ConfigError(f"ray.{role}_{kind} must be >= 0")
        for name, amount in getattr(settings, f"{role}_resources").items():
            if name in ("CPU", "GPU", "memory", "object_store_memory"):
                raise ConfigError(f"ray.{role}_resources: set {name} with ray.{role}_num_cpus / _num_gpus, not as a custom resource")
            if isinstance(amount, bool) or not isinstance(amount, (int, float)) or amount < 0:
                raise ConfigError(f"ray.{role}_resources.{name} must be a number >= 0, got {amount!r}")
    if settings.run_storage not in RUN_STORAGES:
        raise ConfigError(f"ray.run_storage must be one of {', '.join(RUN_STORAGES)}, got {settings.run_storage!r}")
    if settings.start_timeout_s <= 0:
        raise ConfigError("ray.start_timeout_s must be positive")
    if _weights_need_shared_storage(config) and settings.run_storage == "node":
        raise ConfigError(
            f"learner.weights_transport = {config.learner.weights_transport!r} has the actors read the weights from "
            "the run directory, which ray.run_storage = 'node' keeps on the learner's node only: put run.output_dir "
            "on shared storage (ray.run_storage = 'shared' or 'auto'), or use learner.weights_transport = 'inline'"
        )
    device = config.learner.device
    if device.startswith("cuda"):
        if settings.learner_num_gpus <= 0:
            raise ConfigError(
                f"learner.device = {device!r} but ray.learner_num_gpus = 0: Ray shows a process only the GPUs it "
                "asked for; set ray.learner_num_gpus = 1 (one GPU per rank)"
            )
        if device not in ("cuda", "cuda:0"):
            raise ConfigError(
                f"learner.device = {device!r}: under Ray each rank sees only its own GPU, as cuda:0; use cuda or auto"
            )
    if config.learner.num_ranks > 1 and not _bundle(settings, "learner"):
        raise ConfigError("learner.num_ranks > 1 under Ray needs resources per rank: set ray.learner_num_cpus or _num_gpus")


def _driver_view(config: Config) -> Config:
    """The config as validate_config should see it here: the learner's device (and a collective
    transport's nccl backend) is checked against its node's resources (check_ray_settings), not
    against this machine's GPUs."""
    learner = config.learner
    options = dict(learner.weights_options)
    if options.get("backend") == "nccl":
        options["backend"] = "gloo"
    return config.replace(learner=learner.replace(device="cpu", weights_options=options))


def _bundle(settings, role: str) -> dict[str, float]:
    """The resources one process of `role` holds, in Ray's spelling (zero amounts left out)."""
    wanted = {"CPU": getattr(settings, f"{role}_num_cpus"), "GPU": getattr(settings, f"{role}_num_gpus")}
    wanted.update(getattr(settings, f"{role}_resources"))
    return {name: float(amount) for name, amount in wanted.items() if amount > 0}


def connect(ray, address: str) -> bool:
    """Join the cluster at `address`; True when this call connected (and must disconnect)."""
    if ray.is_initialized():
        return False
    if address != "auto" and not address.startswith("ray://"):
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(f"ray.address {address!r} is not HOST:PORT (or auto, or ray://HOST:PORT)")
        # Ray itself would retry for about a minute before failing with a long trace.
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=10).close()
        except OSError as error:
            raise ConfigError(
                f"cannot reach the Ray cluster at ray.address = {address!r} ({error.strerror or error}): start "
                "it first (`ray start --head`, docs/cluster.md) or point ray.address at its head node's HOST:PORT"
            ) from None
    try:
        ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING, namespace="longhorizon")
    except ConnectionError as error:
        raise ConfigError(
            f"no Ray cluster at ray.address = {address!r} ({error}): start one with `ray start --head` "
            "(docs/cluster.md), or set ray.address to its head node's HOST:PORT"
        ) from None
    return True


# -- the learner's files, copied from its node ---------------------------------------------------------


class FolderMirror:
    """What changed in a folder since the last call, as pieces another machine writes into its copy.

    A piece is (relative path, offset, bytes): offset 0 starts the file over (new, or replaced by
    a rename as the learner does with metrics and checkpoints), any other offset continues it.
    Files growing in place (metrics, logs, TensorBoard) travel as their new bytes only. Paths with
    a `.partial` part are being written and renamed later: they travel once renamed. A
    checkpoint's state.pt, which marks the checkpoint complete, travels after the rest of its
    folder."""

    def __init__(self, root: Path, skip: tuple[str, ...] = ()) -> None:
        self.root = Path(root)
        self.skip = set(skip)
        self.sent: dict[str, tuple[int, int]] = {}  # relative path -> (inode, bytes sent)

    def _files(self) -> dict[str, os.stat_result]:
        found = {}
        for folder, subfolders, names in os.walk(self.root):
            subfolders[:] = [name for name in subfolders if not name.endswith(".partial")]
            for name in names:
                path = Path(folder, name)
                relative = path.relative_to(self.root).as_posix()
                if name.endswith(".partial") or relative.split("/")[0] in self.skip:
                    continue
                try:
                    found[relative] = path.stat()
                except FileNotFoundError:
                    continue  # removed while we looked
        return found

    def mark_sent(self, relative: str) -> None:
        """The other side already holds this file as it is now."""
        info = (self.root / relative).stat()
        self.sent[relative] = (info.st_ino, info.st_size)

    def changes(self, budget: int) -> tuple[list[tuple[str, int, bytes]], list[str], bool]:
        """(pieces, deleted paths, more): at most `budget` bytes; `more` when some were left."""
        files = self._files()
        pieces, more = [], False

        def order(relative: str) -> tuple:
            parts = relative.split("/")
            return (*parts[:-1], "\uffff") if parts[-1] == "state.pt" else tuple(parts)

        for relative in sorted(files, key=order):
            info = files[relative]
            inode, sent = self.sent.get(relative, (None, 0))
            start = 0 if inode != info.st_ino or info.st_size < sent else sent
            if relative in self.sent and start == info.st_size:
                continue
            if budget <= 0:
                more = True
                continue
            try:
                with open(self.root / relative, "rb") as file:
                    file.seek(start)
                    data = file.read(min(info.st_size - start, budget))
            except FileNotFoundError:
                continue
            pieces.append((relative, start, data))
            budget -= len(data)
            self.sent[relative] = (info.st_ino, start + len(data))
            more = more or start + len(data) < info.st_size
        deleted = sorted(set(self.sent) - set(files))
        for relative in deleted:
            del self.sent[relative]
        return pieces, deleted, more


def _inside(run_dir: Path, relative: str) -> Path:
    target = (run_dir / relative).resolve()
    if not target.is_relative_to(run_dir.resolve()) or relative.split("/")[0] in _LAUNCHER_FILES:
        raise ValueError(f"refusing to write {relative!r} outside the learner's files of {run_dir}")
    return target


def apply_pieces(run_dir: Path, pieces: list[tuple[str, int, bytes]], deleted: list[str]) -> None:
    """Write a FolderMirror's changes into this machine's copy of the folder."""
    for relative, offset, data in pieces:
        target = _inside(run_dir, relative)
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target, "r+b" if offset and target.exists() else "wb") as file:
            file.seek(offset)
            file.write(data)
            file.truncate()
    for relative in deleted:
        target = _inside(run_dir, relative)
        target.unlink(missing_ok=True)
        # Pruned checkpoints leave empty folders behind.
        for parent in target.parents:
            if parent == run_dir or not parent.is_relative_to(run_dir):
                break
            try:
                parent.rmdir()
            except OSError:
                break


# -- on the nodes ------------------------------------------------------------------------------------


class ProcessHost(SubprocessControl):
    """Runs one worker process on the node Ray placed this host on (this class runs there, as a
    Ray actor; its methods run one at a time on the host's main thread, which also starts the
    worker, so the worker's PR_SET_PDEATHSIG fires only when the host process itself ends).

    It keeps the worker's log in a folder of its own on the node (a `tied_folder`, deleted by its
    janitor when the host dies, even by SIGKILL; so is the worker's scratch folder, see
    `SubprocessControl`) and, for the learner's first rank with node storage, the learner's copy
    of the run under `<node_dir>/longhorizon-runs/<run id>/` (the path is the same for every host
    of a run on one node, so the ranks share it, and a host that Ray recreates on the same node
    finds it again)."""

    def __init__(self, name: str, run_id: str, run_name: str, node_dir: str) -> None:
        self.name = name
        self.work_dir = Path(tied_folder(f"longhorizon-{name}-"))
        self.log_path = self.work_dir / f"{name}.log"
        self.log_path.touch()
        self.log_sent = 0
        base = Path(node_dir or tempfile.gettempdir()) / "longhorizon-runs"
        self.node_output_dir = base / run_id
        self.node_run_dir = self.node_output_dir / run_name
        self.ranks_store = base / f"{run_id}.ranks-store"
        self.mirror: FolderMirror | None = None
        self.process: subprocess.Popen | None = None

    def node(self) -> dict:
        import ray

        return {
            "ip": ray.util.get_node_ip_address(), "hostname": socket.gethostname(), "pid": os.getpid(),
            "node_id": ray.get_runtime_context().get_node_id(), "output_dir": str(self.node_output_dir),
            "ranks_store": str(self.ranks_store),
        }

    def free_ports(self, count: int) -> list[int]:
        """Ports free on this node's address right now (the learner binds them moments later)."""
        import ray

        probes = [socket.socket() for _ in range(count)]
        try:
            for probe in probes:  # held open together, so the ports differ
                probe.bind((ray.util.get_node_ip_address(), 0))
            return [probe.getsockname()[1] for probe in probes]
        finally:
            for probe in probes:
                probe.close()

    def prepare_model(self, spec: str, cache_dir: str, cwd: str) -> str | None:
        """Resolve model.path on this node once, before its workers start (they would race to
        build or convert it); the error's last line when this node cannot. In a subprocess, so the
        host does not keep torch in memory for the whole run."""
        code = "import sys; from longhorizon.common.models import resolve_model_path as r; r(sys.argv[1], sys.argv[2])"
        result = subprocess.run([sys.executable, "-c", code, spec, cache_dir], capture_output=True, text=True,
                                stdin=subprocess.DEVNULL, cwd=cwd if os.path.isdir(cwd) else self.work_dir)
        if result.returncode == 0:
            return None
        return (result.stderr.strip().splitlines() or [f"exit code {result.returncode}"])[-1]

    def sees(self, path: str, token: str) -> bool:
        """Whether `path`, written on the launcher's machine with `token`, is visible here."""
        try:
            return Path(path).read_text() == token
        except OSError:
            return False

    def has_run(self) -> bool:
        """Whether the node copy of the run exists (a host recreated on another node starts empty)."""
        return (self.node_run_dir / "metrics.jsonl").exists() or (self.node_run_dir / "checkpoints").exists()

    def receive(self, relative: str, offset: int, data: bytes, complete: bool) -> None:
        """A piece of a file the launcher sends to rebuild the node copy of a run (resuming)."""
        target = (self.node_run_dir / relative).resolve()
        if not target.is_relative_to(self.node_run_dir.resolve()):
            raise ValueError(f"refusing to write {relative!r} outside {self.node_run_dir}")
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target, "r+b" if offset else "wb") as file:
            file.seek(offset)
            file.write(data)
        if complete:
            self._mirror().mark_sent(relative)

    def _mirror(self) -> FolderMirror:
        if self.mirror is None:
            self.node_run_dir.mkdir(parents=True, exist_ok=True)
            self.mirror = FolderMirror(self.node_run_dir, skip=_LAUNCHER_FILES)
        return self.mirror

    def start(self, role: str, index: int, config_text: str, env: dict[str, str], resume: bool, cwd: str) -> dict:
        """Start the worker; returns its pid and this node's address."""
        if self.process is not None and self.process.poll() is None:
            raise RuntimeError(f"{self.name} is still running (pid {self.process.pid})")
        config_path = self.work_dir / "config.toml"
        config_path.write_text(config_text)
        command = [sys.executable, "-m", "longhorizon.launch.worker", role, "--config", str(config_path),
                   "--index", str(index)]
        if resume:
            command.append("--resume")
        environment = {**os.environ, **env, **self.scratch_environment(self.name)}
        with self.log_path.open("ab") as log_file:
            # The launcher's working folder when this node has it (relative paths in the config then
            # mean the same as there), else this host's own.
            self.process = subprocess.Popen(
                command, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True, env=environment, cwd=cwd if os.path.isdir(cwd) else self.work_dir,
            )
        import ray

        return {"pid": self.process.pid, "node": ray.util.get_node_ip_address(), "host_pid": os.getpid()}

    def poll(self) -> tuple[int, int | None]:
        """(this host's pid, the worker's exit code or None): a host Ray recreated has another pid
        and no worker yet, which the launcher must not take for a worker still running."""
        return os.getpid(), None if self.process is None else self.process.poll()

    def update(self, budget: int, mirror_run: bool) -> dict:
        """New log bytes and, with `mirror_run`, changes to the node copy of the run."""
        with self.log_path.open("rb") as file:
            file.seek(self.log_sent)
            log = file.read(budget)
        self.log_sent += len(log)
        more = self.log_path.stat().st_size > self.log_sent
        pieces, deleted = [], []
        if mirror_run:
            pieces, deleted, more_files = self._mirror().changes(budget - len(log))
            more = more or more_files
        return {"log": log, "pieces": pieces, "deleted": deleted, "more": more}

    def remove_ranks_store(self) -> None:
        self.ranks_store.unlink(missing_ok=True)

    def clean_up(self, keep_run: bool) -> None:
        """Remove what this host left on its node; the node copy of the run only once the
        launcher holds all of it."""
        self.remove_ranks_store()
        if not keep_run:
            shutil.rmtree(self.node_output_dir, ignore_errors=True)
        self.remove_scratch()
        remove_tied_folder(self.work_dir)


# -- on the launcher's machine -------------------------------------------------------------------------


class RayProcess:
    """The launcher's handle on one worker in its host, with the interface `supervise` drives."""

    def __init__(self, ray, host, role: str, index: int, node: str, *, config_text: str, env: dict[str, str],
                 start_timeout_s: float, progress=print, before_start=None) -> None:
        self.ray, self.host = ray, host
        self.role, self.index, self.node = role, index, node
        self.config_text, self.env = config_text, env
        self.start_timeout_s = start_timeout_s
        self.progress = progress
        self.before_start = before_start
        self.restarts = 0
        self.started_at = 0.0
        self.pid: int | None = None
        self.host_pid: int | None = None
        self.given_up = False
        self.host_lost = False

    @property
    def name(self) -> str:
        return process_name(self.role, self.index)

    def _call(self, method: str, *args, timeout: float = _CALL_TIMEOUT_S):
        return self.ray.get(getattr(self.host, method).remote(*args), timeout=timeout)

    def _lost(self, why: Exception | str) -> None:
        if not self.host_lost:
            why = why if isinstance(why, str) else type(why).__name__
            self.progress(f"{self.name}: its Ray host was lost ({why}); Ray recreates it, then it starts again")
        self.host_lost = True

    def start(self, *, resume: bool = False) -> None:
        self.started_at = time.monotonic()
        self.given_up = False
        # A host that Ray is recreating refuses calls until it is back: one loss is one restart,
        # however long the recreation takes (up to ray.start_timeout_s).
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            try:
                if self.before_start is not None:
                    self.before_start(resume)
                started = self._call("start", self.role, self.index, self.config_text, self.env, resume, os.getcwd())
                break
            except (self.ray.exceptions.RayActorError, self.ray.exceptions.GetTimeoutError) as error:
                self._lost(error)
                if time.monotonic() > deadline:
                    return  # poll() reports it lost; the loop counts another restart
                time.sleep(1.0)
        self.pid, self.node, self.host_pid, self.host_lost = started["pid"], started["node"], started["host_pid"], False

    def poll(self) -> int | None:
        if self.given_up or self.started_at == 0.0:
            return None
        if self.host_lost:
            return _HOST_LOST
        try:
            host_pid, code = self._call("poll")
        except (self.ray.exceptions.RayActorError, self.ray.exceptions.GetTimeoutError) as error:
            self._lost(error)
            return _HOST_LOST
        if host_pid != self.host_pid:
            self._lost("it was recreated")
            return _HOST_LOST
        return code

    def terminate(self) -> None:
        self._quietly("terminate")

    def kill(self) -> None:
        self._quietly("kill")

    def _quietly(self, method: str) -> None:
        if self.host_lost:
            return
        try:
            self._call(method)
        except (self.ray.exceptions.RayActorError, self.ray.exceptions.GetTimeoutError) as error:
            self._lost(error)

    def wait(self, timeout: float | None) -> bool:
        if self.host_lost:
            return True
        try:
            return self._call("wait", timeout, timeout=None if timeout is None else timeout + _CALL_TIMEOUT_S)
        except self.ray.exceptions.RayActorError as error:
            self._lost(error)
            return True  # its worker dies with it
        except self.ray.exceptions.GetTimeoutError:
            return False

    def give_up(self) -> None:
        self.given_up = True

    def describe(self) -> dict:
        return {"pid": None if self.given_up else self.pid, "restarts": self.restarts, "node": self.node}


class Placement:
    """The run's hosts on the cluster: one per learner rank (the ranks as one placement group
    packed on one node) and one per actor, each holding its role's resources; removed at the end."""

    def __init__(self, ray, config: Config, run_id: str) -> None:
        self.ray, self.config, self.run_id = ray, config, run_id
        self.host_class = ray.remote(ProcessHost)
        self.bundles = {role: _bundle(config.ray, role) for role in ("learner", "actor")}
        self.learner_hosts: list = []
        self.actor_hosts: list = []
        self.nodes: list[dict] = []  # each host's node, learner ranks first
        self.group = None
        self.placed = False

    @property
    def hosts(self) -> list:
        return [*self.learner_hosts, *self.actor_hosts]

    def _host(self, name: str, role: str, **options):
        bundle = self.bundles[role]
        # max_restarts=-1: Ray recreates a host that died for as long as the loop wants it (the
        # loop's own limits bound the restarts).
        custom = {resource: amount for resource, amount in bundle.items() if resource not in ("CPU", "GPU")}
        return self.host_class.options(
            num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0), resources=custom, max_restarts=-1, **options,
        ).remote(name, self.run_id, self.config.run.name, self.config.ray.node_dir)

    def place(self) -> None:
        """Create the hosts and wait until the cluster has placed them all; then make sure the
        model is there on each node."""
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ray, config = self.ray, self.config
        self._check_cluster_has()
        num_ranks = config.learner.num_ranks
        if num_ranks > 1:
            # One node for every rank: they meet through a file there and gloo stays on loopback.
            self.group = placement_group([self.bundles["learner"]] * num_ranks, strategy="STRICT_PACK")
        for rank in range(num_ranks):
            in_group = {} if self.group is None else {
                "scheduling_strategy": PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=rank)
            }
            self.learner_hosts.append(self._host(process_name("learner", rank), "learner", **in_group))
        for index in range(config.actor.num_actors):
            self.actor_hosts.append(self._host(process_name("actor", index), "actor"))
        calls = [host.node.remote() for host in self.hosts]
        timeout_s = config.ray.start_timeout_s
        _, pending = ray.wait(calls, num_returns=len(calls), timeout=timeout_s)
        if pending:
            waiting = sorted({f"{role} {self.bundles[role]}" for role, call in zip(self._roles(), calls) if call in pending})
            raise ConfigError(
                f"the Ray cluster could not place every process within ray.start_timeout_s = {timeout_s:g}s; still "
                f"waiting: {', '.join(waiting)}. Free now: {ray.available_resources()}. Lower the [ray] resources, "
                "or add nodes that offer them (`ray start --resources ...`)"
            )
        try:
            self.nodes = ray.get(calls)
        except ray.exceptions.RayActorError as error:
            raise ConfigError(
                f"a process host could not start on its node ({error}); every node needs the same Python "
                "environment, with longhorizon and Ray installed"
            ) from None
        self.placed = True
        # The model on every node that runs a process, once per node (its processes would race to
        # build or convert it), nodes side by side.
        one_host_per_node = {node["node_id"]: (host, node) for host, node in zip(self.hosts, self.nodes)}
        calls = [(node, host.prepare_model.remote(config.model.path, config.model.cache_dir, os.getcwd()))
                 for host, node in one_host_per_node.values()]
        for node, call in calls:
            error = ray.get(call, timeout=_CALL_TIMEOUT_S * 5)
            if error:
                raise ConfigError(f"model.path {config.model.path!r} on node {node['hostname']} ({node['ip']}): {error}")

    def _roles(self) -> list[str]:
        return ["learner"] * self.config.learner.num_ranks + ["actor"] * self.config.actor.num_actors

    def _check_cluster_has(self) -> None:
        """Fail at once when the whole cluster lacks a resource (Ray would wait for ever)."""
        total = self.ray.cluster_resources()
        for role, bundle in self.bundles.items():
            for name, amount in bundle.items():
                if total.get(name, 0) < amount:
                    key = {"CPU": "num_cpus", "GPU": "num_gpus"}.get(name, "resources")
                    raise ConfigError(
                        f"each {role} process asks for {amount:g} {name} but the whole Ray cluster has "
                        f"{total.get(name, 0):g}: lower ray.{role}_{key}, or start nodes that offer it "
                        f"(ray start --resources '{{\"{name}\": N}}')"
                    )

    @property
    def learner_node(self) -> dict:
        return self.nodes[0]

    def learner_address(self) -> Config:
        """The config with the learner's address: its node's IP and ports free there."""
        ports = self.ray.get(self.learner_hosts[0].free_ports.remote(3), timeout=_CALL_TIMEOUT_S)
        transport = self.config.transport
        return self.config.replace(transport=transport.replace(
            host=self.learner_node["ip"], trajectory_port=transport.trajectory_port or ports[0],
            broadcast_port=transport.broadcast_port or ports[1], control_port=transport.control_port or ports[2],
        ))

    def rank_environments(self) -> list[dict[str, str]]:
        """torch.distributed's variables for each learner rank (none for a single rank)."""
        num_ranks = self.config.learner.num_ranks
        if num_ranks == 1:
            return [{}]
        node = self.learner_node
        return [
            {
                STORE_FILE_VARIABLE: node["ranks_store"], "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": node["ip"],
                "WORLD_SIZE": str(num_ranks), "RANK": str(rank),
                # Ray shows each rank only its own GPU, which is then cuda:0.
                "LOCAL_RANK": "0" if self.config.ray.learner_num_gpus > 0 else str(rank),
            }
            for rank in range(num_ranks)
        ]

    def close(self, *, keep_node_copy: bool) -> None:
        from ray.util.placement_group import remove_placement_group

        for host in self.hosts:
            if self.placed:
                try:
                    self.ray.get(host.clean_up.remote(keep_node_copy), timeout=30)
                except (self.ray.exceptions.RayError, TimeoutError):  # a host that is gone cleans nothing
                    pass
            self.ray.kill(host, no_restart=True)
        if self.group is not None:
            remove_placement_group(self.group)


class RunCopier:
    """Brings what the processes write on their nodes into the run directory: every log, and with
    node storage the learner's files (`supervise` calls `collect` between its checks)."""

    def __init__(self, ray, run_dir: Path, processes: list[RayProcess], mirrored: RayProcess | None) -> None:
        self.ray, self.run_dir = ray, run_dir
        self.processes, self.mirrored = processes, mirrored
        self.complete = True  # everything written so far is here

    def collect(self, final: bool = False) -> None:
        # Between checks a few seconds at most, so the progress line stays live; at the end until
        # every byte is here.
        deadline = time.monotonic() + (3600.0 if final else 2.0)
        self.complete = False
        while True:
            calls = [(process, process.host.update.remote(_COPY_BUDGET_BYTES, process is self.mirrored))
                     for process in self.processes]
            more = False
            for process, call in calls:
                try:
                    changes = self.ray.get(call, timeout=_CALL_TIMEOUT_S)
                except (self.ray.exceptions.RayActorError, self.ray.exceptions.GetTimeoutError):
                    continue  # the loop learns of a lost host through poll()
                if changes["log"]:
                    with open(self.run_dir / "logs" / f"{process.name}.log", "ab") as log:
                        log.write(changes["log"])
                apply_pieces(self.run_dir, changes["pieces"], changes["deleted"])
                more = more or changes["more"]
            if not more:
                self.complete = final
                return
            if time.monotonic() > deadline:
                return


def _weights_need_shared_storage(config: Config) -> bool:
    """Whether the weights transport has the actors read what the learner writes to its disk."""
    return publisher_class(config.learner.weights_transport).shared_filesystem


def _decide_storage(ray, config: Config, run_dir: Path, learner_host, actor_hosts: list) -> str:
    """"shared" when the learner's node (and, for `path` weights, every actor's) sees the run
    directory, else "node"; `ray.run_storage` can ask for either."""
    setting = config.ray.run_storage
    if setting == "node":
        return "node"
    needs_actors = _weights_need_shared_storage(config)
    probe, token = run_dir / ".storage-probe", secrets.token_hex(16)
    probe.write_text(token)
    try:
        seen = ray.get(learner_host.sees.remote(str(probe), token), timeout=_CALL_TIMEOUT_S)
        if needs_actors:
            seen = seen and all(ray.get([host.sees.remote(str(probe), token) for host in actor_hosts],
                                        timeout=_CALL_TIMEOUT_S))
    finally:
        probe.unlink(missing_ok=True)
    if seen:
        return "shared"
    if setting == "shared" or needs_actors:
        why = f"the actors read the weights there (learner.weights_transport = {config.learner.weights_transport!r})" if needs_actors else \
            "ray.run_storage = 'shared'"
        raise ConfigError(
            f"{run_dir} is not visible from the learner's node{' or an actor node' if needs_actors else ''}, but {why}: "
            "point run.output_dir at storage every node mounts at the same path, or use ray.run_storage = 'node'"
        )
    return "node"


def _push_run(ray, host, run_dir: Path) -> int:
    """Send this machine's copy of the run to a learner node that has none (a resumed run, or a
    host recreated on another node): the latest checkpoint and the files the learner continues."""
    from longhorizon.learner.checkpoint import latest_checkpoint

    latest = latest_checkpoint(run_dir)
    sent = 0
    for path in sorted(run_dir.rglob("*")):
        relative = path.relative_to(run_dir).as_posix()
        if not path.is_file() or relative.split("/")[0] in _LAUNCHER_FILES or ".partial" in relative:
            continue
        if relative.startswith("checkpoints/") and (latest is None or not path.is_relative_to(latest)):
            continue  # only the checkpoint the learner resumes from
        size = path.stat().st_size
        with open(path, "rb") as file:
            offset = 0
            while True:
                data = file.read(_COPY_BUDGET_BYTES)
                complete = offset + len(data) >= size
                ray.get(host.receive.remote(relative, offset, data, complete), timeout=_CALL_TIMEOUT_S)
                offset += len(data)
                sent += len(data)
                if complete:
                    break
    return sent


def launch_ray(config: Config, *, progress=print) -> int:
    """Run a training job on the Ray cluster at `ray.address`; returns the exit code as launch_local."""
    check_ray_settings(config)
    ray = import_ray()
    validate_config(_driver_view(config))
    # The run directory is this machine's; the nodes get absolute paths where they need any.
    config = config.replace(run=config.run.replace(output_dir=str(Path(config.run.output_dir).resolve())))
    connected = connect(ray, config.ray.address)
    run_id = f"{config.run.name}-{secrets.token_hex(4)}"
    placement = Placement(ray, config, run_id)
    storage, copier = None, None
    try:
        # Built or converted here once: nodes on this machine (or sharing its disk) find it ready.
        resolve_model_path(config.model.path, config.model.cache_dir)
        placement.place()
        # The learner binds on its node's address and the actors connect there.
        config = placement.learner_address()
        auth_mechanism(config.transport)  # beyond loopback: CurveZMQ, or transport.insecure said explicitly
        run_dir = prepare_run_dir(config, progress=progress)
        storage = _decide_storage(ray, config, run_dir, placement.learner_hosts[0], placement.actor_hosts)
        learner_node = placement.learner_node
        output_dir = learner_node["output_dir"] if storage == "node" else config.run.output_dir
        # What each worker reads: the same config, with the learner's files where it writes them.
        config_text = dump_toml(config.replace(run=config.run.replace(output_dir=output_dir)))
        # CurveZMQ keys, or the run's secret on loopback (common/auth.py).
        keys_by_role = auth_environments(config.transport)
        first_host = placement.learner_hosts[0]

        def before_learner_start(resume: bool) -> None:
            if storage != "node" or not (resume or config.run.resume):
                return
            if not ray.get(first_host.has_run.remote(), timeout=_CALL_TIMEOUT_S):
                sent = _push_run(ray, first_host, run_dir)
                progress(f"sent the run's latest checkpoint and metrics ({sent / 1e6:.1f} MB) to the learner's node")

        common = {"config_text": config_text, "start_timeout_s": config.ray.start_timeout_s, "progress": progress}
        learner_ranks = [
            RayProcess(ray, host, "learner", rank, node["ip"], env={**keys_by_role["learner"], **rank_env},
                       before_start=before_learner_start if rank == 0 else None, **common)
            for rank, (host, node, rank_env) in enumerate(zip(placement.learner_hosts, placement.nodes,
                                                               placement.rank_environments()))
        ]
        actor_nodes = placement.nodes[len(learner_ranks):]
        actors = [
            RayProcess(ray, host, "actor", index, node["ip"], env=keys_by_role["actor"], **common)
            for index, (host, node) in enumerate(zip(placement.actor_hosts, actor_nodes))
        ]
        copier = RunCopier(ray, run_dir, [*learner_ranks, *actors], learner_ranks[0] if storage == "node" else None)

        progress(f"run directory: {run_dir}  (logs in {run_dir / 'logs'})")
        ranks_text = "" if len(learner_ranks) == 1 else f" of {len(learner_ranks)} ranks"
        progress(
            f"starting 1 learner{ranks_text} and {len(actors)} actor(s) on the Ray cluster at {config.ray.address}: "
            f"env {config.env.name}, engine {config.actor.engine}, model {config.model.path}, mode {config.run.mode}, "
            f"{config.run.total_steps} steps"
        )
        progress(
            f"learner on {learner_node['hostname']} ({learner_node['ip']}), actors on "
            f"{', '.join(sorted({node['ip'] for node in actor_nodes}))}; "
            + ("the learner writes into the run directory (shared storage)" if storage == "shared" else
               f"the learner writes on its node ({output_dir}) and its files are copied here")
        )
        return supervise(
            config, run_dir, learner_ranks, actors, progress=progress, collect=copier.collect,
            before_learner_restart=lambda: ray.get(first_host.remove_ranks_store.remote(), timeout=_CALL_TIMEOUT_S),
        )
    finally:
        keep_node_copy = storage == "node" and copier is not None and not copier.complete
        if keep_node_copy:
            progress(f"not every file of the learner reached {config.run_dir}: the rest stays on its node, "
                     f"under {config.ray.node_dir or 'its temporary folder'}/longhorizon-runs/{run_id}")
        placement.close(keep_node_copy=keep_node_copy)
        if connected:
            ray.shutdown()
