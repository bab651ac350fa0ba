"""dr_grpo: GRPO done right (Liu et al., Understanding R1-Zero-Like Training, 2025). Without the
std division of the advantages and without per-sequence length normalisation: each sequence's
summed token loss is divided by a constant (`loss_normaliser_tokens`), so every token weighs the
same and wrong answers do not drift longer."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from longhorizon.learner.advantages import grpo_advantages
from longhorizon.learner.algorithms.grpo import GRPO


@dataclass(frozen=True)
class DrGRPOSettings:
    clip_eps: float
    loss: str
    weight_level: str
    behaviour_weight_cap: float
    loss_normaliser_tokens: float


class DrGRPO(GRPO):
    summary = "GRPO without std scaling or length normalisation (Liu et al. 2025)"
    Settings = DrGRPOSettings
    aggregation = "sum"

    @property
    def normaliser_tokens(self) -> float:
        return self.settings.loss_normaliser_tokens

    def group_advantages(self, rewards: np.ndarray) -> np.ndarray:
        return grpo_advantages(rewards, scale_by_std=False)
