"""The optimiser step every trainer shares (the RL trainer, SFT and DPO), and the offline trainers'
loop over their planned steps.

An update clips the accumulated gradient, and is applied only when the loss and the gradient norm
are finite: Adam would write NaN into every parameter and into its moments, from which no later
step recovers, so a non-finite update is dropped and the weights and the optimiser's state
(moments, step count) stay as they were. The learning rate rises linearly over the warm-up, then
stays flat (`learning_rate_at`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch


def learning_rate_at(step: int, base: float, warmup_steps: int) -> float:
    """Learning rate of optimiser step `step` (0-based): a linear rise over the warm-up, then flat."""
    if warmup_steps <= 0:
        return base
    return base * min(1.0, (step + 1) / warmup_steps)


@dataclass(frozen=True)
class Update:
    """What one optimiser update did: the gradient's norm before clipping, and whether it was
    applied (False: a non-finite loss or norm, the update dropped)."""

    grad_norm: float
    applied: bool


def apply_update(optimizer: torch.optim.Optimizer, parameters: Iterable[torch.nn.Parameter], *, grad_clip: float,
                 learning_rate: float | Callable[[], float], loss_finite: bool = True,
                 agree: Callable[[bool], bool] = lambda finite: finite) -> Update:
    """Clip the accumulated gradient of `parameters` to `grad_clip` and, if the loss and the norm
    are finite, set `learning_rate` (a value, or a function called only for an applied update)
    and step; otherwise clear the gradient and leave everything as it was. `agree` turns this
    process's verdict into the one every rank acts on (several ranks skip or step together)."""
    norm = torch.nn.utils.clip_grad_norm_(parameters, grad_clip)
    grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    if not agree(loss_finite and math.isfinite(grad_norm)):
        optimizer.zero_grad(set_to_none=True)
        return Update(grad_norm, False)
    rate = learning_rate() if callable(learning_rate) else learning_rate
    for group in optimizer.param_groups:
        group["lr"] = rate
    optimizer.step()
    return Update(grad_norm, True)


@dataclass(frozen=True)
class OfflineSettings:
    """An offline trainer's optimiser settings (its own table: [sft] or [dpo])."""

    learning_rate: float
    warmup_steps: int
    grad_clip: float


def run_offline_steps(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    plan: Sequence[tuple[int, list[int]]],
    settings: OfflineSettings,
    accumulate: Callable[[list[int]], dict[str, float]],
    on_step: Callable[[dict], None],
    *,
    checkpoint_every: int = 0,
    save: Callable[[int, int], object] | None = None,
) -> list[dict]:
    """Train through `plan` ((epoch, example indices) per optimiser step): for each step, clear
    the gradient, let `accumulate(indices)` run the step's micro-batches forward and backward
    (returning the step's figures: a non-finite value among them marks the loss non-finite),
    then apply the update. Each step's record (`step` from 1, `epoch` from 1, the figures,
    `learning_rate`, `grad_norm`, `nonfinite_step`, `learner_step_seconds`) goes to `on_step`
    (metrics, progress) and is returned with the others. Every `checkpoint_every` steps before the
    last, `save(step, epoch index)` writes a checkpoint (the caller saves the last one itself)."""
    records = []
    model.train()
    for step_index, (epoch, indices) in enumerate(plan):
        started = time.perf_counter()
        learning_rate = learning_rate_at(step_index, settings.learning_rate, settings.warmup_steps)
        optimizer.zero_grad(set_to_none=True)
        figures = accumulate(indices)
        update = apply_update(optimizer, model.parameters(), grad_clip=settings.grad_clip, learning_rate=learning_rate,
                              loss_finite=all(math.isfinite(value) for value in figures.values()))
        record = {"step": step_index + 1, "epoch": epoch + 1, **figures, "learning_rate": learning_rate,
                  "grad_norm": update.grad_norm, "nonfinite_step": 0.0 if update.applied else 1.0,
                  "learner_step_seconds": time.perf_counter() - started}
        records.append(record)
        on_step(record)
        if save is not None and checkpoint_every and record["step"] % checkpoint_every == 0 and record["step"] < len(plan):
            save(record["step"], epoch)
    model.eval()
    return records
