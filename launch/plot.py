"""Plots of a training run from its metrics.jsonl: reward, success, horizon, staleness, throughput,
policy entropy and the groups that carried signal.

Run as ``longhorizon plot RUN_DIR``; the PNGs go to ``RUN_DIR/plots/``, and, when the run logs to
Weights & Biases (its ``wandb_run.json``), into that W&B run too.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from longhorizon.common.metrics import log_plots_to_wandb, read_metrics

__all__ = ["main", "moving_average", "plot_run", "signal_bars", "summed_staleness_histogram"]

logger = logging.getLogger(__name__)

# (metric key, file name, y-axis label) for the per-step line plots.
_LINE_PLOTS = (
    ("reward_mean", "reward.png", "mean reward"),
    ("success_rate", "success.png", "success rate"),
    ("horizon_cap", "horizon.png", "horizon cap (turns)"),
    ("episodes_per_s", "throughput.png", "episodes / s"),
)
# The entropy line: the whole next-token distribution's when the run logged it (an entropy bonus or
# target), else the sampled tokens' estimate (the mean of -log pi), which every update logs.
_ENTROPY_KEYS = (("entropy", "entropy (nats per token)"),
                 ("entropy_estimate", "entropy, mean −log π (nats per token)"))
_STALENESS_HISTOGRAM_KEY = "staleness_hist"
# Lines whose per-step values are a handful of groups' outcomes, so noisy: a moving average is
# drawn over them once a run has MOVING_AVERAGE_FROM steps.
_SMOOTHED = {"reward_mean", "success_rate"}
MOVING_AVERAGE_WINDOW = 8
MOVING_AVERAGE_FROM = 16
# How each step's groups were used (signal.png), bottom to top.
_USED_BY_OUTCOME = (("used: a success and a failure", "tab:green"),
                    ("used: one outcome, rewards spread by penalties", "yellowgreen"))
_GROUP_KEYS = (("groups_used", "used (reward spread)", "tab:green"),
               ("groups_skipped_zero_variance", "flat (one reward)", "tab:gray"),
               ("groups_skipped_too_small", "too small", "tab:red"))


def _is_number(value: object) -> bool:
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
    )


def _series(records: Sequence[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) for the records that have a numeric ``key``; the line index stands in for a
    missing step."""
    steps: list[float] = []
    values: list[float] = []
    for index, record in enumerate(records):
        value = record.get(key)
        if not _is_number(value):
            continue
        step = record.get("step")
        steps.append(step if _is_number(step) else index)
        values.append(value)
    return steps, values


def moving_average(values: Sequence[float], window: int) -> list[float]:
    """The mean of each value and the up to ``window - 1`` values before it (shorter at the start)."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    averages, total = [], 0.0
    for index, value in enumerate(values):
        total += value
        if index >= window:
            total -= values[index - window]
        averages.append(total / min(index + 1, window))
    return averages


def summed_staleness_histogram(records: Sequence[dict[str, Any]]) -> Counter[int]:
    """Sum the per-step {eta (as a string): count} dicts over the run."""
    total: Counter[int] = Counter()
    for record in records:
        histogram = record.get(_STALENESS_HISTOGRAM_KEY)
        if not isinstance(histogram, dict):
            continue
        for staleness_text, count in histogram.items():
            try:
                staleness = int(staleness_text)
            except (TypeError, ValueError):
                logger.warning("skipped staleness bucket %r: not an integer", staleness_text)
                continue
            if _is_number(count) and count > 0:
                total[staleness] += int(count)
    return total


def _count(record: dict[str, Any], key: str) -> float:
    return record[key] if _is_number(record.get(key)) else 0


def signal_bars(record: dict[str, Any]) -> list[tuple[str, str, float]]:
    """(label, colour, groups) of one step's batch, bottom to top: groups used, flat and too small.
    Where the record has the outcome counts, the used groups are split into those that set a
    success against a failure (the task's signal) and those whose episodes all had one outcome,
    their rewards spread only by penalties such as invalid replies (the format's signal)."""
    used = _count(record, "groups_used")
    rest = [(label, colour, _count(record, key)) for key, label, colour in _GROUP_KEYS[1:]]
    if not all(_is_number(record.get(key)) for key in ("groups_none_succeeded", "groups_all_succeeded")):
        return [(_GROUP_KEYS[0][1], _GROUP_KEYS[0][2], used), *rest]
    groups = used + sum(value for _, _, value in rest)
    mixed = min(used, max(0, groups - record["groups_none_succeeded"] - record["groups_all_succeeded"]))
    (task_label, task_colour), (format_label, format_colour) = _USED_BY_OUTCOME
    return [(task_label, task_colour, mixed), (format_label, format_colour, used - mixed), *rest]


def style_step_axes(axes, run_name: str, what: str, values: Sequence[float] = ()) -> None:
    """What every per-step plot shares: the run's name and what is drawn as the title, whole steps
    on the x axis, and a constant series drawn on a readable range rather than matplotlib's
    +-0.04 around it (a run at 0% success all along)."""
    from matplotlib.ticker import MaxNLocator

    axes.set_title(f"{run_name}: {what}", fontsize=10)
    axes.set_xlabel("learner step")
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    finite = [value for value in values if math.isfinite(value)]
    if finite and min(finite) == max(finite):
        value = finite[0]
        spread = abs(value) if value else 1.0
        axes.set_ylim(value - spread if value else 0.0, value + spread)


def plot_run(run_dir: str | Path) -> list[Path]:
    """Write the run's plots into ``run_dir/plots/`` (and log them to the run's W&B run, if it has
    one) and return their paths.

    Metrics absent from every record are skipped with a logged note. Raises FileNotFoundError when
    there is no metrics file and ValueError when it holds no records.
    """
    # Deferred so that importing this module (and `longhorizon --help`) stays instant. The figure is
    # drawn on an Agg canvas directly, leaving pyplot's global backend alone.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    run_dir = Path(run_dir)
    records = read_metrics(run_dir, required=True)
    plots_dir = run_dir / "plots"
    plots_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []

    def save(figure: Figure, file_name: str) -> None:
        path = plots_dir / file_name
        FigureCanvasAgg(figure)
        figure.savefig(path, format="png")
        written.append(path)

    entropy_key, entropy_label = next(((key, label) for key, label in _ENTROPY_KEYS
                                       if _series(records, key)[1]), _ENTROPY_KEYS[-1])
    for key, file_name, label in (*_LINE_PLOTS, (entropy_key, "entropy.png", entropy_label)):
        steps, values = _series(records, key)
        if not values:
            logger.warning("no %r in %s: %s not drawn", key, run_dir / "metrics.jsonl", file_name)
            continue
        figure = Figure(figsize=(6, 4), layout="tight")
        axes = figure.add_subplot()
        # The horizon cap changes in stages: a step line shows where each stage starts.
        drawstyle = "steps-post" if key == "horizon_cap" else "default"
        smoothed = key in _SMOOTHED and len(values) >= MOVING_AVERAGE_FROM
        axes.plot(steps, values, drawstyle=drawstyle, marker="." if len(values) < 50 else None,
                  alpha=0.4 if smoothed else 1.0)
        if smoothed:
            axes.plot(steps, moving_average(values, MOVING_AVERAGE_WINDOW), color="black",
                      label=f"mean of the last {MOVING_AVERAGE_WINDOW} steps")
            axes.legend(loc="best", fontsize=8)
        if key == "horizon_cap":
            axes.yaxis.set_major_locator(MaxNLocator(integer=True))
        style_step_axes(axes, run_dir.name, label, values)
        axes.set_ylabel(label)
        axes.grid(alpha=0.3)
        save(figure, file_name)

    steps, _ = _series(records, "groups_used")
    if steps:
        # Which groups of each step's batch carried a gradient: a flat group (every member the
        # same reward) has zero advantage everywhere.
        bars = [signal_bars(record) for record in records if _is_number(record.get("groups_used"))]
        figure = Figure(figsize=(6, 4), layout="tight")
        axes = figure.add_subplot()
        bottom = [0.0] * len(bars)
        # A run recorded before the outcome counts draws one kind of used group; a resumed run
        # can mix both, so the union of labels is drawn, each 0 where a step lacks it.
        labels = list(dict.fromkeys((label, colour) for step_bars in bars for label, colour, _ in step_bars))
        for label, colour in labels:
            values = [sum(value for name, _, value in step_bars if name == label) for step_bars in bars]
            axes.bar(steps, values, bottom=bottom, width=1.0, label=label, color=colour)
            bottom = [below + value for below, value in zip(bottom, values)]
        axes.set_ylim(0, max(max(bottom), 1.0) * 1.35)  # room for the legend
        axes.yaxis.set_major_locator(MaxNLocator(integer=True))
        style_step_axes(axes, run_dir.name, "groups with and without signal")
        axes.set_ylabel("groups in the step's batch")
        axes.legend(loc="best", fontsize=8)
        save(figure, "signal.png")
    else:
        logger.warning("no 'groups_used' in %s: signal.png not drawn", run_dir / "metrics.jsonl")

    histogram = summed_staleness_histogram(records)
    if histogram:
        figure = Figure(figsize=(6, 4), layout="tight")
        axes = figure.add_subplot()
        staleness_values = sorted(histogram)
        axes.bar(staleness_values, [histogram[value] for value in staleness_values])
        if len(staleness_values) <= 20:  # one labelled tick per bar while they stay legible
            axes.set_xticks(staleness_values)
        axes.set_title(f"{run_dir.name}: staleness of the trajectories trained on", fontsize=10)
        axes.set_xlabel("staleness (policy versions behind the learner)")
        axes.set_ylabel("trajectories used")
        save(figure, "staleness.png")
    else:
        logger.warning("no %r in %s: staleness.png not drawn", _STALENESS_HISTOGRAM_KEY, run_dir)
    try:
        log_plots_to_wandb(run_dir, written)
    except Exception as error:  # the PNGs are written whatever W&B makes of them
        logger.warning("plots not logged to Weights & Biases: %r", error)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: ``plot RUN_DIR``. Returns the process exit status."""
    parser = argparse.ArgumentParser(
        prog="longhorizon plot", description="Draw a training run's metrics as PNG files."
    )
    parser.add_argument("run_dir", type=Path, help="run directory holding metrics.jsonl")
    arguments = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        written = plot_run(arguments.run_dir)
    except (FileNotFoundError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
