"""Micro-batches of a step's examples within a memory budget (`plan_micro_batches`), and a group's
shared prefix encoded once: micro-batches of one group's members, and their log-probs.

Every member of a GRPO-style group starts with the same prompt (system text, task, first
observation), often hundreds or thousands of tokens, and a plain forward pass encodes it once per
member. Here a micro-batch holds members of one group only, and its `prefix_length` is the
longest common prefix of their token sequences. The prefix runs through the model once (batch
of one), its keys and values are kept with their autograd history, and each member's remaining
tokens (its suffix) then run with those keys and values in front: the attention of a suffix
token sees exactly what it sees in the plain pass, so the log-probs are the same, and since the
prefix's keys and values are shared by every member, the gradients of every member's loss flow
back into the one prefix pass and add up there, as they add up over the copies in the plain pass.

The cache objects are the installed transformers' own (`Cache` made of `DynamicLayer`s), with
two changes of behaviour: the prefix pass records each layer's keys and values once, and the
suffix pass reads the prefix's without appending to them. Neither grows on a second call, which is
what the backward replay of a checkpointed layer makes, so gradient checkpointing keeps the cache.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from collections.abc import Callable, Sequence

import numpy as np
import torch


def common_prefix_length(sequences: Sequence[Sequence[int]]) -> int:
    """Length of the longest prefix every sequence starts with (0 for no sequences)."""
    if not sequences:
        return 0
    arrays = [np.asarray(s) for s in sequences]
    shortest = min(len(a) for a in arrays)
    first = arrays[0][:shortest]
    length = shortest
    for other in arrays[1:]:
        differs = np.nonzero(other[:shortest] != first)[0]
        if differs.size:
            length = min(length, int(differs[0]))
    return length


def shareable_prefix_length(sequences: Sequence[Sequence[int]]) -> int:
    """The prefix a micro-batch of these sequences shares: their longest common prefix, cut so that
    every sequence keeps at least one token after it (that token's log-prob comes from the prefix's
    last position); 0 (no sharing) for fewer than two sequences."""
    if len(sequences) < 2:
        return 0
    shortest = min(len(s) for s in sequences)
    return max(0, min(common_prefix_length(sequences), shortest - 1))


MIN_SHARED_PREFIX = 16
"""Fewest tokens worth a prefix pass of its own: below this, a second forward pass costs more than
encoding the few shared tokens once saves (and members whose prompts differ share nothing)."""


def _cut_under(lengths: Sequence[int], shared: int, max_sequences: int, cap: int) -> list[int]:
    """Sizes of the micro-batches that `lengths` (sorted, shortest first) are cut into, front to
    back: each takes members while it holds at most `max_sequences` of them and computes at most
    `cap` tokens (`shared` once, plus each member padded to the longest so far after it); a member
    alone is never refused."""
    sizes: list[int] = []
    count = 0
    for length in lengths:
        computed = shared + (count + 1) * (length - shared)
        if count and (count + 1 > max_sequences or computed > cap):
            sizes.append(count)
            count = 0
        count += 1
    if count:
        sizes.append(count)
    return sizes


def balanced_cut(lengths: Sequence[int], shared: int, max_sequences: int, max_tokens: int) -> list[int]:
    """Sizes of the micro-batches one group's members (`lengths`, sorted, shortest first, sharing
    `shared` tokens) are cut into: the fewest the budget allows, and among cuts into that many, the
    one whose costliest micro-batch computes the fewest tokens, cut front to back under that cost.

    Cutting front to back under the budget alone fills the first micro-batches and leaves the last
    with what remains, often one member, which then shares nothing and encodes the prefix again:
    eight members of a group under a budget that holds seven go 4 + 4, not 7 + 1.
    """
    max_sequences, max_tokens = max(1, max_sequences), max(1, max_tokens)
    fewest = len(_cut_under(lengths, shared, max_sequences, max_tokens))
    # Every cost a micro-batch of two or more members within the budget can have, and 0 (each
    # member alone): the lowest cap that still cuts into `fewest` is one of them, and fewer
    # micro-batches come of a larger cap, so a binary search finds it.
    caps = sorted({0} | {
        shared + (end - start) * (lengths[end - 1] - shared)
        for start in range(len(lengths))
        for end in range(start + 2, min(len(lengths), start + max_sequences) + 1)
    })
    caps = [cap for cap in caps if cap <= max_tokens]
    low, high = 0, len(caps) - 1  # caps[high] cuts as the budget does, into `fewest`
    while low < high:
        middle = (low + high) // 2
        if len(_cut_under(lengths, shared, max_sequences, caps[middle])) <= fewest:
            high = middle
        else:
            low = middle + 1
    return _cut_under(lengths, shared, max_sequences, caps[low])


def plan_micro_batches(examples: list, max_sequences: int, max_tokens: int) -> list[list]:
    """Split a step's examples into micro-batches of similar lengths.

    Each micro-batch is padded only to its own longest sequence, so it is sorted by length and
    cut where adding the next sequence would pass ``max_sequences`` or make (sequences x
    longest length) pass ``max_tokens``: a step's peak memory follows the budget, not the
    longest episode times the batch. A sequence longer than the budget is a micro-batch alone.
    """
    max_sequences, max_tokens = max(1, max_sequences), max(1, max_tokens)
    chunks: list[list] = []
    current: list = []
    for example in sorted(examples, key=lambda e: len(e.token_ids)):
        length = len(example.token_ids)  # the longest so far, as the list is sorted
        if current and (len(current) + 1 > max_sequences or (len(current) + 1) * length > max_tokens):
            chunks.append(current)
            current = []
        current.append(example)
    if current:
        chunks.append(current)
    return chunks


def _group_micro_batches(examples: list, max_sequences: int, max_tokens: int,
                         min_prefix: int) -> tuple[list[list[int]], list[int]]:
    """(the micro-batches of the groups that share a prefix, as indices into `examples`; the
    indices of the other examples), as `plan_group_micro_batches` describes."""
    groups: dict[int, list[int]] = {}
    loose: list[int] = []
    for index, example in enumerate(examples):
        if getattr(example, "group", None) is None:
            loose.append(index)
        else:
            groups.setdefault(example.group, []).append(index)
    chunks: list[list[int]] = []
    for key in sorted(groups):
        members = sorted(groups[key], key=lambda i: len(examples[i].token_ids))
        lengths = [len(examples[i].token_ids) for i in members]
        shared = shareable_prefix_length([examples[i].token_ids for i in members])
        if shared < min_prefix:
            loose += members
            continue
        start = 0
        for size in balanced_cut(lengths, shared, max_sequences, max_tokens):
            chunks.append(members[start:start + size])
            start += size
    return chunks, loose


def plan_group_micro_batches(examples: list, max_sequences: int, max_tokens: int,
                             min_prefix: int = MIN_SHARED_PREFIX) -> list[tuple[list, int]]:
    """A step's examples cut into micro-batches: (examples, prefix length).

    The members of a group (the same `group`) whose common prefix is at least `min_prefix` tokens
    go together, sorted by length and cut by `balanced_cut` (at most `max_sequences` members and
    `max_tokens` tokens computed, the group's common prefix counted once, in as few micro-batches
    as that allows, evened out); each micro-batch shares its own members' longest common prefix,
    at least the group's. The other examples (no group, or a group without such a prefix) are cut
    as `plan_micro_batches` cuts them and share nothing, as does a micro-batch left with one member.
    """
    max_sequences, max_tokens = max(1, max_sequences), max(1, max_tokens)
    chunks, loose = _group_micro_batches(examples, max_sequences, max_tokens, min_prefix)
    planned = []
    for chunk in chunks:
        members = [examples[i] for i in chunk]
        planned.append((members, shareable_prefix_length([e.token_ids for e in members])))
    loose_examples = [examples[i] for i in loose]
    planned += [(chunk, 0) for chunk in plan_micro_batches(loose_examples, max_sequences, max_tokens)]
    return planned


def sharing_units(examples: list, max_sequences: int, max_tokens: int,
                  min_prefix: int = MIN_SHARED_PREFIX) -> list[tuple[list[int], int]]:
    """The pieces a step's examples may be dealt to learner ranks in without losing a shared
    prefix, each (indices into `examples`, tokens its forward pass computes): each micro-batch
    `plan_group_micro_batches` makes of a group (its prefix once, its members padded to the
    longest), and every other example alone (its length).

    A group of several micro-batches encodes its prefix once per micro-batch on one rank as well,
    so its micro-batches may go to different ranks at no extra compute; dealing these pieces
    rather than whole groups keeps the ranks even when a step has few groups, or groups of very
    different lengths."""
    max_sequences, max_tokens = max(1, max_sequences), max(1, max_tokens)
    chunks, loose = _group_micro_batches(examples, max_sequences, max_tokens, min_prefix)
    units = []
    for chunk in chunks:
        prefix = shareable_prefix_length([examples[i].token_ids for i in chunk])
        longest = max(len(examples[i].token_ids) for i in chunk)
        units.append((chunk, prefix + len(chunk) * (longest - prefix)))
    return units + [([i], len(examples[i].token_ids)) for i in loose]


def computed_tokens(input_ids: torch.Tensor, prefix_length: int) -> int:
    """Positions a forward pass over a padded [B, L] batch computes: B x L, or with a shared
    prefix of P tokens P + B x (L - P)."""
    count, length = input_ids.shape
    return prefix_length + count * (length - prefix_length)


class _RecordingLayer:
    """Mixed into a DynamicLayer: the prefix pass's keys and values of one layer, kept from the
    first call; a later call (a checkpointed layer's backward replay) uses its own and stores nothing."""

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self.keys, self.values = key_states, value_states
        return key_states, value_states


class _PrefixLayer:
    """Mixed into a DynamicLayer: the prefix's keys and values in front of every call's own, which
    are never appended (every call, the replay too, sees the prefix alone as the past)."""

    def update(self, key_states, value_states, *args, **kwargs):
        return torch.cat([self.keys, key_states], dim=-2), torch.cat([self.values, value_states], dim=-2)


@functools.cache
def _layer_classes():
    """The two cache layers, made once (transformers is imported only when a prefix is shared)."""
    from transformers.cache_utils import DynamicLayer

    recording = type("RecordingPrefixLayer", (_RecordingLayer, DynamicLayer), {})
    prefix = type("SharedPrefixLayer", (_PrefixLayer, DynamicLayer), {})
    return recording, prefix


def _recording_cache(layer_count: int):
    from transformers.cache_utils import Cache

    recording, _ = _layer_classes()
    return Cache(layers=[recording() for _ in range(layer_count)])


def _prefix_cache(recorded, batch_size: int):
    """A fresh cache for one suffix pass: each layer's prefix keys and values expanded (a view,
    with the autograd history) to every member of the micro-batch."""
    from transformers.cache_utils import Cache

    _, prefix = _layer_classes()
    layers = []
    for source in recorded.layers:
        if not source.is_initialized:
            raise RuntimeError("the shared-prefix pass did not record the keys and values of every layer")
        layer = prefix()
        layer.lazy_initialization(source.keys, source.values)
        shape = (batch_size, *source.keys.shape[1:])
        layer.keys = source.keys.expand(shape)
        layer.values = source.values.expand((batch_size, *source.values.shape[1:]))
        layers.append(layer)
    return Cache(layers=layers)


@contextmanager
def _cache_under_checkpointing(model):
    """Let checkpointed decoder layers take the cache: transformers drops it from a layer under
    gradient checkpointing unless the layer says the cache survives the backward replay, which
    these caches do (neither grows on a second call)."""
    changed = []
    for module in model.modules():
        checkpointed = getattr(module, "gradient_checkpointing", False)
        if checkpointed and getattr(module, "_can_checkpoint_with_cache", True) is False:
            module._can_checkpoint_with_cache = True
            changed.append(module)
    try:
        yield
    finally:
        for module in changed:
            module._can_checkpoint_with_cache = False


def _layer_count(model) -> int:
    """The model's decoder layers, each of which gets a cache layer; a model with layers other
    than full attention (sliding windows, linear attention) is refused, as these caches would
    not reproduce their masks."""
    config = getattr(model, "config", None)
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    count = getattr(text, "num_hidden_layers", None)
    if not count:
        raise ValueError(f"{type(model).__name__} does not say its number of layers (config.num_hidden_layers)")
    kinds = set(getattr(text, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"}:
        raise ValueError(f"a shared prefix needs full attention in every layer; {type(model).__name__} has "
                         f"{', '.join(sorted(kinds))}")
    return int(count)


Score = Callable[[torch.Tensor, torch.Tensor], object]
"""Features ([B, T, F]: hidden states, or logits) and targets ([B, T]) -> log-probs, or
(log-probs, entropy)."""


def shared_prefix_forward(run, layer_count: int, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                          prefix_length: int, features_of: Callable, score: Score, with_entropy: bool):
    """Each next token's log-prob (and entropy) of a right-padded batch whose rows all start with
    the same `prefix_length` tokens, the prefix run once.

    `run` is the model (or its decoder) called as a Hugging Face causal LM; `features_of` takes its
    output to what `score` turns into log-probs (logits, or the last hidden state for an output
    layer applied in chunks). The positions inside the prefix predict the same tokens in every
    row, so they are scored once and expanded; the prefix's last position predicts each row's own
    first suffix token.
    """
    count, length = input_ids.shape
    prefix = prefix_length
    if not 0 < prefix < length:
        raise ValueError(f"a shared prefix must leave every row at least one token: {prefix} of {length}")
    recorded = _recording_cache(layer_count)
    prefix_ids = input_ids[:1, :prefix]
    # The caches are passed in and read back here, so the model is not asked to make or return one
    # (use_cache=False, which also keeps transformers from warning under gradient checkpointing).
    prefix_out = run(input_ids=prefix_ids, attention_mask=attention_mask[:1, :prefix], past_key_values=recorded,
                     use_cache=False)
    suffix_positions = torch.arange(prefix, length, device=input_ids.device).unsqueeze(0).expand(count, -1)
    suffix_out = run(input_ids=input_ids[:, prefix:], attention_mask=attention_mask,
                     position_ids=suffix_positions, past_key_values=_prefix_cache(recorded, count), use_cache=False)
    prefix_features, suffix_features = features_of(prefix_out), features_of(suffix_out)
    pieces = []
    if prefix > 1:
        inside = score(prefix_features[:, :prefix - 1], input_ids[:1, 1:prefix])
        pieces.append(inside)
    last = prefix_features[:, prefix - 1:].expand(count, -1, -1)
    rest = score(torch.cat([last, suffix_features[:, :-1]], dim=1), input_ids[:, prefix:])
    if with_entropy:
        parts = [(p[0].expand(count, -1), p[1].expand(count, -1)) for p in pieces] + [rest]
        return torch.cat([p[0] for p in parts], dim=1), torch.cat([p[1] for p in parts], dim=1)
    return torch.cat([p.expand(count, -1) for p in pieces] + [rest], dim=1)


def run_shared_prefix(model, run, input_ids, attention_mask, prefix_length, features_of, score, with_entropy):
    """`shared_prefix_forward` of `run` (`model` or its decoder), with `model`'s checkpointed
    layers allowed to take the cache."""
    with _cache_under_checkpointing(model):
        return shared_prefix_forward(run, _layer_count(model), input_ids, attention_mask, prefix_length,
                                     features_of, score, with_entropy)
