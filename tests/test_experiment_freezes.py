"""The freeze experiment: its verdicts on hand-built metrics records, and the command end to end
on two very short codebook runs."""

import json
from pathlib import Path

import pytest

from longhorizon.launch.recipes import experiment_freezes as experiment

CODEBOOK = str(Path(__file__).resolve().parent.parent / "configs" / "codebook.toml")


def _step(step, success, used=0, flat=16, **extra):
    return {"step": step, "success_rate": success, "groups_used": used, "groups_skipped_zero_variance": flat, **extra}


def test_entropy_prefers_the_full_distribution_then_the_estimate():
    assert experiment.step_entropy(_step(1, 0.4, entropy=0.3, entropy_estimate=0.9)) == 0.3
    assert experiment.step_entropy(_step(1, 0.4, entropy_estimate=0.9)) == 0.9
    assert experiment.step_entropy(_step(1, 0.4, entropy=None, entropy_estimate=0.9)) == 0.9  # non-finite, read back
    assert experiment.step_entropy(_step(1, 0.4)) is None  # every group flat and left out: nothing trained


def test_flat_share_and_mean_entropy_over_steps():
    steps = [_step(1, 0.4, used=4, flat=12, entropy_estimate=0.3), _step(2, 0.4, used=0, flat=16),
             _step(3, 0.4, used=2, flat=6, entropy=0.1)]
    assert experiment.flat_fraction(steps) == pytest.approx(34 / 40)
    assert experiment.mean_entropy(steps) == pytest.approx(0.2)  # step 2 logged none
    assert experiment.flat_fraction([_step(1, 0.0, used=0, flat=0)]) is None
    assert experiment.mean_entropy([_step(1, 0.4)]) is None


def _frozen_tail(first, count, used=2, flat=14, success=0.42, **extra):
    return [_step(s, success, used=used, flat=flat, **extra) for s in range(first, first + count)]


def test_a_run_froze_when_its_last_steps_are_unsolved_and_mostly_flat():
    learning = [_step(s, 0.1 * s, used=10, flat=6, entropy_estimate=1.0) for s in range(1, 6)]
    # 14 of 16 groups flat (87.5%) at 42% success: the codebook freeze.
    assert experiment.froze(learning + _frozen_tail(6, 10), last=10)
    # Step 5 in the window: 14 * 10 + 6 = 146 flat of 176 groups, 83%, still frozen; its 50%
    # success keeps the mean below the level.
    assert experiment.froze(learning + _frozen_tail(6, 10), last=11)
    # With a stricter share (every group flat) it is not.
    assert not experiment.froze(learning + _frozen_tail(6, 10), last=10, flat_share=1.0)
    assert experiment.froze(learning + _frozen_tail(6, 10, used=0, flat=16), last=10, flat_share=1.0)
    # Exactly at the share counts: 12.8 of 16 is not a whole group, so 4 of 20 used over two steps.
    at_share = [_step(1, 0.4, used=2, flat=8), _step(2, 0.4, used=2, flat=8)]
    assert experiment.froze(at_share, last=2, flat_share=0.8)
    # A policy learning its way up: its failures spread over the groups, most of which have signal.
    climbing = _frozen_tail(6, 10, used=9, flat=7, success=0.8, entropy_estimate=0.4)
    assert not experiment.froze(learning + climbing, last=10)
    # Solved and flat is not frozen: the mean over the window reaches 95%.
    solved = _frozen_tail(6, 9, used=1, flat=15, success=1.0) + [_step(15, 0.9, used=1, flat=15)]
    assert not experiment.froze(learning + solved, last=10)
    # The mean is what counts: 0.9 * 9 + 1.0 = 9.1 of 10 is below.
    nearly = _frozen_tail(6, 9, used=1, flat=15, success=0.9) + [_step(15, 1.0, used=1, flat=15)]
    assert experiment.froze(learning + nearly, last=10)
    # Too short to tell.
    assert not experiment.froze(_frozen_tail(6, 9), last=10)
    with pytest.raises(ValueError, match="at least 1"):
        experiment.froze(_frozen_tail(6, 10), last=0)


def test_a_run_whose_entropy_is_near_zero_below_the_level_froze_even_with_signal():
    # Whole-batch algorithms (reinforce_pp, ppo) count no group flat: only the entropy tells.
    sure = _frozen_tail(1, 10, used=16, flat=0, entropy=0.03125)  # 1/32: exact in binary, so is its mean
    assert experiment.froze(sure, last=10)
    assert not experiment.froze(sure, last=10, entropy_floor=0.03125)  # at the floor is not below it
    assert not experiment.froze(_frozen_tail(1, 10, used=16, flat=0, entropy=0.3), last=10)
    # Steps without an entropy (trained on nothing) are left out of its mean.
    mixed = _frozen_tail(1, 5, used=16, flat=0, entropy_estimate=0.02) + _frozen_tail(6, 5, used=16, flat=0)
    assert experiment.froze(mixed, last=10)


def test_steps_to_success_is_the_first_full_window_whose_mean_reaches_the_level():
    successes = [1.0, 0.5, 0.75, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    records = [_step(s, value, used=1) for s, value in enumerate(successes, start=1)]
    # Windows of 5 end from step 5 on: means 0.85 (step 5), 0.85 (step 6), 0.95 (step 7: 4.75 / 5).
    assert experiment.steps_to_success(records, level=0.95, window=5) == 7
    assert experiment.steps_to_success(records, level=0.96, window=5) == 8
    # Step 1 alone is at 100%, and a window of one counts it.
    assert experiment.steps_to_success(records, level=0.95, window=1) == 1
    # Windows of 3: 0.75 (step 3), 0.75, 0.917 (step 5), 1.0 (step 6).
    assert experiment.steps_to_success(records, level=0.99, window=3) == 6
    assert experiment.steps_to_success(records[:4], level=0.5, window=5) is None  # no full window
    assert experiment.steps_to_success([_step(s, 0.42) for s in range(1, 20)]) is None
    # The step number is the record's, not its position.
    later = [_step(s, 1.0) for s in range(41, 46)]
    assert experiment.steps_to_success(later) == 45
    with pytest.raises(ValueError, match="at least 1 step"):
        experiment.steps_to_success(records, window=0)


def test_run_figures_and_the_summary_over_runs():
    frozen = [_step(s, 0.5, entropy_estimate=0.3) for s in range(1, 4)] + [_step(s, 0.25) for s in range(4, 14)]
    figures = experiment.analyse_run(frozen, experiment.Criteria(last=10))
    assert figures == {"steps": 13, "froze": True, "steps_to_success": None, "final_success": 0.25,
                       "final_entropy": 0.3, "success_at_end": 0.25, "flat_share_at_end": 1.0,
                       "entropy_at_end": None}
    runs = [{"seed": 0, **figures}, {"seed": 1, "froze": False, "steps_to_success": 50},
            {"seed": 2, "froze": False, "steps_to_success": 60}, {"seed": 3, "froze": False, "steps_to_success": 70},
            {"seed": 4, "froze": False, "steps_to_success": None}]
    assert experiment.summarise(runs) == {"runs": 5, "frozen": 1, "reached": 3, "median_steps_to_success": 60}
    assert experiment.summarise(runs[:1])["median_steps_to_success"] is None
    with pytest.raises(ValueError, match="no steps"):
        experiment.analyse_run([])


def test_overrides_of_the_keys_the_experiment_sets_are_refused(tmp_path, capsys):
    from longhorizon.launch.cli import main

    code = main(["experiment", "freezes", CODEBOOK, "--runs", "2", "--output", str(tmp_path / "out"),
                 "run.seed=3"])
    assert code == 2
    assert "run.seed is set by the experiment" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_the_command_trains_two_seeds_and_writes_their_verdicts(tmp_path, capsys, tiny_codebook_model):
    from longhorizon.launch.cli import main

    output = tmp_path / "freezes"
    code = main(["experiment", "freezes", CODEBOOK, "--runs", "2", "--output", str(output),
                 "--last-steps", "2", "run.total_steps=3", "actor.num_actors=1",
                 f"model.path={str(tiny_codebook_model)!r}"])
    assert code == 0
    last_line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last_line["experiment"] == "freezes" and last_line["runs"] == 2
    document = json.loads((output / "freezes.json").read_text())
    assert document["summary"] == {key: last_line[key] for key in ("runs", "frozen", "reached",
                                                                   "median_steps_to_success")}
    assert document["criteria"]["last_steps"] == 2
    assert [run["seed"] for run in document["runs"]] == [0, 1]
    for run in document["runs"]:
        assert run["steps"] == 3 and isinstance(run["froze"], bool)
        # A random policy succeeds on about 2% of episodes: not solved in three steps.
        assert run["steps_to_success"] is None and 0.0 <= run["final_success"] < 0.5
        assert run["final_entropy"] is not None and run["final_entropy"] > 0.05
        assert (output / f"run-{run['seed']}" / "metrics.jsonl").is_file()
    # A rerun with the same settings reuses the finished runs instead of training again.
    code = main(["experiment", "freezes", CODEBOOK, "--runs", "2", "--output", str(output),
                 "--last-steps", "2", "run.total_steps=3", "actor.num_actors=1",
                 f"model.path={str(tiny_codebook_model)!r}"])
    assert code == 0
    assert capsys.readouterr().out.count("finished earlier, reusing") == 2
