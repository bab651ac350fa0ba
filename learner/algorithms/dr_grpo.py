"""dr_grpo: GRPO done right (Liu et al., Understanding R1-Zero-Like Training, 2025). Without the
std division of the advantages and without per-sequence length normalisation: each sequence's
summed token loss is divided by a constant (`loss_normaliser_tokens`), so every token weighs the
same and wrong answers do not drift longer."""

from __future__ import annotations

import numpy as np

from longhorizon.learner.advantages import grpo_advantages
from longhorizon.common.config import bounded
from longhorizon.learner.algorithms.base import SymmetricClipOptions
from longhorizon.learner.algorithms.grpo import GRPO


class DrGRPOOptions(SymmetricClipOptions):
    """dr_grpo's keys."""

    loss_normaliser_tokens: float = bounded(1024.0, gt=0)
    """Each sequence's summed token loss is divided by this constant (the generation budget)
    instead of its own length."""


class DrGRPO(GRPO):
    summary = "GRPO without std scaling or length normalisation (Liu et al. 2025)"
    Options = DrGRPOOptions
    aggregation = "sum"

    @property
    def normaliser_tokens(self) -> float:
        return self.options.loss_normaliser_tokens

    def group_advantages(self, rewards: np.ndarray) -> np.ndarray:
        return grpo_advantages(rewards, scale_by_std=False)
