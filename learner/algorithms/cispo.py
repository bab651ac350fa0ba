"""cispo: clipped IS-weight policy optimisation (MiniMax, MiniMax-M1, 2025). GRPO's advantages; the
importance weight pi / mu is clipped and detached, but no token's gradient is ever dropped (PPO's
clip zeroes the gradient of tokens outside the trust region). The weight is taken against mu, so
it is also the off-policy correction."""

from __future__ import annotations

from longhorizon.common.config import Section
from longhorizon.learner.algorithms.grpo import GRPO
from longhorizon.learner.losses import LossOutput, cispo_loss


class CISPOOptions(Section):
    """cispo's keys: the importance weight pi / mu is clipped to [1 - clip_eps_low, 1 + clip_eps_high]."""

    clip_eps_low: float = 1.0
    """1: no lower bound."""
    clip_eps_high: float = 1.0
    """1: the weight capped at 2."""


class CISPO(GRPO):
    summary = "clipped importance weight with stop-gradient, every token kept (MiniMax 2025)"
    Options = CISPOOptions
    aggregation = "token"
    asymmetric_clip = True
    clip_low_may_be_one = True

    def loss(self, logprobs, proximal_logprobs, behaviour_logprobs, advantages, mask) -> LossOutput:
        low, high = self.clip_range
        return cispo_loss(logprobs, behaviour_logprobs, advantages, mask,
                          clip_eps_low=low, clip_eps_high=high, aggregation="token")
