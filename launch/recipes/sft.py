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
  micro-batches of similar lengths (bucketing: each micro-batch is padded only to its longest),
  whose gradients add up to the step's token mean. With `learner.shared_prefix` (the default) the
  prefix a micro-batch's conversations share (an env's system prompt, often most of each one) is
  encoded once, as RL encodes a group's prompt (`plan_sft_micro_batches`).
- Checkpoints hold the model only (no optimiser, no `state.pt`): an SFT checkpoint is where a new
  RL run starts, at step 0 with a fresh optimiser, and an RL run sharing the run folder cannot
  mistake it for one of its own to resume.
- Every input is checked before training starts, and a fresh run moves an earlier one in the same
  folder aside, so a bad line or a typo never costs a finished run.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from longhorizon.actor.evaluate import evaluate_model_folder
from longhorizon.common.config import Config, dump_toml
from longhorizon.common.conversations import tokenizer_fingerprint
from longhorizon.launch.launchers.supervise import fresh_run_dir
from longhorizon.learner.sft import (
    check_sft_config,
    load_model_for_training,
    load_sft_data,
    plan_sft_micro_batches,
    plan_steps,
    save_model_folder,
    sft_loss,
)
from longhorizon.learner.logprobs import (
    chunked_logprobs_match, pad_examples, token_logprobs, use_gradient_checkpointing,
)
from longhorizon.learner.prefix_probe import probe_shared_prefix
from longhorizon.learner.shared_prefix import computed_tokens
from longhorizon.learner.optimiser import OfflineSettings, run_offline_steps
from longhorizon.common.metrics import MetricsWriter
from longhorizon.common.progress import ProgressBar
from longhorizon.learner.checkpoint import checkpoint_dir


def run_sft(config: Config, *, note: Callable[[str], None] = print, progress_stream=None) -> dict:
    """Check everything, train, checkpoint, evaluate; returns the summary (also written to
    `<run dir>/sft_summary.json`)."""
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
        summary["eval_before"] = evaluate_model_folder(config, model_folder, sft.eval_episodes)
        note(f"before: held-out success {summary['eval_before']['success_rate']:.1%} "
             f"on {summary['eval_before']['episodes']} {config.env.eval_split} episodes")

    # Every epoch's steps are planned up front: the warm-up and the progress bar know the total.
    rng = np.random.default_rng(config.run.seed)
    lengths = [len(example.token_ids) for example in data.examples]
    plan = [(epoch, step) for epoch in range(sft.epochs)
            for step in plan_steps(lengths, rng.permutation(len(lengths)), sft.batch_sequences, sft.batch_tokens)]
    if use_gradient_checkpointing(learner.gradient_checkpointing, model, learner.max_tokens_per_micro_batch):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # Chunked log-probs only where they reproduce the model's own logits (as in RL).
    chunked = learner.logprob_chunk_tokens > 0 and chunked_logprobs_match(model)
    chunk_tokens = learner.logprob_chunk_tokens if chunked else 0
    # The conversations' common prefix encoded once per micro-batch, where the model is known to
    # give the plain pass's log-probs that way (as in RL).
    share_prefix = False
    if learner.shared_prefix:
        probe = probe_shared_prefix(model)
        share_prefix = probe.usable
        if not share_prefix:
            note(f"learner.shared_prefix is not used: {probe.reason}; each conversation is encoded whole")
    pad_token_id = hf_tokenizer.pad_token_id if hf_tokenizer.pad_token_id is not None else chat_tokenizer.eos_token_id
    optimizer = torch.optim.AdamW(model.parameters(), lr=sft.learning_rate, weight_decay=sft.weight_decay)
    metrics = MetricsWriter(run_dir, config=config)
    bar = ProgressBar("sft", len(plan), stream=progress_stream)
    started = time.perf_counter()
    checkpoint = None

    def save(step: int, epoch: int) -> Path:
        return save_model_folder(model, model_folder, checkpoint_dir(run_dir, step), provenance={
            "base_model": str(model_folder), "step": step, "epoch": epoch + 1, "data": list(sft.data),
            "conversations": len(data.examples)})

    def accumulate(indices: list[int]) -> dict[str, float]:
        """One step's micro-batches forward and backward: each micro-batch's mean weighted by its
        share of the step's tokens, so the accumulated gradient is that of the step's token mean."""
        plan_of_step = plan_sft_micro_batches([data.examples[i] for i in indices], learner.micro_batch_size,
                                              learner.max_tokens_per_micro_batch, share_prefix)
        micro_batches = [pad_examples(chunk, pad_token_id, prefix).to(device) for chunk, prefix in plan_of_step]
        step_tokens = sum(float(micro.loss_mask.sum()) for micro in micro_batches)
        step_loss = 0.0
        for micro in micro_batches:
            share = float(micro.loss_mask.sum()) / step_tokens
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16,
                                enabled=learner.precision == "bf16-mixed"):
                logprobs = token_logprobs(model, micro, 1.0, chunk_tokens)
            loss = sft_loss(logprobs, micro.loss_mask)
            (loss * share).backward()
            step_loss += loss.item() * share
        return {"sft_loss": step_loss, "train_tokens": step_tokens,
                "sequence_tokens": sum(len(data.examples[i].token_ids) for i in indices),
                "computed_tokens": sum(computed_tokens(micro.input_ids, micro.prefix_length) for micro in micro_batches),
                "train_sequences": len(indices)}

    def on_step(record: dict) -> None:
        metrics.write(record)
        bar.update(record["step"], f"| epoch {record['epoch']}/{sft.epochs} | loss {record['sft_loss']:.4f} | "
                                   f"{record['sequence_tokens'] / max(record['learner_step_seconds'], 1e-9):.0f} tok/s")

    try:
        records = run_offline_steps(
            model, optimizer, plan, OfflineSettings(sft.learning_rate, sft.warmup_steps, sft.grad_clip),
            accumulate, on_step, checkpoint_every=sft.checkpoint_every, save=save,
        )
        checkpoint = save(len(plan), sft.epochs - 1)
    finally:
        bar.close()
        metrics.close()
    losses = [record["sft_loss"] for record in records]
    summary.update({"steps": len(plan), "epochs": sft.epochs, "first_loss": losses[0], "final_loss": losses[-1],
                    "train_seconds": time.perf_counter() - started, "checkpoint": str(checkpoint)})
    note(f"checkpoint: {checkpoint} (model.path of an RL run, or eval --checkpoint)")
    model = optimizer = None  # freed: the evaluation engine loads its own copy
    if sft.eval_episodes > 0:
        summary["eval_after"] = evaluate_model_folder(config, checkpoint, sft.eval_episodes)
        note(f"after: held-out success {summary['eval_after']['success_rate']:.1%} "
             f"on {summary['eval_after']['episodes']} {config.env.eval_split} episodes")
    (run_dir / "sft_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
