"""run.launcher = "ray": a two-node Ray cluster on this machine runs the codebook learning check.

The cluster is real: a head node and a worker node started with `ray start`, each with its own
resources (`learner_node` on the head, `actor_node` on the worker) so the actors can be pinned to
the worker node. Ray 2.60 replaces a node address of 127.0.0.1 by the machine's outward address
(it treats 127.0.0.1 as "this machine", not as an address), so the nodes, the driver and the
learner's sockets use another loopback address, 127.0.0.2, which Ray keeps: every connection
stays on the loopback interface. (Ray's own servers listen on all addresses whatever the node
address; nothing here connects to them through any other.)

The cluster is stopped through the `ray start --block` processes this module started, by pid:
`ray stop` would stop every Ray on the machine.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from longhorizon.common.config import ConfigError, load_config
from longhorizon.common.metrics import read_metrics
from longhorizon.common.processes import stop_process
from longhorizon.launch.launchers.ray import FolderMirror, apply_pieces, check_ray_settings
from longhorizon.learner.checkpoint import latest_checkpoint

REPO_ROOT = Path(__file__).resolve().parent.parent
NODE_IP = "127.0.0.2"
RAY_WORKER_PORTS = range(10002, 20000)  # Ray's default worker port range: the head must not sit in it


def _free_port_outside_ray_range() -> int:
    import socket

    while True:
        with socket.socket() as probe:
            probe.bind((NODE_IP, 0))
            port = probe.getsockname()[1]
        if port not in RAY_WORKER_PORTS:
            return port


class RayCluster:
    """A head and a worker node on this machine, each a `ray start --block` process we own."""

    def __init__(self) -> None:
        # Short: Ray puts Unix sockets under it, whose paths must stay under 108 bytes.
        self.temp_dir = tempfile.mkdtemp(prefix="lh-ray-", dir="/tmp")
        self.port = _free_port_outside_ray_range()
        self.address = f"{NODE_IP}:{self.port}"
        self.processes: list[subprocess.Popen] = []
        self.env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
        self.ray = str(Path(sys.executable).parent / "ray")

    def _start_node(self, name: str, arguments: list[str]) -> subprocess.Popen:
        """Start a node; `_wait_until_started` waits for it."""
        log = open(Path(self.temp_dir) / f"{name}.out", "w")
        # Small footprint: 2 cores and shared memory on the test machine. Ports Ray would take at
        # fixed numbers (client server, dashboard agent) are chosen free, so two clusters (or two
        # nodes) on one machine do not collide.
        process = subprocess.Popen(
            [self.ray, "start", "--block", "--node-ip-address", NODE_IP, "--object-store-memory", str(100 * 2**20),
             "--disable-usage-stats", "--dashboard-agent-listen-port", str(_free_port_outside_ray_range()),
             *arguments],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self.env, start_new_session=True,
        )
        log.close()
        self.processes.append(process)
        return process

    def _wait_until(self, ready, process: subprocess.Popen, name: str) -> None:
        deadline = time.monotonic() + 120
        while not ready():
            output = (Path(self.temp_dir) / f"{name}.out").read_text()
            assert process.poll() is None and time.monotonic() < deadline, output
            time.sleep(0.2)

    def _gcs_accepts(self) -> bool:
        import socket

        try:
            socket.create_connection((NODE_IP, self.port), timeout=1).close()
        except OSError:
            return False
        return True

    def _started(self, name: str) -> bool:
        return "Ray runtime started" in (Path(self.temp_dir) / f"{name}.out").read_text()

    def start(self) -> None:
        self.head = self._start_node("head", [
            "--head", "--port", str(self.port), "--num-cpus", "1", "--resources", json.dumps({"learner_node": 1}),
            "--include-dashboard=false", "--temp-dir", self.temp_dir,
            "--ray-client-server-port", str(_free_port_outside_ray_range()),
        ])
        # The worker node joins as soon as the head's control store listens; both then finish
        # starting side by side.
        self._wait_until(self._gcs_accepts, self.head, "head")
        self.worker = self._start_node("worker", [
            "--address", self.address, "--num-cpus", "2", "--resources", json.dumps({"actor_node": 2}),
        ])
        self._wait_until(lambda: self._started("head"), self.head, "head")
        self._wait_until(lambda: self._started("worker"), self.worker, "worker")

    def stop(self) -> None:
        # The worker node first, then the head; each `ray start --block` stops the processes of
        # its node on SIGTERM. Anything left in their process groups is ended after a grace.
        for process in reversed(self.processes):
            stop_process(process, timeout_s=60)
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def raylet_session(self, pid: int) -> int | None:
        """The session (the `ray start` process) of the raylet whose host runs process `pid`:
        worker process -> its host (a Ray worker) -> the node's raylet."""
        host = _parent(pid)
        raylet = _parent(host) if host else None
        return os.getsid(raylet) if raylet else None


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return int(stat.read().rsplit(")", 1)[1].split()[1])
    except (FileNotFoundError, ProcessLookupError):
        return None


def _temporary_folder(pid: int) -> Path:
    """The TMPDIR its host gave worker process `pid`: its scratch folder."""
    environment = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return Path(next(entry for entry in environment if entry.startswith(b"TMPDIR=")).decode()[len("TMPDIR="):])


@pytest.fixture(scope="module")
def ray_cluster():
    pytest.importorskip("ray")
    cluster = RayCluster()
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def _ray_config(tmp_path, model_folder, cluster, overrides=()):
    return load_config(
        REPO_ROOT / "configs" / "codebook.toml",
        [f"run.output_dir={str(tmp_path)!r}", f"model.path={str(model_folder)!r}", "run.launcher='ray'",
         f"ray.address={cluster.address!r}", "ray.learner_resources={learner_node = 1}",
         "ray.actor_resources={actor_node = 1}", *overrides],
    )


def _run_files(run_dir: Path) -> set[str]:
    """The run directory's file names; TensorBoard's event file is named after host, time and pid."""
    names = set()
    for path in run_dir.rglob("*"):
        if path.is_file():
            name = path.relative_to(run_dir).as_posix()
            names.add("tensorboard/events" if name.startswith("tensorboard/events.out.tfevents.") else name)
    return names


@pytest.mark.slow
def test_codebook_learns_on_a_two_node_ray_cluster_and_survives_a_killed_actor(tmp_path, tiny_codebook_model, ray_cluster):
    from longhorizon.launch.launchers.ray import launch_ray
    from tests.test_learning import _evaluate

    from tests.test_learning import FREEZE_GUARD, TARGET

    config = _ray_config(tmp_path, tiny_codebook_model, ray_cluster, [TARGET, *FREEZE_GUARD])
    run_dir = config.run_dir
    killed: dict = {}

    def kill_actors_midway() -> None:
        """At step 5 actor-0's worker process; at step 15 actor-1's Ray host (the Ray actor
        process that runs its worker), which Ray recreates."""
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and "host" not in killed:
            records = read_metrics(run_dir)
            step = records[-1]["step"] if records else 0
            if step >= 5 and "worker" not in killed:
                table = json.loads((run_dir / "processes.json").read_text())
                killed["worker"] = table["actor-0"]["pid"]
                killed["session"] = ray_cluster.raylet_session(killed["worker"])
                killed["folders"] = [_temporary_folder(killed["worker"])]
                os.kill(killed["worker"], signal.SIGKILL)
            if step >= 15 and "worker" in killed:
                table = json.loads((run_dir / "processes.json").read_text())
                worker = table["actor-1"]["pid"]
                killed["host"] = _parent(worker)
                # The host's own folder (its worker's log is there) and the worker's scratch.
                killed["folders"] += [Path(os.readlink(f"/proc/{worker}/fd/1")).parent, _temporary_folder(worker)]
                os.kill(killed["host"], signal.SIGKILL)
            time.sleep(0.2)

    killer = threading.Thread(target=kill_actors_midway, daemon=True)
    killer.start()
    lines: list[str] = []
    started = time.monotonic()
    code = launch_ray(config, progress=lines.append)
    print(f"ray run: {time.monotonic() - started:.1f}s")
    killer.join(timeout=5)
    output = "\n".join(lines)
    assert code == 0, output
    # On one machine the learner's node sees the run directory: ray.run_storage = auto finds it shared.
    assert "the learner writes into the run directory (shared storage)" in output
    assert "host" in killed, f"the run ended before both kills: {killed}"
    assert "actor-0 exited with code -9; restarting (1)" in output
    assert "actor-1: its Ray host was lost" in output and "actor-1 exited with code 1; restarting (1)" in output
    # The actors ran on the worker node (their resource exists only there).
    assert killed["session"] == ray_cluster.worker.pid
    table = json.loads((run_dir / "processes.json").read_text())
    assert table["actor-0"]["restarts"] == 1 and table["actor-0"]["pid"] != killed["worker"], output
    assert table["actor-1"]["restarts"] == 1 and _parent(table["actor-1"]["pid"]) != killed["host"], output
    assert {entry["node"] for entry in table.values()} == {NODE_IP}
    # The killed worker's temporary folder, and the killed host's and its worker's: all deleted.
    assert len(killed["folders"]) == 3 and not [folder for folder in killed["folders"] if folder.exists()], killed
    assert "127.0.0.2" in (run_dir / "config.toml").read_text()  # the learner's node address, not loopback's default

    records = read_metrics(run_dir)
    last = records[-1]["step"]  # the budget, or where training success held the target
    assert [r["step"] for r in records] == list(range(1, last + 1))
    assert last == config.run.total_steps or records[-1]["target_reached"]
    assert max(r["staleness_max"] for r in records) <= config.learner.max_staleness
    assert records[-1]["actors_seen"] == config.actor.num_actors
    assert sum("| success" in line for line in lines) == last  # one progress line per step
    for name in ("learner", "actor-0", "actor-1"):
        assert (run_dir / "logs" / f"{name}.log").stat().st_size > 0, name
    checkpoint = latest_checkpoint(run_dir)
    assert checkpoint is not None and checkpoint.name == f"step_{last:06d}"
    trained = _evaluate(config, checkpoint)
    print(f"held-out greedy success after the Ray run: {trained.success_rate:.1%}")
    assert trained.failed_episodes == 0
    assert trained.success_rate > 0.8


@pytest.mark.slow
def test_without_shared_storage_the_run_directory_holds_what_a_local_run_writes(tmp_path, tiny_codebook_model, ray_cluster):
    """The learner writes on its node (ray.run_storage = node) and its files are copied here; the
    run directory ends up with the same files as a local run of the same config. The learner has
    two ranks here (a placement group on the head node). Resuming then sends the latest
    checkpoint back to the learner's node, which starts from it."""
    from longhorizon.launch.launchers.local import launch_local
    from longhorizon.launch.launchers.ray import launch_ray

    # One actor: the run directory's files are the point here, and every process less starts
    # sooner (four processes importing torch at once on a 2-core machine).
    short = ["run.total_steps=4", "learner.checkpoint_every=2", "learner.groups_per_step=4", "learner.num_ranks=2",
             "actor.num_actors=1"]
    local_config = load_config(REPO_ROOT / "configs" / "codebook.toml", [
        f"run.output_dir={str(tmp_path / 'local')!r}", f"model.path={str(tiny_codebook_model)!r}", *short,
    ])
    assert launch_local(local_config, progress=lambda line: None) == 0
    node_dir = tmp_path / "learner-node"
    # Two ranks share the head's one learner_node resource and its one CPU.
    two_ranks = ["ray.learner_num_cpus=0.5", "ray.learner_resources={learner_node = 0.5}"]
    ray_config = _ray_config(tmp_path / "ray", tiny_codebook_model, ray_cluster,
                             [*short, *two_ranks, "ray.run_storage='node'", f"ray.node_dir={str(node_dir)!r}"])
    lines: list[str] = []
    assert launch_ray(ray_config, progress=lines.append) == 0, "\n".join(lines)
    assert any("the learner writes on its node" in line for line in lines)
    assert _run_files(ray_config.run_dir) == _run_files(local_config.run_dir)
    assert "logs/learner-rank1.log" in _run_files(ray_config.run_dir)
    assert [r["step"] for r in read_metrics(ray_config.run_dir)] == [1, 2, 3, 4]
    # The node copy is removed once everything is here.
    assert not any(path.is_file() for path in node_dir.rglob("*"))

    # Resumed: the node copy is gone, so the launcher sends the latest checkpoint there first.
    # Midway the learner's first rank is killed: both ranks start again from the node's latest
    # checkpoint (the node copy is still there: nothing is sent again).
    resumed = _ray_config(tmp_path / "ray", tiny_codebook_model, ray_cluster, [
        *short, *two_ranks, "run.total_steps=8", "run.resume=true", "ray.run_storage='node'",
        f"ray.node_dir={str(node_dir)!r}",
    ])
    run_dir = resumed.run_dir
    killed: dict = {}

    def kill_the_learner_midway() -> None:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            records = read_metrics(run_dir)
            if records and records[-1]["step"] >= 5:
                killed["pid"] = json.loads((run_dir / "processes.json").read_text())["learner"]["pid"]
                os.kill(killed["pid"], signal.SIGKILL)
                return
            time.sleep(0.2)

    killer = threading.Thread(target=kill_the_learner_midway, daemon=True)
    killer.start()
    lines.clear()
    assert launch_ray(resumed, progress=lines.append) == 0, "\n".join(lines)
    killer.join(timeout=5)
    output = "\n".join(lines)
    assert sum("sent the run's latest checkpoint" in line for line in lines) == 1, output
    assert killed and "the learner exited with code -9; restarting it from its latest checkpoint (1/3)" in output
    assert json.loads((run_dir / "processes.json").read_text())["learner"]["restarts"] == 1
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, 9))
    assert latest_checkpoint(run_dir).name == "step_000008"
    assert (run_dir / "logs" / "learner.log").read_text().count("resumed from") == 2


def test_a_missing_ray_is_an_error_naming_the_fix(tmp_path, monkeypatch, capsys):
    from longhorizon.launch.cli import main

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now fails as if it were not installed
    config = REPO_ROOT / "configs" / "codebook.toml"
    assert main(["train", str(config), "run.launcher=ray", f"run.output_dir={str(tmp_path)!r}"]) == 2
    error = capsys.readouterr().err
    assert "needs Ray, which is not installed" in error and "pip install -e '.[ray]'" in error
    assert not (tmp_path / "codebook").exists()


def test_an_unreachable_ray_address_is_an_error_naming_the_fix(tmp_path, capsys):
    pytest.importorskip("ray")
    from longhorizon.launch.cli import main
    from longhorizon.launch.launchers.supervise import free_port

    config = REPO_ROOT / "configs" / "codebook.toml"
    nobody = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    assert main(["train", str(config), "run.launcher=ray", f"ray.address={nobody!r}", f"run.output_dir={str(tmp_path)!r}"]) == 2
    assert time.monotonic() - started < 30
    error = capsys.readouterr().err
    assert f"cannot reach the Ray cluster at ray.address = '{nobody}'" in error and "ray start --head" in error


@pytest.mark.parametrize(
    "override, message",
    [
        ("ray.run_storage='nfs'", "ray.run_storage must be one of"),
        ("ray.actor_resources={CPU = 2}", "ray.actor_num_cpus"),
        ("ray.learner_resources={gpu_node = -1}", "must be a number >= 0"),
        ("learner.device='cuda'", "ray.learner_num_gpus = 1"),
        ("learner.weights_transport='path'", "shared storage"),
    ],
)
def test_ray_settings_are_checked_before_connecting(override, message):
    overrides = ["run.launcher=ray", override]
    if "weights_transport" in override:
        overrides.append("ray.run_storage='node'")
    with pytest.raises(ConfigError, match=message):
        check_ray_settings(load_config(None, overrides))


def test_an_unknown_launcher_is_refused(capsys):
    from longhorizon.launch.cli import main

    assert main(["train", str(REPO_ROOT / "configs" / "codebook.toml"), "run.launcher=slurm"]) == 2
    assert "run.launcher: unknown launcher 'slurm'; available: local, ray" in capsys.readouterr().err


def test_the_folder_mirror_sends_growth_replacements_and_deletions(tmp_path):
    source, copy = tmp_path / "node", tmp_path / "here"
    source.mkdir()
    copy.mkdir()
    mirror = FolderMirror(source, skip=("logs",))

    def sync(budget=1 << 20):
        pieces, deleted, more = mirror.changes(budget)
        apply_pieces(copy, pieces, deleted)
        return pieces, more

    (source / "metrics.jsonl").write_text('{"step": 1}\n')
    (source / "logs").mkdir()
    (source / "logs" / "x.log").write_text("not ours")
    (source / "checkpoints" / "step_000002.partial").mkdir(parents=True)
    (source / "checkpoints" / "step_000002.partial" / "state.pt").write_bytes(b"half")
    sync()
    assert _run_files(copy) == {"metrics.jsonl"}
    # Growth travels as the new bytes only.
    with open(source / "metrics.jsonl", "a") as file:
        file.write('{"step": 2}\n')
    pieces, _ = sync()
    assert pieces == [("metrics.jsonl", 12, b'{"step": 2}\n')]
    # A checkpoint renamed into place travels, state.pt last; a big file in pieces under the budget.
    (source / "checkpoints" / "step_000002.partial").rename(source / "checkpoints" / "step_000002")
    (source / "checkpoints" / "step_000002" / "model.safetensors").write_bytes(b"w" * 100)
    pieces, more = sync(budget=60)
    assert more and pieces == [("checkpoints/step_000002/model.safetensors", 0, b"w" * 60)]
    pieces, more = sync(budget=60)
    assert [piece[0] for piece in pieces] == ["checkpoints/step_000002/model.safetensors", "checkpoints/step_000002/state.pt"]
    assert not more
    assert (copy / "checkpoints" / "step_000002" / "model.safetensors").read_bytes() == b"w" * 100
    # A file replaced by a shorter one (metrics cut back on resume) starts over.
    partial = source / "metrics.jsonl.partial"
    partial.write_text('{"step": 1}\n')
    partial.replace(source / "metrics.jsonl")
    sync()
    assert (copy / "metrics.jsonl").read_text() == '{"step": 1}\n'
    # A pruned checkpoint disappears here too, folder and all.
    shutil.rmtree(source / "checkpoints" / "step_000002")
    sync()
    assert _run_files(copy) == {"metrics.jsonl"} and not (copy / "checkpoints" / "step_000002").exists()
    with pytest.raises(ValueError, match="refusing"):
        apply_pieces(copy, [("../outside", 0, b"x")], [])
