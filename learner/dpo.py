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
  evaluation and the run folder are those of `longhorizon sft` (learner/sft.py).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from longhorizon.common.config import Config, ConfigError, DPOConfig, dump_toml
from longhorizon.common.conversations import ConversationFileError, read_conversations
from longhorizon.common.preference_pairs import prompt_messages, read_preference_pairs
from longhorizon.learner.sft import (
    conversation_example,
    evaluate_model,
    fresh_run_dir,
    load_model_for_training,
    plan_steps,
    save_model_folder,
)
from longhorizon.learner.trainer import (
    PRECISIONS, Example, chunked_logprobs_match, learning_rate_at, pad_examples, token_logprobs,
)


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
    if not dpo.beta > 0:
        raise ConfigError(f"dpo.beta must be positive, got {dpo.beta}")
    for key in ("epochs", "batch_pairs"):
        if getattr(dpo, key) < 1:
            raise ConfigError(f"dpo.{key} must be at least 1, got {getattr(dpo, key)}")
    for key in ("warmup_steps", "checkpoint_every", "eval_episodes"):
        if getattr(dpo, key) < 0:
            raise ConfigError(f"dpo.{key} must be 0 or more, got {getattr(dpo, key)}")
    if not dpo.learning_rate > 0 or not dpo.grad_clip > 0:
        raise ConfigError("dpo.learning_rate and dpo.grad_clip must be positive")
    if config.learner.precision not in PRECISIONS:
        raise ConfigError(f"learner.precision must be one of {', '.join(PRECISIONS)}, got {config.learner.precision!r}")
    if config.learner.num_ranks != 1:
        raise ConfigError(f"dpo trains in one process: set learner.num_ranks=1 (got {config.learner.num_ranks})")


def run_dpo(config: Config, *, note: Callable[[str], None] = print, progress_stream=None) -> dict:
    """Check everything, compute the reference, train, checkpoint, evaluate; returns the summary
    (also written to `<run dir>/dpo_summary.json`)."""
    from longhorizon.common.conversations import tokenizer_fingerprint
    from longhorizon.common.metrics import MetricsWriter
    from longhorizon.common.progress import ProgressBar
    from longhorizon.learner.checkpoint import checkpoint_dir

    check_dpo_config(config)
    dpo, learner = config.dpo, config.learner
    model_folder, hf_tokenizer, chat_tokenizer, model, device = load_model_for_training(config)
    data = load_dpo_data(
        dpo.data, dpo.pairs, chat_tokenizer, tokenizer_fingerprint(hf_tokenizer),
        vocab_size=model.get_input_embeddings().num_embeddings, max_tokens=config.actor.max_context_tokens,
    )
    pairs = data.pairs
    note(f"{len(pairs)} pairs: {data.pairs_from_episodes} from {data.episodes} episodes of {data.episode_groups} "
         f"tasks, {data.pairs_from_files} from pair files; {data.retokenized} conversations tokenized from their "
         f"messages for this model")

    run_dir = fresh_run_dir(config.run_dir, note)
    (run_dir / "config.toml").write_text(dump_toml(config))
    summary: dict = {"model": str(model_folder), "data": list(dpo.data), "pair_files": list(dpo.pairs),
                     "pairs": len(pairs), "pairs_from_episodes": data.pairs_from_episodes,
                     "pairs_from_files": data.pairs_from_files, "episodes": data.episodes, "beta": dpo.beta}
    if dpo.eval_before and dpo.eval_episodes > 0:
        summary["eval_before"] = evaluate_model(config, model_folder, dpo.eval_episodes)
        note(f"before: held-out success {summary['eval_before']['success_rate']:.1%} "
             f"on {summary['eval_before']['episodes']} {config.env.eval_split} episodes")

    chunked = learner.logprob_chunk_tokens > 0 and chunked_logprobs_match(model)
    chunk_tokens = learner.logprob_chunk_tokens if chunked else 0
    pad_token_id = hf_tokenizer.pad_token_id if hf_tokenizer.pad_token_id is not None else chat_tokenizer.eos_token_id
    pair_lengths = [max(len(pair.chosen.token_ids), len(pair.rejected.token_ids)) for pair in pairs]
    chosen_tokens = torch.tensor([float(pair.chosen.loss_mask[1:].sum()) for pair in pairs])

    def micro_batches(indices: list[int]):
        """(pair indices, padded batch: the chosen sides then the rejected sides) per micro-batch."""
        for chunk in plan_pair_micro_batches([pair_lengths[i] for i in indices], learner.micro_batch_size,
                                             learner.max_tokens_per_micro_batch):
            chosen = [indices[i] for i in chunk]
            sides = [pairs[i].chosen for i in chosen] + [pairs[i].rejected for i in chosen]
            yield chosen, pad_examples(sides, pad_token_id).to(device)

    def sequence_logprobs_of(batch) -> torch.Tensor:
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=learner.precision == "bf16-mixed"):
            logprobs = token_logprobs(model, batch, 1.0, chunk_tokens)
        return sequence_logprobs(logprobs.float(), batch.loss_mask)

    # The reference: the starting weights, so the policy itself before any update, without dropout.
    reference_chosen = torch.zeros(len(pairs))
    reference_rejected = torch.zeros(len(pairs))
    started = time.perf_counter()
    model.eval()
    with torch.no_grad():
        for chosen, batch in micro_batches(list(range(len(pairs)))):
            sides = sequence_logprobs_of(batch).cpu()
            reference_chosen[chosen] = sides[:len(chosen)]
            reference_rejected[chosen] = sides[len(chosen):]
    summary["reference_seconds"] = time.perf_counter() - started

    rng = np.random.default_rng(config.run.seed)
    plan = [(epoch, step) for epoch in range(dpo.epochs)
            for step in plan_steps([1] * len(pairs), rng.permutation(len(pairs)), dpo.batch_pairs)]
    if learner.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    optimizer = torch.optim.AdamW(model.parameters(), lr=dpo.learning_rate, weight_decay=dpo.weight_decay)
    metrics = MetricsWriter(run_dir)
    bar = ProgressBar("dpo", len(plan), stream=progress_stream)
    started = time.perf_counter()
    records: list[dict] = []
    checkpoint = None

    def save(step: int, epoch: int) -> Path:
        provenance = {"base_model": str(model_folder), "step": step, "epoch": epoch + 1, "data": list(dpo.data),
                      "pair_files": list(dpo.pairs), "pairs": len(pairs), "beta": dpo.beta, "nll_coef": dpo.nll_coef}
        return save_model_folder(model, model_folder, checkpoint_dir(run_dir, step), provenance=provenance,
                                 provenance_file="longhorizon_dpo.json")

    try:
        model.train()
        for step_index, (epoch, indices) in enumerate(plan):
            step_started = time.perf_counter()
            learning_rate = learning_rate_at(step_index, dpo.learning_rate, dpo.warmup_steps)
            for group in optimizer.param_groups:
                group["lr"] = learning_rate
            optimizer.zero_grad(set_to_none=True)
            step = {"dpo_loss": 0.0, "chosen_nll": 0.0, "reward_margin": 0.0, "preference_accuracy": 0.0}
            for chosen, batch in micro_batches(indices):
                sides = sequence_logprobs_of(batch)
                loss, pair_metrics = dpo_loss(
                    sides[:len(chosen)], sides[len(chosen):], reference_chosen[chosen].to(device),
                    reference_rejected[chosen].to(device), beta=dpo.beta)
                nll = chosen_nll(sides[:len(chosen)], chosen_tokens[chosen].to(device))
                # Each micro-batch's mean over its pairs, weighted by its share of the step's pairs:
                # the accumulated gradient is that of the step's mean.
                share = len(chosen) / len(indices)
                ((loss + dpo.nll_coef * nll) * share).backward()
                step["dpo_loss"] += loss.item() * share
                step["chosen_nll"] += nll.item() * share
                for key, value in pair_metrics.items():
                    step[key] += value * share
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), dpo.grad_clip)
            optimizer.step()
            seconds = time.perf_counter() - step_started
            record = {"step": step_index + 1, "epoch": epoch + 1, **step, "learning_rate": learning_rate,
                      "grad_norm": float(norm), "train_pairs": len(indices), "learner_step_seconds": seconds}
            records.append(record)
            metrics.write(record)
            bar.update(step_index + 1, f"| epoch {epoch + 1}/{dpo.epochs} | loss {step['dpo_loss']:.4f} | "
                                       f"accuracy {step['preference_accuracy']:.2f}")
            if dpo.checkpoint_every and (step_index + 1) % dpo.checkpoint_every == 0 and step_index + 1 < len(plan):
                save(step_index + 1, epoch)
        model.eval()
        checkpoint = save(len(plan), dpo.epochs - 1)
    finally:
        bar.close()
        metrics.close()
    last_epoch = last_epoch_means(records, ("dpo_loss", "reward_margin", "preference_accuracy"))
    summary.update({"steps": len(plan), "epochs": dpo.epochs, "first_loss": records[0]["dpo_loss"],
                    "final_loss": last_epoch["dpo_loss"], "final_reward_margin": last_epoch["reward_margin"],
                    "final_preference_accuracy": last_epoch["preference_accuracy"],
                    "train_seconds": time.perf_counter() - started, "checkpoint": str(checkpoint)})
    note(f"checkpoint: {checkpoint} (model.path of an RL run, or eval --checkpoint)")
    del model, optimizer  # the evaluation engine loads its own copy
    if dpo.eval_episodes > 0:
        summary["eval_after"] = evaluate_model(config, checkpoint, dpo.eval_episodes)
        note(f"after: held-out success {summary['eval_after']['success_rate']:.1%} "
             f"on {summary['eval_after']['episodes']} {config.env.eval_split} episodes")
    (run_dir / "dpo_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
