"""ppo: proximal policy optimisation with a learned critic (Schulman et al. 2017; for language
models Ouyang et al. 2022).

Each turn's reward lands on the last token of that turn's reply; the advantages are GAE over the
episode's generated tokens from the critic's values at the start of the update, centred over the
step's tokens (and whitened when `advantage_std_scaling`). The policy loss is grpo's clipped
surrogate with these per-token advantages, plus `value_coef` times the clipped value loss. The
math is in learner/critic.py; the trainer runs the value model this algorithm builds.
"""

from __future__ import annotations

import dataclasses

import torch

from longhorizon.common.config import bounded
from longhorizon.learner.algorithms.base import SumOverRanks
from longhorizon.learner.algorithms.grpo import GRPO, GRPOOptions
from longhorizon.learner.critic import build_value_model, gae, per_token_rewards, value_loss, whiten
from longhorizon.learner.losses import LossOutput
from longhorizon.learner.scoring import ScoredBatch, example_from, group_failed, usable_groups


class PPOOptions(GRPOOptions):
    """ppo's keys: grpo's, and its critic's."""

    critic: str = "shared"
    """The value model: `shared` (a linear head on the policy's own backbone, which the value
    loss then also trains) or a model folder (a separate, usually smaller, critic)."""
    gamma: float = bounded(1.0, ge=0, le=1)
    """Discount per generated token."""
    lam: float = bounded(0.95, ge=0, le=1)
    """GAE's lambda (bias against variance of the advantage estimate)."""
    value_coef: float = bounded(0.5, gt=0)
    """Weight of the value loss beside the policy loss (positive: the critic must learn)."""
    value_clip: float = bounded(0.2, ge=0)
    """The new value may move at most this far from the old one in the clipped value loss (0
    turns the clip off)."""
    advantage_std_scaling: bool = False
    """Also divide the centred GAE advantages by their std over the step (whitening). Off by
    default: whitening keeps the update's size whatever the rewards' spread, so near convergence,
    when a step's rewards are (nearly) all equal, it scales the critic's errors up to the size of
    real advantages, and on the codebook env such updates undid a converged policy in its last
    steps (docs/algorithms.md)."""


class PPO(GRPO):
    summary = ("a learned critic and GAE over generated tokens, turn rewards at turn ends "
               "(Schulman et al. 2017; Ouyang et al. 2022)")
    Options = PPOOptions
    # The trainer runs its critic on any number of ranks (tests/test_distributed.py), but the
    # launcher has not been opened to it: a run with several ranks is refused for now.
    runs_on_several_ranks = False
    takes_step_credit = False  # its critic's GAE gives every token its own advantage already
    takes_turn_samples = False  # its critic reads the whole episode as one sequence

    def scores_every_generated_token(self) -> bool:
        return True  # turn rewards sit at the ends of the generated runs

    def score(self, groups) -> ScoredBatch:
        """Every group with two usable members, flat ones too (the critic is the baseline, and flat
        groups teach it as well), at advantage 0 for now, with each token's reward. The members
        keep their group, whose prompt they share (learner.shared_prefix encodes it once): GAE
        works on each sequence alone and is centred over the whole step, so how the members are
        cut into micro-batches does not change the advantages."""
        kept, failed, too_small = usable_groups(groups)
        examples = [
            example_from(t, 0.0, token_rewards=per_token_rewards(t.loss_mask, t.turn_rewards), group=index,
                         failed=group_failed(members))
            for index, members in enumerate(kept) for t in members
        ]
        return ScoredBatch(examples, len(kept), 0, too_small, failed)

    def build_value_model(self, policy_model):
        critic = build_value_model(policy_model, self.options.critic)
        # The head computes in float32 (a bfloat16 backbone's hidden states are cast up to it), or
        # in float64 beside a float64 backbone: with several ranks FSDP2 shards each unit's
        # parameters in one dtype, and the head sits in the policy's root unit.
        if next(critic.decoder.parameters()).dtype == torch.float64:
            critic.head.to(torch.float64)
        return critic

    def advantages_from_values(self, micro_batches, values, sum_over_ranks: SumOverRanks | None = None):
        """GAE from the critic's values at the start of the update, centred over the step's
        generated tokens (every rank's, with `sum_over_ranks`) and scaled to unit std there when
        `advantage_std_scaling`; the value targets (returns) beside them."""
        settings = self.options
        estimates = [
            gae(micro.token_rewards, micro_values, micro.loss_mask, settings.gamma, settings.lam)
            for micro, micro_values in zip(micro_batches, values)
        ]
        counted = torch.cat([adv[micro.loss_mask > 0] for (adv, _), micro in zip(estimates, micro_batches)]).double()
        # From sums in float64, on one rank as on several: the statistics do not depend on how the
        # step's sequences were dealt to ranks and cut into micro-batches.
        sums = [float(counted.numel()), float(counted.sum()), float((counted ** 2).sum())]
        count, total, squares = sum_over_ranks(sums) if sum_over_ranks is not None else sums
        mean = total / count if count else 0.0
        std = max(squares / count - mean * mean, 0.0) ** 0.5 if count else 1.0
        with_advantages = [
            dataclasses.replace(micro, advantages=whiten(
                adv, micro.loss_mask, mean, std if settings.advantage_std_scaling else None))
            for (adv, _), micro in zip(estimates, micro_batches)
        ]
        return with_advantages, [returns for _, returns in estimates]

    def value_loss(self, values, old_values, returns, mask) -> LossOutput:
        critic = value_loss(values, old_values, returns, mask, value_clip=self.options.value_clip,
                            aggregation=self.aggregation)
        return LossOutput(self.options.value_coef * critic, {"value_loss": critic.item()})
