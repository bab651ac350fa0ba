"""gspo: group sequence policy optimisation (Zheng et al., 2025). GRPO's advantages with one
length-normalised importance ratio per sequence, clipped in a narrow range; every sequence weighs
the same whatever its length."""

from __future__ import annotations

from longhorizon.common.config import Section, bounded
from longhorizon.learner.algorithms.grpo import GRPO
from longhorizon.learner.losses import LossOutput, gspo_loss


class GSPOOptions(Section):
    """gspo's keys."""

    clip_eps_low: float = 3e-4
    """The sequence ratio (a per-token geometric mean, hence the small range) is clipped below at
    1 - clip_eps_low."""
    clip_eps_high: float = 4e-4
    """...and above at 1 + clip_eps_high."""
    behaviour_weight_cap: float = bounded(2.0, ge=1)
    """Truncation of the behaviour weight pi_prox / mu of each sequence."""


class GSPO(GRPO):
    summary = "one length-normalised importance ratio per sequence (Zheng et al. 2025)"
    Options = GSPOOptions
    aggregation = "sequence"
    takes_step_credit = False  # one ratio, and so one advantage, per sequence
    asymmetric_clip = True

    def loss(self, logprobs, proximal_logprobs, behaviour_logprobs, advantages, mask) -> LossOutput:
        low, high = self.clip_range
        return gspo_loss(logprobs, proximal_logprobs, behaviour_logprobs, advantages, mask,
                         clip_eps_low=low, clip_eps_high=high, behaviour_weight_cap=self.options.behaviour_weight_cap)
