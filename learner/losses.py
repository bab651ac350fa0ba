"""Policy-gradient losses with off-policy corrections, as pure functions of token-aligned tensors.

Every tensor is [B, T] and aligned on tokens: position t holds the log-probability of token t under
some policy. ``mask`` is 1 on model-generated tokens that count towards the loss and 0 elsewhere
(prompt, environment observations, padding). Values at masked-out positions are never used, so
padding may hold anything, even -inf.

The three policies involved:
- ``logprobs``: pi_theta, the policy being optimised (carries the gradient);
- ``proximal_logprobs``: pi_prox, the learner's parameters at the start of this update (detached);
- ``behaviour_logprobs``: mu, the policy the actor sampled with (possibly several versions old).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = [
    "AGGREGATION_LEVELS",
    "POLICY_LOSS_NAMES",
    "WEIGHT_LEVELS",
    "LossOutput",
    "aggregate",
    "cispo_loss",
    "decoupled_ppo_loss",
    "gspo_loss",
    "kl_penalty",
    "policy_loss",
    "ppo_clip_loss",
    "sampled_entropy",
    "truncated_is_loss",
]

AGGREGATION_LEVELS = ("token", "sequence", "sum")
WEIGHT_LEVELS = ("token", "sequence", "geometric")
POLICY_LOSS_NAMES = ("decoupled_ppo", "truncated_is", "none")


@dataclass
class LossOutput:
    """A scalar loss to minimise and plain-float diagnostics about how it was formed."""

    loss: torch.Tensor
    metrics: dict[str, float] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------
# Shared helpers


def _check_token_tensors(mask: torch.Tensor, **tensors: torch.Tensor) -> None:
    """Refuse tensors that are not [B, T] or do not line up with the mask."""
    if mask.dim() != 2:
        raise ValueError(f"mask must be [B, T], got shape {tuple(mask.shape)}")
    for name, tensor in tensors.items():
        if tensor.shape != mask.shape:
            raise ValueError(
                f"{name} must have the mask's shape {tuple(mask.shape)}, got {tuple(tensor.shape)}"
            )


def _broadcast_advantages(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Turn [B] (one advantage per sequence) or [B, T] advantages into something that broadcasts."""
    if advantages.dim() == 1 and advantages.shape[0] == mask.shape[0]:
        return advantages.detach().unsqueeze(-1)
    if advantages.shape == mask.shape:
        return advantages.detach()
    raise ValueError(
        f"advantages must be [B]={mask.shape[0]} or [B, T]={tuple(mask.shape)}, "
        f"got {tuple(advantages.shape)}"
    )


def _masked_log_ratio(
    numerator: torch.Tensor, denominator: torch.Tensor, counted: torch.Tensor
) -> torch.Tensor:
    """numerator - denominator on counted tokens and exactly 0 elsewhere.

    Zeroing before any exp() keeps padding (which may be -inf) from producing inf or NaN, in the
    value and in the gradient alike.
    """
    return torch.where(counted, numerator - denominator, torch.zeros_like(numerator))


def _masked_mean(values: torch.Tensor, counted: torch.Tensor) -> float:
    count = int(counted.sum())
    if count == 0:
        return 0.0
    return float(values.detach()[counted].float().mean())


def _masked_max(values: torch.Tensor, counted: torch.Tensor) -> float:
    if not bool(counted.any()):
        return 0.0
    return float(values.detach()[counted].float().max())


def aggregate(
    per_token: torch.Tensor, mask: torch.Tensor, level: str, *, normaliser_tokens: float = 1.0
) -> torch.Tensor:
    """Reduce a [B, T] per-token loss to a scalar over the masked tokens.

    - ``"token"``: sum over every masked token in the batch / number of masked tokens, so long
      sequences weigh in proportion to their length;
    - ``"sequence"``: mean over each sequence's masked tokens, then the mean over the sequences
      that have at least one masked token, so every sequence weighs the same;
    - ``"sum"``: each sequence's summed loss divided by the constant ``normaliser_tokens``, then
      the mean over the sequences with masked tokens (Dr. GRPO): no per-sequence length
      normalisation, so a long answer's tokens weigh as much as a short one's.

    A batch with no masked token gives a zero loss that still belongs to the autograd graph.
    """
    if level not in AGGREGATION_LEVELS:
        raise ValueError(
            f"unknown aggregation level {level!r}; valid: {', '.join(AGGREGATION_LEVELS)}"
        )
    _check_token_tensors(mask, per_token=per_token)
    counted = mask > 0
    # where(), not multiplication: 0 * inf would be NaN.
    masked_values = torch.where(counted, per_token, torch.zeros_like(per_token))
    if level == "token":
        token_count = counted.sum().clamp(min=1)
        return masked_values.sum() / token_count
    tokens_per_sequence = counted.sum(dim=-1)
    if level == "sum":
        if not normaliser_tokens > 0:
            raise ValueError(f"normaliser_tokens must be positive, got {normaliser_tokens}")
        sequence_count = (tokens_per_sequence > 0).sum().clamp(min=1)
        return masked_values.sum() / (sequence_count * normaliser_tokens)
    sequence_means = masked_values.sum(dim=-1) / tokens_per_sequence.clamp(min=1)
    # Sequences without counted tokens have a mean of exactly 0 here; they only must not count.
    sequence_count = (tokens_per_sequence > 0).sum().clamp(min=1)
    return sequence_means.sum() / sequence_count


def _clipped_surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, clip_eps: float, clip_eps_high: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's pessimistic surrogate min(r*A, clip(r, 1 - eps, 1 + eps_high)*A) and where the clipped
    branch was taken; eps_high defaults to eps (symmetric), a larger one is DAPO's clip-higher."""
    high = clip_eps if clip_eps_high is None else clip_eps_high
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + high) * advantages
    return torch.minimum(unclipped, clipped), clipped < unclipped


def _check_clip_eps(clip_eps: float, clip_eps_high: float | None = None) -> None:
    if not 0.0 < clip_eps < 1.0:
        raise ValueError(f"clip_eps must be in (0, 1), got {clip_eps}")
    if clip_eps_high is not None and not clip_eps_high > 0.0:
        raise ValueError(f"clip_eps_high must be positive, got {clip_eps_high}")


def _check_weight_cap(cap: float | None, name: str) -> None:
    # A cap below 1 would shrink the weight of perfectly on-policy tokens.
    if cap is not None and not cap >= 1.0:
        raise ValueError(f"{name} must be >= 1 (or None for no truncation), got {cap}")


# ---------------------------------------------------------------------------------------------
# Policy losses


def ppo_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    aggregation: str = "token",
    normaliser_tokens: float = 1.0,
) -> LossOutput:
    """The plain PPO clipped objective against ``old_logprobs``, with no off-policy correction.

    This is the synchronous baseline (old = behaviour = proximal) and the ``"none"`` correction of
    the asynchronous learner, where stale behaviour log-probs stand in for the old policy.
    """
    _check_clip_eps(clip_eps, clip_eps_high)
    _check_token_tensors(mask, logprobs=logprobs, old_logprobs=old_logprobs)
    counted = mask > 0
    advantages = _broadcast_advantages(advantages, mask)
    ratio = torch.exp(_masked_log_ratio(logprobs, old_logprobs.detach(), counted))
    surrogate, clipped = _clipped_surrogate(ratio, advantages, clip_eps, clip_eps_high)
    loss = aggregate(-surrogate, mask, aggregation, normaliser_tokens=normaliser_tokens)
    metrics = {
        "clip_fraction": _masked_mean(clipped, counted),
        "ratio_mean": _masked_mean(ratio, counted),
        "ratio_max": _masked_max(ratio, counted),
        "tokens": float(counted.sum()),
    }
    return LossOutput(loss, metrics)


def _behaviour_log_weights(
    proximal_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    counted: torch.Tensor,
    weight_level: str,
) -> torch.Tensor:
    """log(pi_prox / mu) at the chosen level, broadcastable to [B, T]."""
    token_log_weights = _masked_log_ratio(proximal_logprobs, behaviour_logprobs, counted)
    if weight_level == "token":
        return token_log_weights
    sequence_log_weights = token_log_weights.sum(dim=-1, keepdim=True)
    if weight_level == "sequence":
        return sequence_log_weights
    tokens_per_sequence = counted.sum(dim=-1, keepdim=True).clamp(min=1)
    return sequence_log_weights / tokens_per_sequence


def decoupled_ppo_loss(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    behaviour_weight_cap: float | None = 2.0,
    weight_level: str = "token",
    aggregation: str = "token",
    normaliser_tokens: float = 1.0,
) -> LossOutput:
    """Decoupled PPO (AReaL): clip against the proximal policy, correct for the behaviour policy.

    per-token loss = -w * min(r * A, clip(r, 1 - eps, 1 + eps_high) * A), with
    r = pi_theta / pi_prox (the trust region is measured from the current parameters, not from
    the stale actor) and w = pi_prox / mu truncated at ``behaviour_weight_cap`` and detached.

    ``weight_level`` sets how w is formed: ``"token"`` per token; ``"sequence"`` the product over
    the sequence's masked tokens (exp of the summed log ratio); ``"geometric"`` the geometric mean
    (exp of the mean log ratio), which tames the product's variance on long sequences. When
    behaviour == proximal, w is exactly 1 and this equals :func:`ppo_clip_loss`.
    """
    if weight_level not in WEIGHT_LEVELS:
        raise ValueError(
            f"unknown weight_level {weight_level!r}; valid: {', '.join(WEIGHT_LEVELS)}"
        )
    _check_clip_eps(clip_eps, clip_eps_high)
    _check_weight_cap(behaviour_weight_cap, "behaviour_weight_cap")
    _check_token_tensors(
        mask,
        logprobs=logprobs,
        proximal_logprobs=proximal_logprobs,
        behaviour_logprobs=behaviour_logprobs,
    )
    counted = mask > 0
    advantages = _broadcast_advantages(advantages, mask)
    proximal_logprobs = proximal_logprobs.detach()
    behaviour_logprobs = behaviour_logprobs.detach()

    ratio = torch.exp(_masked_log_ratio(logprobs, proximal_logprobs, counted))
    surrogate, clipped = _clipped_surrogate(ratio, advantages, clip_eps, clip_eps_high)

    raw_weights = torch.exp(
        _behaviour_log_weights(proximal_logprobs, behaviour_logprobs, counted, weight_level)
    ).expand_as(mask)
    if behaviour_weight_cap is None:
        weights = raw_weights
        truncated = torch.zeros_like(counted)
    else:
        weights = torch.clamp(raw_weights, max=behaviour_weight_cap)
        truncated = raw_weights > behaviour_weight_cap

    loss = aggregate(-(weights * surrogate), mask, aggregation, normaliser_tokens=normaliser_tokens)
    # Weight statistics are token-weighted for every weight_level, so they read alike across levels.
    metrics = {
        "clip_fraction": _masked_mean(clipped, counted),
        "ratio_mean": _masked_mean(ratio, counted),
        "ratio_max": _masked_max(ratio, counted),
        "behaviour_weight_mean": _masked_mean(raw_weights, counted),
        "behaviour_weight_max": _masked_max(raw_weights, counted),
        "behaviour_weight_truncated_fraction": _masked_mean(truncated, counted),
        "tokens": float(counted.sum()),
    }
    return LossOutput(loss, metrics)


def truncated_is_loss(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    is_cap: float = 2.0,
    aggregation: str = "token",
    normaliser_tokens: float = 1.0,
) -> LossOutput:
    """Truncated importance sampling: per-token -min(pi_theta / mu, is_cap) * A * log pi_theta.

    The ratio is detached, so the gradient is the REINFORCE gradient re-weighted by a bounded
    importance weight. The loss value itself is only meaningful through its gradient.
    """
    _check_weight_cap(is_cap, "is_cap")
    _check_token_tensors(mask, logprobs=logprobs, behaviour_logprobs=behaviour_logprobs)
    counted = mask > 0
    advantages = _broadcast_advantages(advantages, mask)
    raw_weights = torch.exp(
        _masked_log_ratio(logprobs.detach(), behaviour_logprobs.detach(), counted)
    )
    weights = torch.clamp(raw_weights, max=is_cap)
    safe_logprobs = torch.where(counted, logprobs, torch.zeros_like(logprobs))
    loss = aggregate(-(weights * advantages * safe_logprobs), mask, aggregation, normaliser_tokens=normaliser_tokens)
    metrics = {
        "is_weight_mean": _masked_mean(raw_weights, counted),
        "is_weight_max": _masked_max(raw_weights, counted),
        "is_weight_truncated_fraction": _masked_mean(raw_weights > is_cap, counted),
        "tokens": float(counted.sum()),
    }
    return LossOutput(loss, metrics)


def gspo_loss(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_eps_low: float = 3e-4,
    clip_eps_high: float = 4e-4,
    behaviour_weight_cap: float | None = 2.0,
) -> LossOutput:
    """GSPO (Zheng et al. 2025): one importance ratio per sequence, length normalised.

    s_i = exp(mean over i's generated tokens of (log pi_theta - log pi_prox)); the loss is
    -mean_i w_i * min(s_i * A_i, clip(s_i, 1 - eps_low, 1 + eps_high) * A_i), where the
    off-policy correction w_i = (pi_prox / mu) at the same level (the geometric mean over the
    sequence's tokens), truncated at ``behaviour_weight_cap`` and detached. Every sequence weighs
    the same whatever its length; the clip range is that of a per-token geometric mean, hence
    its small defaults.
    """
    _check_clip_eps(clip_eps_low, clip_eps_high)
    _check_weight_cap(behaviour_weight_cap, "behaviour_weight_cap")
    _check_token_tensors(
        mask, logprobs=logprobs, proximal_logprobs=proximal_logprobs, behaviour_logprobs=behaviour_logprobs,
    )
    counted = mask > 0
    tokens_per_sequence = counted.sum(dim=-1, keepdim=True).clamp(min=1)
    sequence_advantages = _broadcast_advantages(advantages, mask)
    if sequence_advantages.shape != (mask.shape[0], 1):
        raise ValueError("gspo needs one advantage per sequence ([B])")
    log_ratio = _masked_log_ratio(logprobs, proximal_logprobs.detach(), counted).sum(-1, keepdim=True)
    ratio = torch.exp(log_ratio / tokens_per_sequence)  # [B, 1]
    surrogate, clipped = _clipped_surrogate(ratio, sequence_advantages, clip_eps_low, clip_eps_high)
    raw_weights = torch.exp(
        _behaviour_log_weights(proximal_logprobs.detach(), behaviour_logprobs.detach(), counted, "geometric")
    )
    weights = raw_weights if behaviour_weight_cap is None else torch.clamp(raw_weights, max=behaviour_weight_cap)
    has_tokens = counted.any(dim=-1, keepdim=True)
    per_sequence = torch.where(has_tokens, -(weights * surrogate), torch.zeros_like(surrogate))
    loss = per_sequence.sum() / has_tokens.sum().clamp(min=1)
    metrics = {
        "clip_fraction": _masked_mean(clipped, has_tokens),
        "ratio_mean": _masked_mean(ratio, has_tokens),
        "ratio_max": _masked_max(ratio, has_tokens),
        "behaviour_weight_mean": _masked_mean(raw_weights, has_tokens),
        "behaviour_weight_max": _masked_max(raw_weights, has_tokens),
        "tokens": float(counted.sum()),
    }
    return LossOutput(loss, metrics)


def cispo_loss(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_eps_low: float = 1.0,
    clip_eps_high: float = 1.0,
    aggregation: str = "token",
) -> LossOutput:
    """CISPO (MiniMax-M1, 2025): clip the importance weight, never drop a token's gradient.

    per-token loss = -sg(clip(pi_theta / mu, 1 - eps_low, 1 + eps_high)) * A * log pi_theta.
    Unlike PPO's clip, which zeroes the gradient of tokens outside the trust region, every token
    keeps its policy-gradient term and only its weight is bounded. The weight is taken against
    the behaviour policy mu, so it is itself the off-policy correction.
    """
    if not 0.0 < clip_eps_low <= 1.0:
        raise ValueError(f"clip_eps_low must be in (0, 1], got {clip_eps_low}")
    if not clip_eps_high > 0.0:
        raise ValueError(f"clip_eps_high must be positive, got {clip_eps_high}")
    _check_token_tensors(mask, logprobs=logprobs, behaviour_logprobs=behaviour_logprobs)
    counted = mask > 0
    advantages = _broadcast_advantages(advantages, mask)
    raw_weights = torch.exp(_masked_log_ratio(logprobs.detach(), behaviour_logprobs.detach(), counted))
    weights = torch.clamp(raw_weights, 1.0 - clip_eps_low, 1.0 + clip_eps_high)
    safe_logprobs = torch.where(counted, logprobs, torch.zeros_like(logprobs))
    loss = aggregate(-(weights * advantages * safe_logprobs), mask, aggregation)
    metrics = {
        "is_weight_mean": _masked_mean(raw_weights, counted),
        "is_weight_max": _masked_max(raw_weights, counted),
        "is_weight_clipped_fraction": _masked_mean(weights != raw_weights, counted),
        "tokens": float(counted.sum()),
    }
    return LossOutput(loss, metrics)


def policy_loss(
    name: str,
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor | None,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    **options: object,
) -> LossOutput:
    """Pick the policy loss by config name; ``options`` go to the chosen loss unchanged.

    - ``"decoupled_ppo"``: :func:`decoupled_ppo_loss` (needs ``proximal_logprobs``);
    - ``"truncated_is"``: :func:`truncated_is_loss` (``proximal_logprobs`` unused);
    - ``"none"``: :func:`ppo_clip_loss` with old = behaviour, i.e. no correction for staleness.
    """
    if name == "decoupled_ppo":
        if proximal_logprobs is None:
            raise ValueError("the decoupled_ppo loss needs proximal_logprobs")
        return decoupled_ppo_loss(
            logprobs, proximal_logprobs, behaviour_logprobs, advantages, mask, **options
        )
    if name == "truncated_is":
        return truncated_is_loss(logprobs, behaviour_logprobs, advantages, mask, **options)
    if name == "none":
        return ppo_clip_loss(logprobs, behaviour_logprobs, advantages, mask, **options)
    raise ValueError(f"unknown policy loss {name!r}; valid: {', '.join(POLICY_LOSS_NAMES)}")


# ---------------------------------------------------------------------------------------------
# Regularisers and diagnostics


def kl_penalty(
    logprobs: torch.Tensor,
    reference_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    aggregation: str = "token",
) -> LossOutput:
    """The k3 estimator exp(ref - lp) - (ref - lp) - 1 on the sampled tokens, aggregated.

    Its value, on tokens sampled from pi_theta, is an unbiased estimate of KL(pi_theta || pi_ref),
    and it is never negative, which keeps the penalty from rewarding the policy for drifting. Its
    gradient, taken through the sampled tokens' log-probs as here (the samples fixed), is
    (1 - pi_ref / pi_theta) * grad log pi_theta, whose mean over pi_theta's samples is the gradient
    of the other direction, KL(pi_ref || pi_theta): the update pulls the policy to cover what the
    reference gives mass to (tests/test_losses.py checks both on a small distribution). The
    learner's tokens come from the behaviour policy mu (possibly several versions old) and are not
    reweighted here, so off-policy both hold around mu's samples, biased by how far mu is from
    pi_theta.
    """
    _check_token_tensors(mask, logprobs=logprobs, reference_logprobs=reference_logprobs)
    counted = mask > 0
    log_ratio = _masked_log_ratio(reference_logprobs.detach(), logprobs, counted)
    per_token = torch.exp(log_ratio) - log_ratio - 1.0
    loss = aggregate(per_token, mask, aggregation)
    metrics = {"kl": float(loss.detach()), "kl_max": _masked_max(per_token, counted)}
    return LossOutput(loss, metrics)


def sampled_entropy(
    logprobs: torch.Tensor, mask: torch.Tensor, *, aggregation: str = "token"
) -> torch.Tensor:
    """An estimate of the policy's entropy: minus the mean log-probability of the sampled tokens.

    Only the sampled tokens' log-probs are at hand, not full logits. For tokens drawn from the
    policy itself this is an unbiased estimate of the entropy; for stale tokens it is a
    cross-entropy. It is returned detached: its gradient is zero in expectation, so it is for
    monitoring (collapse to 0 warns of a deterministic policy), not an entropy bonus.
    """
    _check_token_tensors(mask, logprobs=logprobs)
    counted = mask > 0
    safe_logprobs = torch.where(counted, logprobs.detach(), torch.zeros_like(logprobs))
    return aggregate(-safe_logprobs, mask, aggregation)
