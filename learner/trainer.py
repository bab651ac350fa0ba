"""The learner's update step: scored examples in, one (or a few) optimiser steps out.

Read `Trainer.step` top to bottom: pad micro-batches, compute the proximal log-probs (and, for an
algorithm with a critic, its values and advantages; for Clip-Cov or KL-Cov, the tokens they act
on), then for each optimiser step run micro-batches through the model, add the algorithm's loss
(plus optional entropy bonus, KL, KL-Cov and value terms) and step; the target-entropy mode's
coefficient is adapted after the step (learner/entropy.py). How groups become examples, and
what the loss is, belongs to the algorithm (learner/algorithms/); the log-prob helpers are in
learner/logprobs.py.
"""

from __future__ import annotations

import logging
import math
import time
import torch

from longhorizon.common.config import LearnerConfig
from longhorizon.learner import distributed
from longhorizon.learner.algorithms import make_algorithm
from longhorizon.learner.distributed import Ranks
from longhorizon.learner.entropy import (
    EntropyController,
    bonus_entropy,
    bonus_row_weights,
    clip_cov_selection,
    covariance_means,
    entropy_settings,
    kl_cov_penalty,
    kl_cov_selection,
    needs_flat_members,
    token_covariance,
    without_gradient_at,
)
from longhorizon.learner.logprobs import (
    Example,
    PaddedBatch,
    chunked_logprobs_match,
    pad_examples,
    token_logprobs,
    use_gradient_checkpointing,
)
from longhorizon.learner.losses import aggregate, kl_penalty, sampled_entropy
from longhorizon.learner.optimiser import apply_update, learning_rate_at
from longhorizon.learner.scoring import FlatShare, ScoredBatch
from longhorizon.learner.prefix_probe import probe_shared_prefix
from longhorizon.learner.shared_prefix import plan_group_micro_batches, plan_micro_batches, sharing_units
from longhorizon.learner.broadcast import unique_state_dict
from longhorizon.common.lora import apply_lora, lora_settings, merged_from_peft_state, adapter_name
from longhorizon.common.chat import image_model_inputs
from longhorizon.common.models import image_token_ids, require_processor


def score_groups(groups, config: LearnerConfig | None = None) -> ScoredBatch:
    """Score groups as `config.algorithm` does (a running learner asks its trainer's algorithm)."""
    return make_algorithm(config or LearnerConfig()).score(groups)


def has_dropout(model) -> bool:
    """Whether the model samples dropout masks in train mode (modules or attention dropout)."""
    if any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules()):
        return True
    config = getattr(model, "config", None)
    return float(getattr(config, "attention_dropout", 0.0) or 0.0) > 0




class PolicyLogprobs(torch.nn.Module):
    """The policy as the update step uses it: a padded batch in, each next token's log-prob out.

    Wrapping the causal LM makes this the module whose forward pass the step calls, so that with
    several ranks it is the root of the FSDP2 sharding: its pre-forward hook gathers the
    embeddings and output layer, which the chunked log-prob path uses outside the LM's own
    forward method.
    """

    def __init__(self, model, temperature: float, chunk_tokens: int, entropy_top_k: int = 0,
                 suppressed_tokens: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.model = model
        self.temperature = temperature
        self.chunk_tokens = chunk_tokens
        self.entropy_top_k = entropy_top_k
        self.suppressed_tokens = tuple(suppressed_tokens)

    def forward(self, batch: PaddedBatch, with_entropy: bool = False):
        return token_logprobs(self.model, batch, self.temperature, self.chunk_tokens, with_entropy, self.entropy_top_k,
                              self.suppressed_tokens)


def idle_micro_batch(pad_token_id: int, device, shared: bool = False) -> PaddedBatch:
    """Two pad tokens and no loss: a rank with fewer micro-batches than the others runs these, so
    that every rank enters the same number of forward and backward passes (FSDP2 gathers and
    reduces in each). `shared`: the first token as a shared prefix, so that it calls each layer
    twice, as a micro-batch with a shared prefix does."""
    ids = torch.full((1, 2), pad_token_id, dtype=torch.long)
    return PaddedBatch(ids, torch.ones_like(ids), torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1),
                       prefix_length=1 if shared else 0).to(device)


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
        processor=None,
    ) -> None:
        self.config = config
        # A vision-language policy's processor: examples with images are scored with their pixels.
        # Loaded from the model's folder on the first such example when not given.
        self.processor = processor
        self._model_folder = str(getattr(model, "name_or_path", "") or "")
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
        self.algorithm = make_algorithm(config)
        self.aggregation = self.algorithm.aggregation
        self.entropy = entropy_settings(config)
        # The entropy bonus's coefficient: fixed, or adapted after each step (target mode) and
        # kept in checkpoints (`extra_state`).
        self.entropy_controller = EntropyController(self.entropy)
        # The KL penalty and the entropy estimate are means, weighted like the loss ("sum" is a
        # per-sequence weighting, so they take per-sequence means there).
        self._monitor_level = "token" if self.aggregation == "token" else "sequence"
        self.gradient_checkpointing = use_gradient_checkpointing(
            config.gradient_checkpointing, model, config.max_tokens_per_micro_batch)
        if self.gradient_checkpointing:
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
        self.shared_prefix = self._shared_prefix_usable(model)
        # A vision-language policy's image tokens: its engine never samples them (common/models.py).
        self.suppressed_tokens = image_token_ids(getattr(base_model, "config", None))
        self.policy = PolicyLogprobs(model, self.temperature, self.chunk_tokens, self.entropy.entropy_top_k,
                                     self.suppressed_tokens)
        # An algorithm with a learned critic brings its value model: a submodule of the policy
        # wrapper, trained by the same optimiser and saved in the same sharded checkpoint, so the
        # critic resumes with the policy.
        self.value_model = self.algorithm.build_value_model(model)
        if self.value_model is not None:
            self.value_model = self.value_model.to(self.device)
            self.policy.value_model = self.value_model
        self.reference = (
            PolicyLogprobs(reference_model, self.temperature, self.chunk_tokens, suppressed_tokens=self.suppressed_tokens)
            if reference_model is not None else None
        )
        if self.ranks.distributed:
            # Each rank keeps a shard of the parameters, gradients and optimiser state; the
            # reference model (no gradients, no optimiser) is kept whole on every rank.
            units = distributed.decoder_layers(base_model)
            if self.value_model is not None:  # a separate critic's own layers (a shared one has none)
                policy_layers = {id(unit) for unit in units}
                units += [unit for unit in distributed.decoder_layers(self.value_model.decoder)
                          if id(unit) not in policy_layers]
            distributed.shard_model(self.policy, units)
        # Only what trains has optimiser state (with LoRA, the adapters alone).
        self.optimizer = torch.optim.AdamW(
            [p for p in self.policy.parameters() if p.requires_grad], lr=config.learning_rate,
            weight_decay=config.weight_decay,
        )

    def _shared_prefix_usable(self, model) -> bool:
        """learner.shared_prefix where it gives the plain pass's results up to rounding
        (`probe_shared_prefix`), on every rank. Elsewhere the plain pass runs, the same update at
        more compute, and the log says why with the measured difference."""
        if not self.config.shared_prefix:
            return False
        probe = probe_shared_prefix(model)
        usable = probe.usable
        if self.ranks.distributed:  # the ranks must agree: their passes meet in FSDP2's collectives
            usable = distributed.all_reduce_max(0 if usable else 1) == 0
        log = logging.getLogger(__name__)
        if usable:
            log.info("learner.shared_prefix on: %s", probe.reason)
        else:
            log.warning("learner.shared_prefix is not used: %s; each member's prompt is encoded on its own",
                        probe.reason if not probe.usable else "another rank's model refused it")
        return usable

    def deal_examples(self, examples: list[Example]) -> list[list[Example]]:
        """A step's examples dealt to the ranks (one list per rank, in the examples' order), their
        tokens computed about even. With the shared prefix, the members of one micro-batch of a
        group stay together (`sharing_units`), so each rank encodes the prefixes one rank would;
        without it, each example goes alone. Every rank's loss is weighted by the whole step's
        tokens (`_shares`), so the dealing does not change the update."""
        config = self.config
        if self.shared_prefix:
            units = sharing_units(examples, config.micro_batch_size, config.max_tokens_per_micro_batch)
        else:
            units = [([index], len(example.token_ids)) for index, example in enumerate(examples)]
        shares = distributed.split_by_tokens([load for _, load in units], self.ranks.world_size)
        return [[examples[i] for i in sorted(i for unit in share for i in units[unit][0])] for share in shares]

    def _image_inputs(self, images: list[bytes]) -> dict:
        """The model's image inputs for a micro-batch's images, as the actor's engine built them."""
        if self.processor is None:
            if not self._model_folder:
                raise ValueError("examples with images need the model's processor: pass Trainer(processor=...)")
            self.processor = require_processor(self._model_folder)
        return image_model_inputs(self.processor, images)

    def _micro_batches(self, examples: list[Example]) -> list[PaddedBatch]:
        config = self.config
        with_images = any(example.images for example in examples)
        if self.shared_prefix and not with_images:  # a shared prefix is encoded without the images
            # One group's members per micro-batch, their common prefix encoded once.
            plan = plan_group_micro_batches(examples, config.micro_batch_size, config.max_tokens_per_micro_batch)
        else:
            plan = [(chunk, 0) for chunk in plan_micro_batches(
                examples, config.micro_batch_size, config.max_tokens_per_micro_batch)]
        image_inputs = self._image_inputs if with_images else None
        micro_batches = [pad_examples(chunk, self.pad_token_id, prefix, image_inputs).to(self.device)
                         for chunk, prefix in plan] if examples else []
        if self.ranks.distributed:
            # FSDP2 gathers a layer's parameters at each call and reduces its gradients after each
            # call's backward pass: every rank must call the layers alike, micro-batch by
            # micro-batch. A shared prefix calls each layer twice, so the micro-batches with one
            # come first on every rank, then the plain ones, each run topped up with idle ones.
            shared = [micro for micro in micro_batches if micro.prefix_length]
            plain = [micro for micro in micro_batches if not micro.prefix_length]
            most_shared, most_plain = distributed.all_reduce_max_each([len(shared), len(plain)])
            micro_batches = (
                shared + [idle_micro_batch(self.pad_token_id, self.device, shared=True)] * (most_shared - len(shared))
                + plain + [idle_micro_batch(self.pad_token_id, self.device)] * (most_plain - len(plain))
            )
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
            state = merged_from_peft_state(state, self.lora.scale)
        return {name: state[name] for name in self.exported_names}

    def step(self, examples: list[Example], flat: FlatShare = FlatShare()) -> dict[str, float]:
        """Apply `optimizer_steps_per_batch` updates on one batch (`flat`: what the batch's flat
        groups, not passed, add to the loss's denominator); returns metrics.

        An update whose loss or gradient norm is not finite is never applied: the step stops
        there, with the parameters and the optimiser state as they were, and says so in its
        metrics (`nonfinite_step` 1, `optimizer_steps_applied`); the learner worker counts such
        steps and stops a run that keeps making them."""
        config = self.config
        started = time.perf_counter()
        if (flat.tokens > 0 or flat.sequences > 0) and (needs_flat_members(config) or self.value_model is not None):
            # Such a term (KL, entropy, value loss) is not 0 on a flat member: left out, its share
            # would be missing from the update, which is then not the whole batch's gradient.
            raise ValueError(
                "flat groups were left out of the step, but a per-token term that does not vanish at "
                "advantage 0 is on (learner.kl_coef, entropy_coef, entropy_control or a critic): score "
                "them into the examples at advantage 0 (score_each_group(..., train_flat_groups=True))"
            )
        micro_batches = self._micro_batches(examples)
        shares, signal_fraction = self._shares(micro_batches, flat)
        # The proximal policy is the parameters at the start of this update, evaluated as the
        # actors sample (eval mode: no dropout). With one optimiser step and no dropout it
        # equals the current policy, so it is taken from the training forward pass (detached).
        separate_proximal = config.optimizer_steps_per_batch > 1 or has_dropout(self.model)
        # Clip-Cov and KL-Cov pick their tokens over the whole batch before the first backward
        # pass, from the log-probs at the update's start: a pass without gradients when the
        # proximal ones are not taken separately anyway.
        covariance = self.entropy.uses_covariance
        proximal: list[torch.Tensor | None] = [None] * len(micro_batches)
        start_logprobs: list[torch.Tensor | None] = [None] * len(micro_batches)
        reference: list[torch.Tensor | None] = [None] * len(micro_batches)
        old_values: list[torch.Tensor | None] = [None] * len(micro_batches)
        returns: list[torch.Tensor | None] = [None] * len(micro_batches)
        if separate_proximal or covariance or self.reference is not None or self.value_model is not None:
            self.policy.eval()
            with torch.no_grad():
                for index, micro in enumerate(micro_batches):
                    if separate_proximal:
                        proximal[index] = self._logprobs(self.policy, micro)
                        start_logprobs[index] = proximal[index]
                    elif covariance:
                        start_logprobs[index] = self._logprobs(self.policy, micro)
                    if self.reference is not None and config.kl_coef > 0:
                        reference[index] = self._logprobs(self.reference, micro)
                    if self.value_model is not None:
                        old_values[index] = self._values(micro)
        if self.value_model is not None:
            micro_batches, returns = self.algorithm.advantages_from_values(
                micro_batches, old_values, distributed.all_reduce_sum if self.ranks.distributed else None,
            )
        selected: list[torch.Tensor | None] = [None] * len(micro_batches)
        totals: dict[str, float] = {}
        if covariance:
            selected, selected_fraction = self._covariance_selection(micro_batches, start_logprobs)
            name = "cov_clipped_fraction" if self.entropy.mode == "clip_cov" else "cov_penalised_fraction"
        self.policy.train()
        maxima: dict[str, float] = {}
        grad_norm = 0.0
        with_entropy = self.entropy.computes_entropy
        entropy_coef = self.entropy_controller.coefficient
        learning_rate = learning_rate_at(self.optimizer_steps_taken(), config.learning_rate, config.warmup_steps)
        passes = applied = 0
        finite = True
        for _ in range(max(1, config.optimizer_steps_per_batch)):
            self.optimizer.zero_grad(set_to_none=True)
            passes += 1
            loss_finite = True
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
                if with_entropy:
                    logprobs, entropy = self._logprobs(self.policy, micro, with_entropy=True)
                else:
                    logprobs = self._logprobs(self.policy, micro)
                prox = proximal[index] if proximal[index] is not None else logprobs.detach()
                policy_logprobs = logprobs
                if selected[index] is not None and self.entropy.mode == "clip_cov":
                    policy_logprobs = without_gradient_at(logprobs, selected[index])
                output = self.algorithm.loss(policy_logprobs, prox, micro.behaviour_logprobs, micro.advantages,
                                             micro.loss_mask)
                loss = output.loss
                loss_metrics = dict(output.metrics)
                share = shares[index]
                if with_entropy:
                    mean_entropy = aggregate(entropy, micro.loss_mask, self._monitor_level)
                    if entropy_coef > 0:  # the target mode measures the entropy even at 0
                        raised = mean_entropy if self.entropy.entropy_scope == "all" else bonus_entropy(
                            entropy, micro.loss_mask, micro.group_failed, self.entropy.entropy_scope,
                            self._monitor_level, self.entropy.frozen_entropy)
                        loss = loss - entropy_coef * raised
                        if self.entropy.entropy_scope != "all":
                            rows = bonus_row_weights(entropy, micro.loss_mask, micro.group_failed,
                                                     self.entropy.entropy_scope, self.entropy.frozen_entropy)
                            # Weighted as the loss weighs its tokens: each token, or each sequence alike.
                            covered = 1.0 if rows is None else float(aggregate(
                                rows[:, None].expand_as(micro.loss_mask), micro.loss_mask, self._monitor_level))
                            totals["entropy_bonus_share"] = totals.get("entropy_bonus_share", 0.0) + covered * share
                    totals["entropy"] = totals.get("entropy", 0.0) + mean_entropy.item() * share
                if selected[index] is not None and self.entropy.mode == "kl_cov":
                    penalty = kl_cov_penalty(logprobs, prox, selected[index], micro.loss_mask, self._monitor_level)
                    loss = loss + self.entropy.kl_cov_coef * penalty
                    totals["kl_cov_penalty"] = totals.get("kl_cov_penalty", 0.0) + penalty.item() * share
                if reference[index] is not None:
                    kl = kl_penalty(logprobs, reference[index], micro.loss_mask, aggregation=self._monitor_level)
                    loss = loss + config.kl_coef * kl.loss
                    totals["kl"] = totals.get("kl", 0.0) + kl.loss.item() * share
                if self.value_model is not None:
                    critic = self.algorithm.value_loss(self._values(micro), old_values[index], returns[index],
                                                       micro.loss_mask)
                    loss = loss + critic.loss
                    loss_metrics.update(critic.metrics)
                (loss * (share * signal_fraction)).backward()
                loss_value = loss.item()
                loss_finite = loss_finite and math.isfinite(loss_value)
                totals["loss"] = totals.get("loss", 0.0) + loss_value * share
                entropy = sampled_entropy(logprobs, micro.loss_mask, aggregation=self._monitor_level)
                totals["entropy_estimate"] = totals.get("entropy_estimate", 0.0) + float(entropy) * share
                for key, value in loss_metrics.items():
                    if key == "tokens" or not math.isfinite(value):
                        continue
                    if key.endswith("_max"):  # the largest over the step, not an average
                        maxima[key] = max(maxima.get(key, -math.inf), value)
                    else:
                        totals[key] = totals.get(key, 0.0) + value * share
            update = apply_update(
                self.optimizer, self.policy.parameters(), grad_clip=config.grad_clip,
                learning_rate=lambda: learning_rate_at(self.optimizer_steps_taken(), config.learning_rate,
                                                       config.warmup_steps),
                loss_finite=loss_finite, agree=self._all_ranks_agree,
            )
            grad_norm, finite = update.grad_norm, update.applied
            if not finite:
                break  # dropped (learner/optimiser.py); a later pass on this batch would only repeat it
            learning_rate = self.optimizer.param_groups[0]["lr"]
            applied += 1
        self.policy.eval()
        # Summed over passes, then divided by them below: the batch's own tokens and sequences,
        # or 0 when no optimiser step was applied (nothing was trained on).
        totals["train_tokens"] = float(sum(micro.loss_mask.sum() for micro in micro_batches)) * passes * (applied > 0)
        totals["train_sequences"] = float(len(examples)) * passes * (applied > 0)
        if self.ranks.distributed:
            totals, maxima = self._combine_over_ranks(totals, maxima)
        metrics = {key: value / passes for key, value in totals.items()}
        metrics.update(maxima)
        metrics["grad_norm"] = grad_norm
        metrics["learning_rate"] = learning_rate
        # 1 when a pass had a non-finite loss or gradient norm and its update was skipped (the
        # same on every rank); the optimiser steps before it on this batch were applied.
        metrics["nonfinite_step"] = 0.0 if finite else 1.0
        metrics["optimizer_steps_applied"] = float(applied)
        metrics["signal_fraction"] = signal_fraction
        if with_entropy:
            metrics["entropy_coef"] = entropy_coef  # the coefficient this step used
            if applied > 0:
                # Every rank has the same combined entropy, so the coefficients stay equal.
                self.entropy_controller.update(metrics.get("entropy", math.nan))
        if covariance:
            metrics[name] = selected_fraction
        metrics["learner_step_seconds"] = time.perf_counter() - started
        return metrics

    def _covariance_selection(self, micro_batches: list[PaddedBatch],
                              start_logprobs: list[torch.Tensor]) -> tuple[list[torch.Tensor], float]:
        """Clip-Cov's or KL-Cov's tokens in each micro-batch, and their fraction of the batch's
        generated tokens. The covariance is centred over the whole batch (every rank's tokens);
        with several ranks each rank picks its share among its own tokens."""
        masks = [micro.loss_mask for micro in micro_batches]
        advantages = [micro.advantages for micro in micro_batches]
        sums = list(covariance_means(start_logprobs, advantages, masks))
        if self.ranks.distributed:
            sums = distributed.all_reduce_sum(sums)
        total_logprob, total_advantage, count = sums
        mean_logprob, mean_advantage = total_logprob / (count or 1.0), total_advantage / (count or 1.0)
        covariances = [token_covariance(lp, adv, mask, mean_logprob, mean_advantage)
                       for lp, adv, mask in zip(start_logprobs, advantages, masks)]
        settings = self.entropy
        if settings.mode == "clip_cov":
            # The global RNG (kept in checkpoints): a resumed run draws as the original would.
            chosen = clip_cov_selection(covariances, masks, settings.fraction, settings.clip_cov_low,
                                        settings.clip_cov_high)
        else:
            chosen = kl_cov_selection(covariances, masks, settings.fraction)
        picked = [float(c.sum()) for c in chosen]
        counted, total = sum(picked), float(sum(float((m > 0).sum()) for m in masks))
        if self.ranks.distributed:
            counted, total = distributed.all_reduce_sum([counted, total])
        return [c if n else None for c, n in zip(chosen, picked)], counted / (total or 1.0)

    def extra_state(self) -> dict:
        """What a checkpoint keeps of the trainer beside the model and the optimiser: the
        target-entropy mode's coefficient."""
        return {"entropy_control": self.entropy_controller.state_dict()}

    def load_extra_state(self, state: dict) -> None:
        """Restore `extra_state` (a checkpoint without it leaves the coefficient at its start)."""
        self.entropy_controller.load_state_dict(state.get("entropy_control", {}))

    def _all_ranks_agree(self, finite: bool) -> bool:
        """Whether this pass's update may be applied on every rank: the gradient norm is already
        global over the ranks, but each rank's loss is its own, so with several ranks the verdict
        is combined and every rank skips, or steps, together."""
        if self.ranks.distributed:
            finite = distributed.all_reduce_max(0 if finite else 1) == 0
        return finite

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

    def actor_weights(self) -> dict[str, torch.Tensor]:
        """What the actors need of the policy after an update: the adapters alone with LoRA, else
        the whole model (a collective with several ranks, as `full_state_dict`)."""
        if self.lora is not None:
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
