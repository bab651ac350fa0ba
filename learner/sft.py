"""Supervised fine-tuning on conversation files (`longhorizon sft CONFIG`).

Reads the JSONL that `longhorizon collect` writes (common/conversations.py), trains model.path on
the assistant tokens only (mean negative log-likelihood over them), evaluates the result greedily
on the env's held-out split, and writes Hugging Face folders an RL run starts from
(`model.path = "<run dir>/checkpoints/step_N"`).

- Tokens: a conversation's stored token ids are used when the file's tokenizer fingerprint is the
  model's; otherwise its messages are tokenized with the model's tokenizer, in the layout the actor
  builds for RL (`tokenize_conversation`). Either way SFT trains on the format RL will sample in.
- Batches: each epoch shuffles the conversations and cuts them into optimiser steps of at most
  `sft.batch_sequences` conversations (and `sft.batch_tokens` tokens); a step is split into
  micro-batches of similar lengths by the learner's own `plan_micro_batches` (bucketing: each
  micro-batch is padded only to its longest), whose gradients add up to the step's token mean.
- Checkpoints hold the model only (no optimiser, no `state.pt`): an SFT checkpoint is where a new
  RL run starts, at step 0 with a fresh optimiser, and an RL run sharing the run folder cannot
  mistake it for one of its own to resume.
- Every input is checked before training starts, and a fresh run moves an earlier one in the same
  folder aside, so a bad line or a typo never costs a finished run.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from longhorizon.common.config import Config, ConfigError, SFTConfig, dump_toml
from longhorizon.common.conversations import (
    ConversationFileError,
    ConversationRecord,
    read_conversations,
    tokenize_conversation,
    tokenizer_fingerprint,
)
from longhorizon.learner.trainer import (
    PRECISIONS,
    Example,
    chunked_logprobs_match,
    learning_rate_at,
    pad_examples,
    plan_micro_batches,
    token_logprobs,
)

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
    for key in ("epochs", "batch_sequences"):
        if getattr(sft, key) < 1:
            raise ConfigError(f"sft.{key} must be at least 1, got {getattr(sft, key)}")
    for key in ("batch_tokens", "warmup_steps", "checkpoint_every", "eval_episodes"):
        if getattr(sft, key) < 0:
            raise ConfigError(f"sft.{key} must be 0 or more, got {getattr(sft, key)}")
    if not sft.learning_rate > 0 or not sft.grad_clip > 0:
        raise ConfigError("sft.learning_rate and sft.grad_clip must be positive")
    if config.learner.precision not in PRECISIONS:
        raise ConfigError(f"learner.precision must be one of {', '.join(PRECISIONS)}, got {config.learner.precision!r}")
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


def evaluate_model(config: Config, model_folder: str | Path, episodes: int) -> dict:
    """Greedy held-out success of a model folder on env.eval_split (first `episodes` tasks)."""
    import trio

    from longhorizon.actor.engines.base import make_engine
    from longhorizon.actor.evaluate import evaluate, greedy
    from longhorizon.actor.worker import engine_settings

    # The engine that plays is a model engine whatever actor.engine says (a scripted oracle or an
    # endpoint played the data); its options travel only to the engine they were written for.
    name = "vllm" if config.actor.engine == "vllm" else "hf"
    settings = greedy(engine_settings(config, str(model_folder)))
    if config.actor.engine != name:
        settings = dataclasses.replace(settings, engine_options={})
    engine = make_engine(name, settings)

    async def play():
        try:
            return await evaluate(
                engine, config.env.name, dict(config.env.options), split=config.env.eval_split, episodes=episodes,
                horizon_cap=max(config.horizon.stages), max_new_tokens=config.actor.sampling.max_new_tokens,
                max_context_tokens=config.actor.max_context_tokens, seed=config.run.seed,
            )
        finally:
            await engine.close()

    result = trio.run(play)
    return {"split": config.env.eval_split, "episodes": result.episodes, "success_rate": result.success_rate,
            "mean_reward": result.mean_reward, "failed_episodes": result.failed_episodes}


def fresh_run_dir(run_dir: Path, note: Callable[[str], None], markers: Sequence[str] = ("metrics.jsonl", "checkpoints")
                  ) -> Path:
    """`run_dir`, ready for a new run: when it holds one of `markers` (an earlier run's outputs),
    that run is moved aside under a time stamp."""
    if any((run_dir / marker).exists() for marker in markers):
        stamp = time.strftime('%Y%m%d-%H%M%S')
        kept = run_dir.with_name(f"{run_dir.name}.{stamp}")
        count = 1
        while kept.exists():  # runs within the same second
            count += 1
            kept = run_dir.with_name(f"{run_dir.name}.{stamp}-{count}")
        run_dir.rename(kept)
        note(f"an earlier run was in {run_dir}; moved it to {kept}")
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


# ---------------------------------------------------------------- the run

def load_model_for_training(config: Config):
    """model.path, loaded where [learner] says, with torch's threads and seed set: returns
    (model folder, Hugging Face tokenizer, chat tokenizer, model, device)."""
    from longhorizon.common.chat import HFChatTokenizer
    from longhorizon.common.models import load_causal_lm, load_tokenizer, resolve_device, resolve_model_path

    model_folder = resolve_model_path(config.model.path, config.model.cache_dir)
    hf_tokenizer = load_tokenizer(model_folder)
    torch.set_num_threads(max(1, config.learner.torch_threads))
    torch.manual_seed(config.run.seed)
    device = resolve_device(config.learner.device)
    model = load_causal_lm(model_folder, config.model.dtype).to(device)
    return model_folder, hf_tokenizer, HFChatTokenizer(hf_tokenizer), model, device


def run_sft(config: Config, *, note: Callable[[str], None] = print, progress_stream=None) -> dict:
    """Check everything, train, checkpoint, evaluate; returns the summary (also written to
    `<run dir>/sft_summary.json`)."""
    from longhorizon.common.metrics import MetricsWriter
    from longhorizon.common.progress import ProgressBar
    from longhorizon.learner.checkpoint import checkpoint_dir

    check_sft_config(config)
    sft, learner = config.sft, config.learner
    model_folder, hf_tokenizer, chat_tokenizer, model, device = load_model_for_training(config)
    data = load_sft_data(
        sft.data, chat_tokenizer, tokenizer_fingerprint(hf_tokenizer),
        vocab_size=model.get_input_embeddings().num_embeddings, max_tokens=config.actor.max_context_tokens,
        only_successful=sft.only_successful,
    )
    note(f"{len(data.examples)} conversations ({data.tokens} tokens, {data.assistant_tokens} trained on) from "
         f"{len(sft.data)} file(s); {data.retokenized} tokenized from their messages for this model"
         + (f"; {data.left_out_unsuccessful} unsuccessful left out" if sft.only_successful else ""))

    run_dir = fresh_run_dir(config.run_dir, note)
    (run_dir / "config.toml").write_text(dump_toml(config))
    summary: dict = {"model": str(model_folder), "data": list(sft.data), "conversations": len(data.examples),
                     "retokenized": data.retokenized, "tokens": data.tokens, "assistant_tokens": data.assistant_tokens}
    if sft.eval_before and sft.eval_episodes > 0:
        summary["eval_before"] = evaluate_model(config, model_folder, sft.eval_episodes)
        note(f"before: held-out success {summary['eval_before']['success_rate']:.1%} "
             f"on {summary['eval_before']['episodes']} {config.env.eval_split} episodes")

    # Every epoch's steps are planned up front: the warm-up and the progress bar know the total.
    rng = np.random.default_rng(config.run.seed)
    lengths = [len(example.token_ids) for example in data.examples]
    plan = [(epoch, step) for epoch in range(sft.epochs)
            for step in plan_steps(lengths, rng.permutation(len(lengths)), sft.batch_sequences, sft.batch_tokens)]
    if learner.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # Chunked log-probs only where they reproduce the model's own logits (as in RL).
    chunked = learner.logprob_chunk_tokens > 0 and chunked_logprobs_match(model)
    chunk_tokens = learner.logprob_chunk_tokens if chunked else 0
    pad_token_id = hf_tokenizer.pad_token_id if hf_tokenizer.pad_token_id is not None else chat_tokenizer.eos_token_id
    optimizer = torch.optim.AdamW(model.parameters(), lr=sft.learning_rate, weight_decay=sft.weight_decay)
    metrics = MetricsWriter(run_dir)
    bar = ProgressBar("sft", len(plan), stream=progress_stream)
    started = time.perf_counter()
    losses: list[float] = []
    checkpoint = None

    def save(step: int, epoch: int) -> Path:
        return save_model_folder(model, model_folder, checkpoint_dir(run_dir, step), provenance={
            "base_model": str(model_folder), "step": step, "epoch": epoch + 1, "data": list(sft.data),
            "conversations": len(data.examples)})

    try:
        model.train()
        for step_index, (epoch, indices) in enumerate(plan):
            step_started = time.perf_counter()
            learning_rate = learning_rate_at(step_index, sft.learning_rate, sft.warmup_steps)
            for group in optimizer.param_groups:
                group["lr"] = learning_rate
            chunks = plan_micro_batches([data.examples[i] for i in indices], learner.micro_batch_size,
                                        learner.max_tokens_per_micro_batch)
            micro_batches = [pad_examples(chunk, pad_token_id).to(device) for chunk in chunks]
            step_tokens = sum(float(micro.loss_mask.sum()) for micro in micro_batches)
            sequence_tokens = sum(len(data.examples[i].token_ids) for i in indices)
            optimizer.zero_grad(set_to_none=True)
            step_loss = 0.0
            for micro in micro_batches:
                # Each micro-batch's mean weighted by its share of the step's tokens: the
                # accumulated gradient is the gradient of the whole step's token mean.
                share = float(micro.loss_mask.sum()) / step_tokens
                with torch.autocast(device_type=device.type, dtype=torch.bfloat16,
                                    enabled=learner.precision == "bf16-mixed"):
                    logprobs = token_logprobs(model, micro, 1.0, chunk_tokens)
                loss = sft_loss(logprobs, micro.loss_mask)
                (loss * share).backward()
                step_loss += loss.item() * share
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), sft.grad_clip)
            optimizer.step()
            losses.append(step_loss)
            seconds = time.perf_counter() - step_started
            metrics.write({"step": step_index + 1, "epoch": epoch + 1, "sft_loss": step_loss,
                           "learning_rate": learning_rate, "grad_norm": float(norm), "train_tokens": step_tokens,
                           "sequence_tokens": sequence_tokens, "train_sequences": len(indices),
                           "learner_step_seconds": seconds})
            bar.update(step_index + 1, f"| epoch {epoch + 1}/{sft.epochs} | loss {step_loss:.4f} | "
                                       f"{sequence_tokens / max(seconds, 1e-9):.0f} tok/s")
            if sft.checkpoint_every and (step_index + 1) % sft.checkpoint_every == 0 and step_index + 1 < len(plan):
                save(step_index + 1, epoch)
        model.eval()
        checkpoint = save(len(plan), sft.epochs - 1)
    finally:
        bar.close()
        metrics.close()
    summary.update({"steps": len(plan), "epochs": sft.epochs, "first_loss": losses[0], "final_loss": losses[-1],
                    "train_seconds": time.perf_counter() - started, "checkpoint": str(checkpoint)})
    note(f"checkpoint: {checkpoint} (model.path of an RL run, or eval --checkpoint)")
    del model, optimizer  # the evaluation engine loads its own copy
    if sft.eval_episodes > 0:
        summary["eval_after"] = evaluate_model(config, checkpoint, sft.eval_episodes)
        note(f"after: held-out success {summary['eval_after']['success_rate']:.1%} "
             f"on {summary['eval_after']['episodes']} {config.env.eval_split} episodes")
    (run_dir / "sft_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
