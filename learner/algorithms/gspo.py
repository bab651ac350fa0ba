"""gspo: group sequence policy optimisation (Zheng et al., 2025). GRPO's advantages with one
length-normalised importance ratio per sequence, clipped in a narrow range; every sequence weighs
the same whatever its length."""

from __future__ import annotations

from dataclasses import dataclass

from longhorizon.learner.algorithms.grpo import GRPO
from longhorizon.learner.losses import LossOutput, gspo_loss


@dataclass(frozen=True)
class GSPOSettings:
    clip_eps_low: float | None
    clip_eps_high: float | None
    behaviour_weight_cap: float


class GSPO(GRPO):
    summary = "one length-normalised importance ratio per sequence (Zheng et al. 2025)"
    Settings = GSPOSettings
    aggregation = "sequence"
    takes_step_credit = False  # one ratio, and so one advantage, per sequence
    default_clip = (3e-4, 4e-4)
    """The clip range of a per-token geometric mean, hence so small."""

    def loss(self, logprobs, proximal_logprobs, behaviour_logprobs, advantages, mask) -> LossOutput:
        low, high = self.clip_range
        return gspo_loss(logprobs, proximal_logprobs, behaviour_logprobs, advantages, mask,
                         clip_eps_low=low, clip_eps_high=high, behaviour_weight_cap=self.settings.behaviour_weight_cap)
