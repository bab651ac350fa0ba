"""Horizon schedules: stage boundaries, per-stage lengths, validation, the reference table."""

import pytest

from longhorizon.learner.curriculum import (
    HORIZON_SCHEDULE_KINDS,
    REFERENCE_FIXED_HORIZONS,
    REFERENCE_SCHEDULES,
    HorizonState,
    fixed_horizon,
    make_horizon_schedule,
    stepwise_horizon,
)


def test_fixed_horizon_never_changes():
    assert fixed_horizon(0, 15) == HorizonState(cap=15, stage=0, step=0)
    assert fixed_horizon(10_000, 15) == HorizonState(cap=15, stage=0, step=10_000)


def test_stepwise_boundaries_belong_to_the_next_stage():
    stages = (10, 20, 30)
    # 100 steps per stage: 0..99 -> 10, 100..199 -> 20, 200.. -> 30 for ever.
    assert stepwise_horizon(0, stages, 100) == HorizonState(cap=10, stage=0, step=0)
    assert stepwise_horizon(99, stages, 100) == HorizonState(cap=10, stage=0, step=99)
    assert stepwise_horizon(100, stages, 100) == HorizonState(cap=20, stage=1, step=100)
    assert stepwise_horizon(199, stages, 100).cap == 20
    assert stepwise_horizon(200, stages, 100) == HorizonState(cap=30, stage=2, step=200)
    assert stepwise_horizon(1_000_000, stages, 100) == HorizonState(cap=30, stage=2, step=1_000_000)


def test_stepwise_with_a_length_per_stage():
    # Stage 0 lasts 5 steps (0..4), stage 1 lasts 20 (5..24), stage 2 from step 25 on.
    stages = (4, 8, 16)
    assert stepwise_horizon(4, stages, [5, 20, 999]).cap == 4
    assert stepwise_horizon(5, stages, [5, 20, 999]).cap == 8
    assert stepwise_horizon(24, stages, [5, 20, 999]).cap == 8
    assert stepwise_horizon(25, stages, [5, 20, 999]) == HorizonState(cap=16, stage=2, step=25)
    # The last stage's length may be left out: it lasts for ever anyway.
    assert stepwise_horizon(25, stages, [5, 20]).cap == 16


def test_single_stage_stepwise_is_fixed():
    assert stepwise_horizon(500, [12], 10) == HorizonState(cap=12, stage=0, step=500)


@pytest.mark.parametrize(
    "stages, stage_steps, message",
    [
        ([], 10, "at least one stage"),
        ([10, 10, 20], 10, "strictly increasing"),
        ([20, 10], 10, "strictly increasing"),
        ([0, 10], 10, "positive integers"),
        ([5, 7.5], 10, "positive integers"),
        ([5, 10], 0, "positive integers"),
        ([5, 10, 15], [10, -1], "positive integers"),
        ([5, 10, 15], [10], "1 entries for 3 stages"),
        ([5, 10, 15], [10, 10, 10, 10], "4 entries"),
        ([5, 10], "10", "integer or a list"),
    ],
)
def test_stepwise_validation(stages, stage_steps, message):
    with pytest.raises(ValueError, match=message):
        stepwise_horizon(0, stages, stage_steps)


def test_negative_step_is_refused():
    with pytest.raises(ValueError, match="step"):
        stepwise_horizon(-1, [5, 10], 10)
    with pytest.raises(ValueError, match="step"):
        make_horizon_schedule("fixed", [5]).at(-1)


def test_schedule_object_matches_the_functions():
    schedule = make_horizon_schedule("stepwise", [6, 13, 20], 100)
    for step in (0, 99, 100, 150, 199, 200, 5000):
        assert schedule.at(step) == stepwise_horizon(step, [6, 13, 20], 100)
    assert schedule.final_cap == 20


def test_fixed_schedule_uses_the_first_stage():
    schedule = make_horizon_schedule("fixed", [15, 20])
    assert schedule.at(0) == HorizonState(cap=15, stage=0, step=0)
    assert schedule.at(300) == HorizonState(cap=15, stage=0, step=300)
    assert schedule.final_cap == 15


def test_schedule_construction_validates_early():
    with pytest.raises(ValueError, match="fixed, stepwise, adaptive"):
        make_horizon_schedule("sawtooth", [5, 10], 10)
    with pytest.raises(ValueError, match="needs its rule"):
        make_horizon_schedule("adaptive", [5, 10], 10)
    with pytest.raises(ValueError, match="needs stage_steps"):
        make_horizon_schedule("stepwise", [5, 10])
    with pytest.raises(ValueError, match="strictly increasing"):
        make_horizon_schedule("stepwise", [10, 5], 10)
    assert HORIZON_SCHEDULE_KINDS == ("fixed", "stepwise", "adaptive")


def test_reference_schedules():
    assert REFERENCE_SCHEDULES["webarena"] == ((8, 12, 15), 80)
    assert REFERENCE_SCHEDULES["search"] == ((5, 8, 10), 100)
    assert REFERENCE_SCHEDULES["textcraft"] == ((10, 20, 30), 100)
    assert REFERENCE_SCHEDULES["babyai"] == ((6, 13, 20), 100)
    assert REFERENCE_SCHEDULES["sciworld"] == ((10, 20, 30), 100)
    assert set(REFERENCE_FIXED_HORIZONS) == set(REFERENCE_SCHEDULES)
    # Every reference schedule is valid; webarena's third stage starts at step 160.
    for stages, stage_steps in REFERENCE_SCHEDULES.values():
        make_horizon_schedule("stepwise", stages, stage_steps)
    webarena = make_horizon_schedule("stepwise", *REFERENCE_SCHEDULES["webarena"])
    assert webarena.at(159).cap == 12
    assert webarena.at(160).cap == 15


# -- adaptive --------------------------------------------------------------------------------------

from longhorizon.learner.curriculum import AdaptiveRule, AdaptiveSchedule, AdaptiveState, adaptive_step  # noqa: E402

RULE = AdaptiveRule(window=3, min_gain=0.02, truncation_threshold=0.5, min_stage_steps=6, max_stage_steps=20)


def _run(curve, truncated=None, stages=(3, 6, 9), rule=RULE):
    """Feed a success curve step by step; returns the stage after each step and the schedule."""
    schedule = AdaptiveSchedule(stages, rule)
    truncated = truncated or [0.0] * len(curve)
    seen = []
    for step, (success, cut) in enumerate(zip(curve, truncated), start=1):
        seen.append(schedule.observe(step, success, cut).stage)
    return seen, schedule


def test_a_rising_success_rate_keeps_the_stage_until_it_levels_off():
    # Rising by 0.05 a step for 10 steps, then flat at 0.5.
    curve = [0.05 * i for i in range(1, 11)] + [0.5] * 4
    stages, schedule = _run(curve)
    # Steps 1..10: each window gains 0.15 on the one before. Flat from step 11: at step 13 the last
    # window (0.5, 0.5, 0.5) gains 0.05 on (0.4, 0.45, 0.5) -> stays; at step 14 it gains 0.0167 ->
    # moves on.
    assert stages[:13] == [0] * 13
    assert stages[13] == 1
    assert schedule.state.last_decision.startswith("step 14: success stopped rising")


def test_a_flat_curve_moves_on_after_the_minimum_stay():
    stages, _ = _run([0.3] * 7)
    assert stages == [0, 0, 0, 0, 0, 1, 1]  # the stage began at step 0; at step 6 it has lasted 6


def test_no_success_yet_is_not_a_plateau():
    # 0 against 0 is a policy that has not started at this cap: it stays until the maximum stay.
    stages, schedule = _run([0.0] * 21)
    assert stages[:19] == [0] * 19 and stages[19] == 1
    assert "max_stage_steps (20)" in schedule.state.last_decision
    # Flat below plateau_min_success (0.05) stays; flat at it moves on after the minimum stay.
    assert _run([0.04] * 8)[0] == [0] * 8
    assert _run([0.05] * 8)[0][5] == 1


def test_too_many_truncated_episodes_move_on_even_while_success_rises():
    curve = [0.1 * i for i in range(1, 8)]
    cut = [0.0, 0.0, 0.0, 0.6, 0.6, 0.6, 0.6]
    stages, schedule = _run(curve, cut)
    assert stages[5] == 1 and stages[4] == 0
    assert "60% of episodes cut by the cap" in schedule.state.last_decision


def test_the_maximum_stay_ends_a_stage_and_the_last_stage_never_ends():
    rising = [min(1.0, 0.04 * i) for i in range(1, 60)]  # gains more than 0.02 per window until 1.0
    stages, _ = _run(rising, rule=AdaptiveRule(window=3, min_gain=0.0, min_stage_steps=6, max_stage_steps=10))
    assert stages[9] == 1  # step 10: the maximum stay
    assert max(stages) == 2 and stages[-1] == 2


def test_the_decision_is_a_pure_function_of_state_and_figures():
    state = AdaptiveState(stage=0, stage_start=0, success=(0.2, 0.2, 0.2, 0.2, 0.2), truncated=(0.0,) * 5)
    first = adaptive_step(state, RULE, 2, 6, 0.2, 0.0)
    second = adaptive_step(state, RULE, 2, 6, 0.2, 0.0)
    assert first == second and first.stage == 1 and first.stage_start == 6 and first.success == ()
    assert state.stage == 0  # the input is not changed


def test_adaptive_rules_are_checked():
    with pytest.raises(ValueError, match="at least twice horizon.window"):
        AdaptiveRule(window=5, min_stage_steps=8)
    with pytest.raises(ValueError, match="max_stage_steps"):
        AdaptiveRule(window=2, min_stage_steps=10, max_stage_steps=5)
    with pytest.raises(ValueError, match="plateau_min_success"):
        AdaptiveRule(plateau_min_success=1.5)
