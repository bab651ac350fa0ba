"""The offline DPO run (`longhorizon dpo CONFIG`): check everything, compute the reference, train,
checkpoint, evaluate. The loss and the data are learner/dpo.py."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from longhorizon.actor.evaluate import evaluate_model_folder
from longhorizon.common.config import Config, dump_toml
from longhorizon.launch.launchers.supervise import fresh_run_dir
from longhorizon.learner.dpo import (
    check_dpo_config,
    chosen_nll,
    dpo_loss,
    last_epoch_means,
    load_dpo_data,
    plan_pair_micro_batches,
    sequence_logprobs,
)
from longhorizon.learner.sft import load_model_for_training, plan_steps, save_model_folder
from longhorizon.learner.logprobs import (
    chunked_logprobs_match, pad_examples, token_logprobs, use_gradient_checkpointing,
)
from longhorizon.learner.optimiser import OfflineSettings, run_offline_steps
from longhorizon.common.conversations import tokenizer_fingerprint
from longhorizon.common.metrics import MetricsWriter
from longhorizon.common.progress import ProgressBar
from longhorizon.learner.checkpoint import checkpoint_dir


def run_dpo(config: Config, *, note: Callable[[str], None] = print, progress_stream=None) -> dict:
    """Check everything, compute the reference, train, checkpoint, evaluate; returns the summary
    (also written to `<run dir>/dpo_summary.json`)."""
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
        summary["eval_before"] = evaluate_model_folder(config, model_folder, dpo.eval_episodes)
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
    if use_gradient_checkpointing(learner.gradient_checkpointing, model, learner.max_tokens_per_micro_batch):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    optimizer = torch.optim.AdamW(model.parameters(), lr=dpo.learning_rate, weight_decay=dpo.weight_decay)
    metrics = MetricsWriter(run_dir, config=config)
    bar = ProgressBar("dpo", len(plan), stream=progress_stream)
    started = time.perf_counter()
    checkpoint = None

    def save(step: int, epoch: int) -> Path:
        provenance = {"base_model": str(model_folder), "step": step, "epoch": epoch + 1, "data": list(dpo.data),
                      "pair_files": list(dpo.pairs), "pairs": len(pairs), "beta": dpo.beta, "nll_coef": dpo.nll_coef}
        return save_model_folder(model, model_folder, checkpoint_dir(run_dir, step), provenance=provenance,
                                 provenance_file="longhorizon_dpo.json")

    def accumulate(indices: list[int]) -> dict[str, float]:
        """One step's micro-batches forward and backward: each micro-batch's mean over its pairs,
        weighted by its share of the step's pairs, so the accumulated gradient is the step mean's."""
        step = {"dpo_loss": 0.0, "chosen_nll": 0.0, "reward_margin": 0.0, "preference_accuracy": 0.0}
        for chosen, batch in micro_batches(indices):
            sides = sequence_logprobs_of(batch)
            loss, pair_metrics = dpo_loss(
                sides[:len(chosen)], sides[len(chosen):], reference_chosen[chosen].to(device),
                reference_rejected[chosen].to(device), beta=dpo.beta)
            nll = chosen_nll(sides[:len(chosen)], chosen_tokens[chosen].to(device))
            share = len(chosen) / len(indices)
            ((loss + dpo.nll_coef * nll) * share).backward()
            step["dpo_loss"] += loss.item() * share
            step["chosen_nll"] += nll.item() * share
            for key, value in pair_metrics.items():
                step[key] += value * share
        return {**step, "train_pairs": len(indices)}

    def on_step(record: dict) -> None:
        metrics.write(record)
        bar.update(record["step"], f"| epoch {record['epoch']}/{dpo.epochs} | loss {record['dpo_loss']:.4f} | "
                                   f"accuracy {record['preference_accuracy']:.2f}")

    try:
        records = run_offline_steps(
            model, optimizer, plan, OfflineSettings(dpo.learning_rate, dpo.warmup_steps, dpo.grad_clip),
            accumulate, on_step, checkpoint_every=dpo.checkpoint_every, save=save,
        )
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
    model = optimizer = None  # freed: the evaluation engine loads its own copy
    if dpo.eval_episodes > 0:
        summary["eval_after"] = evaluate_model_folder(config, checkpoint, dpo.eval_episodes)
        note(f"after: held-out success {summary['eval_after']['success_rate']:.1%} "
             f"on {summary['eval_after']['episodes']} {config.env.eval_split} episodes")
    (run_dir / "dpo_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
