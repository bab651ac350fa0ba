"""Entropy control: a target entropy held by an adaptive bonus coefficient, and Clip-Cov / KL-Cov.

A policy-gradient run can sharpen its policy until every member of a group plays alike: no group
has signal, and nothing corrects a wrong answer (the freeze in docs/algorithms.md). Three ways to
keep the entropy up, chosen by `learner.entropy_control`:

- ``"target"``: an entropy bonus whose coefficient is adapted after each step, up by
  ``entropy_coef_step`` when the step's entropy was below ``target_entropy``, down by the same
  when above, kept within [0, ``entropy_coef_max``] (the adaptive coefficient of Skywork-OR1,
  started at ``entropy_coef``). The coefficient is state: checkpoints keep it.
- ``"clip_cov"`` and ``"kl_cov"`` (Cui et al. 2025, "The Entropy Mechanism of Reinforcement
  Learning for Reasoning Language Models"): the entropy falls fastest through tokens whose
  log-probability and advantage covary most, cov_t = (log pi(y_t) - mean) * (A_t - mean), both
  centred over the batch's generated tokens. Clip-Cov detaches the policy-gradient of a random
  ``cov_fraction`` of the tokens whose covariance lies in [``clip_cov_low``, ``clip_cov_high``];
  KL-Cov adds ``kl_cov_coef`` * |log pi_theta - log pi_prox| on the top ``cov_fraction`` of the
  tokens by covariance.

The bonus (a fixed ``entropy_coef``, or the target mode's) is on the whole next-token
distribution's entropy, or with ``entropy_top_k`` > 0 on the entropy of its k likeliest tokens
renormalised (`learner.logprobs.clamped_entropy`, after AEnt's clamped entropy): the bonus then
spreads the policy over the answers it nearly gave, not over the vocabulary's tail. With
``entropy_scope = "failed_groups"`` it acts only on the tokens of groups in which no member
succeeded, and with ``"frozen_groups"`` only on those of their rows whose mean entropy per
generated token is below ``frozen_entropy``: the policy is sure there and wrong, which a policy
still searching (its entropy high, at the start of a run) is not (`bonus_entropy`).

The math is pure functions of token-aligned [B, T] tensors (as in learner/losses.py); the trainer
(learner/trainer.py) runs them. Every mode keeps the flat groups in the update at advantage 0
(`needs_flat_members`): their tokens count in the entropy, in the covariance's centring and in the
KL-Cov penalty.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from longhorizon.learner.losses import aggregate

if TYPE_CHECKING:
    from longhorizon.common.config import LearnerConfig

__all__ = [
    "ENTROPY_CONTROLS",
    "ENTROPY_SCOPES",
    "EntropyControlError",
    "EntropyController",
    "EntropySettings",
    "adapted_coefficient",
    "bonus_entropy",
    "bonus_row_weights",
    "clip_cov_selection",
    "covariance_means",
    "entropy_settings",
    "kl_cov_penalty",
    "kl_cov_selection",
    "needs_flat_members",
    "selected_count",
    "token_covariance",
    "without_gradient_at",
]

ENTROPY_CONTROLS = ("none", "target", "clip_cov", "kl_cov")
ENTROPY_SCOPES = ("all", "failed_groups", "frozen_groups")
"""Where the bonus acts: every generated token, those of groups in which no member succeeded, or
those of the rows of such groups whose mean entropy is below `frozen_entropy`."""

# The learner keys each mode reads besides `entropy_control` (`entropy_coef` is common to all:
# a fixed bonus, or the adaptive coefficient's start in the target mode). Setting one that the
# chosen mode does not read is refused, as for algorithm keys.
MODE_KEYS = {
    "none": (),
    "target": ("target_entropy", "entropy_coef_step", "entropy_coef_max"),
    "clip_cov": ("cov_fraction", "clip_cov_low", "clip_cov_high"),
    "kl_cov": ("cov_fraction", "kl_cov_coef"),
}
# cov_fraction when unset: the fractions of the paper's experiments.
DEFAULT_COV_FRACTION = {"clip_cov": 2e-4, "kl_cov": 2e-3}


class EntropyControlError(ValueError):
    """The learner's entropy-control settings do not fit together."""


@dataclass(frozen=True)
class EntropySettings:
    """The validated entropy-control keys of a LearnerConfig."""

    mode: str = "none"
    entropy_coef: float = 0.0
    target_entropy: float = 0.0
    entropy_coef_step: float = 0.005
    entropy_coef_max: float = 0.1
    cov_fraction: float | None = None
    clip_cov_low: float = 1.0
    clip_cov_high: float = 5.0
    kl_cov_coef: float = 1.0
    entropy_top_k: int = 0
    entropy_scope: str = "all"
    frozen_entropy: float = 1.0

    @property
    def fraction(self) -> float:
        """The covariance modes' fraction, their default when unset."""
        if self.cov_fraction is not None:
            return self.cov_fraction
        return DEFAULT_COV_FRACTION.get(self.mode, 0.0)

    @property
    def computes_entropy(self) -> bool:
        """Whether the step needs each position's full-distribution entropy (a bonus is on)."""
        return self.mode == "target" or self.entropy_coef > 0

    @property
    def uses_covariance(self) -> bool:
        return self.mode in ("clip_cov", "kl_cov")


def entropy_settings(config: LearnerConfig) -> EntropySettings:
    """The entropy-control keys of `config`, refused with a message naming the key when they are
    out of range or set for a mode that does not read them."""
    mode = config.entropy_control
    if mode not in ENTROPY_CONTROLS:
        raise EntropyControlError(f"learner.entropy_control must be one of {', '.join(ENTROPY_CONTROLS)}, got {mode!r}")
    defaults = EntropySettings()
    read = MODE_KEYS[mode]
    for key in sorted({k for keys in MODE_KEYS.values() for k in keys}):
        if key not in read and getattr(config, key) != getattr(defaults, key):
            readers = [name for name, keys in MODE_KEYS.items() if key in keys]
            raise EntropyControlError(
                f"learner.{key} is not used by learner.entropy_control = {mode!r} (it is read by "
                f"{', '.join(readers)}); remove it or choose one of those"
            )
    settings = EntropySettings(mode=mode, **{f.name: getattr(config, f.name)
                                             for f in dataclasses.fields(EntropySettings) if f.name != "mode"})

    def require(condition: bool, message: str) -> None:
        if not condition:
            raise EntropyControlError(message)

    require(math.isfinite(settings.entropy_coef) and settings.entropy_coef >= 0,
            f"learner.entropy_coef must be >= 0, got {settings.entropy_coef}")
    if mode == "target":
        require(math.isfinite(settings.target_entropy) and settings.target_entropy > 0,
                f"learner.target_entropy must be positive (nats per generated token) with entropy_control = "
                f"'target', got {settings.target_entropy}")
        require(math.isfinite(settings.entropy_coef_step) and settings.entropy_coef_step > 0,
                f"learner.entropy_coef_step must be positive, got {settings.entropy_coef_step}")
        require(math.isfinite(settings.entropy_coef_max) and settings.entropy_coef_max >= settings.entropy_coef,
                f"learner.entropy_coef_max must be >= learner.entropy_coef (the coefficient's start), got "
                f"{settings.entropy_coef_max} < {settings.entropy_coef}")
        require(settings.entropy_coef_max > 0, "learner.entropy_coef_max must be positive")
    require(settings.entropy_scope in ENTROPY_SCOPES,
            f"learner.entropy_scope must be one of {', '.join(ENTROPY_SCOPES)}, got {settings.entropy_scope!r}")

    def require_bonus(setting_is_default: bool, setting: str, what_it_does: str) -> None:
        require(setting_is_default or settings.computes_entropy,
                f"{setting} {what_it_does} the entropy bonus, which is off: set learner.entropy_coef > 0 or "
                "learner.entropy_control = 'target', or remove it")

    require_bonus(settings.entropy_scope == "all", f"learner.entropy_scope = {settings.entropy_scope!r}", "places")
    require(settings.entropy_scope == "frozen_groups" or settings.frozen_entropy == defaults.frozen_entropy,
            f"learner.frozen_entropy is read only with learner.entropy_scope = 'frozen_groups' (it is "
            f"{settings.entropy_scope!r}); remove it or choose that scope")
    require(math.isfinite(settings.frozen_entropy) and settings.frozen_entropy > 0,
            f"learner.frozen_entropy must be positive (nats per generated token), got {settings.frozen_entropy}")
    top_k = settings.entropy_top_k
    require(isinstance(top_k, int) and not isinstance(top_k, bool) and top_k >= 0,
            f"learner.entropy_top_k must be a whole number >= 0 (0: the whole vocabulary), got {top_k!r}")
    require(top_k != 1, "learner.entropy_top_k = 1 leaves one token, whose entropy is always 0: use 0 (the whole "
                        "vocabulary) or at least 2")
    require_bonus(top_k == 0, f"learner.entropy_top_k = {top_k}", "clamps")
    # frozen_entropy is a level of the whole distribution's entropy; a clamped one never exceeds
    # log k, so judged by it (frozen_entropy 0.8, k = 2) every failed row would count as frozen.
    require(not (top_k and settings.entropy_scope == "frozen_groups"),
            f"learner.entropy_scope = 'frozen_groups' picks rows by the whole distribution's entropy "
            f"(frozen_entropy), which learner.entropy_top_k = {top_k} does not compute (its clamped entropy "
            f"is at most log {top_k}): use entropy_top_k = 0, or entropy_scope = 'failed_groups'")
    if settings.uses_covariance and settings.cov_fraction is not None:
        require(0 < settings.cov_fraction <= 1, f"learner.cov_fraction must be in (0, 1], got {settings.cov_fraction}")
    if mode == "clip_cov":
        require(math.isfinite(settings.clip_cov_low) and math.isfinite(settings.clip_cov_high)
                and settings.clip_cov_low <= settings.clip_cov_high,
                f"learner.clip_cov_low must be <= learner.clip_cov_high, got {settings.clip_cov_low} and "
                f"{settings.clip_cov_high}")
    if mode == "kl_cov":
        require(math.isfinite(settings.kl_cov_coef) and settings.kl_cov_coef > 0,
                f"learner.kl_cov_coef must be positive, got {settings.kl_cov_coef}")
        # |log pi_theta - log pi_prox| is 0, with a zero gradient, until the parameters have moved
        # from the proximal ones: with one optimiser step per batch it would never act.
        require(config.optimizer_steps_per_batch >= 2,
                "learner.entropy_control = 'kl_cov' penalises drift from the policy at the start of the update, "
                "which only exists from a batch's second optimiser step: set learner.optimizer_steps_per_batch >= 2")
    return settings


def needs_flat_members(config: LearnerConfig) -> bool:
    """Whether a per-token term that does not vanish at advantage 0 is on: a KL penalty, an entropy
    bonus, or any entropy control. Then flat groups must go through the model at advantage 0 for
    the update to be the whole batch's gradient; without one, leaving them out (and counting them
    in the denominator) gives the same gradient for less compute."""
    return config.kl_coef > 0 or config.entropy_coef > 0 or config.entropy_control != "none"


# ---------------------------------------------------------------------------------------------
# Target entropy: the adaptive coefficient


def adapted_coefficient(coefficient: float, entropy: float, target: float, step: float, maximum: float) -> float:
    """The next step's bonus coefficient: up by `step` when the entropy was below the target, down
    by `step` when above, unchanged at the target, kept within [0, maximum]."""
    if entropy < target:
        coefficient += step
    elif entropy > target:
        coefficient -= step
    return min(max(coefficient, 0.0), maximum)


class EntropyController:
    """The adaptive coefficient of the target mode, carried from step to step (and in checkpoints);
    in the other modes its coefficient is the fixed `entropy_coef`."""

    def __init__(self, settings: EntropySettings) -> None:
        self.settings = settings
        self.coefficient = float(settings.entropy_coef)

    @property
    def adaptive(self) -> bool:
        return self.settings.mode == "target"

    def update(self, entropy: float) -> None:
        """After an applied step whose batch had this entropy (a non-finite one changes nothing)."""
        if self.adaptive and math.isfinite(entropy):
            s = self.settings
            self.coefficient = adapted_coefficient(self.coefficient, entropy, s.target_entropy, s.entropy_coef_step,
                                                   s.entropy_coef_max)

    def state_dict(self) -> dict:
        return {"coefficient": self.coefficient}

    def load_state_dict(self, state: dict) -> None:
        if self.adaptive and "coefficient" in state:
            self.coefficient = float(state["coefficient"])


# ---------------------------------------------------------------------------------------------
# Clip-Cov and KL-Cov


def _token_advantages(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B] or [B, T] advantages as [B, T]."""
    if advantages.dim() == 1:
        return advantages.unsqueeze(-1).expand_as(mask)
    return advantages


def covariance_means(logprobs: list[torch.Tensor], advantages: list[torch.Tensor],
                     masks: list[torch.Tensor]) -> tuple[float, float, float]:
    """(sum of log-probs, sum of advantages, number of tokens) over the generated tokens of every
    micro-batch: the sums a batch's centring is made of (added over ranks before dividing)."""
    total_logprob = total_advantage = count = 0.0
    for lp, adv, mask in zip(logprobs, advantages, masks):
        counted = mask > 0
        total_logprob += float(lp.detach().double()[counted].sum())
        total_advantage += float(_token_advantages(adv, mask).double()[counted].sum())
        count += float(counted.sum())
    return total_logprob, total_advantage, count


def token_covariance(logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                     mean_logprob: float, mean_advantage: float) -> torch.Tensor:
    """Each generated token's contribution to the covariance of log-prob and advantage,
    (log pi(y_t) - mean_logprob) * (A_t - mean_advantage), and 0 elsewhere (detached)."""
    counted = mask > 0
    centred = (logprobs.detach() - mean_logprob) * (_token_advantages(advantages, mask).detach() - mean_advantage)
    return torch.where(counted, centred, torch.zeros_like(centred))


def selected_count(fraction: float, tokens: int) -> int:
    """How many of `tokens` generated tokens a covariance mode acts on: the fraction, rounded down,
    and at least one when there is any token (a small batch would otherwise never act)."""
    return 0 if tokens <= 0 else max(1, int(fraction * tokens))


def _flat(covariances: list[torch.Tensor], masks: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.cat([c.reshape(-1) for c in covariances]), torch.cat([(m > 0).reshape(-1) for m in masks])


def _unflat(chosen: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    pieces, start = [], 0
    for tensor in like:
        pieces.append(chosen[start:start + tensor.numel()].reshape(tensor.shape))
        start += tensor.numel()
    return pieces


def clip_cov_selection(covariances: list[torch.Tensor], masks: list[torch.Tensor], fraction: float, low: float,
                       high: float, generator: torch.Generator | None = None) -> list[torch.Tensor]:
    """Clip-Cov's tokens, one bool [B, T] per micro-batch: `selected_count(fraction, tokens)` drawn
    at random (without replacement) from the generated tokens whose covariance lies in
    [low, high], or all of them when fewer lie there."""
    values, counted = _flat(covariances, masks)
    in_band = (counted & (values >= low) & (values <= high)).nonzero().reshape(-1)
    wanted = selected_count(fraction, int(counted.sum()))
    if in_band.numel() > wanted:
        order = torch.randperm(in_band.numel(), generator=generator)
        in_band = in_band[order[:wanted]]
    chosen = torch.zeros_like(counted)
    chosen[in_band] = True
    return _unflat(chosen, covariances)


def kl_cov_selection(covariances: list[torch.Tensor], masks: list[torch.Tensor],
                     fraction: float) -> list[torch.Tensor]:
    """KL-Cov's tokens, one bool [B, T] per micro-batch: the `selected_count(fraction, tokens)`
    generated tokens of largest covariance (ties broken by position)."""
    values, counted = _flat(covariances, masks)
    wanted = selected_count(fraction, int(counted.sum()))
    ranked = torch.where(counted, values, torch.full_like(values, -math.inf))
    chosen = torch.zeros_like(counted)
    if wanted:
        # A stable sort: equal covariances are taken in position order, the same on every machine.
        chosen[torch.sort(ranked, descending=True, stable=True).indices[:wanted]] = True
    return _unflat(chosen & counted, covariances)


def without_gradient_at(logprobs: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
    """Clip-Cov: the log-probs with the selected tokens' gradient detached (same values), so the
    policy loss takes nothing from them."""
    return torch.where(selected, logprobs.detach(), logprobs)


def kl_cov_penalty(logprobs: torch.Tensor, proximal_logprobs: torch.Tensor, selected: torch.Tensor,
                   mask: torch.Tensor, aggregation: str) -> torch.Tensor:
    """KL-Cov's term: |log pi_theta - log pi_prox| on the selected tokens, 0 on the others,
    aggregated over all the generated tokens (token or sequence level, as the trainer's KL
    penalty), so a penalty on a few tokens is divided by all of them."""
    counted = (mask > 0) & selected
    drift = torch.where(counted, (logprobs - proximal_logprobs.detach()).abs(), torch.zeros_like(logprobs))
    return aggregate(drift, mask, aggregation)


def bonus_row_weights(entropy: torch.Tensor, loss_mask: torch.Tensor, group_failed: torch.Tensor | None, scope: str,
                      frozen_entropy: float = 0.0) -> torch.Tensor | None:
    """Which rows the bonus acts on, 1.0 or 0.0 per row ([B]), or None for every row (scope "all",
    or no group outcome known). "failed_groups": the rows of groups in which no member succeeded;
    "frozen_groups": those of them whose mean entropy per generated token (without gradient: the
    choice of rows is not trained) is below `frozen_entropy`."""
    if scope == "all" or group_failed is None:
        return None
    if scope == "failed_groups":
        return group_failed
    counted = loss_mask.sum(dim=1)
    row_entropy = (entropy.detach() * loss_mask).sum(dim=1) / counted.clamp(min=1)
    return group_failed * ((row_entropy < frozen_entropy) & (counted > 0)).to(group_failed.dtype)


def bonus_entropy(entropy: torch.Tensor, loss_mask: torch.Tensor, group_failed: torch.Tensor | None, scope: str,
                  level: str, frozen_entropy: float = 0.0) -> torch.Tensor:
    """The entropy the bonus raises: the mean over the generated tokens (aggregated at `level`),
    or with a narrower scope the same mean with every row outside it (`bonus_row_weights`)
    counted at 0. The denominator is every generated token either way, so the bonus weighs in
    proportion to its rows' share of the batch."""
    weights = bonus_row_weights(entropy, loss_mask, group_failed, scope, frozen_entropy)
    if weights is None:
        return aggregate(entropy, loss_mask, level)
    return aggregate(entropy * weights[:, None], loss_mask, level)
