"""PPO's critic: per-token rewards at turn ends, GAE over generated tokens, the clipped value loss,
and the value model (a head on the policy's backbone, or a separate small model).

Time steps are the episode's generated tokens in order, across turns: the environment's
observation tokens between turns are not actions, so they are skipped, and the value of a state
is read from the hidden state just before a generated token. Each turn's reward is placed on the
last token of that turn's reply. Arrays here are aligned as the trainer's are: position p of a
`[B, L-1]` array is about token p + 1, predicted from the hidden state at p.
"""

from __future__ import annotations

import numpy as np
import torch
from longhorizon.learner.losses import aggregate
from longhorizon.common.models import load_causal_lm, resolve_model_path

CRITIC_CHOICES = "shared, or a model folder for a separate critic"


def per_token_rewards(loss_mask: np.ndarray, turn_rewards: list[float]) -> np.ndarray:
    """Rewards per token: turn k's reward on the last token of the k-th run of generated tokens.

    An episode has one reply per turn; if it has more replies than rewards (cut off after its
    last reply) the extra replies get 0, and rewards beyond the last reply are added to it, so
    the rewards always sum to the episode's return.
    """
    mask = np.asarray(loss_mask) > 0
    rewards = np.zeros(mask.shape[0], dtype=np.float32)
    ends = [i for i in range(mask.shape[0]) if mask[i] and (i + 1 == mask.shape[0] or not mask[i + 1])]
    if not ends:
        return rewards
    for turn, reward in enumerate(turn_rewards):
        rewards[ends[min(turn, len(ends) - 1)]] += float(reward)
    return rewards


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float):
    """Generalised advantage estimation over each row's counted positions, in order.

    With the counted positions t_1 < ... < t_n of a row, V_{n+1} = 0 (the episode ended) and
    delta_k = r_k + gamma * V_{k+1} - V_k, A_k = delta_k + gamma * lam * A_{k+1}; the value
    target is R_k = A_k + V_k. Returns (advantages, returns), [B, T], 0 where not counted.
    """
    if not (0.0 <= gamma <= 1.0 and 0.0 <= lam <= 1.0):
        raise ValueError(f"gamma and lam must be in [0, 1], got {gamma}, {lam}")
    advantages = torch.zeros_like(values, dtype=torch.float32)
    for row in range(values.shape[0]):
        positions = torch.nonzero(mask[row] > 0).flatten().tolist()
        following_value, following_advantage = 0.0, 0.0
        for position in reversed(positions):
            value = float(values[row, position])
            delta = float(rewards[row, position]) + gamma * following_value - value
            following_advantage = delta + gamma * lam * following_advantage
            advantages[row, position] = following_advantage
            following_value = value
    returns = torch.where(mask > 0, advantages + values.float(), torch.zeros_like(advantages))
    return advantages, returns


def whiten(values: torch.Tensor, mask: torch.Tensor, mean: float, std: float | None, eps: float = 1e-6) -> torch.Tensor:
    """(x - mean) / (std + eps) on counted positions, 0 elsewhere (mean and std of the whole step);
    std None only centres."""
    scale = 1.0 if std is None else std + eps
    return torch.where(mask > 0, (values - mean) / scale, torch.zeros_like(values))


def value_loss(values, old_values, returns, mask, *, value_clip: float, aggregation: str = "token"):
    """PPO's clipped value loss: 0.5 * max((V - R)^2, (V_old + clip(V - V_old, +-c) - R)^2),
    aggregated over counted tokens like the policy loss; `value_clip` <= 0 turns the clip off."""
    unclipped = (values - returns) ** 2
    if value_clip > 0:
        clipped_values = old_values + torch.clamp(values - old_values, -value_clip, value_clip)
        per_token = 0.5 * torch.maximum(unclipped, (clipped_values - returns) ** 2)
    else:
        per_token = 0.5 * unclipped
    level = "token" if aggregation == "token" else "sequence"
    return aggregate(per_token, mask, level)


class ValueModel(torch.nn.Module):
    """V(state) for every position: a linear head on a decoder's last hidden state. The decoder
    is the policy's own (`shared`: the value loss also shapes the policy's backbone) or a
    separate model's."""

    def __init__(self, decoder, hidden_size: int) -> None:
        super().__init__()
        self.decoder = decoder
        self.head = torch.nn.Linear(hidden_size, 1)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    def forward(self, input_ids, attention_mask) -> torch.Tensor:
        """Values aligned with the trainer's arrays: [B, L-1], position p from the hidden state at p."""
        hidden = self.decoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state[:, :-1]
        return self.head(hidden.to(self.head.weight.dtype)).squeeze(-1).float()


def build_value_model(policy_model, critic: str, dtype: str = "float32") -> ValueModel:
    """The critic `learner.critic` names, around `policy_model`."""
    if critic == "shared":
        return ValueModel(policy_model.get_decoder(), policy_model.config.hidden_size)

    separate = load_causal_lm(resolve_model_path(critic), dtype)
    return ValueModel(separate.get_decoder(), separate.config.hidden_size)
