"""Supervised fine-tuning's parts: the loss, the step plan, the conversation data and the model
folders it writes. The run itself (train, checkpoint, evaluate) is launch/recipes/sft.py."""

from __future__ import annotations

import dataclasses
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from longhorizon.common.config import Config, ConfigError, SFTConfig
from longhorizon.common.conversations import (
    ConversationFileError,
    ConversationRecord,
    read_conversations,
    tokenize_conversation,
)
from longhorizon.learner.logprobs import Example
from longhorizon.learner.shared_prefix import plan_group_micro_batches, plan_micro_batches
from longhorizon.common.chat import HFChatTokenizer
from longhorizon.common.models import load_causal_lm, load_tokenizer, resolve_device, resolve_model_path

# Files that make a checkpoint a self-contained model folder besides the weights and config (the
# same set the RL checkpoints copy): the tokenizer, its chat template, the tiny models' marker.
_TOKENIZER_FILES = ("tokenizer*", "special_tokens_map.json", "chat_template.jinja", "longhorizon_tiny.json")
KEEP_CHECKPOINTS = 3


# ---------------------------------------------------------------- the loss and the schedule

def sft_loss(logprobs: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Mean negative log-likelihood of the masked tokens: -sum(mask * log p) / sum(mask).

    `logprobs` and `loss_mask` are [B, T] (the mask 1 on assistant tokens). Every token weighs the
    same, so a long reply counts in proportion to its length. With no masked token the loss is 0
    and still part of the autograd graph.
    """
    if logprobs.shape != loss_mask.shape:
        raise ValueError(f"logprobs {tuple(logprobs.shape)} and loss_mask {tuple(loss_mask.shape)} differ in shape")
    counted = loss_mask > 0
    # where(), not a product: a -inf log-prob outside the mask would give NaN.
    masked = torch.where(counted, logprobs, torch.zeros_like(logprobs))
    return -masked.sum() / counted.sum().clamp(min=1)


def plan_steps(
    lengths: Sequence[int], order: Sequence[int], batch_sequences: int, batch_tokens: int = 0
) -> list[list[int]]:
    """Cut conversations (indices into `lengths`, in `order`) into optimiser steps of at most
    `batch_sequences` conversations and, when `batch_tokens` > 0, at most that many tokens (a
    conversation longer than that is a step of its own)."""
    steps: list[list[int]] = []
    current: list[int] = []
    tokens = 0
    for index in order:
        full = len(current) >= batch_sequences or (batch_tokens > 0 and tokens + lengths[index] > batch_tokens)
        if current and full:
            steps.append(current)
            current, tokens = [], 0
        current.append(int(index))
        tokens += lengths[index]
    if current:
        steps.append(current)
    return steps


def plan_sft_micro_batches(examples: Sequence[Example], max_sequences: int, max_tokens: int,
                           share_prefix: bool) -> list[tuple[list[Example], int]]:
    """One step's conversations cut into micro-batches: (conversations, shared prefix length).

    With `share_prefix`, the step's conversations count as one group: those whose common prefix
    is long enough (the system prompt and the task's instructions, often most of a conversation)
    go in micro-batches that encode it once (`plan_group_micro_batches`); the prefix is masked out
    of the loss, but gradients still flow through it as in the plain pass. Without it, or for a
    step whose conversations share too little, each conversation is encoded whole."""
    if share_prefix:
        return plan_group_micro_batches([dataclasses.replace(example, group=0) for example in examples],
                                        max_sequences, max_tokens)
    return [(chunk, 0) for chunk in plan_micro_batches(list(examples), max_sequences, max_tokens)]


# ---------------------------------------------------------------- data

@dataclass
class SFTData:
    examples: list[Example]
    conversations: int
    retokenized: int
    """Conversations tokenized from their messages (no token ids for this model's tokenizer)."""
    left_out_unsuccessful: int
    tokens: int
    assistant_tokens: int


def check_sft_config(config: Config) -> None:
    """Values of [sft] (and the learner settings SFT uses) that cannot work, as errors naming the key."""
    sft: SFTConfig = config.sft
    if not sft.data:
        raise ConfigError('sft.data is empty: list the conversation files to train on, e.g. '
                          'sft.data=["runs/oracle.jsonl"] (write one with `longhorizon collect`)')
    if not all(isinstance(path, str) and path for path in sft.data):
        raise ConfigError(f"sft.data must be a list of file paths, got {sft.data!r}")
    if config.learner.num_ranks != 1:
        raise ConfigError(f"sft trains in one process: set learner.num_ranks=1 (got {config.learner.num_ranks})")


def conversation_example(
    record: ConversationRecord, chat_tokenizer, fingerprint: str, *, vocab_size: int, max_tokens: int
) -> tuple[Example, bool]:
    """A checked conversation as a training example for a model with this tokenizer, and whether
    it was tokenized from its messages (its stored ids are for another tokenizer, or absent).

    Raises ConversationFileError naming the line and the fix for token ids outside the model's
    vocabulary, no assistant token, or more than `max_tokens` tokens."""
    retokenized = False
    if record.token_ids is not None and record.tokenizer["fingerprint"] == fingerprint:
        token_ids, loss_mask = record.token_ids, record.loss_mask
    else:
        conversation = tokenize_conversation(chat_tokenizer, record.messages)
        token_ids, loss_mask = conversation.token_ids, conversation.loss_mask
        retokenized = True
    ids = np.asarray(token_ids, dtype=np.int64)
    mask = np.asarray(loss_mask, dtype=np.float32)
    if ids.size and int(ids.max()) >= vocab_size:
        raise ConversationFileError(
            f"{record.where}: token id {int(ids.max())} is outside the model's vocabulary of "
            f"{vocab_size}: the ids were made for another model. Delete token_ids, loss_mask and "
            f"tokenizer from the file's lines to tokenize the messages, or collect again with "
            f"--model set to this model")
    if mask[1:].sum() == 0:  # the first token is never predicted
        raise ConversationFileError(
            f"{record.where}: no assistant token (loss_mask has no 1): nothing to learn from; "
            f"delete the line or collect it again")
    if ids.size > max_tokens:
        raise ConversationFileError(
            f"{record.where}: {ids.size} tokens, more than actor.max_context_tokens = {max_tokens} "
            f"(the longest conversation RL trains on): raise it or drop the conversation")
    example = Example(token_ids=ids, loss_mask=mask, behaviour_logprobs=np.zeros(ids.size, np.float32), advantage=0.0)
    return example, retokenized


def load_sft_data(
    paths: Sequence[str | Path],
    chat_tokenizer,
    fingerprint: str,
    *,
    vocab_size: int,
    max_tokens: int,
    only_successful: bool = False,
) -> SFTData:
    """Every conversation of `paths` as a training example for a model with this tokenizer.

    Raises ConversationFileError naming the file, line and fix for: a malformed line, token ids
    outside the model's vocabulary, a conversation with no assistant token or longer than
    `max_tokens`, and data left with nothing to train on."""
    examples: list[Example] = []
    conversations = retokenized = left_out = tokens = assistant_tokens = 0
    for path in paths:
        records = read_conversations(path)
        if not records:
            raise ConversationFileError(f"{path} holds no conversations (is it the file `longhorizon collect` wrote?)")
        for record in records:
            conversations += 1
            if only_successful:
                if record.success is None:
                    raise ConversationFileError(
                        f"{record.where}: no \"success\" field, so sft.only_successful cannot tell; set "
                        f"sft.only_successful=false or add the field")
                if not record.success:
                    left_out += 1
                    continue
            example, was_retokenized = conversation_example(
                record, chat_tokenizer, fingerprint, vocab_size=vocab_size, max_tokens=max_tokens)
            retokenized += int(was_retokenized)
            tokens += len(example.token_ids)
            assistant_tokens += int(example.loss_mask[1:].sum())
            examples.append(example)
    if not examples:
        raise ConversationFileError(
            f"none of the {conversations} conversations in {', '.join(map(str, paths))} succeeded: nothing "
            f"to train on with sft.only_successful=true")
    return SFTData(examples, conversations, retokenized, left_out, tokens, assistant_tokens)


# ---------------------------------------------------------------- checkpoints and evaluation

def save_model_folder(
    model, source_folder: Path, target: Path, *, provenance: dict, provenance_file: str = "longhorizon_sft.json"
) -> Path:
    """A Hugging Face model folder (weights, config, tokenizer files) at `target`, written beside
    it first and renamed, so a crash never leaves half a folder under the final name.
    `provenance` (what it was trained from) goes to `provenance_file` in it."""
    partial = target.with_name(target.name + ".partial")
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    model.save_pretrained(partial, safe_serialization=True)
    for pattern in _TOKENIZER_FILES:
        for file in Path(source_folder).glob(pattern):
            shutil.copy2(file, partial / file.name)
    (partial / provenance_file).write_text(json.dumps(provenance, indent=2) + "\n")
    if target.exists():
        shutil.rmtree(target)
    partial.rename(target)
    done = sorted(p for p in target.parent.glob("step_*") if p.is_dir() and not p.name.endswith(".partial"))
    for old in done[:-KEEP_CHECKPOINTS]:
        shutil.rmtree(old, ignore_errors=True)
    return target


# ---------------------------------------------------------------- the run

def load_model_for_training(config: Config):
    """model.path, loaded where [learner] says, with torch's threads and seed set: returns
    (model folder, Hugging Face tokenizer, chat tokenizer, model, device)."""
    model_folder = resolve_model_path(config.model.path, config.model.cache_dir)
    hf_tokenizer = load_tokenizer(model_folder)
    torch.set_num_threads(max(1, config.learner.torch_threads))
    torch.manual_seed(config.run.seed)
    device = resolve_device(config.learner.device)
    model = load_causal_lm(model_folder, config.model.dtype).to(device)
    return model_folder, hf_tokenizer, HFChatTokenizer(hf_tokenizer), model, device


