"""reinforce_pp: REINFORCE++ (Hu, 2025). Rewards are normalised over the whole batch, whatever the
task, so a group whose members all scored alike still counts; the loss is grpo's."""

from __future__ import annotations

from longhorizon.learner.advantages import reinforce_pp_advantages
from longhorizon.learner.algorithms.grpo import GRPO
from longhorizon.learner.scoring import ScoredBatch, score_whole_batch


class ReinforcePP(GRPO):
    summary = "rewards normalised over the whole batch (Hu 2025)"

    def score(self, groups) -> ScoredBatch:
        return score_whole_batch(groups, self.shaped_rewards, reinforce_pp_advantages, step_credit=self.step_credit)
