"""Outcome-reward advantage estimators (GRPO, RLOO, REINFORCE++) and reward shaping, as pure numpy functions.

Everything is computed in float64. The buffer refuses rewards beyond ``learner.max_abs_reward``
(at most 1e12), so no sum, mean or variance here can overflow, and the advantages stay bounded:
at most twice the bound in absolute value when only centred (rloo, dr_grpo), at most sqrt(n - 1)
when divided by the population std of n rewards (grpo, reinforce_pp). Unbounded finite rewards
were not safe: two rewards of 1e308 overflow the group's mean to inf, and the update to NaN.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "group_has_signal",
    "grpo_advantages",
    "overlong_penalty",
    "reinforce_pp_advantages",
    "rloo_advantages",
]


def _as_reward_vector(rewards: np.ndarray | list[float], *, minimum_size: int = 1) -> np.ndarray:
    """Return the rewards as a float64 vector, refusing shapes and values no estimator can use."""
    reward_vector = np.asarray(rewards, dtype=np.float64)
    if reward_vector.ndim != 1:
        raise ValueError(f"rewards must be a 1-D array, got shape {reward_vector.shape}")
    if reward_vector.size < minimum_size:
        raise ValueError(
            f"need at least {minimum_size} reward(s), got {reward_vector.size}"
        )
    if not np.all(np.isfinite(reward_vector)):
        raise ValueError(f"rewards must be finite, got {reward_vector.tolist()}")
    return reward_vector


def grpo_advantages(
    rewards: np.ndarray | list[float], *, eps: float = 1e-6, scale_by_std: bool = True
) -> np.ndarray:
    """GRPO advantages for one group: (r - group mean) / (group std + eps).

    The std is the population std (ddof=0): the group is the whole set of samples we normalise
    over, not a sample from which we estimate a wider spread, and ddof=0 stays defined for a group
    of one. With ``scale_by_std=False`` only the mean is removed (the Dr. GRPO variant), which
    avoids up-weighting groups whose rewards barely differ.
    """
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    reward_vector = _as_reward_vector(rewards)
    centred = reward_vector - reward_vector.mean()
    if not scale_by_std:
        return centred
    return centred / (reward_vector.std(ddof=0) + eps)


def rloo_advantages(rewards: np.ndarray | list[float]) -> np.ndarray:
    """RLOO advantages for one group: r_i minus the mean of the other members' rewards."""
    reward_vector = _as_reward_vector(rewards, minimum_size=2)
    group_size = reward_vector.size
    leave_one_out_mean = (reward_vector.sum() - reward_vector) / (group_size - 1)
    return reward_vector - leave_one_out_mean


def reinforce_pp_advantages(
    rewards_of_batch: np.ndarray | list[float], *, eps: float = 1e-6
) -> np.ndarray:
    """REINFORCE++ advantages for outcome rewards (gamma = 1): normalised over the whole batch.

    Unlike GRPO the baseline and scale come from every episode in the batch, whatever its task;
    population std (ddof=0), as for GRPO.
    """
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    reward_vector = _as_reward_vector(rewards_of_batch)
    return (reward_vector - reward_vector.mean()) / (reward_vector.std(ddof=0) + eps)


def overlong_penalty(generated_tokens: int, max_tokens: int, buffer_tokens: int) -> float:
    """DAPO's soft overlong punishment, added to an episode's reward.

    0 up to ``max_tokens - buffer_tokens`` generated tokens, then falling linearly to -1 at
    ``max_tokens``, and -1 beyond: episodes that run into the length limit learn to be shorter
    without the cliff of a truncated episode simply failing.
    """
    if buffer_tokens <= 0 or max_tokens <= buffer_tokens:
        raise ValueError(
            f"need 0 < buffer_tokens < max_tokens, got buffer {buffer_tokens} and max {max_tokens}"
        )
    free = max_tokens - buffer_tokens
    if generated_tokens <= free:
        return 0.0
    if generated_tokens <= max_tokens:
        return (free - generated_tokens) / buffer_tokens
    return -1.0


def group_has_signal(rewards: np.ndarray | list[float], *, tol: float = 1e-8) -> bool:
    """False when every reward in the group is the same (within tol): all advantages are then 0.

    Such groups contribute nothing to a group-relative gradient; the trainer skips and counts them
    (a rising count warns that the policy has become deterministic).
    """
    reward_vector = _as_reward_vector(rewards)
    return bool(reward_vector.max() - reward_vector.min() > tol)
