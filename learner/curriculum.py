"""Horizon schedules (ScalingInter-RL): the most turns an episode may take, as a function of step.

Short horizons early let the policy learn the basic skills with stable gradients; longer ones later
leave room for planning, backtracking and reflection. `fixed` and `stepwise` are pure functions of
the learner step. `adaptive` decides when to move to the next stage from the figures each step
logs (success rate, share of episodes cut by the cap): its decision is a pure function of its
state and those figures, and the state is checkpointed, so a resumed run continues the same stage
with the same window.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "HORIZON_SCHEDULE_KINDS",
    "REFERENCE_FIXED_HORIZONS",
    "REFERENCE_SCHEDULES",
    "HorizonSchedule",
    "HorizonState",
    "AdaptiveRule",
    "AdaptiveState",
    "adaptive_step",
    "fixed_horizon",
    "make_horizon_schedule",
    "stepwise_horizon",
]

HORIZON_SCHEDULE_KINDS = ("fixed", "stepwise", "adaptive")

# The reference's ScalingInter schedules: (horizon stages, learner steps per stage).
REFERENCE_SCHEDULES: dict[str, tuple[tuple[int, ...], int]] = {
    "webarena": ((8, 12, 15), 80),
    "search": ((5, 8, 10), 100),
    "textcraft": ((10, 20, 30), 100),
    "babyai": ((6, 13, 20), 100),
    "sciworld": ((10, 20, 30), 100),
}

# The reference's fixed-horizon baselines, for comparison runs.
REFERENCE_FIXED_HORIZONS: dict[str, int] = {
    "webarena": 15,
    "search": 5,
    "textcraft": 30,
    "babyai": 20,
    "sciworld": 20,
}


@dataclass(frozen=True)
class HorizonState:
    """The horizon in force at a learner step."""

    cap: int
    """Most turns an episode may take; the actor truncates the episode there."""
    stage: int
    """Index of the schedule stage, from 0."""
    step: int
    """The learner step this state was computed for."""


def _is_int(value: object) -> bool:
    # bool is an int subclass, but True as a horizon is a config mistake.
    return isinstance(value, int) and not isinstance(value, bool)


def _check_step(step: int) -> None:
    if not _is_int(step) or step < 0:
        raise ValueError(f"step must be an integer >= 0, got {step!r}")


def _check_stages(stages: Sequence[int]) -> tuple[int, ...]:
    stages = tuple(stages)
    if not stages:
        raise ValueError("a horizon schedule needs at least one stage")
    if not all(_is_int(cap) and cap > 0 for cap in stages):
        raise ValueError(f"horizon stages must be positive integers, got {list(stages)}")
    if any(later <= earlier for earlier, later in itertools.pairwise(stages)):
        raise ValueError(f"horizon stages must be strictly increasing, got {list(stages)}")
    return stages


def _stage_lengths(stages: tuple[int, ...], stage_steps: int | Sequence[int]) -> tuple[int, ...]:
    """The length in learner steps of every stage but the last, which never ends."""
    if _is_int(stage_steps):
        lengths = (stage_steps,) * (len(stages) - 1)
    elif isinstance(stage_steps, Sequence) and not isinstance(stage_steps, str):
        lengths = tuple(stage_steps)
        # Giving a length for the last stage too is natural to write; that value is unused.
        if len(lengths) not in (len(stages), len(stages) - 1):
            raise ValueError(
                f"stage_steps has {len(lengths)} entries for {len(stages)} stages; give one per "
                f"stage (the last stage lasts forever, so its entry may be left out)"
            )
        lengths = lengths[: len(stages) - 1]
    else:
        raise ValueError(
            f"stage_steps must be an integer or a list of integers, got {stage_steps!r}"
        )
    if not all(_is_int(length) and length > 0 for length in lengths):
        raise ValueError(f"stage_steps must be positive integers, got {stage_steps!r}")
    return lengths


def _stage_at(step: int, stage_lengths: Sequence[int]) -> int:
    # Stage k starts at the sum of the lengths before it; a step on a boundary belongs to the new
    # stage, so with 100-step stages steps 0..99 are stage 0 and step 100 is stage 1.
    stage_starts = list(itertools.accumulate(stage_lengths))
    return bisect.bisect_right(stage_starts, step)


def fixed_horizon(step: int, cap: int) -> HorizonState:
    """The same cap at every step (the fixed-horizon baseline)."""
    _check_step(step)
    if not _is_int(cap) or cap <= 0:
        raise ValueError(f"horizon cap must be a positive integer, got {cap!r}")
    return HorizonState(cap=cap, stage=0, step=step)


def stepwise_horizon(
    step: int, stages: Sequence[int], stage_steps: int | Sequence[int]
) -> HorizonState:
    """Stage k's cap for ``stage_steps`` learner steps (or ``stage_steps[k]``), the last forever."""
    _check_step(step)
    checked_stages = _check_stages(stages)
    stage = _stage_at(step, _stage_lengths(checked_stages, stage_steps))
    return HorizonState(cap=checked_stages[stage], stage=stage, step=step)


@dataclass(frozen=True)
class HorizonSchedule:
    """A validated horizon schedule; build it with :func:`make_horizon_schedule`."""

    kind: str
    stages: tuple[int, ...]
    stage_lengths: tuple[int, ...]
    """Learner steps spent in each stage but the last."""

    def at(self, step: int) -> HorizonState:
        """The horizon in force at learner ``step``."""
        if self.kind == "fixed":
            return fixed_horizon(step, self.stages[0])
        _check_step(step)
        stage = _stage_at(step, self.stage_lengths)
        return HorizonState(cap=self.stages[stage], stage=stage, step=step)

    @property
    def final_cap(self) -> int:
        """The largest cap this schedule will ever give (for sizing buffers and timeouts)."""
        return self.stages[0] if self.kind == "fixed" else self.stages[-1]


@dataclass(frozen=True)
class AdaptiveRule:
    """When the adaptive schedule moves on: after at least `min_stage_steps` steps in a stage,
    when the success rate stopped rising (the mean of the last `window` steps is at least
    `plateau_min_success` and not above the mean of the `window` before by more than `min_gain`:
    "0 against 0" is a policy that has not started, not a plateau) or when the share of episodes cut by the
    cap, averaged over the last `window` steps, reaches `truncation_threshold` (the cap, not the
    skill, is what holds the policy back); and always after `max_stage_steps`."""

    window: int = 10
    min_gain: float = 0.02
    plateau_min_success: float = 0.05
    truncation_threshold: float = 0.5
    min_stage_steps: int = 20
    max_stage_steps: int = 200

    def __post_init__(self) -> None:
        if not (_is_int(self.window) and self.window >= 1):
            raise ValueError(f"horizon.window must be a positive integer, got {self.window!r}")
        if not (_is_int(self.min_stage_steps) and self.min_stage_steps >= 2 * self.window):
            raise ValueError(
                f"horizon.min_stage_steps ({self.min_stage_steps}) must be at least twice horizon.window "
                f"({self.window}): the plateau test compares two windows of the stage"
            )
        if not (_is_int(self.max_stage_steps) and self.max_stage_steps >= self.min_stage_steps):
            raise ValueError("horizon.max_stage_steps must be an integer >= horizon.min_stage_steps")
        if not 0.0 <= self.plateau_min_success <= 1.0:
            raise ValueError(f"horizon.plateau_min_success must be in [0, 1], got {self.plateau_min_success}")
        if not 0.0 < self.truncation_threshold <= 1.0:
            raise ValueError(f"horizon.truncation_threshold must be in (0, 1], got {self.truncation_threshold}")


@dataclass(frozen=True)
class AdaptiveState:
    """Where the adaptive schedule is: its stage, when the stage began, the figures seen in it
    (the last 2 x window steps), and why it last moved."""

    stage: int = 0
    stage_start: int = 0
    success: tuple[float, ...] = ()
    truncated: tuple[float, ...] = ()
    last_decision: str = ""


def adaptive_step(
    state: AdaptiveState, rule: AdaptiveRule, last_stage: int, step: int, success_rate: float, truncated_rate: float,
) -> AdaptiveState:
    """The schedule's state after learner step `step` logged these figures (a pure function).

    `step` is the number of steps done, so the stage has lasted step - stage_start steps.
    """
    keep = 2 * rule.window
    success = (state.success + (float(success_rate),))[-keep:]
    truncated = (state.truncated + (float(truncated_rate),))[-keep:]
    stayed = step - state.stage_start
    reason = ""
    if state.stage < last_stage and stayed >= rule.min_stage_steps:
        recent, earlier = success[-rule.window:], success[-2 * rule.window:-rule.window]
        recent_mean, earlier_mean = sum(recent) / len(recent), sum(earlier) / len(earlier)
        cut = sum(truncated[-rule.window:]) / rule.window
        if cut >= rule.truncation_threshold:
            reason = f"{cut:.0%} of episodes cut by the cap over the last {rule.window} steps"
        elif recent_mean >= rule.plateau_min_success and recent_mean - earlier_mean <= rule.min_gain:
            reason = (f"success stopped rising: {recent_mean:.3f} over the last {rule.window} steps "
                      f"against {earlier_mean:.3f} before")
        elif stayed >= rule.max_stage_steps:
            reason = f"the stage reached horizon.max_stage_steps ({rule.max_stage_steps})"
    if reason:
        return AdaptiveState(stage=state.stage + 1, stage_start=step, last_decision=f"step {step}: {reason}")
    return AdaptiveState(state.stage, state.stage_start, success, truncated, state.last_decision)


class AdaptiveSchedule:
    """The adaptive schedule of a run: `observe` after each step, `current` for the cap in force."""

    kind = "adaptive"

    def __init__(self, stages: Sequence[int], rule: AdaptiveRule, state: AdaptiveState | None = None) -> None:
        self.stages = _check_stages(stages)
        self.rule = rule
        self.state = state or AdaptiveState()

    def current(self, step: int) -> HorizonState:
        return HorizonState(cap=self.stages[self.state.stage], stage=self.state.stage, step=step)

    # The cap in force does not depend on the step alone; `at` names it as the other schedules do.
    at = current

    def observe(self, step: int, success_rate: float, truncated_rate: float) -> HorizonState:
        """Take the figures of step `step` (steps done so far) and return the horizon from now."""
        self.state = adaptive_step(self.state, self.rule, len(self.stages) - 1, step, success_rate, truncated_rate)
        return self.current(step)

    @property
    def final_cap(self) -> int:
        return self.stages[-1]


def make_horizon_schedule(
    kind: str, stages: Sequence[int], stage_steps: int | Sequence[int] | None = None
) -> HorizonSchedule:
    """Build a step-driven schedule by config name: ``"fixed"`` (uses stages[0]) or ``"stepwise"``;
    ``"adaptive"`` is built by :func:`make_schedule`, which takes the horizon config."""
    if kind == "adaptive":
        raise ValueError("the adaptive schedule needs its rule: build it with make_schedule(config.horizon)")
    if kind not in HORIZON_SCHEDULE_KINDS:
        raise ValueError(
            f"unknown horizon schedule {kind!r}; valid: {', '.join(HORIZON_SCHEDULE_KINDS)}"
        )
    if kind == "fixed":
        checked_stages = _check_stages(stages)
        return HorizonSchedule(kind="fixed", stages=checked_stages[:1], stage_lengths=())
    if stage_steps is None:
        raise ValueError("a stepwise horizon schedule needs stage_steps")
    checked_stages = _check_stages(stages)
    return HorizonSchedule(
        kind="stepwise",
        stages=checked_stages,
        stage_lengths=_stage_lengths(checked_stages, stage_steps),
    )


def make_schedule(horizon, state: AdaptiveState | None = None):
    """The schedule a `[horizon]` config table asks for."""
    if horizon.schedule == "adaptive":
        rule = AdaptiveRule(
            window=horizon.window, min_gain=horizon.min_gain, plateau_min_success=horizon.plateau_min_success,
            truncation_threshold=horizon.truncation_threshold,
            min_stage_steps=horizon.min_stage_steps, max_stage_steps=horizon.max_stage_steps,
        )
        return AdaptiveSchedule(horizon.stages, rule, state)
    return make_horizon_schedule(horizon.schedule, horizon.stages, horizon.stage_steps)
