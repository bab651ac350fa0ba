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
    with pytest.raises(ValueError, match="fixed, stepwise"):
        make_horizon_schedule("adaptive", [5, 10], 10)
    with pytest.raises(ValueError, match="needs stage_steps"):
        make_horizon_schedule("stepwise", [5, 10])
    with pytest.raises(ValueError, match="strictly increasing"):
        make_horizon_schedule("stepwise", [10, 5], 10)
    assert HORIZON_SCHEDULE_KINDS == ("fixed", "stepwise")


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
