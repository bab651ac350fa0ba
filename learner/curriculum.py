"""Horizon schedules (ScalingInter-RL): the most turns an episode may take, as a function of step.

Short horizons early let the policy learn the basic skills with stable gradients; longer ones later
leave room for planning, backtracking and reflection. Schedules here are pure functions of the
learner step. Adaptive schedules, which react to success rates or to how often episodes hit the
cap, will need observations as well as the step and will sit beside these as another kind.
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
    "fixed_horizon",
    "make_horizon_schedule",
    "stepwise_horizon",
]

HORIZON_SCHEDULE_KINDS = ("fixed", "stepwise")

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


def make_horizon_schedule(
    kind: str, stages: Sequence[int], stage_steps: int | Sequence[int] | None = None
) -> HorizonSchedule:
    """Build a schedule by config name: ``"fixed"`` (uses stages[0]) or ``"stepwise"``."""
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
