"""`longhorizon bench soak`: a long training run with actors (and the learner) killed now and then; memory and data.

It starts `longhorizon train CONFIG` (the codebook config by default, run.total_steps set so the
run outlasts the soak). From the learner's first step on (start-up is not part of the soak), it
kills a random actor with SIGKILL every `--kill-every-s` seconds (the launcher restarts it), the
learner every `--kill-learner-every-s` seconds if asked (the launcher restarts it from its latest
checkpoint, written every 200 steps then; it restarts a learner at most 3 times in a run), and
samples the resident memory of every process of the run every `--sample-every-s` seconds. After
`--minutes` it stops the run with SIGTERM and reports:

- per process (learner, and each actor process incarnation that lived long enough): resident
  memory when its warm-up ended (`--warmup-s` after it started) and at its last sample, and the
  growth between them;
- where the data went, from the learner's last metrics record: trajectories received = accepted +
  refused (each for one counted reason), accepted = trained + dropped with their group + held +
  lost on restart (held by the learner at the checkpoint a restarted learner resumed from), and
  the episodes the actors reported sending against those received (the difference was in flight,
  or died with a killed actor);
- that no process of the run is left once the launcher has exited.

Run: `longhorizon bench soak --minutes 60 --kill-every-s 120` (a table for people, then one line of
JSON); `--kill-learner-every-s 600` kills the learner too. A run directory under `--output-dir` (default: a temporary folder) keeps the logs.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from longhorizon.common.metrics import read_metrics
from longhorizon.common.processes import stop_process
from longhorizon.launch.bench.memory import MIB, memory_use
from longhorizon.launch.launchers.supervise import MAX_LEARNER_RESTARTS
from longhorizon.launch.bench.tables import BenchStopped, Column, parsed, print_table, run_as_command

PROG = "longhorizon bench soak"

_REFUSALS = (
    "trajectories_duplicate", "trajectories_malformed", "trajectories_too_long", "trajectories_dropped_stale",
    "trajectories_future", "trajectories_late", "trajectories_overfull",
)
REPO_ROOT = Path(__file__).resolve().parents[2]
_STARTUP_TIMEOUT_S = 600.0
_EXIT_GRACE_S = 5.0
"""How long the processes of the run may take to exit once the launcher returned, before they
count as left behind."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="longhorizon bench soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(REPO_ROOT / "configs" / "codebook.toml"),
                        help="training config (default: configs/codebook.toml)")
    parser.add_argument("--minutes", type=float, default=60.0, help="length of the soak (default %(default)s)")
    parser.add_argument("--kill-every-s", type=float, default=120.0,
                        help="SIGKILL a random actor this often; 0 never (default %(default)s)")
    parser.add_argument("--kill-learner-every-s", type=float, default=0.0,
                        help="SIGKILL the learner this often (at most 3 times: the launcher's limit of learner "
                             "restarts); 0 never (default %(default)s)")
    parser.add_argument("--sample-every-s", type=float, default=10.0, help="memory sampling interval (default %(default)s)")
    parser.add_argument("--warmup-s", type=float, default=120.0,
                        help="a process's memory is compared from this long after it started (default %(default)s)")
    parser.add_argument("--output-dir", default=None, help="where the run directory goes (default: a temporary folder)")
    parser.add_argument("overrides", nargs="*", help="config overrides, key=value")
    return parser


def _rss_mb(pid: int) -> float | None:
    """Resident memory of one process, or None once it has ended."""
    use = memory_use([pid])
    return use.rss_bytes / MIB if use.processes else None


def _run_processes(run_dir: Path) -> dict[str, dict]:
    """The launcher's table of the processes now running: name to its entry (pid, scratch folder)."""
    try:
        table = json.loads((run_dir / "processes.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}
    return {name: entry for name, entry in table.items() if entry.get("pid")}


def memory_growth(samples: dict[tuple[str, int], list[tuple[float, float]]], warmup_s: float) -> list[dict[str, Any]]:
    """Growth of each process's memory from the end of its warm-up to its last sample.

    `samples` maps (role, pid) to (seconds since that process was first seen, RSS MB) pairs.
    Processes that did not outlive their warm-up by at least one more sample are left out.
    """
    rows = []
    for (role, pid), series in sorted(samples.items()):
        after_warmup = [(t, rss) for t, rss in series if t >= warmup_s]
        if len(after_warmup) < 2:
            continue
        (start_t, start_rss), (end_t, end_rss) = after_warmup[0], after_warmup[-1]
        rows.append({
            "role": role, "pid": pid, "from_s": start_t, "to_s": end_t, "rss_start_mb": start_rss,
            "rss_end_mb": end_rss, "growth_pct": 100.0 * (end_rss - start_rss) / start_rss,
        })
    return rows


def data_accounting(record: dict[str, Any]) -> dict[str, Any]:
    """The learner's last record, checked: every trajectory received is counted once."""
    refused = sum(int(record.get(name, 0)) for name in _REFUSALS)
    received, accepted = int(record.get("trajectories_received", 0)), int(record.get("trajectories_accepted", 0))
    trained = int(record.get("trajectories_trained", 0))
    dropped = int(record.get("trajectories_dropped_with_group", 0))
    held = int(record.get("trajectories_held", 0))
    lost_on_restart = int(record.get("trajectories_lost_on_restart", 0))
    reported = int(record.get("actor_episodes_reported", 0))
    return {
        "received": received, "accepted": accepted, "refused": refused, "trained": trained,
        "dropped_with_group": dropped, "held": held, "lost_on_restart": lost_on_restart,
        "actor_episodes_reported": reported,
        "in_flight_or_lost_at_kills": reported - received,
        "received_adds_up": received == accepted + refused,
        "accepted_adds_up": accepted == trained + dropped + held + lost_on_restart,
    }


def run_soak(args: argparse.Namespace) -> dict[str, Any]:
    output = Path(args.output_dir or tempfile.mkdtemp(prefix="longhorizon-soak-"))
    run_dir = output / "soak"
    command = [
        sys.executable, "-m", "longhorizon.launch.cli", "train", args.config,
        f"run.output_dir={str(output)!r}", "run.name='soak'", "run.total_steps=100000000",
        # A killed learner resumes from its latest checkpoint: a recent one when the learner is killed.
        f"learner.checkpoint_every={200 if args.kill_learner_every_s > 0 else 1000}", *args.overrides, "--no-plots",
    ]
    output.mkdir(parents=True, exist_ok=True)
    print(f"soak: {args.config} for {args.minutes:g} min from its first learner step, "
          + (f"an actor killed every {args.kill_every_s:g} s" if args.kill_every_s > 0 else "no actor killed")
          + (f", the learner every {args.kill_learner_every_s:g} s" if args.kill_learner_every_s > 0 else "")
          + f"; the run is in {run_dir} (its console in {output / 'launcher.log'})"
          + ("" if args.output_dir else ", removed at the end"), flush=True)
    launcher_log = (output / "launcher.log").open("w")
    launcher = subprocess.Popen(command, stdout=launcher_log, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
    launcher_log.close()
    samples: dict[tuple[str, int], list[tuple[float, float]]] = {}
    first_seen: dict[int, float] = {}
    every_pid: set[int] = set()
    scratch_folders: set[str] = set()  # each worker's TMPDIR, which the launcher must delete
    kills = learner_kills = 0
    rng = random.Random(0)
    # The soak's clock starts at the learner's first step: start-up (model build, imports) is
    # not part of it and takes very different times on a loaded machine.
    startup_deadline = time.monotonic() + _STARTUP_TIMEOUT_S
    try:
        while not (run_dir / "metrics.jsonl").is_file() or (run_dir / "metrics.jsonl").stat().st_size == 0:
            if launcher.poll() is not None or time.monotonic() > startup_deadline:
                stop_process(launcher, timeout_s=180)
                tail = (output / "launcher.log").read_text()[-2000:]
                raise RuntimeError(f"the run did not reach its first step (exit {launcher.returncode}): {tail}")
            time.sleep(0.5)
    except KeyboardInterrupt:  # before the clock started: nothing measured to report
        stop_process(launcher, timeout_s=180)
        if not args.output_dir:
            shutil.rmtree(output, ignore_errors=True)
        raise
    started = time.monotonic()
    print("soak: the learner made its first step; the clock starts", flush=True)
    next_kill = started + args.kill_every_s if args.kill_every_s > 0 else float("inf")
    next_learner_kill = started + args.kill_learner_every_s if args.kill_learner_every_s > 0 else float("inf")
    next_report = started + 60
    try:
        while time.monotonic() - started < args.minutes * 60:
            if launcher.poll() is not None:
                tail = (output / "launcher.log").read_text()[-2000:]
                raise RuntimeError(f"the run ended early (exit {launcher.returncode}): {tail}")
            now = time.monotonic()
            processes = _run_processes(run_dir)
            for name, entry in processes.items():
                pid = entry["pid"]
                if entry.get("scratch"):
                    scratch_folders.add(entry["scratch"])
                every_pid.add(pid)
                first_seen.setdefault(pid, now)
                rss = _rss_mb(pid)
                if rss is not None:
                    role = "learner" if name == "learner" else name
                    samples.setdefault((role, pid), []).append((now - first_seen[pid], rss))
            actors = [entry["pid"] for name, entry in processes.items() if name != "learner"]
            if now >= next_kill and actors:
                os.kill(rng.choice(actors), signal.SIGKILL)
                kills += 1
                next_kill = now + args.kill_every_s
            if now >= next_learner_kill and "learner" in processes and learner_kills < MAX_LEARNER_RESTARTS:
                os.kill(processes["learner"]["pid"], signal.SIGKILL)
                learner_kills += 1
                next_learner_kill = now + args.kill_learner_every_s
            if now >= next_report:
                next_report = now + 60
                print(f"  {(now - started) / 60:5.1f} min: {kills} actors killed, the learner {learner_kills} times",
                      flush=True)
            time.sleep(args.sample_every_s)
    except KeyboardInterrupt:  # Ctrl-C: stop, and report what the minutes so far measured
        print(f"soak: interrupted after {(time.monotonic() - started) / 60:.1f} min; stopping the run and "
              "reporting what was measured", flush=True)
    finally:
        minutes = (time.monotonic() - started) / 60  # the soak's own time, not the stop's
        stop_process(launcher, timeout_s=180)
    every_pid.update(entry["pid"] for entry in _run_processes(run_dir).values())
    # The launcher has returned, so its children are stopping: give them a moment to go.
    deadline = time.monotonic() + _EXIT_GRACE_S
    while any(_rss_mb(pid) is not None for pid in every_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    left_behind = sorted(pid for pid in every_pid if _rss_mb(pid) is not None)
    folders_left_behind = sorted(folder for folder in scratch_folders if os.path.exists(folder))
    records = read_metrics(run_dir)
    if not args.output_dir:  # a temporary folder: the figures below are all that is kept
        shutil.rmtree(output, ignore_errors=True)
    return {
        "minutes": min(args.minutes, minutes), "kills": kills, "learner_kills": learner_kills, "steps": records[-1]["step"] if records else 0,
        "memory": memory_growth(samples, args.warmup_s),
        "data": data_accounting(records[-1]) if records else {},
        "left_behind": left_behind, "scratch_folders": len(scratch_folders),
        "folders_left_behind": folders_left_behind, "run_dir": str(run_dir) if args.output_dir else None,
    }


def print_report(result: dict[str, Any]) -> None:
    """A table for people and the data's account (the command prints the result as JSON after them)."""
    print(f"soak: {result['minutes']:.0f} min, {result['steps']} learner steps, {result['kills']} actors killed, "
          f"the learner {result['learner_kills']} times")
    print_table(
        [Column("process", 10), Column("pid", 8), Column("from s", 7, ".0f"), Column("to s", 7, ".0f"),
         Column("RSS start MB", 13, ".0f"), Column("RSS end MB", 11, ".0f"), Column("growth", 8)],
        [[row["role"], row["pid"], row["from_s"], row["to_s"], row["rss_start_mb"], row["rss_end_mb"],
          f"{row['growth_pct']:.1f}%"] for row in result["memory"]],
    )
    data = result["data"]
    if data:
        print(f"trajectories: {data['received']} received = {data['accepted']} accepted + {data['refused']} refused "
              f"({'adds up' if data['received_adds_up'] else 'DOES NOT ADD UP'}); accepted = {data['trained']} trained + "
              f"{data['dropped_with_group']} dropped with their group + {data['held']} held + "
              f"{data['lost_on_restart']} lost on restart "
              f"({'adds up' if data['accepted_adds_up'] else 'DOES NOT ADD UP'}); actors reported "
              f"{data['actor_episodes_reported']} sent")
    print(f"processes left behind: {len(result['left_behind'])}; scratch folders left behind: "
          f"{len(result['folders_left_behind'])} of {result['scratch_folders']}")


def _check(args: argparse.Namespace) -> None:
    if args.minutes <= 0 or args.sample_every_s <= 0 or args.warmup_s < 0 or args.kill_every_s < 0 \
            or args.kill_learner_every_s < 0:
        raise ValueError("--minutes and --sample-every-s must be positive, --warmup-s, --kill-every-s and "
                         "--kill-learner-every-s not negative")


def run(argv: list[str]) -> dict[str, Any]:
    """Soak as the options say, print the tables, return the result."""
    args = parsed(build_parser(), argv, check=_check)
    try:
        result = run_soak(args)
    except RuntimeError as error:
        raise BenchStopped(1, str(error)) from error
    print_report(result)
    return result


def main(argv: list[str]) -> int:
    return run_as_command(PROG, run, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
