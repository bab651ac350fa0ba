"""Rejection-sampling fine-tuning (`longhorizon rft CONFIG`): rounds of sampling with the current
policy, keeping the episodes that succeeded, and supervised fine-tuning on them.

Each round r (of `rft.rounds`):

1. collect: `rft.episodes_per_round` episodes of env.train_split played by the current policy with
   actor.sampling (the hf or vllm engine), by `longhorizon collect`'s code (actor/collect.py). Rounds
   take consecutive tasks of the split and new reset seeds, so no round replays another's episodes.
2. keep: the episodes that succeeded (or, with `rft.min_reward`, those whose reward reaches the
   round's threshold), one copy of each conversation when `rft.deduplicate`.
3. fine-tune: `longhorizon sft`'s run (launch/recipes/sft.py) with the settings of [sft], from the current
   policy, on the episodes kept in this round and every earlier one (`rft.accumulate`) plus
   sft.data when given (an expert set, as in AgentEvol). Each round starts a fresh optimiser: its
   data is a new, larger set drawn from a new policy, and the SFT run stays the one `sft` runs.
   The round's checkpoint is the next round's policy, and it is evaluated greedily on
   env.eval_split (sft.eval_episodes).

Everything lands in `<run dir>/round_NN/`: `samples.jsonl` (every episode played), `kept.jsonl`
and the SFT run (metrics, summary, `checkpoints/step_N/`); `rft_summary.json` holds the rounds.
"""

from __future__ import annotations
import json
import time
from pathlib import Path
from typing import Callable, Sequence

from longhorizon.common.config import Config, ConfigError, RFTConfig, dump_toml
from longhorizon.actor.engines.base import EngineError, engine_class
from longhorizon.actor.engines.factory import plays_local_weights
from longhorizon.actor.collect import run_collect
from longhorizon.common.conversations import record_line
from longhorizon.common.models import resolve_model_path
from longhorizon.common.progress import ProgressBar
from longhorizon.launch.launchers.supervise import fresh_run_dir

def keep_episodes(records: Sequence[dict], *, min_reward: float | None, deduplicate: bool) -> list[dict]:
    """The records (conversation-file lines) to fine-tune on: those whose `success` is true, or
    with `min_reward` set those whose `reward` is at least it; with `deduplicate`, only the first
    of records whose messages are the same."""
    kept, seen = [], set()
    for record in records:
        if min_reward is None:
            good = bool(record.get("success"))
        else:
            good = record.get("reward") is not None and record["reward"] >= min_reward
        if not good:
            continue
        if deduplicate:
            key = json.dumps(record["messages"], sort_keys=True)
            if key in seen:
                continue
            seen.add(key)
        kept.append(record)
    return kept


def round_min_reward(min_reward: float | list | None, round_index: int) -> float | None:
    """The reward threshold of round `round_index` (1-based): `min_reward` itself, or its entry
    for the round when it is a list (the last entry for every later round)."""
    if isinstance(min_reward, list):
        return float(min_reward[min(round_index, len(min_reward)) - 1])
    return min_reward


def check_rft_config(config: Config) -> None:
    """Values of [rft] that cannot work, as errors naming the key and the fix."""
    rft: RFTConfig = config.rft

    try:
        engine_cls = engine_class(config.actor.engine)
    except EngineError as error:
        raise ConfigError(f"actor.engine: {error}") from None
    if not plays_local_weights(engine_cls):
        raise ConfigError(f"rft samples with the model it trains: set actor.engine to an engine that samples "
                          f"from a local model and loads its checkpoints (got {config.actor.engine!r})")
    if config.actor.sampling.temperature <= 0:
        raise ConfigError("rft needs varied episodes to select from: set actor.sampling.temperature above 0 "
                          "(e.g. 1.0)")
    if isinstance(rft.min_reward, list) and (not rft.min_reward or not all(
            isinstance(value, (int, float)) and not isinstance(value, bool) for value in rft.min_reward)):
        raise ConfigError(f"rft.min_reward must be a number or a list of numbers (one per round), got "
                          f"{rft.min_reward!r}")
    if rft.min_reward is not None and config.sft.only_successful:
        raise ConfigError("rft.min_reward keeps episodes that did not succeed, which sft.only_successful=true "
                          "would drop again: unset one of them")
    if config.sft.data and not all(isinstance(path, str) and path for path in config.sft.data):
        raise ConfigError(f"sft.data must be a list of file paths, got {config.sft.data!r}")


def _round_config(config: Config, *, policy: str, run_dir: Path, round_index: int, data: list[str],
                  eval_before: bool) -> Config:
    """The config of one round: its own folder, policy, seeds and training data."""
    offset = (round_index - 1) * config.rft.episodes_per_round
    return config.replace(
        run=config.run.replace(output_dir=str(run_dir), name=f"round_{round_index:02d}", seed=config.run.seed + offset),
        model=config.model.replace(path=policy),
        sft=config.sft.replace(data=data, eval_before=eval_before),
    )


def run_rft(config: Config, *, note: Callable[[str], None] = print, progress_stream=None) -> dict:
    """All rounds; returns the summary (also written to `<run dir>/rft_summary.json`)."""
    from longhorizon.launch.recipes.sft import run_sft
    from longhorizon.learner.sft import check_sft_config

    check_rft_config(config)
    rft = config.rft
    # sft.data may be empty here (the rounds fill it): check the rest of [sft] with a placeholder.
    check_sft_config(config.replace(sft=config.sft.replace(data=["kept.jsonl"])))
    policy = str(resolve_model_path(config.model.path, config.model.cache_dir))
    run_dir = fresh_run_dir(config.run_dir, note, markers=("config.toml", "round_01"))
    (run_dir / "config.toml").write_text(dump_toml(config))
    summary: dict = {"model": policy, "rounds": []}
    kept_files: list[str] = []
    started = time.perf_counter()

    for round_index in range(1, rft.rounds + 1):
        round_started = time.perf_counter()
        round_config = _round_config(config, policy=policy, run_dir=run_dir, round_index=round_index, data=[],
                                     eval_before=config.sft.eval_before and round_index == 1)
        round_dir = round_config.run_dir
        round_dir.mkdir(parents=True)
        samples = round_dir / "samples.jsonl"
        bar = ProgressBar(f"round {round_index}/{rft.rounds}: sample", rft.episodes_per_round, stream=progress_stream)
        try:
            collected = run_collect(
                round_config, output=samples, episodes=rft.episodes_per_round, max_tasks=rft.episodes_per_round,
                first_task=(round_index - 1) * rft.episodes_per_round,
                concurrency=max(1, config.actor.max_batch_size), on_note=note,
                on_progress=lambda done, total, detail: bar.update(done, detail),
            )
        finally:
            bar.close()
        records = [json.loads(line) for line in samples.read_text(encoding="utf-8").splitlines() if line.strip()]
        min_reward = round_min_reward(rft.min_reward, round_index)
        kept = keep_episodes(records, min_reward=min_reward, deduplicate=rft.deduplicate)
        if kept:
            kept_path = round_dir / "kept.jsonl"
            kept_path.write_text("".join(record_line(episode) for episode in kept), encoding="utf-8")
            kept_files = [*kept_files, str(kept_path)] if rft.accumulate else [str(kept_path)]
        elif not rft.accumulate:
            kept_files = []
        rewards = [line["reward"] for line in records]
        record = {"round": round_index, "policy": policy, "sampled": collected.episodes, "failed": collected.failed,
                  "successful": collected.successful, "sample_success_rate": collected.successful / collected.episodes,
                  "sample_mean_reward": sum(rewards) / max(len(rewards), 1), "min_reward": min_reward,
                  "kept": len(kept)}
        what = "succeeded" if min_reward is None else f"reached reward {min_reward}"
        note(f"round {round_index}: {len(kept)} of {collected.episodes} sampled episodes {what} and are kept "
             f"({collected.successful} successful)")
        data = kept_files + list(config.sft.data)
        if not data:
            raise ValueError(
                f"round {round_index}: none of the {collected.episodes} sampled episodes {what}, so there is nothing "
                f"to fine-tune on (mean reward {record['sample_mean_reward']:.3f}). Set rft.min_reward to keep "
                f"partial successes, raise rft.episodes_per_round, start from a stronger model.path, or add "
                f"expert conversations in sft.data")
        sft_summary = run_sft(round_config.replace(sft=round_config.sft.replace(data=data)),
                              note=note, progress_stream=progress_stream)
        policy = sft_summary["checkpoint"]
        record.update({"trained_conversations": sft_summary["conversations"], "steps": sft_summary["steps"],
                       "checkpoint": policy, "seconds": time.perf_counter() - round_started})
        if "eval_before" in sft_summary:  # the starting model, evaluated by the first round
            summary["eval_before"] = sft_summary["eval_before"]
        if "eval_after" in sft_summary:
            record["eval_after"] = sft_summary["eval_after"]
        summary["rounds"].append(record)
        (run_dir / "rft_summary.json").write_text(json.dumps(summary, indent=2) + "\n")

    summary.update({"checkpoint": policy, "seconds": time.perf_counter() - started})
    if "eval_after" in summary["rounds"][-1]:
        summary["eval_after"] = summary["rounds"][-1]["eval_after"]
    note(f"checkpoint: {policy} (model.path of an RL run, or eval --checkpoint)")
    (run_dir / "rft_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
