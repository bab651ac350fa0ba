"""DPO (Rafailov et al. 2023): preference pairs of episodes, the loss against a frozen
reference, and the offline trainer (`longhorizon dpo CONFIG`).

A pair is two episodes of the same task, the preferred one (`chosen`) and the other
(`rejected`). Pairs come from groups (the best and the worst member of a group whose rewards
differ: a conversation file's episodes grouped by task, `dpo.data`) or from a preference-pair
file (common/preference_pairs.py, `dpo.pairs`). An episode's log-likelihood is the sum of its
generated tokens' log-probs (every assistant turn of the conversation: the loss mask), under the
policy and under the reference.

- The reference is the starting model (model.path), frozen. It equals the policy before the first
  update, so its log-likelihoods of every pair are computed once, up front, with the policy's own
  weights in eval mode and without gradients: no second copy of the model is kept.
- A step's pairs are cut into micro-batches that hold both sides of each pair (the loss is a
  function of the pair's two log-likelihoods), each weighted by its share of the step's pairs.
- Data checks, checkpoints (Hugging Face folders an RL run starts from), the held-out greedy
  evaluation and the run folder are those of `longhorizon sft`; the run itself is launch/recipes/dpo.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from longhorizon.common.config import Config, ConfigError, DPOConfig
from longhorizon.common.conversations import ConversationFileError, read_conversations
from longhorizon.common.preference_pairs import prompt_messages, read_preference_pairs
from longhorizon.learner.sft import (
    conversation_example,
)
from longhorizon.learner.logprobs import Example
from longhorizon.learner.scoring import usable_members


@dataclass
class PreferencePair:
    task_id: str
    chosen: object
    rejected: object
    reward_margin: float


def pairs_from_groups(groups) -> list[PreferencePair]:
    """One pair per group whose usable members' rewards differ: its best against its worst
    (the first of equals, so the choice is deterministic)."""
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


def chosen_nll(policy_chosen: torch.Tensor, chosen_tokens: torch.Tensor) -> torch.Tensor:
    """Mean over pairs of the chosen episode's negative log-likelihood per generated token,
    -(pi_c / n_c): the term `dpo.nll_coef` adds to the DPO loss (as in iterative RPO, Pang et al.
    2024). The DPO loss alone only widens the gap between the two sides, and can do so by lowering
    both; this term keeps the chosen answers likely."""
    return -(policy_chosen / chosen_tokens.clamp(min=1)).mean()


def last_epoch_means(records: Sequence[dict], keys: Sequence[str]) -> dict[str, float]:
    """Each key's mean over the last epoch's steps, weighted by each step's pairs (`train_pairs`).

    The summary's final figures: the epoch's last step alone can hold a couple of pairs (the
    remainder of the epoch after full batches), too few for an accuracy or a margin to mean much.
    """
    last = [record for record in records if record["epoch"] == records[-1]["epoch"]]
    pairs = sum(record["train_pairs"] for record in last)
    return {key: sum(record[key] * record["train_pairs"] for record in last) / pairs for key in keys}


def plan_pair_micro_batches(pair_lengths: Sequence[int], max_sequences: int, max_tokens: int) -> list[list[int]]:
    """Cut a step's pairs (indices into `pair_lengths`, each the longer side's tokens) into
    micro-batches of similar lengths that keep both sides of a pair together: at most
    `max_sequences` sequences (two per pair) and (sequences x longest) at most `max_tokens`. A pair
    over either budget is a micro-batch alone."""
    max_pairs = max(1, max_sequences // 2)
    chunks: list[list[int]] = []
    current: list[int] = []
    for index in sorted(range(len(pair_lengths)), key=lambda i: pair_lengths[i]):
        length = pair_lengths[index]  # the longest so far, as the order is by length
        if current and (len(current) + 1 > max_pairs or 2 * (len(current) + 1) * length > max_tokens):
            chunks.append(current)
            current = []
        current.append(index)
    if current:
        chunks.append(current)
    return chunks


# ---------------------------------------------------------------- data

@dataclass
class CollectedEpisode:
    """A line of a conversation file as `pairs_from_groups` sees a group member."""

    task_id: str
    reward: float
    example: Example
    where: str
    error: str = ""

    @property
    def loss_mask(self) -> np.ndarray:
        return self.example.loss_mask


@dataclass
class EpisodeGroup:
    """The episodes of one task (and one prompt) in the conversation files."""

    trajectories: list = field(default_factory=list)


@dataclass
class TrainingPair:
    chosen: Example
    rejected: Example
    task_id: str
    where: str
    """Where the two conversations come from, for reports."""


@dataclass
class DPOData:
    pairs: list[TrainingPair]
    episodes: int
    """Conversations read from dpo.data."""
    episode_groups: int
    """Tasks (with their prompts) among them."""
    pairs_from_episodes: int
    pairs_from_files: int
    retokenized: int
    """Conversations tokenized from their messages (no token ids for this model's tokenizer)."""


def group_episodes(episodes: Sequence[CollectedEpisode], prompts: Sequence[str]) -> list[EpisodeGroup]:
    """Episodes grouped by task id and prompt (an env whose reset seed changes the instance shows
    another first observation, and two instances are no pair), ordered by task id and prompt:
    `collect` writes episodes as they end, so the same episodes give the same groups in any order."""
    groups: dict[tuple[str, str], EpisodeGroup] = {}
    for episode, prompt in zip(episodes, prompts):
        groups.setdefault((episode.task_id, prompt), EpisodeGroup()).trajectories.append(episode)
    return [groups[key] for key in sorted(groups)]


def load_dpo_data(
    episode_paths: Sequence[str | Path],
    pair_paths: Sequence[str | Path],
    chat_tokenizer,
    fingerprint: str,
    *,
    vocab_size: int,
    max_tokens: int,
) -> DPOData:
    """Every pair of `episode_paths` (each task's best episode against its worst, when their
    rewards differ) and of `pair_paths`, as training examples for a model with this tokenizer.

    Raises ConversationFileError naming the file, line and fix for a malformed line, a line the
    model cannot train on (see `conversation_example`), an episode with no task id or reward, and
    conversation files in which no task has two episodes with different rewards."""
    def example(record) -> Example:
        nonlocal retokenized
        made, was_retokenized = conversation_example(
            record, chat_tokenizer, fingerprint, vocab_size=vocab_size, max_tokens=max_tokens)
        retokenized += int(was_retokenized)
        return made

    retokenized = 0
    episodes: list[CollectedEpisode] = []
    prompts: list[str] = []
    for path in episode_paths:
        records = read_conversations(path)
        if not records:
            raise ConversationFileError(f"{path} holds no conversations (is it the file `longhorizon collect` wrote?)")
        for record in records:
            missing = [key for key in ("task_id", "reward") if getattr(record, key) is None]
            if missing:
                raise ConversationFileError(
                    f"{record.where}: no {' or '.join(missing)}: episodes in dpo.data are paired by task and "
                    f"ranked by reward; add the field(s), or write the pairs yourself to a file in dpo.pairs")
            episodes.append(CollectedEpisode(record.task_id, float(record.reward), example(record), record.where))
            prompts.append(json.dumps(prompt_messages(record.messages), sort_keys=True))
    groups = group_episodes(episodes, prompts)
    from_episodes = [TrainingPair(pair.chosen.example, pair.rejected.example, pair.task_id,
                                  f"{pair.chosen.where} over {pair.rejected.where}")
                     for pair in pairs_from_groups(groups)]
    if episode_paths and not from_episodes:
        repeated = sum(len(group.trajectories) >= 2 for group in groups)
        raise ConversationFileError(
            f"no pair in {', '.join(map(str, episode_paths))}: of {len(groups)} tasks, {repeated} have two or more "
            f"episodes and none of those has two with different rewards. Sample several episodes per task with a "
            f"model at temperature 1, e.g. `longhorizon collect CONFIG actor.engine=hf --tasks 64 --episodes 512 "
            f"--output FILE.jsonl`, or give pairs in dpo.pairs")
    from_files: list[TrainingPair] = []
    for path in pair_paths:
        records = read_preference_pairs(path)
        if not records:
            raise ConversationFileError(f"{path} holds no pairs: one {{\"chosen\": ..., \"rejected\": ...}} object "
                                        f"per line")
        for record in records:
            from_files.append(TrainingPair(example(record.chosen), example(record.rejected),
                                           record.task_id or "", record.where))
    return DPOData(from_episodes + from_files, len(episodes), len(groups), len(from_episodes), len(from_files),
                   retokenized)


# ---------------------------------------------------------------- the run

def check_dpo_config(config: Config) -> None:
    """Values of [dpo] (and the learner settings DPO uses) that cannot work, as errors naming the key."""
    dpo: DPOConfig = config.dpo
    if not dpo.data and not dpo.pairs:
        raise ConfigError('dpo.data and dpo.pairs are both empty: list conversation files with several episodes '
                          'per task (dpo.data=["runs/samples.jsonl"], from `longhorizon collect`) or preference-pair '
                          'files (dpo.pairs=["pairs.jsonl"])')
    for key in ("data", "pairs"):
        paths = getattr(dpo, key)
        if not all(isinstance(path, str) and path for path in paths):
            raise ConfigError(f"dpo.{key} must be a list of file paths, got {paths!r}")
    if config.learner.num_ranks != 1:
        raise ConfigError(f"dpo trains in one process: set learner.num_ranks=1 (got {config.learner.num_ranks})")


