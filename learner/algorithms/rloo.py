"""rloo: REINFORCE leave-one-out (Ahmadian et al., Back to Basics, 2024). Each member's baseline is
the mean of the other members' rewards: unbiased, and no std division, so a group whose rewards
barely differ is not blown up. The loss is grpo's."""

from __future__ import annotations

import numpy as np

from longhorizon.learner.advantages import rloo_advantages
from longhorizon.learner.algorithms.grpo import GRPO


class RLOO(GRPO):
    summary = "leave-one-out baseline within the group (Ahmadian et al. 2024)"

    def group_advantages(self, rewards: np.ndarray) -> np.ndarray:
        return rloo_advantages(rewards)
