"""The horizon experiment: its budget accounting (hand-computed), the arms' settings, the summary,
and the command end to end on a tiny budget."""

import json
from pathlib import Path

import pytest

from longhorizon.common.config import load_config
from longhorizon.launch.recipes import experiment_horizons as experiment

REPO_ROOT = Path(__file__).resolve().parent.parent
CONFIG = REPO_ROOT / "configs" / "horizons.toml"


def test_mean_turns_at_cap_counts_min_of_length_and_cap():
    assert experiment.mean_turns_at_cap([2, 3, 8], 3) == pytest.approx(8 / 3)
    assert experiment.mean_turns_at_cap([2, 3, 8], 8) == pytest.approx(13 / 3)
    with pytest.raises(ValueError, match="no task lengths"):
        experiment.mean_turns_at_cap([], 3)


def test_step_turns_are_new_episodes_times_their_mean_turns():
    records = [
        {"trajectories_trained": 4, "episode_turns_mean": 2.5},   # 4 episodes x 2.5 = 10
        {"trajectories_trained": 8, "episode_turns_mean": 3.0},   # 4 x 3 = 12
        {"trajectories_trained": 16, "episode_turns_mean": 1.0},  # 8 x 1 = 8
    ]
    assert experiment.step_turns(records) == [10.0, 12.0, 8.0]
    assert experiment.cumulative_turns(records) == [10.0, 22.0, 30.0]
    assert experiment.cumulative_turns([]) == []


def test_budget_targets_and_the_first_steps_that_reach_them():
    assert experiment.budget_targets(30, 3) == [10.0, 20.0, 30.0]
    assert experiment.first_steps_reaching([10.0, 22.0, 30.0], [10.0, 20.0, 30.0, 31.0]) == [1, 2, 3, None]
    assert experiment.first_steps_reaching([5.0, 9.0, 25.0], [10.0, 20.0]) == [3, 3]
    with pytest.raises(ValueError, match="at least one evaluation point"):
        experiment.budget_targets(30, 0)


def test_stage_steps_share_the_budget_and_the_step_limit_outlasts_it():
    # Stages playing 100, 150 and 250 turns per step: 1000 turns last 2 steps of each.
    assert experiment.stepwise_stage_steps(1000, [100, 150, 250]) == 2
    assert experiment.stepwise_stage_steps(10, [100, 150, 250]) == 1
    # 1000 turns at the fewest 100 turns per step is 10 steps; with the 25% margin, 12.5 -> 13, + 1.
    assert experiment.step_limit(1000, 100) == 14
    with pytest.raises(ValueError, match="positive"):
        experiment.stepwise_stage_steps(0, [100])


def test_each_arm_sets_its_horizon_and_nothing_else():
    stages = (3, 5, 8)
    assert experiment.arm_overrides("fixed-short", stages, 40, 10) == ['horizon.schedule="fixed"', "horizon.stages=[3]"]
    assert experiment.arm_overrides("fixed-long", stages, 40, 10) == ['horizon.schedule="fixed"', "horizon.stages=[8]"]
    assert experiment.arm_overrides("stepwise", stages, 40, 10) == [
        'horizon.schedule="stepwise"', "horizon.stages=[3, 5, 8]", "horizon.stage_steps=40"]
    assert experiment.arm_overrides("adaptive", stages, 4, 10) == [
        'horizon.schedule="adaptive"', "horizon.stages=[3, 5, 8]", "horizon.max_stage_steps=10"]
    with pytest.raises(ValueError, match="unknown arm 'sideways'; valid arms: fixed-short, fixed-long"):
        experiment.arm_overrides("sideways", stages, 40, 10)
    for arm in experiment.ARMS:  # every arm's overrides make a valid config
        load_config(CONFIG, experiment.arm_overrides(arm, stages, 40, 10))


def test_plan_of_the_shipped_config():
    config = load_config(CONFIG)
    plan = experiment.make_plan(config, 50_000)
    # 8 groups of 8 episodes. The 2000 train tasks have lengths 2..8 in turn: 286 of each length
    # but 8, which has 285, so the even-share means below hold to 0.1%.
    assert plan.episodes_per_step == 64
    assert plan.stages == (3, 5, 8) and plan.eval_cap == 8
    expected = [64 * (2 + 3 * 6) / 7, 64 * (2 + 3 + 4 + 5 * 4) / 7, 64 * 5]
    assert plan.turns_per_step_by_stage == pytest.approx(expected, rel=1e-3)
    assert plan.stage_steps == round(50_000 / sum(plan.turns_per_step_by_stage))
    assert plan.total_steps > 50_000 / plan.turns_per_step_by_stage[0]


def _run(successes, budget_step):
    return {"budget_step": budget_step, "turns_at_budget_step": 100.0 + budget_step,
            "curve": [{"budget_share": share, "turns": share * 100, "success": value, "easy": value, "hard": value / 2}
                      for share, value in zip((0.0, 0.5, 1.0), successes)]}


def test_summary_and_table_over_seeds():
    runs = {"stepwise": {0: _run([0.0, 0.6, 0.4], 10), 1: _run([0.0, 0.2, 0.8], 12)}}
    summary = experiment.summarise(runs, 100)["stepwise"]
    assert summary["final_success"] == {"mean": pytest.approx(0.6), "min": 0.4, "max": 0.8}
    assert summary["best_success"] == {"mean": pytest.approx(0.7), "min": 0.6, "max": 0.8}
    assert summary["steps_at_budget"] == {"mean": 11.0, "min": 10, "max": 12}
    assert [point["success"]["mean"] for point in summary["curve"]] == pytest.approx([0.0, 0.4, 0.6])
    table = experiment.format_table({"stepwise": summary})
    assert "| stepwise | 2 | 11 [10-12] | 60.0% [40%-80%] | 70.0% [60%-80%] |" in table


def test_unknown_arm_is_refused_before_anything_runs(tmp_path, capsys):
    from longhorizon.launch.cli import main

    code = main(["experiment", "horizons", "--arms", "fixed-short,sideways", "--output", str(tmp_path)])
    assert code == 2
    assert "unknown arm 'sideways'" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


@pytest.mark.slow
def test_the_command_runs_two_arms_on_a_tiny_budget(tmp_path, capsys):
    from longhorizon.launch.cli import main

    output = tmp_path / "horizons"
    code = main(["experiment", "horizons", "--seeds", "1", "--budget", "1500", "--points", "2",
                 "--arms", "fixed-short,fixed-long", "--output", str(output),
                 # One actor process instead of two: the experiment's bookkeeping is under test.
                 "--set", "actor.num_actors=1"])
    assert code == 0
    last_line = capsys.readouterr().out.strip().splitlines()[-1]
    result = json.loads(last_line)
    assert result["experiment"] == "horizons" and result["budget_turns"] == 1500
    assert set(result["arms"]) == {"fixed-short", "fixed-long"}
    for arm in result["arms"].values():
        assert 0.0 <= arm["final_success"]["mean"] <= arm["best_success"]["mean"] <= 1.0
        # Stopped at the first step past the budget: over it by less than one step's turns.
        assert 1500 <= arm["turns_at_budget"]["mean"] < 1500 + 64 * 8
    # A long cap spends more turns per episode, so it gets fewer learner steps for the budget.
    assert result["arms"]["fixed-long"]["steps_at_budget"]["mean"] < result["arms"]["fixed-short"]["steps_at_budget"]["mean"]

    document = json.loads((output / "curves.json").read_text())
    for arm in ("fixed-short", "fixed-long"):
        run = document["runs"][arm]["0"]
        assert [point["budget_share"] for point in run["curve"]] == [0.0, 0.5, 1.0]
        assert run["curve"][-1]["step"] == run["budget_step"]
        assert run["curve"][-1]["episodes"] == 200
        caps = set(run["horizon_cap_by_step"])
        assert caps == ({3} if arm == "fixed-short" else {8})
    assert (output / "horizons.png").stat().st_size > 0
