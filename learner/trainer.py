"""The learner's update step: groups of trajectories in, one (or a few) optimiser steps out.

Read top to bottom: filter and score the groups (advantages), pad micro-batches, compute the
proximal log-probs, then for each optimiser step run micro-batches through the model, form the
off-policy-corrected policy loss (plus an optional KL term) and step.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.utils.checkpoint

from longhorizon.common.config import LearnerConfig
from longhorizon.learner import algorithms, distributed
from longhorizon.learner.advantages import group_has_signal
from longhorizon.learner.critic import build_value_model, gae, per_token_rewards, value_loss, whiten
from longhorizon.learner.distributed import Ranks
from longhorizon.learner.losses import aggregate, kl_penalty, sampled_entropy


@dataclass
class Example:
    """One trajectory prepared for training."""

    token_ids: np.ndarray
    loss_mask: np.ndarray
    behaviour_logprobs: np.ndarray
    advantage: float
    # ppo: each token's reward (turn rewards at the turn's last token); None for the others.
    token_rewards: np.ndarray | None = None


def learning_rate_at(step: int, base: float, warmup_steps: int) -> float:
    """Learning rate of optimiser step `step` (0-based): a linear rise over the warm-up, then flat."""
    if warmup_steps <= 0:
        return base
    return base * min(1.0, (step + 1) / warmup_steps)


@dataclass(frozen=True)
class FlatShare:
    """What the batch's flat groups would have added to the loss's denominator: their members'
    generated tokens and their number. They are not passed through the model (every advantage is
    0, so their policy gradient is 0), but they still count, so a batch that is mostly flat makes
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


def shaped_rewards(config: LearnerConfig, members) -> np.ndarray:
    return np.array([
        algorithms.shaped_reward(config, t.reward, int(np.sum(t.loss_mask))) for t in members
    ], dtype=np.float64)


def group_carries_signal(config: LearnerConfig, group) -> bool:
    """Whether a group would contribute to a group-relative update: two usable members whose
    (shaped) rewards differ."""
    members = usable_members(group)
    return len(members) >= 2 and group_has_signal(shaped_rewards(config, members))


def score_groups(groups, config: LearnerConfig | None = None) -> ScoredBatch:
    """Turn groups into examples with advantages, as `config.algorithm` scores them.

    Trajectories whose episode failed leave their group, and a group left with fewer than two
    members is skipped. Algorithms that score per group skip (and count) groups whose rewards are
    all equal: every advantage would be 0. REINFORCE++ normalises over the whole batch instead,
    so a flat group still counts there.
    """
    config = config or LearnerConfig()
    algorithm = algorithms.get_algorithm(config.algorithm)
    scored: list[tuple[list, np.ndarray]] = []
    used = zero_variance = too_small = failed = 0
    flat_tokens, flat_sequences = 0.0, 0
    for group in groups:
        members = usable_members(group)
        failed += len(group.trajectories) - len(members)
        if len(members) < 2:
            too_small += 1
            continue
        rewards = shaped_rewards(config, members)
        if algorithm.advantages == "critic":  # ppo: the critic is the baseline, flat groups teach it too
            used += 1
            scored.append((members, rewards))
            continue
        if algorithm.advantages == "group" and not group_has_signal(rewards):
            zero_variance += 1
            if config.entropy_coef > 0:
                # Trained on at advantage 0 for the entropy bonus alone: a policy so sharp that
                # every member plays alike (flat at any success rate) is pushed to explore again.
                scored.append((members, rewards))
                continue
            flat_tokens += float(sum(np.sum(t.loss_mask) for t in members))
            flat_sequences += len(members)
            continue
        used += 1
        scored.append((members, rewards))
    if algorithm.advantages == "batch" and scored:
        values = algorithms.batch_advantages(np.concatenate([rewards for _, rewards in scored]))
        offsets = np.cumsum([0] + [len(members) for members, _ in scored])
        advantages = [values[offsets[i]:offsets[i + 1]] for i in range(len(scored))]
    elif algorithm.advantages == "critic":  # computed in the update step, from the critic's values
        advantages = [np.zeros(len(members)) for members, _ in scored]
    else:
        advantages = [algorithms.group_advantages(config, rewards) for _, rewards in scored]
    examples: list[Example] = []
    for (members, _), values in zip(scored, advantages):
        for trajectory, value in zip(members, values):
            loss_mask = np.asarray(trajectory.loss_mask, dtype=np.float32)
            examples.append(
                Example(
                    token_ids=np.asarray(trajectory.token_ids, dtype=np.int64),
                    loss_mask=loss_mask,
                    behaviour_logprobs=np.asarray(trajectory.behaviour_logprobs, dtype=np.float32),
                    advantage=float(value),
                    token_rewards=(per_token_rewards(loss_mask, trajectory.turn_rewards)
                                   if algorithm.advantages == "critic" else None),
                )
            )
    return ScoredBatch(examples, used, zero_variance, too_small, failed, FlatShare(flat_tokens, flat_sequences))


@dataclass
class PaddedBatch:
    input_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, L]
    loss_mask: torch.Tensor  # [B, L-1], aligned with the predicted tokens input_ids[:, 1:]
    behaviour_logprobs: torch.Tensor  # [B, L-1]
    advantages: torch.Tensor  # [B], or [B, L-1] per token (ppo)
    token_rewards: torch.Tensor | None = None  # [B, L-1] (ppo)

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def to(self, device) -> "PaddedBatch":
        return PaddedBatch(*(None if tensor is None else tensor.to(device) for tensor in (
            self.input_ids, self.attention_mask, self.loss_mask, self.behaviour_logprobs, self.advantages,
            self.token_rewards,
        )))


def pad_examples(examples: list[Example], pad_token_id: int) -> PaddedBatch:
    longest = max(len(e.token_ids) for e in examples)
    count = len(examples)
    input_ids = torch.full((count, longest), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((count, longest), dtype=torch.long)
    loss_mask = torch.zeros((count, longest), dtype=torch.float32)
    behaviour = torch.zeros((count, longest), dtype=torch.float32)
    for row, example in enumerate(examples):
        length = len(example.token_ids)
        input_ids[row, :length] = torch.as_tensor(np.array(example.token_ids))
        attention_mask[row, :length] = 1
        loss_mask[row, :length] = torch.as_tensor(np.array(example.loss_mask))
        behaviour[row, :length] = torch.as_tensor(np.array(example.behaviour_logprobs))
    advantages = torch.tensor([e.advantage for e in examples], dtype=torch.float32)
    token_rewards = None
    if any(e.token_rewards is not None for e in examples):
        token_rewards = torch.zeros((count, longest), dtype=torch.float32)
        for row, example in enumerate(examples):
            if example.token_rewards is not None:
                token_rewards[row, :len(example.token_ids)] = torch.as_tensor(np.array(example.token_rewards))
        token_rewards = token_rewards[:, 1:]
    # Token t is predicted from the tokens before it, so targets, masks, behaviour log-probs and
    # rewards drop their first position.
    return PaddedBatch(input_ids, attention_mask, loss_mask[:, 1:], behaviour[:, 1:], advantages, token_rewards)


def token_logprobs(
    model, batch: PaddedBatch, temperature: float = 1.0, chunk_tokens: int = 0, with_entropy: bool = False,
):
    """Log-prob of each next token under `model` at the sampling temperature: [B, L-1]; with
    `with_entropy`, (log-probs, entropy of each position's whole next-token distribution).

    With `chunk_tokens` > 0 the output layer runs over about that many positions of the batch at
    a time, and in training its logits are recomputed in the backward pass: only one chunk's
    `[B, chunk, vocabulary]` logits exist at once, never the whole micro-batch's (for a
    vocabulary of 49k, 4,096 positions of fp32 logits are 0.8 GB, and the backward pass keeps
    several copies). The model must split into a decoder and an output layer (`split_output_layer`).
    """
    targets = batch.input_ids[:, 1:]
    parts = split_output_layer(model) if chunk_tokens > 0 else None
    if parts is None:
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
        return _logprobs_from_logits(logits, targets, temperature, with_entropy)
    decoder, output_layer = parts
    hidden = decoder(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state[:, :-1]
    positions = max(1, chunk_tokens // max(1, hidden.shape[0]))
    pieces = []
    for start in range(0, hidden.shape[1], positions):
        chunk, chunk_targets = hidden[:, start:start + positions], targets[:, start:start + positions]
        if torch.is_grad_enabled() and chunk.requires_grad:
            pieces.append(torch.utils.checkpoint.checkpoint(
                _output_logprobs, output_layer, chunk, chunk_targets, temperature, with_entropy, use_reentrant=False,
            ))
        else:
            pieces.append(_output_logprobs(output_layer, chunk, chunk_targets, temperature, with_entropy))
    if with_entropy:
        return torch.cat([p[0] for p in pieces], dim=1), torch.cat([p[1] for p in pieces], dim=1)
    return torch.cat(pieces, dim=1)


def _output_logprobs(output_layer, hidden: torch.Tensor, targets: torch.Tensor, temperature: float,
                     with_entropy: bool = False):
    return _logprobs_from_logits(output_layer(hidden), targets, temperature, with_entropy)


def _logprobs_from_logits(logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool = False):
    logits = logits.float()
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    normaliser = torch.logsumexp(logits, dim=-1)
    chosen = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - normaliser
    if not with_entropy:
        return chosen
    # H = log Z - sum_v p_v * logit_v, from the same logits (no second softmax over the vocabulary).
    entropy = normaliser - (torch.softmax(logits, dim=-1) * logits).sum(-1)
    return chosen, entropy


def split_output_layer(model):
    """(decoder, output layer) of a Hugging Face causal LM whose logits are exactly
    output_layer(decoder(...).last_hidden_state), or None for a model that does more (logit
    soft-capping or scaling, say): `chunked_logprobs_match` checks it on a real forward pass."""
    get_decoder = getattr(model, "get_decoder", None)
    get_output = getattr(model, "get_output_embeddings", None)
    if get_decoder is None or get_output is None:
        return None
    decoder, output_layer = get_decoder(), get_output()
    if decoder is None or output_layer is None or decoder is model:
        return None
    return decoder, output_layer


def chunked_logprobs_match(model, tolerance: float = 1e-4) -> bool:
    """Whether chunked log-probs equal the model's own logits' on a short input."""
    if split_output_layer(model) is None:
        return False
    vocabulary = model.get_input_embeddings().num_embeddings
    ids = torch.arange(9, dtype=torch.long).remainder(vocabulary).unsqueeze(0)
    probe = PaddedBatch(ids, torch.ones_like(ids), torch.ones(1, 8), torch.zeros(1, 8), torch.zeros(1))
    probe = probe.to(next(model.parameters()).device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            whole = token_logprobs(model, probe)
            chunked = token_logprobs(model, probe, chunk_tokens=3)
    except Exception:  # a decoder with another calling convention: use the whole logits
        return False
    finally:
        model.train(was_training)
    return bool(torch.allclose(whole, chunked, atol=tolerance, rtol=0))


def plan_micro_batches(examples: list[Example], max_sequences: int, max_tokens: int) -> list[list[Example]]:
    """Split a step's examples into micro-batches of similar lengths.

    Each micro-batch is padded only to its own longest sequence, so it is sorted by length and
    cut where adding the next sequence would pass ``max_sequences`` or make (sequences x
    longest length) pass ``max_tokens``: a step's peak memory follows the budget, not the
    longest episode times the batch. A sequence longer than the budget is a micro-batch alone.
    """
    max_sequences, max_tokens = max(1, max_sequences), max(1, max_tokens)
    chunks: list[list[Example]] = []
    current: list[Example] = []
    for example in sorted(examples, key=lambda e: len(e.token_ids)):
        length = len(example.token_ids)  # the longest so far, as the list is sorted
        if current and (len(current) + 1 > max_sequences or (len(current) + 1) * length > max_tokens):
            chunks.append(current)
            current = []
        current.append(example)
    if current:
        chunks.append(current)
    return chunks


def has_dropout(model) -> bool:
    """Whether the model samples dropout masks in train mode (modules or attention dropout)."""
    if any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules()):
        return True
    config = getattr(model, "config", None)
    return float(getattr(config, "attention_dropout", 0.0) or 0.0) > 0


PRECISIONS = ("fp32", "bf16-mixed")


class PolicyLogprobs(torch.nn.Module):
    """The policy as the update step uses it: a padded batch in, each next token's log-prob out.

    Wrapping the causal LM makes this the module whose forward pass the step calls, so that with
    several ranks it is the root of the FSDP2 sharding: its pre-forward hook gathers the
    embeddings and output layer, which the chunked log-prob path uses outside the LM's own
    forward method.
    """

    def __init__(self, model, temperature: float, chunk_tokens: int) -> None:
        super().__init__()
        self.model = model
        self.temperature = temperature
        self.chunk_tokens = chunk_tokens

    def forward(self, batch: PaddedBatch, with_entropy: bool = False):
        return token_logprobs(self.model, batch, self.temperature, self.chunk_tokens, with_entropy)


def idle_micro_batch(pad_token_id: int, device) -> PaddedBatch:
    """Two pad tokens and no loss: a rank with fewer micro-batches than the others runs these, so
    that every rank enters the same number of forward and backward passes (FSDP2 gathers and
    reduces in each)."""
    ids = torch.full((1, 2), pad_token_id, dtype=torch.long)
    return PaddedBatch(ids, torch.ones_like(ids), torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1)).to(device)


class Trainer:
    """Owns the optimiser and applies policy updates to `model`."""

    def __init__(
        self,
        model,
        config: LearnerConfig,
        *,
        temperature: float = 1.0,
        pad_token_id: int = 0,
        reference_model=None,
        ranks: Ranks | None = None,
    ) -> None:
        from longhorizon.learner.broadcast import unique_state_dict
        from longhorizon.common.lora import apply_lora, lora_settings

        self.config = config
        self.ranks = ranks or Ranks.single()
        # Names of the parameters a model folder holds: a tied output layer is stored once.
        self.exported_names = list(unique_state_dict(model))
        self.lora = lora_settings(config.lora)
        base_model = model
        if self.lora is not None:
            model = apply_lora(model, self.lora)
        self.model = model
        self.temperature = temperature if temperature > 0 else 1.0
        self.pad_token_id = pad_token_id
        self.reference_model = reference_model
        self.device = next(model.parameters()).device
        self.algorithm = algorithms.check_algorithm_settings(config)
        self.aggregation = algorithms.aggregation_level(config)
        # The KL penalty and the entropy estimate are means, weighted like the loss ("sum" is a
        # per-sequence weighting, so they take per-sequence means there).
        self._monitor_level = "token" if self.aggregation == "token" else "sequence"
        if config.precision not in PRECISIONS:
            raise ValueError(f"learner.precision must be one of {', '.join(PRECISIONS)}, got {config.precision!r}")
        if config.gradient_checkpointing:
            # transformers' own switch: each decoder layer's activations are recomputed in backward.
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        # Chunked log-probs only where they reproduce the model's own logits.
        self.chunk_tokens = config.logprob_chunk_tokens
        if self.chunk_tokens > 0 and not chunked_logprobs_match(model):
            logging.getLogger(__name__).warning(
                "%s does not split into a decoder and an output layer; log-probs use whole logits",
                type(model).__name__,
            )
            self.chunk_tokens = 0
        self.policy = PolicyLogprobs(model, self.temperature, self.chunk_tokens)
        self.value_model = None
        if self.algorithm.advantages == "critic":
            # A submodule of the policy wrapper: trained by the same optimiser and saved in the
            # same sharded checkpoint, so the critic resumes with the policy.
            self.value_model = build_value_model(model, config.critic).to(self.device)
            self.policy.value_model = self.value_model
        self.reference = (
            PolicyLogprobs(reference_model, self.temperature, self.chunk_tokens) if reference_model is not None else None
        )
        if self.ranks.distributed:
            # Each rank keeps a shard of the parameters, gradients and optimiser state; the
            # reference model (no gradients, no optimiser) is kept whole on every rank.
            units = distributed.decoder_layers(base_model)
            if self.value_model is not None and config.critic != "shared":
                units += distributed.decoder_layers(self.value_model.decoder)  # a separate critic's own layers
            distributed.shard_model(self.policy, units)
        # Only what trains has optimiser state (with LoRA, the adapters alone).
        self.optimizer = torch.optim.AdamW(
            [p for p in self.policy.parameters() if p.requires_grad], lr=config.learning_rate,
            weight_decay=config.weight_decay,
        )

    def _micro_batches(self, examples: list[Example]) -> list[PaddedBatch]:
        micro_batches = [pad_examples(chunk, self.pad_token_id).to(self.device) for chunk in plan_micro_batches(
            examples, self.config.micro_batch_size, self.config.max_tokens_per_micro_batch,
        )] if examples else []
        if self.ranks.distributed:
            most = distributed.all_reduce_max(len(micro_batches))
            micro_batches += [idle_micro_batch(self.pad_token_id, self.device)] * (most - len(micro_batches))
        return micro_batches

    def _logprobs(self, policy: PolicyLogprobs, micro: PaddedBatch, with_entropy: bool = False):
        """Log-probs of a micro-batch (and with `with_entropy` each position's entropy); under
        bf16-mixed the model computes in bfloat16 while its weights stay fp32, and the log-probs
        come out in fp32."""
        with torch.autocast(
            device_type=self.device.type, dtype=torch.bfloat16, enabled=self.config.precision == "bf16-mixed",
        ):
            return policy(micro, with_entropy=with_entropy)

    def _shares(self, micro_batches: list[PaddedBatch], flat: FlatShare) -> tuple[list[float], float]:
        """Weight of each micro-batch's mean loss so that accumulated gradients equal the full
        batch's (with several ranks, the full batch is every rank's examples together), and the
        fraction of the batch those examples are once the flat groups' tokens (or sequences) are
        counted too (`FlatShare`: every rank is given the same). The loss is scaled by both; the
        logged figures by the shares alone, so they stay means over what was trained on."""
        if self.aggregation == "token":
            counts = [float(micro.loss_mask.sum()) for micro in micro_batches]
        else:
            counts = [float((micro.loss_mask.sum(-1) > 0).sum()) for micro in micro_batches]
        total = sum(counts)
        if self.ranks.distributed:
            total = distributed.all_reduce_sum([total])[0]
        left_out = flat.tokens if self.aggregation == "token" else flat.sequences
        return [count / (total or 1.0) for count in counts], total / ((total + left_out) or 1.0)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's parameters as a model folder stores them (a tied output layer once).

        With several ranks this gathers the shards, a collective every rank must enter; rank 0
        gets the tensors (on the CPU) and the other ranks an empty dict.
        """
        from longhorizon.learner.broadcast import unique_state_dict

        if not self.ranks.distributed:
            if self.lora is None:
                return unique_state_dict(self.model)
            state = dict(self.model.state_dict())
        else:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            gathered = get_model_state_dict(
                self.policy, options=StateDictOptions(full_state_dict=True, cpu_offload=True),
            )
            if not self.ranks.is_main:
                return {}
            prefix = "model."
            state = {name[len(prefix):]: tensor for name, tensor in gathered.items() if name.startswith(prefix)}
        if self.lora is not None:
            from longhorizon.common.lora import merged_from_peft_state

            state = merged_from_peft_state(state, self.lora.scale)
        return {name: state[name] for name in self.exported_names}

    def step(self, examples: list[Example], flat: FlatShare = FlatShare()) -> dict[str, float]:
        """Apply `optimizer_steps_per_batch` updates on one batch (`flat`: what the batch's flat
        groups, not passed, add to the loss's denominator); returns metrics."""
        config = self.config
        started = time.perf_counter()
        micro_batches = self._micro_batches(examples)
        shares, signal_fraction = self._shares(micro_batches, flat)
        # The proximal policy is the parameters at the start of this update, evaluated as the
        # actors sample (eval mode: no dropout). With one optimiser step and no dropout it
        # equals the current policy, so it is taken from the training forward pass (detached).
        separate_proximal = config.optimizer_steps_per_batch > 1 or has_dropout(self.model)
        proximal: list[torch.Tensor | None] = [None] * len(micro_batches)
        reference: list[torch.Tensor | None] = [None] * len(micro_batches)
        old_values: list[torch.Tensor | None] = [None] * len(micro_batches)
        returns: list[torch.Tensor | None] = [None] * len(micro_batches)
        if separate_proximal or self.reference is not None or self.value_model is not None:
            self.policy.eval()
            with torch.no_grad():
                for index, micro in enumerate(micro_batches):
                    if separate_proximal:
                        proximal[index] = self._logprobs(self.policy, micro)
                    if self.reference is not None and config.kl_coef > 0:
                        reference[index] = self._logprobs(self.reference, micro)
                    if self.value_model is not None:
                        old_values[index] = self._values(micro)
        if self.value_model is not None:
            micro_batches, returns = self._critic_advantages(micro_batches, old_values)
        self.policy.train()
        totals: dict[str, float] = {}
        maxima: dict[str, float] = {}
        grad_norm = 0.0
        entropy_bonus = config.entropy_coef > 0
        for _ in range(max(1, config.optimizer_steps_per_batch)):
            self.optimizer.zero_grad(set_to_none=True)
            for index, micro in enumerate(micro_batches):
                if float(micro.loss_mask.sum()) == 0:
                    if self.ranks.distributed:
                        # No loss here, but the pass must happen: the other ranks' forward and
                        # backward wait for this rank's part of each gather and reduction.
                        idle = self._logprobs(self.policy, micro).sum() * 0.0
                        if self.value_model is not None:
                            idle = idle + self._values(micro).sum() * 0.0
                        idle.backward()
                    continue
                if entropy_bonus:
                    logprobs, entropy = self._logprobs(self.policy, micro, with_entropy=True)
                else:
                    logprobs = self._logprobs(self.policy, micro)
                prox = proximal[index] if proximal[index] is not None else logprobs.detach()
                output = algorithms.algorithm_loss(
                    config, logprobs, prox, micro.behaviour_logprobs, micro.advantages, micro.loss_mask,
                )
                loss = output.loss
                share = shares[index]
                if entropy_bonus:
                    mean_entropy = aggregate(entropy, micro.loss_mask, self._monitor_level)
                    loss = loss - config.entropy_coef * mean_entropy
                    totals["entropy"] = totals.get("entropy", 0.0) + mean_entropy.item() * share
                if reference[index] is not None:
                    kl = kl_penalty(logprobs, reference[index], micro.loss_mask, aggregation=self._monitor_level)
                    loss = loss + config.kl_coef * kl.loss
                    totals["kl"] = totals.get("kl", 0.0) + kl.loss.item() * share
                if self.value_model is not None:
                    critic = value_loss(
                        self._values(micro), old_values[index], returns[index], micro.loss_mask,
                        value_clip=config.value_clip, aggregation=self.aggregation,
                    )
                    loss = loss + config.value_coef * critic
                    totals["value_loss"] = totals.get("value_loss", 0.0) + critic.item() * share
                (loss * (share * signal_fraction)).backward()
                totals["loss"] = totals.get("loss", 0.0) + loss.item() * share
                entropy = sampled_entropy(logprobs, micro.loss_mask, aggregation=self._monitor_level)
                totals["entropy_estimate"] = totals.get("entropy_estimate", 0.0) + float(entropy) * share
                for key, value in output.metrics.items():
                    if key == "tokens" or not math.isfinite(value):
                        continue
                    if key.endswith("_max"):  # the largest over the step, not an average
                        maxima[key] = max(maxima.get(key, -math.inf), value)
                    else:
                        totals[key] = totals.get(key, 0.0) + value * share
            norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), config.grad_clip)
            grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
            learning_rate = learning_rate_at(self.optimizer_steps_taken(), config.learning_rate, config.warmup_steps)
            for group in self.optimizer.param_groups:
                group["lr"] = learning_rate
            self.optimizer.step()
        self.policy.eval()
        steps = max(1, config.optimizer_steps_per_batch)
        totals["train_tokens"] = float(sum(micro.loss_mask.sum() for micro in micro_batches)) * steps
        totals["train_sequences"] = float(len(examples)) * steps
        if self.ranks.distributed:
            totals, maxima = self._combine_over_ranks(totals, maxima)
        metrics = {key: value / steps for key, value in totals.items()}
        metrics.update(maxima)
        metrics["grad_norm"] = grad_norm
        metrics["learning_rate"] = learning_rate
        metrics["signal_fraction"] = signal_fraction
        metrics["learner_step_seconds"] = time.perf_counter() - started
        return metrics

    def optimizer_steps_taken(self) -> int:
        """Optimiser steps so far, from Adam's own count, so a resumed run continues its warm-up
        where the checkpoint left it."""
        for state in self.optimizer.state.values():
            if "step" in state:
                step = state["step"]
                return int(step.full_tensor() if hasattr(step, "full_tensor") else step)
        return 0

    def _values(self, micro: PaddedBatch) -> torch.Tensor:
        with torch.autocast(
            device_type=self.device.type, dtype=torch.bfloat16, enabled=self.config.precision == "bf16-mixed",
        ):
            return self.value_model(micro.input_ids, micro.attention_mask)

    def _critic_advantages(self, micro_batches: list[PaddedBatch], old_values: list) -> tuple[list, list]:
        """ppo: GAE from the critic's values at the start of the update, centred over the step's
        generated tokens (and scaled to unit std there unless `advantage_std_scaling` is off); the
        micro-batches come back with per-token advantages, and the value targets (returns) beside
        them."""
        config = self.config
        estimates = [
            gae(micro.token_rewards, values, micro.loss_mask, config.gamma, config.lam)
            for micro, values in zip(micro_batches, old_values)
        ]
        counted = torch.cat([adv[micro.loss_mask > 0] for (adv, _), micro in zip(estimates, micro_batches)])
        if self.ranks.distributed:  # the mean and std of every rank's tokens together
            count, total, squares = distributed.all_reduce_sum(
                [float(counted.numel()), float(counted.double().sum()), float((counted.double() ** 2).sum())])
            mean = total / count if count else 0.0
            std = max(squares / count - mean * mean, 0.0) ** 0.5 if count else 1.0
        else:
            mean = float(counted.mean()) if counted.numel() else 0.0
            std = float(counted.std(unbiased=False)) if counted.numel() else 1.0
        with_advantages = [
            PaddedBatch(micro.input_ids, micro.attention_mask, micro.loss_mask, micro.behaviour_logprobs,
                        whiten(adv, micro.loss_mask, mean, std if config.advantage_std_scaling else None),
                        micro.token_rewards)
            for (adv, _), micro in zip(estimates, micro_batches)
        ]
        return with_advantages, [ret for _, ret in estimates]

    def actor_weights(self) -> dict[str, torch.Tensor]:
        """What the actors need of the policy after an update: the adapters alone with LoRA, else
        the whole model (a collective with several ranks, as `full_state_dict`)."""
        if self.lora is not None:
            from longhorizon.common.lora import adapter_name

            # As `adapter_state_dict` names them; with several ranks each adapter is gathered, one
            # tensor at a time, in the same order on every rank.
            adapters = {}
            for name, parameter in self.model.named_parameters():
                saved = adapter_name(name)
                if saved is not None:
                    full = parameter.full_tensor() if hasattr(parameter, "full_tensor") else parameter
                    if self.ranks.is_main:
                        adapters[saved] = full.detach().to("cpu")
            return adapters
        return self.full_state_dict()

    @staticmethod
    def _combine_over_ranks(totals: dict[str, float], maxima: dict[str, float]) -> tuple[dict, dict]:
        """The step's metrics over every rank's examples: share-weighted sums are added, maxima
        take the largest. A rank that ran only idle micro-batches has fewer keys."""
        import torch.distributed as dist

        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, (totals, maxima))
        summed: dict[str, float] = {}
        largest: dict[str, float] = {}
        for rank_totals, rank_maxima in every:
            for name, value in rank_totals.items():
                summed[name] = summed.get(name, 0.0) + value
            for name, value in rank_maxima.items():
                largest[name] = max(largest.get(name, -math.inf), value)
        return summed, largest
