"""Metrics files: reading and following a growing metrics.jsonl, and cutting it back on resume."""

import json
import logging

import pytest

from longhorizon.common.metrics import MetricsFollower, read_metrics, truncate_metrics


def _append(path, text):
    with path.open("a") as file:
        file.write(text)


def test_the_follower_returns_whole_new_lines_once(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 1}) + "\n")
    follower = MetricsFollower(tmp_path)  # what was there before is not new
    assert follower.new_records() == []
    _append(path, json.dumps({"step": 2}) + "\n" + '{"step": ')  # the last line is being written
    assert follower.new_records() == [{"step": 2}]
    _append(path, "3}\n")
    assert follower.new_records() == [{"step": 3}]
    assert follower.new_records() == []


def test_the_follower_continues_after_the_file_is_cut_back(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": step}) + "\n" for step in range(1, 6)))
    follower = MetricsFollower(tmp_path)
    assert truncate_metrics(tmp_path, last_step=3) == 2
    assert follower.new_records() == []
    _append(path, json.dumps({"step": 4}) + "\n")
    assert follower.new_records() == [{"step": 4}]
    assert MetricsFollower(tmp_path / "absent").new_records() == []


def test_truncate_keeps_the_steps_up_to_the_checkpoint_and_drops_a_torn_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": step, "x": step * 2}) + "\n" for step in range(1, 8)) + '{"step": 8, "x"')
    assert truncate_metrics(tmp_path, last_step=4) == 4
    assert [record["step"] for record in read_metrics(tmp_path)] == [1, 2, 3, 4]
    assert truncate_metrics(tmp_path, last_step=4) == 0
    assert truncate_metrics(tmp_path / "absent", last_step=0) == 0


def test_read_metrics_skips_lines_that_are_not_records_and_can_require_some(tmp_path, caplog):
    assert read_metrics(tmp_path) == []  # a run that has not stepped yet
    with pytest.raises(FileNotFoundError, match="no metrics file"):
        read_metrics(tmp_path, required=True)
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n")
    with pytest.raises(ValueError, match="no metric records"):
        read_metrics(tmp_path, required=True)
    path.write_text(json.dumps({"step": 1}) + "\n[1, 2]\n\n" + json.dumps({"step": 2}) + "\n" + '{"step": 3, "lo')
    with caplog.at_level(logging.WARNING, logger="longhorizon.common.metrics"):
        assert read_metrics(tmp_path, required=True) == [{"step": 1}, {"step": 2}]
    assert "metrics.jsonl:2: skipped, not a JSON object" in caplog.text
    assert "metrics.jsonl:5: skipped, not JSON" in caplog.text
