"""Run plots drawn from a small synthetic metrics.jsonl."""

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from longhorizon.common.metrics import read_metrics
from longhorizon.launch.plot import main, moving_average, plot_run, signal_bars, summed_staleness_histogram

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def write_metrics(run_dir: Path, records: list[dict], tail: str = "") -> None:
    lines = [json.dumps(record) for record in records]
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n" + tail, encoding="utf-8")


def synthetic_records(steps: int = 6) -> list[dict]:
    return [
        {
            "step": step,
            "version": step,
            "reward_mean": 0.1 * step,
            "success_rate": min(1.0, 0.15 * step),
            "horizon_cap": 10 if step < 3 else 20,
            "horizon_stage": 0 if step < 3 else 1,
            "staleness_hist": {"0": 4, "1": step},
            "episodes_per_s": 2.0 + step,
            "groups_used": step % 3,
            "groups_skipped_zero_variance": 2 - step % 3,
            "loss": 0.5,
            "entropy_estimate": 0.4 - 0.05 * step,
        }
        for step in range(steps)
    ]


def assert_valid_png(path: Path) -> None:
    import matplotlib.image

    assert path.read_bytes()[:8] == PNG_SIGNATURE
    height, width, _ = matplotlib.image.imread(path).shape
    assert height > 100 and width > 100


def test_plot_run_writes_every_plot(tmp_path):
    write_metrics(tmp_path, synthetic_records())
    written = plot_run(tmp_path)
    names = sorted(path.name for path in written)
    assert names == ["entropy.png", "horizon.png", "reward.png", "signal.png", "staleness.png", "success.png",
                     "throughput.png"]
    for path in written:
        assert path.parent == tmp_path / "plots"
        assert_valid_png(path)


def test_the_entropy_plot_prefers_the_full_distributions_entropy(tmp_path, monkeypatch):
    from matplotlib.axes import Axes

    records = synthetic_records(4)
    records[2]["entropy"] = 0.9  # logged on one step only (say the bonus was switched on mid-run)
    write_metrics(tmp_path, records)
    drawn = {}
    original_plot = Axes.plot

    def recording_plot(self, x, y, *args, **kwargs):
        drawn.setdefault(self.get_figure(), []).append(list(y))
        return original_plot(self, x, y, *args, **kwargs)

    monkeypatch.setattr(Axes, "plot", recording_plot)
    estimate = pytest.approx([0.4, 0.35, 0.3, 0.25])
    written = plot_run(tmp_path)
    assert "entropy.png" in [path.name for path in written]
    first_lines = [lines[0] for lines in drawn.values()]
    assert [0.9] in first_lines and estimate not in first_lines
    # Without it, the estimate every update logs is drawn.
    del records[2]["entropy"]
    write_metrics(tmp_path, records)
    drawn.clear()
    plot_run(tmp_path)
    assert estimate in [lines[0] for lines in drawn.values()]


def test_moving_average_by_hand():
    # Window 3: 1; (1+2)/2; (1+2+6)/3; (2+6+4)/3.
    assert moving_average([1.0, 2.0, 6.0, 4.0], 3) == pytest.approx([1.0, 1.5, 3.0, 4.0])
    assert moving_average([5.0], 8) == [5.0]
    with pytest.raises(ValueError, match="window"):
        moving_average([1.0], 0)


def test_missing_keys_are_skipped_with_a_note(tmp_path, caplog):
    records = [{"step": step, "reward_mean": float(step)} for step in range(3)]
    write_metrics(tmp_path, records)
    with caplog.at_level(logging.WARNING, logger="longhorizon.launch.plot"):
        written = plot_run(tmp_path)
    assert [path.name for path in written] == ["reward.png"]
    assert "success_rate" in caplog.text and "staleness_hist" in caplog.text
    assert not (tmp_path / "plots" / "success.png").exists()


def test_cut_off_last_line_is_skipped(tmp_path, caplog):
    write_metrics(tmp_path, synthetic_records(3), tail='{"step": 3, "reward_me')
    assert len(read_metrics(tmp_path)) == 3
    with caplog.at_level(logging.WARNING, logger="longhorizon.common.metrics"):
        assert len(plot_run(tmp_path)) == 7
    assert "not JSON" in caplog.text


def test_missing_or_empty_metrics_give_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no metrics file"):
        plot_run(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("\n\n", encoding="utf-8")
    with pytest.raises(ValueError, match="no metric records"):
        plot_run(tmp_path)


def test_main_reports_errors_and_paths(tmp_path, capsys):
    assert main([str(tmp_path)]) == 1
    assert "no metrics file" in capsys.readouterr().err
    write_metrics(tmp_path, synthetic_records())
    assert main([str(tmp_path)]) == 0
    printed = capsys.readouterr().out.split()
    assert len(printed) == 7 and all(Path(line).is_file() for line in printed)


def test_importing_the_module_does_not_import_matplotlib():
    # `longhorizon --help` must stay instant, so matplotlib loads only when plotting.
    code = "import sys, longhorizon.launch.plot; print('matplotlib' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "False"


def test_staleness_histogram_is_summed_over_the_run(caplog):
    records = synthetic_records(6)
    records.append({"step": 6, "staleness_hist": {"2": 3, "bad": 1}})
    records.append({"step": 7})
    with caplog.at_level(logging.WARNING, logger="longhorizon.launch.plot"):
        histogram = summed_staleness_histogram(records)
    # eta 0: 4 per step over steps 0..5; eta 1: 0 + 1 + ... + 5; eta 2: 3 from step 6.
    assert histogram == {0: 24, 1: 15, 2: 3}
    assert "'bad'" in caplog.text


def test_signal_bars_split_used_groups_by_outcome_where_the_record_has_outcomes():
    # 4 groups: 2 used, 1 flat, 1 too small. Without outcome counts the used groups are one bar;
    # with 1 group without a success and 1 of only successes, the other 2 (both used) were mixed.
    record = {"groups_used": 2, "groups_skipped_zero_variance": 1, "groups_skipped_too_small": 1}
    assert [value for _, _, value in signal_bars(record)] == [2, 1, 1]
    assert [value for _, _, value in signal_bars({**record, "groups_none_succeeded": 1, "groups_all_succeeded": 1})] \
        == [2, 0, 1, 1]
    # 3 groups without a success: of the 2 used, only 1 can have set a success against a failure;
    # the other spread its rewards through penalties alone.
    bars = signal_bars({**record, "groups_none_succeeded": 3, "groups_all_succeeded": 0})
    assert [(label.split(":")[0], value) for label, _, value in bars] == [
        ("used", 1), ("used", 1), ("flat (one reward)", 1), ("too small", 1)]
    assert "one outcome" in bars[1][0]


def test_step_plots_are_titled_with_the_run_take_whole_steps_and_show_a_constant_series_readably():
    from matplotlib.figure import Figure

    from longhorizon.launch.plot import style_step_axes

    axes = Figure().add_subplot()
    axes.plot([1, 2, 3], [0.0, 0.0, 0.0])
    style_step_axes(axes, "codebook", "training success", [0.0, 0.0, 0.0])
    assert axes.get_title() == "codebook: training success"
    assert axes.get_ylim() == (0.0, 1.0)  # not matplotlib's -0.055..0.055 around 0
    ticks = axes.xaxis.get_major_locator().tick_values(1, 3)
    assert all(float(tick).is_integer() for tick in ticks)
    axes = Figure().add_subplot()
    style_step_axes(axes, "run", "reward", [0.5, 0.5])
    assert axes.get_ylim() == (0.0, 1.0)
    axes = Figure().add_subplot()
    axes.plot([1, 2], [0.2, 0.7])
    style_step_axes(axes, "run", "reward", [0.2, 0.7])
    low, high = axes.get_ylim()
    assert low < 0.2 and high > 0.7 and high - low < 1.0  # a varying series keeps matplotlib's range
