"""Turning a step's groups of trajectories into training examples with advantages.

What every algorithm's scoring shares: which members of a group can be scored at all, the
examples and counts a scored batch carries, and the two common ways to score, one group at a
time (`score_each_group`: grpo and its kin) or over the whole batch (`score_whole_batch`:
reinforce_pp). An algorithm picks one, or writes its own from `usable_groups` and `example_from`
(ppo: every member at advantage 0, its advantages come from the critic in the update step).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from longhorizon.learner.advantages import group_has_signal
from longhorizon.learner.logprobs import Example
from longhorizon.learner.samples import cut, images_of, reply_mask, windows_of
from longhorizon.learner.step_credit import StepCredit, group_token_advantages

RewardsOf = Callable[[Sequence], np.ndarray]
"""The (shaped) rewards of a group's members, in order."""
AdvantagesOf = Callable[[np.ndarray], np.ndarray]
"""Advantages from rewards: one group's (per-group scoring) or the whole batch's."""


@dataclass(frozen=True)
class FlatShare:
    """What the batch's flat groups would have added to the loss's denominator: their members'
    generated tokens and their number. They are not passed through the model (every advantage is
    0, so their policy gradient is 0; when a term that is not 0 there is on, such as a KL penalty,
    they are passed instead and this stays empty), but they still count, so a batch that is mostly flat makes
    a proportionally small update, the policy gradient of the whole batch. Without this, the few
    groups with signal near convergence (or from a fine-tuned policy) carry an update as large as a
    batch full of signal, made of their noise."""

    tokens: float = 0.0
    sequences: int = 0


@dataclass
class ScoredBatch:
    examples: list[Example]
    groups_used: int
    groups_skipped_zero_variance: int
    groups_skipped_too_small: int
    failed_trajectories: int
    flat: FlatShare = field(default_factory=FlatShare)


def usable_members(group) -> list:
    """The members a group can be scored on: episodes that ended without an env or engine error
    and generated at least one token (a failed episode says nothing about the policy)."""
    return [t for t in group.trajectories if not t.error and int(np.sum(t.loss_mask)) > 0]


def generated_tokens(trajectory) -> int:
    return int(np.sum(trajectory.loss_mask))


def usable_groups(groups) -> tuple[list[list], int, int]:
    """(the usable members of each group that has at least two, trajectories left out as failed,
    groups skipped as too small): a group of one has nothing to compare against."""
    kept: list[list] = []
    failed = too_small = 0
    for group in groups:
        members = usable_members(group)
        failed += len(group.trajectories) - len(members)
        if len(members) < 2:
            too_small += 1
        else:
            kept.append(members)
    return kept, failed, too_small


def group_failed(members) -> bool:
    """No member of the group succeeded."""
    return not any(bool(getattr(t, "success", False)) for t in members)


def example_from(trajectory, advantage: float, token_rewards: np.ndarray | None = None,
                 group: int | None = None, failed: bool = False,
                 token_advantages: np.ndarray | None = None) -> Example:
    """`group`: the index of the member's group in the step (its members share a prompt, which
    learner.shared_prefix encodes once); `failed`: no member of that group succeeded;
    `token_advantages`: per token, with learner.step_credit."""
    return Example(
        token_ids=np.asarray(trajectory.token_ids, dtype=np.int64),
        loss_mask=np.asarray(trajectory.loss_mask, dtype=np.float32),
        behaviour_logprobs=np.asarray(trajectory.behaviour_logprobs, dtype=np.float32),
        advantage=float(advantage),
        token_rewards=token_rewards,
        group=group,
        group_failed=failed,
        token_advantages=token_advantages,
        images=images_of(trajectory),
    )


def examples_from(trajectory, advantage: float, group: int | None = None, failed: bool = False,
                  token_advantages: np.ndarray | None = None) -> list[Example]:
    """A trajectory's examples: itself, or with turn samples (learner/samples.py) one per turn, in
    the context that turn was sampled in, each with the episode's advantage (and its tokens' own
    with `token_advantages`)."""
    windows = windows_of(trajectory)
    if not windows:
        return [example_from(trajectory, advantage, group=group, failed=failed, token_advantages=token_advantages)]
    prompt_length = int(trajectory.prompt_length)
    examples = []
    for window in windows:
        start, _, end = window
        examples.append(Example(
            token_ids=cut(trajectory.token_ids, prompt_length, start, end).astype(np.int64),
            loss_mask=reply_mask(trajectory.loss_mask, prompt_length, window),
            behaviour_logprobs=cut(trajectory.behaviour_logprobs, prompt_length, start, end).astype(np.float32),
            advantage=float(advantage),
            group=group,
            group_failed=failed,
            token_advantages=None if token_advantages is None else cut(token_advantages, prompt_length, start, end),
            images=images_of(trajectory, window),
        ))
    return examples


def _group_examples(members, advantages, index: int, failed: bool, step_credit: StepCredit | None,
                    per_token: list | None = None) -> list[Example]:
    """One group's examples; with `step_credit`, each turn credited against the group's other
    turns from the same state (`per_token`, when already computed)."""
    if per_token is None:
        per_token = (group_token_advantages(members, list(advantages), step_credit) if step_credit is not None
                     else [None] * len(members))
    return [example for t, value, tokens in zip(members, advantages, per_token)
            for example in examples_from(t, value, group=index, failed=failed, token_advantages=tokens)]


def score_each_group(groups, rewards_of: RewardsOf, advantages_of: AdvantagesOf, *,
                     train_flat_groups: bool = False, step_credit: StepCredit | None = None) -> ScoredBatch:
    """Advantages within each group. A flat group, one whose every advantage would be 0 (its
    rewards all equal and, with step credit, its turns from a shared state all with equal
    returns), is skipped and counted; its tokens and members still count in the loss's denominator
    (`FlatShare`). With `train_flat_groups` (a KL penalty, an entropy bonus or entropy control is
    on: `learner.entropy.needs_flat_members`) it is trained on instead, at its advantages of 0:
    such a term is not 0 on its members, so leaving them out would drop their share of it (and an
    entropy bonus alone can push a policy so sharp that every member plays alike, flat at any
    success rate, to explore again); it is still counted as flat.

    With step credit, a group whose episodes all earned the same can still tell its turns apart:
    two successes, one reaching a state in fewer turns, give that state's turns different
    discounted returns. Such a group trains on its step advantages alone (GiGPO's efficiency
    signal) and counts as used."""
    kept, failed, too_small = usable_groups(groups)
    examples: list[Example] = []
    used = flat_groups = flat_sequences = 0
    flat_tokens = 0.0
    for index, members in enumerate(kept):
        rewards = rewards_of(members)
        episode_signal = group_has_signal(rewards)
        if not episode_signal and step_credit is None and not train_flat_groups:
            flat_groups += 1
            flat_tokens += float(sum(np.sum(t.loss_mask) for t in members))
            flat_sequences += len(members)
            continue
        advantages = advantages_of(rewards)
        per_token = (group_token_advantages(members, list(advantages), step_credit) if step_credit is not None
                     else None)
        step_signal = per_token is not None and any(bool(np.any(values != 0)) for values in per_token)
        if episode_signal or step_signal:
            used += 1
        else:
            flat_groups += 1
            if not train_flat_groups:
                flat_tokens += float(sum(np.sum(t.loss_mask) for t in members))
                flat_sequences += len(members)
                continue
        examples += _group_examples(members, advantages, index, group_failed(members), step_credit, per_token)
    return ScoredBatch(examples, used, flat_groups, too_small, failed, FlatShare(flat_tokens, flat_sequences))


def score_whole_batch(groups, rewards_of: RewardsOf, advantages_of: AdvantagesOf, *,
                      step_credit: StepCredit | None = None) -> ScoredBatch:
    """Advantages over every usable member of the batch at once: a flat group still counts, since
    its members sit above or below the rest of the batch. Step credit, when on, is within each
    group."""
    kept, failed, too_small = usable_groups(groups)
    if not kept:
        return ScoredBatch([], 0, 0, too_small, failed)
    rewards = np.concatenate([rewards_of(group) for group in kept])
    advantages = advantages_of(rewards)
    examples, start = [], 0
    for index, group in enumerate(kept):
        examples += _group_examples(group, advantages[start:start + len(group)], index, group_failed(group),
                                    step_credit)
        start += len(group)
    return ScoredBatch(examples, len(kept), 0, too_small, failed)
