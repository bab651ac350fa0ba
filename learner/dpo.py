"""DPO (Rafailov et al. 2023): preference pairs of episodes, and the loss against a frozen reference.

A pair is two episodes of the same task, the preferred one (`chosen`) and the other
(`rejected`). Pairs come from groups (the best and the worst member of a group whose rewards
differ) or from a JSONL file. An episode's log-likelihood is the sum of its generated tokens'
log-probs (every assistant turn of the conversation: the loss mask), under the policy and under
the reference (the starting model, frozen).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PreferencePair:
    task_id: str
    chosen: object
    rejected: object
    reward_margin: float


def pairs_from_groups(groups) -> list[PreferencePair]:
    """One pair per group whose usable members' rewards differ: its best against its worst
    (the first of equals, so the choice is deterministic)."""
    from longhorizon.learner.trainer import usable_members

    pairs = []
    for group in groups:
        members = usable_members(group)
        if len(members) < 2:
            continue
        best = max(members, key=lambda t: t.reward)
        worst = min(members, key=lambda t: t.reward)
        if best.reward > worst.reward:
            pairs.append(PreferencePair(best.task_id, best, worst, float(best.reward - worst.reward)))
    return pairs


def sequence_logprobs(token_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each row's summed log-prob over its counted tokens: [B, T] -> [B]."""
    return torch.where(mask > 0, token_logprobs, torch.zeros_like(token_logprobs)).sum(dim=-1)


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    reference_chosen: torch.Tensor,
    reference_rejected: torch.Tensor,
    *,
    beta: float = 0.1,
) -> tuple[torch.Tensor, dict[str, float]]:
    """mean over pairs of -log sigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r))), from sequence
    log-likelihoods ([P] each); also the implied reward margin and the preference accuracy."""
    if not beta > 0:
        raise ValueError(f"beta must be positive, got {beta}")
    chosen_reward = beta * (policy_chosen - reference_chosen.detach())
    rejected_reward = beta * (policy_rejected - reference_rejected.detach())
    margin = chosen_reward - rejected_reward
    loss = -F.logsigmoid(margin).mean()
    metrics = {
        "reward_margin": float(margin.detach().mean()),
        "preference_accuracy": float((margin.detach() > 0).float().mean()),
    }
    return loss, metrics
