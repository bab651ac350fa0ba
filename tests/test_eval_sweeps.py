"""Evaluation sweeps: success against the horizon cap and Pass@k against k, checked on scripted
policies whose rates are known exactly, plus the files each sweep writes."""

import json
from pathlib import Path

import pytest

from longhorizon.actor.evaluate import EpisodeRecord, bootstrap_mean_interval, default_ks, pass_at_k_curve
from longhorizon.actor.metrics import pass_at_k
from longhorizon.launch.recipes.eval import main as eval_main

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
SCRIPTED = "actor.engine='scripted'"


def _sweep(tmp_path, capsys, name, *args):
    output_dir = tmp_path / name
    assert eval_main([*args, "--output-dir", str(output_dir)]) == 0
    last_line = capsys.readouterr().out.strip().splitlines()[-1]
    document = json.loads(last_line)
    assert json.loads((output_dir / f"{document['sweep']}{'-sweep' if document['sweep'] == 'horizon' else ''}.json")
                      .read_text()) == document
    return document, output_dir


def _assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, path


def test_codebook_oracle_succeeds_exactly_from_the_third_turn(tmp_path, capsys):
    document, output_dir = _sweep(
        tmp_path, capsys, "codebook-horizon", str(CONFIGS / "codebook.toml"), SCRIPTED,
        "--tasks", "30", "--sweep", "horizon", "--values", "4,1,2,3",
    )
    points = document["points"]
    assert [p["horizon_cap"] for p in points] == [1, 2, 3, 4]
    # Three symbols to answer: no episode can succeed before its third turn, and the oracle
    # always succeeds once it has it.
    assert [p["success_rate"] for p in points] == [0.0, 0.0, 1.0, 1.0]
    assert [p["mean_turns"] for p in points] == [1.0, 2.0, 3.0, 3.0]
    assert [(p["cut_by_horizon"], p["cut_by_context"]) for p in points] == [(30, 0), (30, 0), (0, 0), (0, 0)]
    assert all(p["episodes"] == 30 and p["failed_episodes"] == 0 for p in points)
    assert points[0]["success_rate_ci95"][0] == 0.0 < points[0]["success_rate_ci95"][1]
    table = (output_dir / "horizon-sweep.md").read_text()
    assert table.count("\n") == 2 + len(points) and "| 3 " in table
    _assert_png(output_dir / "horizon-sweep.png")
    episodes = [json.loads(line) for line in (output_dir / "episodes.jsonl").read_text().splitlines()]
    assert len(episodes) == 4 * 30 and {e["horizon_cap"] for e in episodes} == {1, 2, 3, 4}


def test_codebook_random_pass_at_k_follows_the_independent_trials_curve(tmp_path, capsys):
    document, output_dir = _sweep(
        tmp_path, capsys, "codebook-pass", str(CONFIGS / "codebook.toml"), SCRIPTED,
        "actor.scripted_policy='random'", "--tasks", "40", "--samples", "64", "--sweep", "pass-at-k",
        "--bootstrap", "500",
    )
    assert [p["k"] for p in document["points"]] == [1, 2, 4, 8, 16, 32, 64]
    assert document["summary"]["episodes"] == 40 * 64 and document["horizon_cap"] == 3
    for point in document["points"]:
        # Each episode succeeds with probability 1/64 independently of the task, so
        # pass@k = 1 - (63/64)^k; allow 4.5 standard errors (taken from the bootstrap interval).
        truth = 1 - (63 / 64) ** point["k"]
        low, high = point["ci95"]
        assert low <= point["pass@k"] <= high
        standard_error = max((high - low) / 3.92, 1e-3)
        assert abs(point["pass@k"] - truth) < 4.5 * standard_error, (point, truth)
    values = [p["pass@k"] for p in document["points"]]
    assert values == sorted(values) and values[-1] > 0.3
    _assert_png(output_dir / "pass-at-k.png")
    assert "| 64 " in (output_dir / "pass-at-k.md").read_text()


def test_textcraft_oracle_needs_the_budget_deep_recipes_take(tmp_path, capsys):
    document, _ = _sweep(
        tmp_path, capsys, "textcraft", str(CONFIGS / "textcraft.toml"), SCRIPTED,
        "--tasks", "111", "--sweep", "horizon", "--values", "2,40",
    )
    short, long = document["points"]
    assert long["success_rate"] == 1.0 and long["failed_episodes"] == 0
    # A depth-4 item needs at least four crafts, so two turns can never reach it.
    assert short["per_category"]["depth-4"]["success_rate"] == 0.0
    assert short["success_rate"] < long["success_rate"]


def test_episodes_stopped_by_the_context_limit_are_counted_and_named(tmp_path, capsys):
    """The oracle succeeds on every codebook task, unless the context cannot hold its third turn:
    then the summary says which limit the figures measure."""
    def args(max_context_tokens):
        return ["--tasks", "20", "--output-dir", str(tmp_path / "eval"), str(CONFIGS / "codebook.toml"), SCRIPTED,
                "actor.scripted_policy='oracle'", f"actor.max_context_tokens={max_context_tokens}"]

    assert eval_main(args(70)) == 0
    output = capsys.readouterr().out
    cut = json.loads(output.strip().splitlines()[-1])
    assert "warning: 20 episodes stopped" in output and "actor.max_context_tokens = 70" in output
    assert eval_main(args(4096)) == 0
    output = capsys.readouterr().out
    whole = json.loads(output.strip().splitlines()[-1])
    assert (whole["success_rate"], whole["cut_by_context"], whole["cut_by_horizon"]) == (1.0, 0, 0)
    assert "warning" not in output
    assert cut["success_rate"] == 0.0 and cut["cut_by_context"] == 20 and cut["mean_turns"] < 3
    assert cut["max_context_tokens"] == 70


def test_the_context_warning_names_the_limit():
    from longhorizon.launch.recipes.eval import context_warning

    assert context_warning(0, 2048) == ""
    assert "3 episodes" in context_warning(3, 2048) and "actor.max_context_tokens = 2048" in context_warning(3, 2048)


def test_pass_at_k_curve_on_hand_built_records():
    def runs(task, category, successes, total):
        return [EpisodeRecord(task, category, i < successes, float(i < successes), 2, "") for i in range(total)]

    records = runs("a", "x", 1, 4) + runs("b", "x", 4, 4) + runs("c", "y", 0, 4)
    records += runs("d", "y", 2, 3) + [EpisodeRecord("d", "y", False, 0.0, 1, "EnvError: broke")]
    points = pass_at_k_curve(records, 4, [1, 2], resamples=200)
    # Task d lost an episode to an error and is left out: a, b and c remain.
    assert [p["tasks"] for p in points] == [3, 3]
    assert points[0]["pass@k"] == pytest.approx((0.25 + 1.0 + 0.0) / 3)
    assert points[1]["pass@k"] == pytest.approx((pass_at_k(4, 1, 2) + 1.0 + 0.0) / 3)
    assert points[1]["per_category"] == pytest.approx({"x": (0.5 + 1.0) / 2, "y": 0.0})
    with pytest.raises(ValueError, match="k=5"):
        pass_at_k_curve(records, 4, [5])


def test_bootstrap_interval_and_default_ks():
    assert bootstrap_mean_interval([0.5] * 10) == (0.5, 0.5)
    low, high = bootstrap_mean_interval([0.0, 1.0] * 50, resamples=2000)
    # The mean of 100 fair coin flips has standard error 0.05: the 95% interval is about 0.4-0.6.
    assert 0.38 < low < 0.43 and 0.57 < high < 0.62
    assert default_ks(64) == [1, 2, 4, 8, 16, 32, 64]
    assert default_ks(10) == [1, 2, 4, 8, 10]


def test_bad_sweep_requests_are_clear_errors(tmp_path, capsys):
    config = str(CONFIGS / "codebook.toml")
    assert eval_main([config, SCRIPTED, "--sweep", "pass-at-k", "--output-dir", str(tmp_path)]) == 2
    assert "--samples" in capsys.readouterr().err
    assert eval_main([config, SCRIPTED, "--sweep", "pass-at-k", "--samples", "4", "--values", "8"]) == 2
    assert "k=8" in capsys.readouterr().err
    assert eval_main([config, SCRIPTED, "--sweep", "horizon"]) == 2
    assert "--values" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_a_checkpoint_that_is_not_there_is_one_clear_line(tmp_path, capsys):
    config = str(CONFIGS / "codebook.toml")
    missing = tmp_path / "run" / "checkpoints" / "step_000003"
    assert eval_main([config, "--checkpoint", str(missing), "--tasks", "2"]) == 2
    assert capsys.readouterr().err == f"error: no folder {str(missing)!r}: give a model folder or a run's " \
                                      f"checkpoints/step_N folder\n"
    # Beside the run's saved steps, the error names them; an empty folder is no model either.
    for step in ("step_000002", "step_000004"):
        (missing.parent / step).mkdir(parents=True)
        (missing.parent / step / "config.json").write_text("{}")
    assert eval_main([config, "--checkpoint", str(missing), "--tasks", "2"]) == 2
    assert "holds step_000002, step_000004" in capsys.readouterr().err
    missing.mkdir()
    assert eval_main([config, "--checkpoint", str(missing), "--tasks", "2"]) == 2
    assert "holds no model (no config.json)" in capsys.readouterr().err


def test_eval_shows_its_progress_on_stderr(capsys):
    assert eval_main([str(CONFIGS / "codebook.toml"), SCRIPTED, "--tasks", "4", "--samples", "2"]) == 0
    progress = capsys.readouterr().err.splitlines()
    assert progress[-1].startswith("eval [########################] 8/8 8 succeeded |"), progress
