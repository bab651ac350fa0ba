"""The RL algorithms `learner.algorithm` names: how each turns rewards into advantages and forms its loss.

Every algorithm here is a choice of three pure parts: an advantage estimator (per group, or over
the whole batch), reward shaping, and a policy loss with its aggregation. All of them keep the
learner's off-policy machinery: the staleness bound of the buffer, and a correction for the lag
between the behaviour policy mu (what the actor sampled with) and the policy being trained
(decoupled PPO's weight pi_prox / mu, or an importance weight against mu). docs/algorithms.md
gives each one's formula, keys and source.

Each algorithm names the learner keys it reads beyond the common ones; setting another
algorithm's key is refused, so a config never silently carries a setting that does nothing.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from longhorizon.learner.advantages import (
    grpo_advantages,
    overlong_penalty,
    reinforce_pp_advantages,
    rloo_advantages,
)
from longhorizon.learner.losses import LossOutput, cispo_loss, gspo_loss, policy_loss

# Keys of LearnerConfig that only some algorithms read.
ALGORITHM_KEYS = (
    "clip_eps", "clip_eps_low", "clip_eps_high", "loss", "weight_level", "aggregation",
    "behaviour_weight_cap", "overlong_max_tokens", "overlong_buffer_tokens", "loss_normaliser_tokens",
    "critic", "gamma", "lam", "value_coef", "value_clip", "advantage_std_scaling",
)
_CLIPPED_FAMILY = frozenset({"clip_eps", "loss", "weight_level", "aggregation", "behaviour_weight_cap"})


@dataclass(frozen=True)
class Algorithm:
    name: str
    summary: str
    uses: frozenset
    """The keys of ALGORITHM_KEYS it reads."""
    advantages: str = "group"
    """How rewards become advantages: "group" (per group, by `group_estimator`), "batch", or
    "critic" (GAE from a learned value model, in the update step)."""
    group_estimator: str = "grpo"
    """grpo (mean and std of the group), mean (mean only) or rloo (leave-one-out mean)."""
    aggregation: str | None = None
    """A fixed aggregation level, or None for learner.aggregation."""
    default_clip: tuple[float, float] | None = None
    """(clip_eps_low, clip_eps_high) when the config leaves them unset."""
    resamples_flat_groups: bool = False
    """Groups whose rewards are all equal are replaced by further groups until the batch is full."""


ALGORITHMS: dict[str, Algorithm] = {
    algorithm.name: algorithm
    for algorithm in (
        Algorithm("grpo", "group-normalised advantages, clipped surrogate (Shao et al. 2024)", _CLIPPED_FAMILY),
        Algorithm("rloo", "leave-one-out baseline within the group (Ahmadian et al. 2024)", _CLIPPED_FAMILY,
                  group_estimator="rloo"),
        Algorithm("reinforce_pp", "rewards normalised over the whole batch (Hu 2025)", _CLIPPED_FAMILY,
                  advantages="batch"),
        Algorithm("dr_grpo", "GRPO without std scaling or length normalisation (Liu et al. 2025)",
                  (_CLIPPED_FAMILY - {"aggregation"}) | {"loss_normaliser_tokens"},
                  group_estimator="mean", aggregation="sum"),
        Algorithm("dapo", "clip-higher, token-level loss, dynamic sampling, overlong shaping (Yu et al. 2025)",
                  frozenset({"clip_eps_low", "clip_eps_high", "loss", "weight_level", "behaviour_weight_cap",
                             "overlong_max_tokens", "overlong_buffer_tokens"}),
                  aggregation="token", default_clip=(0.2, 0.28), resamples_flat_groups=True),
        Algorithm("gspo", "one length-normalised importance ratio per sequence (Zheng et al. 2025)",
                  frozenset({"clip_eps_low", "clip_eps_high", "behaviour_weight_cap"}),
                  aggregation="sequence", default_clip=(3e-4, 4e-4)),
        Algorithm("ppo", "a learned critic and GAE over generated tokens, turn rewards at turn ends "
                  "(Schulman et al. 2017; Ouyang et al. 2022)",
                  _CLIPPED_FAMILY | {"critic", "gamma", "lam", "value_coef", "value_clip", "advantage_std_scaling"},
                  advantages="critic"),
        Algorithm("cispo", "clipped importance weight with stop-gradient, every token kept (MiniMax 2025)",
                  frozenset({"clip_eps_low", "clip_eps_high"}), aggregation="token", default_clip=(1.0, 1.0)),
    )
}


class AlgorithmError(ValueError):
    """The learner's algorithm settings do not fit together."""


def get_algorithm(name: str) -> Algorithm:
    if name not in ALGORITHMS:
        raise AlgorithmError(f"unknown learner.algorithm {name!r}; valid: {', '.join(ALGORITHMS)}")
    return ALGORITHMS[name]


def check_algorithm_settings(config) -> Algorithm:
    """The chosen algorithm, after refusing any algorithm-specific key it does not read that
    differs from its default (`config` is a LearnerConfig)."""
    algorithm = get_algorithm(config.algorithm)
    defaults = {f.name: f.default for f in dataclasses.fields(config)}
    for key in ALGORITHM_KEYS:
        if key not in algorithm.uses and getattr(config, key) != defaults[key]:
            readers = [a.name for a in ALGORITHMS.values() if key in a.uses]
            raise AlgorithmError(
                f"learner.{key} is not used by learner.algorithm = {algorithm.name!r} (it is read by "
                f"{', '.join(readers) or 'no algorithm'}); remove it or choose one of those"
            )
    if algorithm.resamples_flat_groups and config.overlong_buffer_tokens and not config.overlong_max_tokens:
        raise AlgorithmError("learner.overlong_buffer_tokens needs learner.overlong_max_tokens")
    if config.overlong_max_tokens and not 0 < config.overlong_buffer_tokens < config.overlong_max_tokens:
        raise AlgorithmError("learner.overlong_buffer_tokens must be between 0 and learner.overlong_max_tokens")
    if algorithm.advantages == "critic":
        if not (0 <= config.gamma <= 1 and 0 <= config.lam <= 1):
            raise AlgorithmError(f"learner.gamma and learner.lam must be in [0, 1], got {config.gamma}, {config.lam}")
        if config.value_coef <= 0:
            raise AlgorithmError("learner.value_coef must be positive (the critic must learn)")
    low, high = clip_range(config, algorithm)
    if not (0 < low <= 1 and high > 0):
        raise AlgorithmError(f"clip range must have 0 < clip_eps_low <= 1 and clip_eps_high > 0, got {low}, {high}")
    return algorithm


def clip_range(config, algorithm: Algorithm | None = None) -> tuple[float, float]:
    """(low, high): the ratio is clipped to [1 - low, 1 + high]."""
    algorithm = algorithm or get_algorithm(config.algorithm)
    if algorithm.default_clip is None:
        return config.clip_eps, config.clip_eps
    low = algorithm.default_clip[0] if config.clip_eps_low is None else config.clip_eps_low
    high = algorithm.default_clip[1] if config.clip_eps_high is None else config.clip_eps_high
    return low, high


def aggregation_level(config) -> str:
    return get_algorithm(config.algorithm).aggregation or config.aggregation


def shaped_reward(config, reward: float, generated_tokens: int) -> float:
    """The reward the advantages are computed from: DAPO adds its overlong penalty when set."""
    if config.algorithm == "dapo" and config.overlong_max_tokens > 0:
        return reward + overlong_penalty(generated_tokens, config.overlong_max_tokens, config.overlong_buffer_tokens)
    return reward


def group_advantages(config, rewards: np.ndarray) -> np.ndarray:
    """Advantages of one group's members (algorithms that score per group)."""
    estimator = get_algorithm(config.algorithm).group_estimator
    if estimator == "rloo":
        return rloo_advantages(rewards)
    return grpo_advantages(rewards, scale_by_std=estimator == "grpo")


def batch_advantages(rewards: np.ndarray) -> np.ndarray:
    """Advantages over a whole batch (REINFORCE++)."""
    return reinforce_pp_advantages(rewards)


def algorithm_loss(config, logprobs, proximal_logprobs, behaviour_logprobs, advantages, mask) -> LossOutput:
    """The chosen algorithm's loss on one micro-batch."""
    algorithm = get_algorithm(config.algorithm)
    low, high = clip_range(config, algorithm)
    if algorithm.name == "gspo":
        return gspo_loss(logprobs, proximal_logprobs, behaviour_logprobs, advantages, mask,
                         clip_eps_low=low, clip_eps_high=high, behaviour_weight_cap=config.behaviour_weight_cap)
    if algorithm.name == "cispo":
        return cispo_loss(logprobs, behaviour_logprobs, advantages, mask,
                          clip_eps_low=low, clip_eps_high=high, aggregation="token")
    aggregation = aggregation_level(config)
    normaliser = dict(normaliser_tokens=config.loss_normaliser_tokens) if aggregation == "sum" else {}
    if config.loss == "decoupled_ppo":
        options = dict(clip_eps=low, clip_eps_high=high, behaviour_weight_cap=config.behaviour_weight_cap,
                       weight_level=config.weight_level)
    elif config.loss == "truncated_is":
        options = dict(is_cap=config.behaviour_weight_cap)
    else:
        options = dict(clip_eps=low, clip_eps_high=high)
    return policy_loss(config.loss, logprobs, proximal_logprobs, behaviour_logprobs, advantages, mask,
                       aggregation=aggregation, **options, **normaliser)
