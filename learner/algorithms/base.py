"""The interface every RL algorithm implements: the learner keys it reads, their validation, how it
scores a batch of groups, and its loss on a micro-batch.

An algorithm is a subclass of `Algorithm`, made from the learner's config once per run. The
trainer and the learner only ever ask it questions (what is your loss here, do you resample flat
groups, do you bring a critic); none of them compares an algorithm's name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, ClassVar, Sequence

import numpy as np

from longhorizon.common.config import ConfigError, Section, bounded, check_section
from longhorizon.learner.advantages import group_has_signal
from longhorizon.learner.entropy import EntropyControlError, entropy_settings, needs_flat_members
from longhorizon.learner.losses import POLICY_LOSS_NAMES, WEIGHT_LEVELS, LossOutput
from longhorizon.learner.scoring import ScoredBatch, usable_members
from longhorizon.learner.step_credit import group_token_advantages, step_credit_from

if TYPE_CHECKING:
    import torch

    from longhorizon.common.config import LearnerConfig
    from longhorizon.learner.critic import ValueModel
    from longhorizon.learner.logprobs import PaddedBatch

OPTIONS_KEY = "learner.algorithm_options"
"""Where an algorithm's keys sit in the config."""

SumOverRanks = Callable[[list], list]
"""Element-wise sum of a list of floats over the learner's ranks (torch.distributed)."""


class AlgorithmError(ValueError):
    """The learner's algorithm settings do not fit together."""


class CorrectionOptions(Section):
    """The off-policy correction's keys, read by the algorithms whose loss is a surrogate against
    the behaviour policy mu."""

    loss: str = "decoupled_ppo"
    """Off-policy correction: decoupled_ppo, truncated_is, or none (plain PPO against the behaviour policy)."""
    behaviour_weight_cap: float = bounded(2.0, ge=1)
    """Truncation of the behaviour weight pi_prox / mu (decoupled_ppo) or pi / mu (truncated_is)."""
    weight_level: str = "token"
    """Level of the behaviour weight: token, sequence or geometric."""


class SymmetricClipOptions(CorrectionOptions):
    """A correction and one symmetric ratio clip."""

    clip_eps: float = 0.2
    """PPO ratio clip: the ratio is kept in [1 - clip_eps, 1 + clip_eps], 0 < clip_eps < 1."""


class Algorithm:
    """One RL algorithm, bound to its settings.

    A subclass declares its keys in `Options`, a `common.config.Section` (pydantic) model whose
    fields are the keys of `learner.algorithm_options` (their checked values: `self.options`), and
    implements `aggregation`, `score` and `loss`. An algorithm with a learned critic also
    implements `build_value_model`, `advantages_from_values` and `value_loss`.
    """

    summary: ClassVar[str] = ""
    """One line: what it is, with its source."""
    Options: ClassVar[type[Section] | None] = None
    """Its keys, under `learner.algorithm_options`; None: it has none, and the table must be empty."""
    resamples_flat_groups: ClassVar[bool] = False
    """Groups whose rewards are all equal are set aside by the learner, and further groups awaited
    in their place until the batch is full (async mode only)."""
    takes_step_credit: ClassVar[bool] = False
    """Whether its scoring applies `learner.step_credit` (passes `self.step_credit` to
    score_each_group or score_whole_batch); others refuse the setting."""
    takes_turn_samples: ClassVar[bool] = False
    """Whether its scoring trains a trajectory with turn samples (actor.history_turns) as one
    example per turn (score_each_group and score_whole_batch do, through
    scoring.examples_from); others refuse actor.history_turns."""
    runs_on_several_ranks: ClassVar[bool] = True
    """Whether the launcher may start the learner on more than one rank with it."""
    aggregation: str = "token"
    """How the loss reduces over a micro-batch's tokens (losses.AGGREGATION_LEVELS): the trainer
    weights micro-batches and the monitored figures the same way."""

    def __init__(self, config: LearnerConfig, name: str | None = None) -> None:
        self.name = name or config.algorithm
        self.options = options_from(self.Options, config, self.name)
        try:
            self.step_credit = step_credit_from(config)
        except ValueError as error:
            raise AlgorithmError(str(error)) from None
        if self.step_credit is not None and not self.takes_step_credit:
            raise AlgorithmError(f"learner.step_credit = {config.step_credit!r} gives each turn an advantage of its own, "
                                 f"which learner.algorithm = {self.name!r} does not take")
        try:  # the common entropy-control keys, checked wherever an algorithm is made
            entropy_settings(config)
        except EntropyControlError as error:
            raise AlgorithmError(str(error)) from None
        # A KL penalty, an entropy bonus or entropy control (common keys) is a per-token term that
        # does not vanish at advantage 0: flat groups then go through the model, so it counts them.
        self.train_flat_groups = needs_flat_members(config)
        self.check_settings()

    @classmethod
    def reads(cls) -> frozenset[str]:
        """The keys of `learner.algorithm_options` this algorithm takes."""
        return frozenset(cls.Options.model_fields) if cls.Options is not None else frozenset()

    def check_settings(self) -> None:
        """Raise AlgorithmError when the settings do not fit together."""

    def scores_every_generated_token(self) -> bool:
        """Whether its scores read all of an episode's generated tokens (a length penalty, turn
        rewards placed at turn ends, credit per turn): then staleness judged per token, which takes
        an episode's old turns out of its loss mask, would change them, and the launcher refuses
        the two."""
        return self.step_credit is not None  # its turns are the runs of generated tokens

    # -- scoring ------------------------------------------------------------------------------

    def shaped_reward(self, trajectory) -> float:
        """The reward its advantages are computed from (plain by default)."""
        return float(trajectory.reward)

    def shaped_rewards(self, members: Sequence) -> np.ndarray:
        return np.array([self.shaped_reward(t) for t in members], dtype=np.float64)

    def carries_signal(self, group) -> bool:
        """Whether a group would move a group-relative update: two usable members whose (shaped)
        rewards differ, or with step credit, turns from a shared state whose returns differ. The
        learner asks it of each group when `resamples_flat_groups`."""
        members = usable_members(group)
        if len(members) < 2:
            return False
        if group_has_signal(self.shaped_rewards(members)):
            return True
        return self.step_credit is not None and any(
            bool(np.any(values != 0)) for values in group_token_advantages(members, [0.0] * len(members),
                                                                          self.step_credit))

    def score(self, groups) -> ScoredBatch:
        """A step's groups as examples with advantages, and what was left out (learner/scoring.py
        has the shared ways)."""
        raise NotImplementedError

    # -- the update ---------------------------------------------------------------------------

    def loss(self, logprobs: torch.Tensor, proximal_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor,
             advantages: torch.Tensor, mask: torch.Tensor) -> LossOutput:
        """Its policy loss on one micro-batch (tensors as in learner/losses.py)."""
        raise NotImplementedError

    def build_value_model(self, policy_model) -> ValueModel | None:
        """A learned critic around `policy_model`, or None (no critic: the default). The trainer
        runs it, trains it with the policy's optimiser and keeps it in the checkpoint."""
        return None

    def advantages_from_values(self, micro_batches: list[PaddedBatch], values: list[torch.Tensor],
                               sum_over_ranks: SumOverRanks | None = None) -> tuple[list[PaddedBatch], list]:
        """With a critic: the micro-batches with their advantages from the critic's `values` at the
        start of the update, and the value targets beside them. `sum_over_ranks` is given when
        the step's examples are split over several ranks."""
        raise NotImplementedError(f"{type(self).__name__} has no critic")

    def value_loss(self, values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                   mask: torch.Tensor) -> LossOutput:
        """With a critic: its weighted loss on one micro-batch, added to the policy loss."""
        raise NotImplementedError(f"{type(self).__name__} has no critic")


def options_from(options_class: type[Section] | None, config: LearnerConfig, name: str) -> Section | None:
    """`learner.algorithm_options` checked by the algorithm's `Options` model (None when it
    declares none, which leaves the table nothing to hold)."""
    if options_class is None:
        if config.algorithm_options:
            raise AlgorithmError(
                f"learner.algorithm_options {dict(config.algorithm_options)!r} is set, but learner.algorithm = "
                f"{name!r} declares no options of its own: remove the table"
            )
        return None
    if not (isinstance(options_class, type) and issubclass(options_class, Section)):
        raise AlgorithmError(f"an algorithm's Options must be a longhorizon.common.config.Section, got {options_class!r}")
    try:
        return check_section(options_class, dict(config.algorithm_options), "learner.algorithm_options")
    except ConfigError as error:
        raise AlgorithmError(str(error)) from None


# Values of the shared choice keys an algorithm may read; "sum" aggregation is dr_grpo's own.
CHOICES = {"aggregation": ("token", "sequence"), "weight_level": WEIGHT_LEVELS, "loss": POLICY_LOSS_NAMES}


def check_choices(options) -> None:
    """Refuse a value of `aggregation`, `weight_level` or `loss` (when the options hold them) that
    no loss knows, wherever the algorithm is made (the launcher, the learner, a script), before its
    first update."""
    for key, choices in CHOICES.items():
        value = getattr(options, key, None)
        if value is not None and value not in choices:
            raise AlgorithmError(f"{OPTIONS_KEY}.{key} must be one of {', '.join(choices)}, got {value!r}")


def check_clip_range(low: float, high: float, *, low_key: str = "clip_eps_low", high_key: str = "clip_eps_high",
                     low_may_be_one: bool = False) -> None:
    """The ratio is clipped to [1 - low, 1 + high]: refuse the values the loss would refuse at its
    first update, naming the key. A clipped surrogate needs low < 1 (a lower bound of 0 leaves
    the ratio unbounded below); an importance weight that is only capped (cispo) may take 1."""
    low_ok = 0 < low <= 1 if low_may_be_one else 0 < low < 1
    if not low_ok:
        bound = "(0, 1]" if low_may_be_one else "(0, 1)"
        raise AlgorithmError(f"clip range: {OPTIONS_KEY}.{low_key} must be in {bound}, got {low}")
    if not high > 0:
        raise AlgorithmError(f"clip range: {OPTIONS_KEY}.{high_key} must be positive, got {high}")
