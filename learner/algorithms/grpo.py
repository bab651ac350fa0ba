"""grpo, the default: group-normalised advantages and a clipped surrogate with an off-policy
correction (Shao et al., DeepSeekMath, 2024).

Most other built-ins are GRPO with one part changed (the estimator, the scoring, the clip, the
aggregation or the loss), so they subclass it and override that part alone.
"""

from __future__ import annotations

import numpy as np

from longhorizon.learner.advantages import grpo_advantages
from longhorizon.learner.algorithms.base import Algorithm, SymmetricClipOptions, check_choices, check_clip_range
from longhorizon.learner.losses import LossOutput, policy_loss
from longhorizon.learner.scoring import ScoredBatch, score_each_group


class GRPOOptions(SymmetricClipOptions):
    """grpo's keys (rloo and reinforce_pp take the same)."""

    aggregation: str = "token"
    """Loss aggregation: token (mean over all generated tokens) or sequence (mean of per-sequence means)."""


class GRPO(Algorithm):
    summary = "group-normalised advantages, clipped surrogate (Shao et al. 2024)"
    Options = GRPOOptions
    takes_step_credit = True
    takes_turn_samples = True

    asymmetric_clip = False
    """False: one symmetric `clip_eps`. True: its options hold `clip_eps_low` and `clip_eps_high` instead."""

    @property
    def clip_range(self) -> tuple[float, float]:
        """(low, high): the ratio is clipped to [1 - low, 1 + high]."""
        if not self.asymmetric_clip:
            return self.options.clip_eps, self.options.clip_eps
        return self.options.clip_eps_low, self.options.clip_eps_high

    @property
    def aggregation(self) -> str:
        return self.options.aggregation

    normaliser_tokens = 1.0
    """The constant a sequence's summed loss is divided by under "sum" aggregation."""

    clip_low_may_be_one = False
    """Whether its loss takes a lower clip of 1 (no lower bound): a weight that is only capped
    (cispo) does, a clipped surrogate does not."""

    def check_settings(self) -> None:
        keys = ("clip_eps", "clip_eps") if not self.asymmetric_clip else ("clip_eps_low", "clip_eps_high")
        check_clip_range(*self.clip_range, low_key=keys[0], high_key=keys[1],
                         low_may_be_one=self.clip_low_may_be_one)
        check_choices(self.options)

    def group_advantages(self, rewards: np.ndarray) -> np.ndarray:
        """Advantages of one group's members: (r - mean) / (std + eps)."""
        return grpo_advantages(rewards)

    def score(self, groups) -> ScoredBatch:
        return score_each_group(groups, self.shaped_rewards, self.group_advantages,
                                train_flat_groups=self.train_flat_groups, step_credit=self.step_credit)

    def loss(self, logprobs, proximal_logprobs, behaviour_logprobs, advantages, mask) -> LossOutput:
        """The clipped surrogate, corrected for the behaviour policy as the `loss` option says."""
        settings = self.options
        low, high = self.clip_range
        if settings.loss == "decoupled_ppo":
            options = dict(clip_eps=low, clip_eps_high=high, behaviour_weight_cap=settings.behaviour_weight_cap,
                           weight_level=settings.weight_level)
        elif settings.loss == "truncated_is":
            options = dict(is_cap=settings.behaviour_weight_cap)
        else:
            options = dict(clip_eps=low, clip_eps_high=high)
        return policy_loss(settings.loss, logprobs, proximal_logprobs, behaviour_logprobs, advantages, mask,
                           aggregation=self.aggregation, normaliser_tokens=self.normaliser_tokens, **options)
