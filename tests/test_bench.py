"""`longhorizon bench`: steady-state arithmetic, the two modes' configs, arguments, and real runs."""

import json
import sys
import threading
import time
from pathlib import Path

import pytest

from longhorizon.common.config import config_to_dict
from longhorizon.common.metrics import read_metrics
from longhorizon.launch.bench.async_vs_sync import AsyncVsSyncSettings, bench_config, steady_state
from longhorizon.launch.bench.cli import main
from longhorizon.launch.bench.transport import THREAD_GROUPS, thread_cpu_seconds


def record(step: int, time: float, used: int, flat: int = 0, small: int = 0, staleness_mean: float = 0.0,
           staleness_max: int = 0, dropped: int = 0) -> dict:
    return {
        "step": step, "time": time, "groups_used": used, "groups_skipped_zero_variance": flat,
        "groups_skipped_too_small": small, "staleness_mean": staleness_mean, "staleness_max": staleness_max,
        "groups_dropped_stale": dropped, "episode_turns_mean": 4.0, "reward_mean": 0.5,
        "learner_step_seconds": 0.25,
    }


def test_steady_state_counts_episodes_after_the_first_step():
    records = [
        record(1, time=1.0, used=4, staleness_mean=0.0),
        record(2, time=3.0, used=3, flat=1, staleness_mean=1.0, staleness_max=2),
        record(3, time=6.0, used=2, flat=1, small=1, staleness_mean=2.0, staleness_max=3, dropped=1),
    ]
    figures = steady_state(records, group_size=4)
    # Steps 2 and 3 consumed 4 groups each of 4 episodes over 6.0 - 1.0 seconds.
    assert figures["window_episodes"] == 32
    assert figures["window_seconds"] == pytest.approx(5.0)
    assert figures["episodes_per_s"] == pytest.approx(6.4)
    assert figures["seconds_per_step"] == pytest.approx(2.5)
    assert figures["staleness_mean"] == pytest.approx(1.0)
    assert figures["staleness_max"] == 3
    assert figures["groups_dropped_stale"] == 1
    assert figures["groups_used"] == 9


def test_steady_state_needs_two_increasing_steps():
    with pytest.raises(ValueError, match="two learner steps"):
        steady_state([record(1, 1.0, 4)], group_size=4)
    with pytest.raises(ValueError, match="do not increase"):
        steady_state([record(1, 2.0, 4), record(2, 2.0, 4)], group_size=4)


def test_the_two_modes_differ_only_in_mode(tmp_path):
    settings = AsyncVsSyncSettings(actors=2, concurrent_groups=3, token_latency_s=0.004, rollout_slots="episode")
    configs = {mode: config_to_dict(bench_config(settings, mode, tmp_path, tmp_path / "model")) for mode in ("async", "sync")}
    assert configs["async"]["run"]["mode"] == "async" and configs["sync"]["run"]["mode"] == "sync"
    for config in configs.values():
        del config["run"]["mode"], config["run"]["name"]
    assert configs["async"] == configs["sync"]
    config = configs["sync"]
    assert config["env"]["name"] == "longtail"
    assert config["actor"]["engine"] == "scripted" and config["actor"]["num_actors"] == 2
    assert config["actor"]["simulated_token_latency_s"] == 0.004
    assert config["actor"]["rollout_slots"] == "episode"  # sync mode ignores it
    # A sync batch is exactly what the actors run at once: 2 actors x 3 groups.
    assert config["learner"]["groups_per_step"] == 6
    assert config["horizon"]["schedule"] == "fixed" and config["horizon"]["stages"] == [30]


@pytest.mark.parametrize(
    "arguments, complaint",
    [
        (["async-vs-sync", "--steps", "1"], "steps must be at least 2"),
        (["async-vs-sync", "--group-size", "1"], "group-size"),
        (["async-vs-sync", "--long-fraction", "2"], "long-fraction"),
        (["async-vs-sync", "--token-latency-ms", "-1"], "latency"),
        (["async-vs-sync", "--rollout-slots", "token"], "invalid choice"),
        (["nonsense"], "invalid choice"),
        (["async-vs-sync", "--steps", "many"], "invalid int value"),
        (["transport", "--transport-rounds", "0"], "at least 1"),
    ],
)
def test_bad_arguments_are_a_clear_error(arguments, complaint, capsys):
    assert main(arguments) == 2
    assert complaint in capsys.readouterr().err


def test_transport_prints_a_table_then_json(capsys):
    arguments = ["transport", "--trajectory-bytes", "4096", "--transport-messages", "5", "--transport-rounds", "1"]
    assert main([*arguments, *allocator_as_it_is()]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) > 2
    result = json.loads(lines[-1])
    assert result["trajectory_bytes"] == 4096 and result["raw_mb_per_s"] > 0
    if sys.platform == "linux":
        for kind in ("raw", "trajectory", "raw_split"):
            cpu = result[f"{kind}_cpu_us_per_message"]
            assert set(cpu) == {f"{side}_{group}" for side in ("receiver", "sender") for group in THREAD_GROUPS}
            # Each timed message is sent and received by the main threads, and written out by
            # the sender's ZeroMQ I/O thread after its warm-up. (Five small messages may already
            # sit in the receiver's queues when its timing starts, so its I/O thread may have
            # nothing left to do, and their rate, hence the cores busy, has no steady-state bound.)
            for thread in ("receiver_main", "sender_main", "sender_zeromq"):
                assert cpu[thread] > 0, (kind, cpu)
            assert result[f"{kind}_cores_busy"] > 0
        assert any("cores busy" in line for line in lines)


def allocator_as_it_is() -> list[str]:
    """The transport bench's option that leaves this test process's allocator as it is: the
    bench keeps freed buffers unless told --glibc-allocator, and a process that keeps them (an
    earlier test's bench) cannot go back."""
    from longhorizon.common.memory import keeping_freed_message_memory

    return [] if keeping_freed_message_memory() else ["--glibc-allocator"]


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread CPU times are read from Linux's /proc")
def test_thread_cpu_counts_each_thread_in_its_group():
    def spin(cpu_seconds: float) -> None:
        # Until this thread has used that much CPU: on a busy machine wall time says nothing.
        end = time.thread_time() + cpu_seconds
        while time.thread_time() < end:
            pass

    spun, measured = threading.Event(), threading.Event()

    def work_then_wait() -> None:
        spin(0.2)
        spun.set()
        measured.wait(60)  # an ended thread drops out of the figures: stay until measured

    before = thread_cpu_seconds()
    spin(0.2)
    worker = threading.Thread(target=work_then_wait)
    worker.start()
    assert spun.wait(60)
    after = thread_cpu_seconds()
    measured.set()
    worker.join()
    assert set(before) == set(THREAD_GROUPS)
    assert after["main"] - before["main"] >= 0.15
    assert after["other"] - before["other"] >= 0.15
    assert after["zeromq"] >= before["zeromq"]


@pytest.mark.slow
def test_async_vs_sync_runs_both_modes_over_real_processes(tmp_path, capsys):
    """One actor process playing two groups at once: the same two groups a step as two actors of
    one group each, with a process fewer to start in each mode (an import of torch, seconds of
    CPU on the suite's busy cores); the modes and their accounting are under test, not the
    number of actors."""
    output_dir = tmp_path / "bench"
    code = main([
        "async-vs-sync", "--steps", "3", "--actors", "1", "--concurrent-groups", "2", "--group-size", "2",
        "--token-latency-ms", "0.5", "--rollout-slots", "episode", "--output-dir", str(output_dir),
    ])
    assert code == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert any(line.startswith("async ") for line in lines) and any(line.startswith("sync ") for line in lines)
    result = json.loads(lines[-1])
    assert result == json.loads((output_dir / "bench.json").read_text())
    for mode in ("async", "sync"):
        assert result[f"{mode}_steps"] == 3
        # Steps 2 and 3 each consumed 2 groups (the actor's two at once) of 2 episodes.
        assert result[f"{mode}_window_episodes"] == 8
        assert result[f"{mode}_episodes_per_s"] > 0
        assert len(read_metrics(Path(output_dir) / mode)) == 3
    assert result["sync_staleness_mean"] == 0.0 and result["sync_staleness_max"] == 0
    assert result["async_staleness_mean"] >= 0.0
    assert result["speedup"] == pytest.approx(result["async_episodes_per_s"] / result["sync_episodes_per_s"])
    assert {"target_speedup", "meets_target", "concurrent_episodes", "token_latency_s"} <= set(result)
    assert result["rollout_slots"] == "episode"


def test_soak_memory_growth_is_measured_from_the_end_of_each_warm_up():
    from longhorizon.launch.bench.soak import memory_growth

    samples = {
        ("learner", 10): [(0.0, 50.0), (60.0, 100.0), (120.0, 102.0), (180.0, 105.0)],
        ("actor-0", 11): [(0.0, 80.0), (30.0, 90.0)],  # killed before its warm-up ended
    }
    [row] = memory_growth(samples, warmup_s=60.0)
    assert (row["role"], row["pid"], row["from_s"], row["to_s"]) == ("learner", 10, 60.0, 180.0)
    assert row["growth_pct"] == 5.0


def test_soak_data_accounting_checks_both_identities():
    from longhorizon.launch.bench.soak import data_accounting

    record = {
        "trajectories_received": 100, "trajectories_accepted": 90, "trajectories_duplicate": 4,
        "trajectories_dropped_stale": 6, "trajectories_trained": 80, "trajectories_dropped_with_group": 7,
        "trajectories_held": 3, "actor_episodes_reported": 104,
    }
    data = data_accounting(record)
    assert data["received_adds_up"] and data["accepted_adds_up"]
    assert data["in_flight_or_lost_at_kills"] == 4
    assert not data_accounting({**record, "trajectories_held": 2})["accepted_adds_up"]
    # After a learner restart, what its buffer held at the checkpoint is a term of its own.
    restarted = {**record, "trajectories_accepted": 95, "trajectories_received": 105, "trajectories_lost_on_restart": 5}
    data = data_accounting(restarted)
    assert data["lost_on_restart"] == 5 and data["received_adds_up"] and data["accepted_adds_up"]
    assert not data_accounting({**restarted, "trajectories_lost_on_restart": 0})["accepted_adds_up"]


@pytest.mark.slow
def test_a_short_soak_kills_actors_and_the_learner_accounts_for_every_trajectory_and_leaves_nothing(tmp_path):
    from longhorizon.launch.bench.soak import build_parser, run_soak

    args = build_parser().parse_args([
        # 30 s on the soak's clock (it starts at the first step): actors killed at about 6, 12, 18
        # and 24 s, the learner at 10 s (its restart from the checkpoint takes the next seconds).
        "--minutes", "0.5", "--kill-every-s", "6", "--kill-learner-every-s", "10", "--sample-every-s", "1",
        "--warmup-s", "4", "--output-dir", str(tmp_path), "learner.checkpoint_every=5",
    ])
    result = run_soak(args)
    assert result["kills"] >= 2 and result["learner_kills"] >= 1
    assert result["steps"] > 0
    assert result["data"]["received_adds_up"] and result["data"]["accepted_adds_up"]
    assert result["data"]["received"] > 0
    assert result["left_behind"] == []
    # Every worker's scratch folder was seen, and deleted by the launcher, killed workers' too.
    assert result["scratch_folders"] >= 3 and result["folders_left_behind"] == []
    assert any(row["role"] == "learner" for row in result["memory"])


@pytest.mark.slow
def test_learner_bench_times_our_step_and_a_bare_loop(tiny_codebook_model, capsys):
    from longhorizon.launch.bench.learner import main as bench_learner

    code = bench_learner([
        "--model", str(tiny_codebook_model), "--tokens", "64", "--sequences", "2", "--steps", "1",
        "--logprob-chunk-tokens", "0,32", "--device", "cpu", "--gradient-checkpointing", "on",
    ])
    assert code == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    kinds = [(run["kind"], run["logprob_chunk_tokens"], run["gradient_checkpointing"]) for run in result["runs"]]
    assert kinds == [("longhorizon", 0, True), ("longhorizon", 32, True), ("bare torch", None, None)]
    for run in result["runs"]:
        assert run["step_s"] > 0 and run["peak_rss_mb"] > 0 and run["overhead_vs_bare"] is not None
    assert bench_learner(["--steps", "0"]) == 2


@pytest.mark.slow
def test_learner_bench_runs_ranks_in_processes(tiny_codebook_model, capsys):
    """One benchmark, three runs of two rank processes each: our step with the shared prefix off
    and on, and the bare loop. (Two benchmarks started these six times over; how the ranks split
    a step's sequences is tests/test_distributed.py's.)"""
    from longhorizon.launch.bench.learner import main as bench_learner

    assert bench_learner(["--ranks", "0"]) == 2
    code = bench_learner([
        "--model", str(tiny_codebook_model), "--shape", "codebook", "--tokens", "64", "--sequences", "8",
        "--group-size", "4", "--steps", "1", "--device", "cpu", "--ranks", "2", "--shared-prefix", "off,on",
    ])
    assert code == 0
    runs = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["runs"]
    assert [(run["kind"], run["ranks"], run["shared_prefix"]) for run in runs] == [
        ("longhorizon", 2, False), ("longhorizon", 2, True), ("bare torch", 2, False)]
    # Each rank's share of the eight sequences fits one micro-batch.
    assert all(run["micro_batches"] == 1 and run["step_s"] > 0 and run["overhead_vs_bare"] is not None for run in runs)
    # With the shared prefix each rank encodes its group's 32-token prompt once.
    off, on, bare = runs
    assert off["tokens_trained"] == on["tokens_trained"] == bare["tokens_trained"]
    assert on["tokens_computed"] == off["tokens_computed"] - 2 * 3 * 32
    # "auto", the default, leaves a tiny model's step without checkpointing: its activations are small.
    assert off["gradient_checkpointing"] is False and on["gradient_checkpointing"] is False


def test_peak_memory_counts_the_commands_children_and_passes_its_exit_code(capsys):
    """A command whose child holds 200 MB for a while and exits 3: the tree's peak holds the
    child's 200 MB, the child is listed, and the exit code is the command's."""
    import json
    import sys

    from longhorizon.launch.bench.peak_memory import main

    child = "import time; block = bytearray(200 * 2**20); time.sleep(2)"
    parent = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {child!r}]); sys.exit(3)"
    assert main(["--interval-s", "0.1", "--", sys.executable, "-c", parent]) == 3
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["exit_code"] == 3 and result["peak_pss_mb"] >= 200
    assert any("bytearray(200" in label and mb >= 200 for label, mb in result["own_peak_mb"].items())


BURN_IN_A_GRANDCHILD = (
    "import subprocess, sys; subprocess.run([sys.executable, '-c', "
    "'import time\\nend = time.process_time() + 0.5\\nwhile time.process_time() < end: pass'], check=True)"
)


def test_worker_start_counts_the_cpu_of_the_whole_process_tree():
    """A command whose child burns 0.5 s of CPU: the run's CPU includes it."""
    from longhorizon.launch.bench.worker_start import timed_run

    figures = timed_run([sys.executable, "-c", BURN_IN_A_GRANDCHILD])
    assert figures["cpu_s"] >= 0.5 and figures["wall_s"] >= 0.5


def test_worker_start_alternates_the_modes_and_reports_medians(monkeypatch, capsys):
    from longhorizon.launch.bench import worker_start

    cpu = iter([30.0, 16.0, 32.0, 17.0, 31.0, 20.0])  # fresh, forked, fresh, forked, ...
    commands = []

    def fake_run(command):
        commands.append(command)
        return {"cpu_s": next(cpu), "wall_s": 10.0}

    monkeypatch.setattr(worker_start, "timed_run", fake_run)
    assert worker_start.main(["--rounds", "3", "--actors", "2"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert ["run.fork_server=false" in c for c in commands] == [True, False] * 3
    assert ["run.fork_server=true" in c for c in commands] == [False, True] * 3
    assert all("actor.num_actors=2" in c and "run.total_steps=3" in c for c in commands)
    assert result["medians"]["fresh"]["cpu_s"] == 31.0 and result["medians"]["forked"]["cpu_s"] == 17.0
    assert result["cpu_saved_per_start_s"] == pytest.approx((31.0 - 17.0) / 3)  # 1 learner + 2 actors


def test_worker_start_refuses_a_config_that_is_not_there(capsys):
    from longhorizon.launch.bench.worker_start import main as bench_worker_start

    assert bench_worker_start(["no-such-config"]) == 2
    assert "config file not found: no-such-config" in capsys.readouterr().err
