"""The run report: its figures from hand-made metrics records, its findings, the command, and the
learner's per-step outcome figures it reads."""

import json
from types import SimpleNamespace

import pytest

from longhorizon.launch.cli import main as cli_main
from longhorizon.launch.report import diagnose, format_report, main, summarise_run
from longhorizon.learner.worker import cut_by_cap, outcome_figures


def record(step, **fields):
    base = {"step": step, "version": step, "time": 60.0 * step, "success_rate": 0.0, "horizon_cap": 4,
            "groups_used": 0, "groups_skipped_zero_variance": 2, "groups_skipped_too_small": 0,
            "groups_dropped_stale": 0, "groups_resampled": 0, "trajectories_received": 16 * step,
            "groups_none_succeeded": 2, "groups_all_succeeded": 0, "invalid_action_rate": 0.0,
            "truncated_rate": 1.0, "episodes_per_s": 0.2}
    return {**base, **fields}


def updated(step, **fields):
    """A step that trained: one group used, one flat."""
    trained = {"groups_used": 1, "groups_skipped_zero_variance": 1, "groups_none_succeeded": 1,
               "train_sequences": 8.0, "entropy_estimate": 0.05, "grad_norm": 1.0, "clip_fraction": 0.0,
               "learner_step_seconds": 100.0}
    return record(step, **{**trained, **fields})


def test_summary_sums_per_step_counts_reads_run_wide_counters_and_averages_updates():
    records = [
        updated(1, success_rate=0.25, entropy_estimate=0.02, grad_norm=0.5, signal_fraction=0.2),
        record(2, groups_dropped_stale=1),
        updated(3, success_rate=0.5, horizon_cap=6, entropy_estimate=0.08, grad_norm=1.5,
                groups_dropped_stale=3, invalid_action_rate=0.5),
        record(4, horizon_cap=6, groups_dropped_stale=3, groups_none_succeeded=1, groups_all_succeeded=1),
    ]
    summary = summarise_run(records)
    assert summary["steps"] == 4 and summary["steps_with_update"] == 2
    assert summary["wall_s"] == 240.0 and summary["versions"] == 4
    # Groups: used 1 + 1, flat 1 + 2 + 1 + 2; stale is the counter's last value (3), not a sum.
    assert (summary["groups_used"], summary["groups_flat"], summary["groups_scored"]) == (2, 6, 8)
    assert summary["flat_share"] == pytest.approx(6 / 8)
    assert summary["groups_dropped_stale"] == 3 and summary["stale_share"] == pytest.approx(3 / 11)
    assert summary["groups_none_succeeded"] == 1 + 2 + 1 + 1 and summary["groups_all_succeeded"] == 1
    assert summary["trajectories_received"] == 64
    # Means of the update's figures over the two steps that trained.
    assert summary["entropy_mean"] == pytest.approx(0.05)
    assert (summary["entropy_min"], summary["entropy_max"]) == (0.02, 0.08)
    assert summary["grad_norm_mean"] == pytest.approx(1.0) and summary["grad_norm_max"] == 1.5
    assert summary["update_seconds_mean"] == 100.0
    assert summary["signal_fraction_mean"] == pytest.approx(0.2)  # the one update that logged it
    assert summary["success_by_cap"] == {4: pytest.approx(0.125), 6: pytest.approx(0.25)}
    assert summary["success_mean"] == pytest.approx(0.1875)
    assert summary["invalid_action_rate_mean"] == pytest.approx(0.125)
    # Records from before cut_by_cap_rate: every truncation is taken as the cap's.
    assert summary["cut_by_cap_rate_mean"] == summary["truncated_rate_mean"] == 1.0
    assert summarise_run([updated(1, truncated_rate=0.5, cut_by_cap_rate=0.25)])["cut_by_cap_rate_mean"] == 0.25


def test_findings_name_flat_groups_by_outcome_low_entropy_stale_drops_and_the_format():
    records = [updated(1, invalid_action_rate=0.4, groups_dropped_stale=2)] + [record(s, groups_dropped_stale=2) for s in (2, 3)]
    findings = diagnose(summarise_run(records))
    text = "\n".join(findings)
    assert "83% of the groups were flat" in text and "2 of 3 steps made no update" in text
    assert "Only 1 of 6 groups set a success against a failure" in text
    assert "5 had no success and 0 only successes" in text and "out of the policy's reach" in text
    assert "entropy averaged 0.050 nats" in text
    assert "2 groups (25%) were dropped as stale" in text
    assert "13% of the turns were replies the env could not read" in text


def test_a_healthy_run_has_no_findings_and_mastered_tasks_are_told_apart():
    healthy = [updated(s, groups_skipped_zero_variance=0, groups_used=2, groups_none_succeeded=0,
                       entropy_estimate=0.5) for s in range(1, 5)]
    assert diagnose(summarise_run(healthy)) == []
    mastered = [record(s, groups_none_succeeded=0, groups_all_succeeded=2) for s in range(1, 4)]
    assert "mostly mastered" in "\n".join(diagnose(summarise_run(mastered)))


def test_runs_recorded_before_the_outcome_figures_still_report():
    records = [{k: v for k, v in updated(s).items()
                if k not in ("groups_none_succeeded", "groups_all_succeeded", "invalid_action_rate")}
               for s in range(1, 3)]
    summary = summarise_run(records)
    assert summary["groups_none_succeeded"] is None and summary["invalid_action_rate_mean"] is None
    text = format_report(summary)
    assert "outcomes: n/a groups without a success" in text and "invalid replies per turn: n/a" in text
    assert "50% of the groups were flat" in text and "set a success against" not in text


def test_the_command_prints_the_report_or_json_and_refuses_a_folder_without_metrics(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(updated(s)) for s in (1, 2)) + "\n")
    assert main([str(tmp_path)]) == 0
    assert "steps 2 (last 2), 2.0 min; an update in 2 of them" in capsys.readouterr().out
    assert main([str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["groups_used"] == 2
    assert main([str(tmp_path / "missing")]) == 1
    assert "no metrics.jsonl" in capsys.readouterr().err
    assert cli_main(["report", str(tmp_path), "--json"]) == 0  # the command line's wiring
    assert json.loads(capsys.readouterr().out)["steps"] == 2
    (tmp_path / "metrics.jsonl").write_text("")
    assert main([str(tmp_path)]) == 1
    assert "holds no metric records" in capsys.readouterr().err


def trajectory(success, turns=4, invalid=0):
    return SimpleNamespace(success=success, num_turns=turns, invalid_actions=invalid)


def test_outcome_figures_count_groups_by_success_and_invalid_replies_per_turn():
    groups = [
        SimpleNamespace(trajectories=[trajectory(False, invalid=2), trajectory(False)]),
        SimpleNamespace(trajectories=[trajectory(True), trajectory(True, turns=2)]),
        SimpleNamespace(trajectories=[trajectory(True), trajectory(False, turns=6, invalid=1)]),
    ]
    assert outcome_figures(groups) == {
        "groups_none_succeeded": 1, "groups_all_succeeded": 1, "invalid_action_rate": 3 / 24,
    }
    assert outcome_figures([]) == {"groups_none_succeeded": 0, "groups_all_succeeded": 0, "invalid_action_rate": 0.0}


def test_only_a_truncation_on_the_caps_turn_is_the_caps_cut():
    def episode(turns, cap=4, truncated=True, terminated=False):
        return SimpleNamespace(num_turns=turns, horizon_cap=cap, truncated=truncated, terminated=terminated)

    assert cut_by_cap(episode(4))
    assert not cut_by_cap(episode(3))  # the context budget or the env's own limit, before the cap
    assert not cut_by_cap(episode(4, truncated=False, terminated=True))  # finished on the last turn
    assert not cut_by_cap(episode(2, truncated=False))


def test_a_run_that_learned_is_told_from_one_out_of_reach_and_every_update_is_said_so():
    # From every group failing to every group succeeding: both kinds of flat group, most of them
    # failures over the whole run, yet the tasks ended mastered.
    learned = ([record(s, groups_none_succeeded=2) for s in range(1, 13)]
               + [updated(s, groups_none_succeeded=0, groups_all_succeeded=1) for s in range(13, 21)])
    text = "\n".join(diagnose(summarise_run(learned)))
    assert "went from failing most groups in the first steps to succeeding in most in the last" in text, text
    assert "out of the policy's reach" not in text
    flat_but_updating = [updated(s) for s in range(1, 3)]
    text = "\n".join(diagnose(summarise_run(flat_but_updating)))
    assert "every step still made an update" in text and "0 of 2" not in text


def test_a_run_shorter_than_two_windows_names_no_first_and_last_windows():
    short = format_report(summarise_run([updated(1, success_rate=0.25), updated(2, success_rate=0.75)]))
    assert "training success: mean 50.0%; by cap" in short and "first 8 steps" not in short
    long = format_report(summarise_run([updated(step, success_rate=step / 16) for step in range(1, 17)]))
    assert "first 8 steps 28.1%, last 8 78.1%" in long


def test_versions_beyond_the_updates_are_said_to_be_sync_modes():
    """Sync mode makes a version per step, with or without an update; async mode one per update."""
    sync = format_report(summarise_run([record(1), record(2), updated(3)]))
    assert "an update in 1 of them; policy version 3 (a version per step: sync mode)" in sync
    asynchronous = format_report(summarise_run([record(1, version=0), updated(2, version=1)]))
    assert "an update in 1 of them; policy version 1\n" in asynchronous
