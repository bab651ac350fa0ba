"""Training examples as padded tensors, and each next token's log-prob (and entropy) under a model.

What the RL update, SFT and DPO share: an `Example` is one token sequence with its loss mask,
`pad_examples` makes a micro-batch of them (learner/shared_prefix.py plans which examples go
together), and `token_logprobs` runs the model over a padded batch (the output layer in chunks
when asked, so the whole batch's logits never exist at once).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch
import torch.utils.checkpoint

from longhorizon.learner.shared_prefix import run_shared_prefix


@dataclass
class Example:
    """One trajectory prepared for training."""

    token_ids: np.ndarray
    loss_mask: np.ndarray
    behaviour_logprobs: np.ndarray
    advantage: float
    # ppo: each token's reward (turn rewards at the turn's last token); None for the others.
    token_rewards: np.ndarray | None = None
    # Which group of the step it came from (its members share a prompt): with
    # learner.shared_prefix a micro-batch holds one group's members and encodes their common
    # prefix once (learner/shared_prefix.py). None: shares nothing.
    group: int | None = None
    # No member of its group succeeded: `learner.entropy_scope = "failed_groups"` puts the entropy
    # bonus on these examples alone.
    group_failed: bool = False
    # learner.step_credit: each token's advantage (its episode's plus its turn's), one per token
    # id; None: `advantage` for every token.
    token_advantages: np.ndarray | None = None
    # The images its tokens show (PNG or JPEG bytes, in the order of their tokens), for a
    # vision-language policy: the model sees them again when it scores the tokens. Empty: text.
    images: tuple[bytes, ...] = ()


@dataclass
class PaddedBatch:
    """Examples as tensors, padded to the longest; what a model and a loss take."""

    input_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, L]
    loss_mask: torch.Tensor  # [B, L-1], aligned with the predicted tokens input_ids[:, 1:]
    behaviour_logprobs: torch.Tensor  # [B, L-1]
    advantages: torch.Tensor  # [B], or [B, L-1] per token (ppo, learner.step_credit)
    token_rewards: torch.Tensor | None = None  # [B, L-1] (ppo)
    # Tokens every row starts with, encoded once for the whole micro-batch (learner/shared_prefix.py);
    # 0: each row is encoded on its own.
    prefix_length: int = 0
    group_failed: torch.Tensor | None = None  # [B], 1.0 where no member of the row's group succeeded
    # A vision-language model's image inputs (pixel_values, ...) for every row's images, row after
    # row; None for text.
    image_inputs: dict[str, torch.Tensor] | None = None

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def to(self, device) -> "PaddedBatch":
        return PaddedBatch(*(None if tensor is None else tensor.to(device) for tensor in (
            self.input_ids, self.attention_mask, self.loss_mask, self.behaviour_logprobs, self.advantages,
            self.token_rewards,
        )), prefix_length=self.prefix_length,
            group_failed=None if self.group_failed is None else self.group_failed.to(device),
            image_inputs=None if self.image_inputs is None else {
                name: value.to(device) for name, value in self.image_inputs.items()})


def pad_examples(examples: list[Example], pad_token_id: int, prefix_length: int = 0,
                 image_inputs: Callable[[list[bytes]], dict] | None = None) -> PaddedBatch:
    """The examples as one right-padded batch, aligned on the predicted tokens; with
    `prefix_length`, its first tokens, which every example must share, are encoded once. Examples
    with images need `image_inputs` (images -> the model's image inputs: a VLM's processor)."""
    batch_images = [image for example in examples for image in example.images]
    if batch_images and image_inputs is None:
        raise ValueError("examples with images need the model's image processor to be scored")
    if batch_images and prefix_length:
        raise ValueError("a shared prefix is encoded without images: examples with images cannot share one")
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
    if any(e.token_advantages is not None for e in examples):
        per_token = advantages[:, None].repeat(1, longest)
        for row, example in enumerate(examples):
            if example.token_advantages is not None:
                per_token[row, :len(example.token_ids)] = torch.as_tensor(np.array(example.token_advantages))
        advantages = per_token[:, 1:]
    token_rewards = None
    if any(e.token_rewards is not None for e in examples):
        token_rewards = torch.zeros((count, longest), dtype=torch.float32)
        for row, example in enumerate(examples):
            if example.token_rewards is not None:
                token_rewards[row, :len(example.token_ids)] = torch.as_tensor(np.array(example.token_rewards))
        token_rewards = token_rewards[:, 1:]
    # Token t is predicted from the tokens before it, so targets, masks, behaviour log-probs,
    # rewards and per-token advantages drop their first position.
    if prefix_length:
        shortest = min(len(e.token_ids) for e in examples)
        if not 0 < prefix_length < shortest or bool((input_ids[:, :prefix_length] != input_ids[:1, :prefix_length]).any()):
            raise ValueError(f"a shared prefix of {prefix_length} tokens is not shared by every example "
                             f"with at least one token after it (shortest {shortest})")
    group_failed = torch.tensor([float(e.group_failed) for e in examples], dtype=torch.float32)
    return PaddedBatch(input_ids, attention_mask, loss_mask[:, 1:], behaviour[:, 1:], advantages, token_rewards,
                       prefix_length, group_failed, image_inputs(batch_images) if batch_images else None)


def token_logprobs(
    model, batch: PaddedBatch, temperature: float = 1.0, chunk_tokens: int = 0, with_entropy: bool = False,
    entropy_top_k: int = 0, suppressed_tokens: Sequence[int] = (),
):
    """Log-prob of each next token under `model` at the sampling temperature: [B, L-1]; with
    `with_entropy`, (log-probs, entropy of each position's next-token distribution: the whole
    vocabulary's, or with `entropy_top_k` > 0 that of its k likeliest tokens renormalised,
    `clamped_entropy`).

    With `chunk_tokens` > 0 the output layer runs over about that many positions of the batch at
    a time, and in training its logits are recomputed in the backward pass: only one chunk's
    `[B, chunk, vocabulary]` logits exist at once, never the whole micro-batch's (for a
    vocabulary of 49k, 4,096 positions of fp32 logits are 0.8 GB, and the backward pass keeps
    several copies). The model must split into a decoder and an output layer (`split_output_layer`).
    A batch with a `prefix_length` runs that shared prefix once (learner/shared_prefix.py).

    A vision-language model's batch (`image_inputs`, or `suppressed_tokens`: the image tokens its
    engine never samples) runs the whole model, with those tokens' probability taken out as the
    engine's sampler takes it out.
    """
    targets = batch.input_ids[:, 1:]
    if batch.image_inputs is not None or suppressed_tokens:
        # The whole model: its image encoder puts the images' features on their tokens (the
        # decoder alone, or a prefix encoded once, would see the placeholders instead).
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                       **(batch.image_inputs or {})).logits[:, :-1]
        return logprobs_from_logits(logits, targets, temperature, with_entropy, entropy_top_k, suppressed_tokens)
    parts = split_output_layer(model) if chunk_tokens > 0 else None
    if batch.prefix_length:
        if parts is None:
            return run_shared_prefix(
                model, model, batch.input_ids, batch.attention_mask, batch.prefix_length,
                lambda output: output.logits,
                lambda logits, chosen: logprobs_from_logits(logits, chosen, temperature, with_entropy, entropy_top_k),
                with_entropy,
            )
        decoder, output_layer = parts
        return run_shared_prefix(
            model, decoder, batch.input_ids, batch.attention_mask, batch.prefix_length,
            lambda output: output.last_hidden_state,
            lambda hidden, chosen: chunked_output_logprobs(output_layer, hidden, chosen, temperature, chunk_tokens,
                                                           with_entropy, entropy_top_k),
            with_entropy,
        )
    if parts is None:
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
        return logprobs_from_logits(logits, targets, temperature, with_entropy, entropy_top_k)
    decoder, output_layer = parts
    hidden = decoder(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state[:, :-1]
    return chunked_output_logprobs(output_layer, hidden, targets, temperature, chunk_tokens, with_entropy,
                                   entropy_top_k)


def chunked_output_logprobs(output_layer, hidden: torch.Tensor, targets: torch.Tensor, temperature: float,
                            chunk_tokens: int, with_entropy: bool = False, entropy_top_k: int = 0):
    """Log-probs (and entropy) of `targets` [B, T] from the decoder's `hidden` [B, T, H], the
    output layer run over about `chunk_tokens` positions of the batch at a time (recomputed in the
    backward pass when training)."""
    positions = max(1, chunk_tokens // max(1, hidden.shape[0]))
    pieces = []
    for start in range(0, hidden.shape[1], positions):
        chunk, chunk_targets = hidden[:, start:start + positions], targets[:, start:start + positions]
        if torch.is_grad_enabled() and chunk.requires_grad:
            pieces.append(torch.utils.checkpoint.checkpoint(
                _output_logprobs, output_layer, chunk, chunk_targets, temperature, with_entropy, entropy_top_k,
                use_reentrant=False,
            ))
        else:
            pieces.append(_output_logprobs(output_layer, chunk, chunk_targets, temperature, with_entropy,
                                           entropy_top_k))
    if with_entropy:
        return torch.cat([p[0] for p in pieces], dim=1), torch.cat([p[1] for p in pieces], dim=1)
    return torch.cat(pieces, dim=1)


def _output_logprobs(output_layer, hidden: torch.Tensor, targets: torch.Tensor, temperature: float,
                     with_entropy: bool = False, entropy_top_k: int = 0):
    return logprobs_from_logits(output_layer(hidden), targets, temperature, with_entropy, entropy_top_k)


def logprobs_from_logits(logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool = False,
                         entropy_top_k: int = 0, suppressed_tokens: Sequence[int] = ()):
    """Log-prob of each target under `logits` divided by the temperature; with `with_entropy`, also
    each position's entropy: the whole distribution's, or with `entropy_top_k` > 0 the clamped one
    (`clamped_entropy`)."""
    logits = logits.float()
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    if suppressed_tokens:
        # The lowest finite value, not -inf (the entropy's p * logit stays 0), set after the
        # temperature so that dividing cannot overflow it.
        logits = logits.index_fill(-1, torch.as_tensor(list(suppressed_tokens), device=logits.device),
                                   torch.finfo(logits.dtype).min)
    normaliser = torch.logsumexp(logits, dim=-1)
    chosen = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - normaliser
    if not with_entropy:
        return chosen
    if 0 < entropy_top_k < logits.shape[-1]:
        return chosen, clamped_entropy(logits, entropy_top_k)
    # H = log Z - sum_v p_v * logit_v, from the same logits (no second softmax over the vocabulary).
    entropy = normaliser - (torch.softmax(logits, dim=-1) * logits).sum(-1)
    return chosen, entropy


def clamped_entropy(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Entropy of each position's distribution restricted to its `top_k` likeliest tokens and
    renormalised over them: [..., V] logits in, [...] nats out, at most log(top_k).

    An entropy bonus on the whole distribution raises it most cheaply by moving mass into the long
    tail of tokens the policy never meant to say (for a tiny vocabulary, the symbols and control
    tokens; for a real one, thousands of junk tokens), so sampled replies garble before the policy
    tries the alternatives it nearly chose. Clamped to the k likeliest, the bonus only evens out
    those alternatives: the tail's logits get no gradient from it. Which tokens are the top k is
    chosen without gradient (ties broken by torch.topk); the entropy is differentiable in their
    logits.
    """
    top = logits.topk(top_k, dim=-1).values
    return torch.logsumexp(top, dim=-1) - (torch.softmax(top, dim=-1) * top).sum(-1)


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


ACTIVATION_BYTES_PER_UNIT = 100
"""Bytes a training forward pass keeps for the backward pass, per token, decoder layer and unit of
the hidden size: SmolLM2-135M in fp32 keeps 1.3-2.3 MB a token (30 layers of 576), 75-133 bytes a
unit (`longhorizon bench learner`, docs/benchmarks.md)."""

CHECKPOINTING_FLOOR_BYTES = 1 << 30
"""Activations below this never turn gradient checkpointing on: small models and micro-batches
train faster without the recomputation, and their memory is not what limits a run."""


def gradient_checkpointing_pays(model, max_tokens_per_micro_batch: int) -> bool:
    """Whether recomputing each layer's activations in the backward pass pays for `model`: when a
    full micro-batch's activations (`ACTIVATION_BYTES_PER_UNIT` per token, layer and hidden unit)
    would be more than the model's own training state (weights, and for what trains its gradient
    and AdamW's two moments) and more than `CHECKPOINTING_FLOOR_BYTES`. Then they are most of the
    step's peak, and checkpointing keeps only each layer's input (one unit in ~100) for about a
    third more compute."""
    config = getattr(model, "config", None)
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    layers, hidden = getattr(text, "num_hidden_layers", None), getattr(text, "hidden_size", None)
    if not layers or not hidden:
        return False
    activations = max_tokens_per_micro_batch * layers * hidden * ACTIVATION_BYTES_PER_UNIT
    state = sum(p.numel() * p.element_size() + (3 * p.numel() * 4 if p.requires_grad else 0)
                for p in model.parameters())
    return activations > max(state, CHECKPOINTING_FLOOR_BYTES)


def use_gradient_checkpointing(setting: bool | str, model, max_tokens_per_micro_batch: int) -> bool:
    """learner.gradient_checkpointing resolved for `model`: true, false, or "auto"
    (`gradient_checkpointing_pays`)."""
    if isinstance(setting, bool):
        return setting
    if setting != "auto":
        raise ValueError(f"learner.gradient_checkpointing must be true, false or \"auto\", got {setting!r}")
    return gradient_checkpointing_pays(model, max_tokens_per_micro_batch)
