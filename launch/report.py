"""What a training run's metrics say about whether and why it learned: non-finite updates, signal
per group, outcomes, exploration, staleness, the format, the update, and success by horizon stage.

Run as ``longhorizon report RUN_DIR`` (``--json`` for the figures alone); ``longhorizon train``
prints it at the end. The figures are pure functions of the records in ``metrics.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from longhorizon.common.metrics import read_metrics

__all__ = ["diagnose", "format_report", "load_summary", "main", "summarise_run"]

# Thresholds of the diagnoses: where a figure starts to explain a run that does not learn.
FLAT_SHARE_WARNING = 0.5
LOW_ENTROPY_NATS = 0.1
STALE_SHARE_WARNING = 0.1
INVALID_RATE_WARNING = 0.1
# The windows at the start and end of a run whose mean training success is compared.
SUCCESS_WINDOW = 8


# The update's figures whose non-finite value means the update itself was not finite.
_UPDATE_KEYS = ("loss", "grad_norm")
# Steps listed in a finding, at most (the rest are counted).
_STEPS_SHOWN = 12


def _values(records: Sequence[dict[str, Any]], key: str) -> list[float]:
    """The finite numeric values of ``key``, in step order, from the records that have one."""
    return [float(r[key]) for r in records
            if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool) and math.isfinite(r[key])]


def nonfinite_steps(records: Sequence[dict[str, Any]]) -> list[int]:
    """The steps whose update had a non-finite loss or gradient norm: skipped by the trainer
    (`nonfinite_step`), or, in runs recorded before the trainer skipped them, a loss or gradient
    norm that was NaN or infinite (written as null and named in `nonfinite_metrics`, or bare)."""
    steps = []
    for index, record in enumerate(records):
        named = record.get("nonfinite_metrics")
        named = named if isinstance(named, list) else []
        bare = [record.get(key) for key in _UPDATE_KEYS]
        if (record.get("nonfinite_step")
                or any(key in named for key in _UPDATE_KEYS)
                or any(isinstance(value, float) and not math.isfinite(value) for value in bare)):
            steps.append(int(record.get("step", index + 1)))
    return steps


def _step_list(steps: Sequence[int]) -> str:
    """Steps as runs, '3-5, 9', the first few only."""
    runs: list[list[int]] = []
    for step in steps:
        if runs and step == runs[-1][1] + 1:
            runs[-1][1] = step
        else:
            runs.append([step, step])
    text = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs[:_STEPS_SHOWN])
    return text + (f" and {len(runs) - _STEPS_SHOWN} more runs" if len(runs) > _STEPS_SHOWN else "")


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _last(records: Sequence[dict[str, Any]], key: str) -> float:
    """A run-wide counter's final value (the learner counts these over the whole run)."""
    values = _values(records, key)
    return values[-1] if values else 0.0


def summarise_run(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The run's figures from its per-step records. Per-step counts are summed; run-wide counters
    (stale drops, trajectories received) are read from the last record; means of the update's
    figures are over steps that made an update."""
    if not records:
        raise ValueError("the run has no step records yet")
    updated = [r for r in records if r.get("train_sequences", 0)]
    groups_used = sum(_values(records, "groups_used"))
    groups_flat = sum(_values(records, "groups_skipped_zero_variance"))
    groups_too_small = sum(_values(records, "groups_skipped_too_small"))
    groups_stale = _last(records, "groups_dropped_stale")
    groups_scored = groups_used + groups_flat + groups_too_small
    by_cap: dict[int, list[float]] = {}
    for record in records:
        if "horizon_cap" in record and "success_rate" in record:
            by_cap.setdefault(int(record["horizon_cap"]), []).append(float(record["success_rate"]))
    success = _values(records, "success_rate")
    summary: dict[str, Any] = {
        "steps": len(records),
        # Steps whose update was not finite, and whether the trainer skipped them (it records
        # `nonfinite_step` since it does) or the weights took them.
        "nonfinite_steps": nonfinite_steps(records),
        "nonfinite_skipped": any("nonfinite_step" in r for r in records),
        "last_step": int(records[-1].get("step", len(records))),
        "wall_s": float(records[-1].get("time", 0.0)),
        "versions": int(records[-1].get("version", 0)),
        "steps_with_update": len(updated),
        "groups_scored": int(groups_scored),
        "groups_used": int(groups_used),
        "groups_flat": int(groups_flat),
        "groups_too_small": int(groups_too_small),
        "flat_share": groups_flat / groups_scored if groups_scored else None,
        "groups_resampled": int(_last(records, "groups_resampled")),
        "groups_dropped_stale": int(groups_stale),
        "stale_share": groups_stale / (groups_scored + groups_stale) if groups_scored + groups_stale else None,
        "trajectories_received": int(_last(records, "trajectories_received")),
        "success_mean": _mean(success),
        "success_first_window": _mean(success[:SUCCESS_WINDOW]),
        "success_last_window": _mean(success[-SUCCESS_WINDOW:]),
        "success_by_cap": {cap: _mean(values) for cap, values in sorted(by_cap.items())},
        "entropy_mean": _mean(_values(updated, "entropy_estimate")),
        "entropy_min": min(_values(updated, "entropy_estimate"), default=None),
        "entropy_max": max(_values(updated, "entropy_estimate"), default=None),
        "grad_norm_mean": _mean(_values(updated, "grad_norm")),
        "grad_norm_max": max(_values(updated, "grad_norm"), default=None),
        "clip_fraction_mean": _mean(_values(updated, "clip_fraction")),
        # The update's size relative to a batch full of signal (flat groups count, untrained).
        "signal_fraction_mean": _mean(_values(updated, "signal_fraction")),
        "update_seconds_mean": _mean(_values(updated, "learner_step_seconds")),
        "episodes_per_s_mean": _mean(_values(records, "episodes_per_s")),
        "truncated_rate_mean": _mean(_values(records, "truncated_rate")),
        # Runs recorded before cut_by_cap_rate existed: every truncation counted as the cap's.
        "cut_by_cap_rate_mean": _mean(_values(records, "cut_by_cap_rate") or _values(records, "truncated_rate")),
        "cut_by_context_rate_mean": _mean(_values(records, "cut_by_context_rate")),
    }
    # Figures that older runs did not record: None when absent, so a report still reads.
    outcome_keys = ("groups_none_succeeded", "groups_all_succeeded")
    if all(any(key in r for r in records) for key in outcome_keys):
        summary.update({key: int(sum(_values(records, key))) for key in outcome_keys})
        # The same counts at the run's start and end: a run that learned has flat groups of both
        # kinds, failures first and successes last.
        for window, window_records in (("first", records[:SUCCESS_WINDOW]), ("last", records[-SUCCESS_WINDOW:])):
            summary.update({f"{key}_{window}_window": int(sum(_values(window_records, key))) for key in outcome_keys})
    else:
        summary.update({key: None for key in outcome_keys})
    summary["invalid_action_rate_mean"] = _mean(_values(records, "invalid_action_rate"))
    # The learner's peak memory and the least the machine had left (runs recorded before these
    # figures existed: None).
    peaks, available = _values(records, "rss_peak_mb"), _values(records, "memory_available_mb")
    summary["learner_rss_peak_mb"] = max(peaks) if peaks else None
    summary["memory_available_min_mb"] = min(available) if available else None
    return summary


def _reach_verdict(summary: dict[str, Any]) -> str:
    """Where the tasks stand for the policy, from the flat groups' outcomes over the last steps,
    and whether that changed since the first (a run that learned has flat groups of both kinds)."""
    def mostly_failed(window: str) -> bool:
        return summary[f"groups_none_succeeded_{window}_window"] >= summary[f"groups_all_succeeded_{window}_window"]

    if mostly_failed("last"):
        return ("The tasks are mostly out of the policy's reach: easier tasks, a warm start, a shorter cap "
                "first, larger groups or more exploration.")
    if mostly_failed("first") and summary["steps"] > SUCCESS_WINDOW:
        return ("The policy went from failing most groups in the first steps to succeeding in most in the "
                "last: the tasks are now mastered, and harder tasks or a longer cap would give it more to learn.")
    return "The tasks are mostly mastered: harder tasks or a longer cap."


def diagnose(summary: dict[str, Any]) -> list[str]:
    """Plain findings from the figures, each naming the figure and a lever; empty when nothing
    stands out."""
    findings: list[str] = []
    # First: a non-finite update explains everything after it better than any figure below.
    bad_steps = summary.get("nonfinite_steps") or []
    if bad_steps:
        if summary.get("nonfinite_skipped"):
            what = ("the trainer skipped their updates (weights and optimiser state unchanged), so "
                    "those steps trained on nothing")
        else:
            what = ("the weights took those updates, so every later figure, success included, may "
                    "describe a broken policy rather than the tasks")
        findings.append(
            f"{len(bad_steps)} step(s) had a non-finite loss or gradient norm (step {_step_list(bad_steps)}): "
            f"{what}. Look at what fed them (the learner log's WARNING lines name their groups): "
            "rewards (learner.max_abs_reward), behaviour log-probs, precision, the learning rate."
        )
    flat_share = summary["flat_share"]
    if flat_share is not None and flat_share >= FLAT_SHARE_WARNING:
        idle_steps = summary["steps"] - summary["steps_with_update"]
        findings.append(f"{flat_share:.0%} of the groups were flat (one reward for every episode), so they "
                        "gave no gradient; " + (f"{idle_steps} of {summary['steps']} steps made no update."
                                                if idle_steps else "every step still made an update."))
    none, every, scored = summary["groups_none_succeeded"], summary["groups_all_succeeded"], summary["groups_scored"]
    if none is not None and scored and (none + every) / scored >= FLAT_SHARE_WARNING:
        # Outcomes, not rewards: a group without a success can still spread its rewards through
        # format penalties, and then it costs an update that teaches the format alone.
        findings.append(
            f"Only {scored - none - every} of {scored} groups set a success against a failure (the task's "
            f"signal): {none} had no success and {every} only successes. " + _reach_verdict(summary))
    entropy = summary["entropy_mean"]
    if entropy is not None and entropy < LOW_ENTROPY_NATS:
        findings.append(f"The sampled tokens' entropy averaged {entropy:.3f} nats: the policy hardly "
                        "explores, so a group's episodes mostly repeat one another (a higher "
                        "actor.sampling.temperature, a lighter warm start).")
    stale_share = summary["stale_share"]
    if stale_share is not None and stale_share >= STALE_SHARE_WARNING:
        findings.append(f"{summary['groups_dropped_stale']} groups ({stale_share:.0%}) were dropped as "
                        "stale before training (learner.max_staleness, or faster updates).")
    invalid = summary["invalid_action_rate_mean"]
    if invalid is not None and invalid >= INVALID_RATE_WARNING:
        findings.append(f"{invalid:.0%} of the turns were replies the env could not read as an action: "
                        "the format, not the task, is failing (see the sample episodes).")
    first, last = summary["success_first_window"], summary["success_last_window"]
    if first is not None and last is not None and summary["steps"] >= 2 * SUCCESS_WINDOW:
        # No verdict: a window holds only a few groups' outcomes, and a few points either way is noise.
        findings.append(f"Training success was {first:.1%} over the first {SUCCESS_WINDOW} steps and "
                        f"{last:.1%} over the last {SUCCESS_WINDOW}.")
    return findings


def _number(value: Any, spec: str, suffix: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{suffix}"


def format_report(summary: dict[str, Any]) -> str:
    """The summary and its findings as text for a terminal."""
    lines = [
        f"steps {summary['steps']} (last {summary['last_step']}), {summary['wall_s'] / 60:.1f} min; "
        f"an update in {summary['steps_with_update']} of them; policy version {summary['versions']}"
        # Sync mode names a version per step, with or without an update.
        + (" (a version per step: sync mode)" if summary["versions"] > summary["steps_with_update"] else ""),
        f"groups: {summary['groups_scored']} scored: {summary['groups_used']} used, {summary['groups_flat']} "
        f"flat ({_number(summary['flat_share'], '.0%')}), {summary['groups_too_small']} too small; "
        f"{summary['groups_dropped_stale']} dropped stale ({_number(summary['stale_share'], '.0%')}); "
        f"{summary['groups_resampled']} resampled",
        f"outcomes: {_number(summary['groups_none_succeeded'], 'd')} groups without a success, "
        f"{_number(summary['groups_all_succeeded'], 'd')} all successes",
        f"training success: mean {_number(summary['success_mean'], '.1%')}"
        + (f", first {SUCCESS_WINDOW} steps {_number(summary['success_first_window'], '.1%')}, last {SUCCESS_WINDOW} "
           f"{_number(summary['success_last_window'], '.1%')}" if summary["steps"] >= 2 * SUCCESS_WINDOW else "")
        + "; by cap: "
        + (", ".join(f"{cap}: {_number(value, '.1%')}" for cap, value in summary["success_by_cap"].items())
           or "n/a"),
        f"episodes cut by the cap: {_number(summary['cut_by_cap_rate_mean'], '.0%')}, by the context budget: "
        f"{_number(summary['cut_by_context_rate_mean'], '.0%')} (truncated for any reason: "
        f"{_number(summary['truncated_rate_mean'], '.0%')}); invalid replies per "
        f"turn: {_number(summary['invalid_action_rate_mean'], '.1%')}",
        f"exploration: entropy {_number(summary['entropy_mean'], '.3f')} nats (min "
        f"{_number(summary['entropy_min'], '.3f')}, max {_number(summary['entropy_max'], '.3f')})",
        f"updates: {len(summary.get('nonfinite_steps') or [])} non-finite; grad norm mean "
        f"{_number(summary['grad_norm_mean'], '.2f')} (max "
        f"{_number(summary['grad_norm_max'], '.2f')}), clip fraction {_number(summary['clip_fraction_mean'], '.3f')}, "
        f"scaled to {_number(summary['signal_fraction_mean'], '.0%')} by flat groups, "
        f"{_number(summary['update_seconds_mean'], '.1f', ' s')} each; actors "
        f"{_number(summary['episodes_per_s_mean'], '.2f')} episodes/s",
        f"memory: learner peak {_number(summary.get('learner_rss_peak_mb'), '.0f', ' MiB')}, least left on the "
        f"machine {_number(summary.get('memory_available_min_mb'), '.0f', ' MiB')}",
    ]
    findings = diagnose(summary)
    if findings:
        lines.append("findings:")
        lines += [f"  - {finding}" for finding in findings]
    return "\n".join(lines)


def load_summary(run_dir: str | Path) -> dict[str, Any]:
    """The figures of the run in ``run_dir``. Raises FileNotFoundError without metrics, ValueError
    when no step has been recorded."""
    metrics = Path(run_dir) / "metrics.jsonl"
    if not metrics.is_file():
        raise FileNotFoundError(f"no metrics.jsonl in {run_dir}: is it a training run's directory?")
    return summarise_run(read_metrics(run_dir, required=True))


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: ``report RUN_DIR [--json]``. Returns the process exit status."""
    parser = argparse.ArgumentParser(
        prog="longhorizon report", description="Summarise a training run: signal, outcomes, exploration, staleness."
    )
    parser.add_argument("run_dir")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    try:
        summary = load_summary(args.run_dir)
    except (FileNotFoundError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(json.dumps(summary, indent=1) if args.json else format_report(summary))
    return 0
