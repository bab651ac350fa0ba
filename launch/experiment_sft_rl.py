"""The SFT-then-RL experiment: does a model get better on held-out tasks, first from oracle play,
then from RL?

`longhorizon experiment sft-rl CONFIG [overrides]` runs, into the config's run directory:

1. base: model.path played greedily on env.eval_split (`sft_rl.eval_episodes` episodes, at the
   last horizon stage);
2. sft: `sft_rl.oracle_episodes` episodes of env.train_split played by the env's scripted oracle
   (`longhorizon collect`'s code) and `longhorizon sft`'s run on them ([sft] settings), the
   result evaluated the same way;
3. rl: `longhorizon train` ([run], [actor], [learner], [horizon]) from the SFT checkpoint, its
   final checkpoint evaluated the same way.

The held-out split is checked first: no task of env.eval_split may equal a task of
env.train_split, so nothing evaluated was fine-tuned or trained on. Every evaluation reports its
successes with a 95% Wilson interval, and every phase its wall time. Outputs: `summary.json`,
`held_out.png` (held-out success per phase), `oracle.jsonl`, `sft/` and `rl/` (the runs, with the
RL run's training curves). It prints a table, then one line of JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

from longhorizon.common.config import Config, ConfigError, dump_toml

PHASES = ("base", "sft", "rl")


def held_out_overlap(config: Config) -> list[str]:
    """The eval-split task ids whose task data is also a train-split task's (a leak), sorted."""
    from longhorizon.envs.base import list_tasks

    def key(task) -> str:
        return json.dumps(dict(task.data), sort_keys=True, default=str)

    options = dict(config.env.options)
    trained = {key(task) for task in list_tasks(config.env.name, config.env.train_split, **options)}
    return sorted(task.task_id for task in list_tasks(config.env.name, config.env.eval_split, **options)
                  if key(task) in trained)


def check_sft_rl_config(config: Config) -> None:
    """What cannot work, as errors naming the key and the fix, before anything runs."""
    settings = config.sft_rl
    if settings.oracle_episodes < 0 or settings.eval_episodes < 1:
        raise ConfigError("sft_rl.oracle_episodes must be >= 0 (0: no SFT) and sft_rl.eval_episodes >= 1")
    if not settings.oracle_episodes and not settings.rl:
        raise ConfigError("sft_rl.oracle_episodes = 0 and sft_rl.rl = false leave nothing to train")
    if config.env.train_split == config.env.eval_split:
        raise ConfigError(f"env.eval_split and env.train_split are both {config.env.eval_split!r}: the "
                          f"evaluation must be on tasks nothing trained on")
    leaked = held_out_overlap(config)
    if leaked:
        raise ConfigError(f"{len(leaked)} task(s) of env.eval_split {config.env.eval_split!r} are also in "
                          f"env.train_split {config.env.train_split!r} (first: {leaked[0]}): choose disjoint splits")
    if settings.rl:
        from longhorizon.actor.engines.base import EngineError, engine_class
        from longhorizon.actor.engines.factory import plays_local_weights

        try:
            trains_a_model = plays_local_weights(engine_class(config.actor.engine))
        except EngineError as error:
            raise ConfigError(f"actor.engine: {error}") from None
        if not trains_a_model:
            raise ConfigError(f"the RL phase trains a model: set actor.engine to an engine that samples from a "
                              f"local model and takes its weight updates (got {config.actor.engine!r})")
    if settings.oracle_episodes:
        from longhorizon.envs.base import get_env_spec

        policies = get_env_spec(config.env.name).policies
        if settings.oracle_policy not in policies:
            raise ConfigError(f"env {config.env.name!r} has no scripted policy {settings.oracle_policy!r} for "
                              f"sft_rl.oracle_policy; available: {', '.join(sorted(policies))}")


def wilson_entry(evaluation: dict) -> dict:
    """An evaluation (evaluate_model's dict) with its successes and 95% Wilson interval added."""
    from longhorizon.actor.metrics import wilson_interval

    played = evaluation["episodes"] - evaluation["failed_episodes"]
    successes = round(evaluation["success_rate"] * played)
    low, high = wilson_interval(successes, played)
    return {**evaluation, "played": played, "successes": successes, "wilson_low": low, "wilson_high": high}


def _phase_config(config: Config, run_dir: Path, name: str, **sections) -> Config:
    run = dataclasses.replace(config.run, output_dir=str(run_dir), name=name)
    return dataclasses.replace(config, run=run, **sections)


def run_sft_rl(config: Config, *, note: Callable[[str], None] = print, progress_stream=None) -> dict:
    """Every phase; returns the summary (also written to `<run dir>/summary.json`)."""
    from longhorizon.actor.collect import run_collect
    from longhorizon.common.models import resolve_model_path
    from longhorizon.learner.checkpoint import latest_checkpoint
    from longhorizon.launch.launcher import fresh_run_dir
    from longhorizon.launch.sft import evaluate_model, run_sft
    from longhorizon.learner.sft import check_sft_config

    check_sft_rl_config(config)
    settings = config.sft_rl
    if settings.oracle_episodes:
        check_sft_config(dataclasses.replace(config, sft=dataclasses.replace(config.sft, data=["oracle.jsonl"])))
    base_model = str(resolve_model_path(config.model.path, config.model.cache_dir))
    run_dir = fresh_run_dir(config.run_dir, note, markers=("config.toml", "summary.json"))
    (run_dir / "config.toml").write_text(dump_toml(config))
    summary: dict = {"run_dir": str(run_dir), "env": config.env.name, "env_options": dict(config.env.options), "model": base_model,
                     "eval_split": config.env.eval_split, "eval_episodes": settings.eval_episodes,
                     "eval_horizon": max(config.horizon.stages), "phases": {}}
    started = time.perf_counter()

    def save() -> None:
        summary["seconds"] = time.perf_counter() - started
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")

    # Evaluations and SFT run alone on the machine: they take every core unless told otherwise.
    threads = settings.torch_threads or os.cpu_count() or 1
    eval_config = dataclasses.replace(config, actor=dataclasses.replace(config.actor, torch_threads=threads))

    def evaluate(phase: str, model: str, extra: dict) -> None:
        began = time.perf_counter()
        note(f"{phase}: evaluating {model} on {settings.eval_episodes} {config.env.eval_split} episodes")
        entry = wilson_entry(evaluate_model(eval_config, model, settings.eval_episodes))
        entry.update({"eval_seconds": time.perf_counter() - began, **extra, "model": model})
        summary["phases"][phase] = entry
        note(f"{phase}: held-out success {entry['success_rate']:.1%} "
             f"[{entry['wilson_low']:.1%}, {entry['wilson_high']:.1%}] ({entry['successes']}/{entry['played']})")
        save()

    evaluate("base", base_model, {"train_seconds": 0.0})
    policy = base_model
    if settings.oracle_episodes:
        began = time.perf_counter()
        oracle_file = run_dir / "oracle.jsonl"
        collect_config = dataclasses.replace(config, actor=dataclasses.replace(
            config.actor, engine="scripted", scripted_policy=settings.oracle_policy, engine_options={}))
        collected = run_collect(collect_config, output=oracle_file, episodes=settings.oracle_episodes,
                                model=base_model, overwrite=True, on_note=note)
        note(f"sft: {collected.written} oracle conversations of {config.env.train_split} "
             f"({collected.successful} successful) in {oracle_file}")
        sft_config = _phase_config(
            config, run_dir, "sft", learner=dataclasses.replace(config.learner, torch_threads=threads),
            sft=dataclasses.replace(config.sft, data=[str(oracle_file)], eval_episodes=0, eval_before=False))
        sft_summary = run_sft(sft_config, note=note, progress_stream=progress_stream)
        policy = sft_summary["checkpoint"]
        sft_entry = {"model": policy, "train_seconds": time.perf_counter() - began,
                     "oracle_conversations": collected.written, "sft_steps": sft_summary["steps"]}
        if settings.eval_sft or not settings.rl:
            evaluate("sft", policy, sft_entry)
        else:
            summary["sft"] = sft_entry  # trained, not evaluated: the RL phase starts from it
    if settings.rl:
        from longhorizon.launch.launcher import launch
        from longhorizon.launch.plot import plot_run
        from longhorizon.launch.report import format_report, load_summary

        began = time.perf_counter()
        rl_config = _phase_config(config, run_dir, "rl", model=dataclasses.replace(config.model, path=policy))
        code = launch(rl_config, progress=note)
        if code != 0:
            save()
            raise RuntimeError(f"the RL run ended with exit code {code}; see {rl_config.run_dir / 'logs'}")
        train_seconds = time.perf_counter() - began
        plot_run(rl_config.run_dir)
        note(format_report(load_summary(rl_config.run_dir)))
        checkpoint = latest_checkpoint(rl_config.run_dir)
        evaluate("rl", str(checkpoint), {"train_seconds": train_seconds, "rl_steps": config.run.total_steps})
    save()
    plot_held_out(summary, run_dir / "held_out.png")
    return summary


def format_table(summary: dict) -> str:
    rows = ["| phase | held-out success | 95% Wilson | successes | train wall time | eval wall time |",
            "|---|---|---|---|---|---|"]
    for phase in PHASES:
        entry = summary["phases"].get(phase)
        if entry is None:
            if phase == "sft" and "sft" in summary:  # trained, not evaluated (sft_rl.eval_sft = false)
                rows.append(f"| sft | not evaluated | | | {summary['sft']['train_seconds'] / 60:.1f} min | - |")
            continue
        trained = f"{entry['train_seconds'] / 60:.1f} min" if phase != "base" else "-"
        rows.append(f"| {phase} | {entry['success_rate']:.1%} | [{entry['wilson_low']:.1%}, {entry['wilson_high']:.1%}] "
                    f"| {entry['successes']}/{entry['played']} | {trained} | {entry['eval_seconds'] / 60:.1f} min |")
    return "\n".join(rows)


def plot_held_out(summary: dict, path: Path) -> Path:
    """Held-out success of each phase with its Wilson interval, as bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases = [phase for phase in PHASES if phase in summary["phases"]]
    entries = [summary["phases"][phase] for phase in phases]
    rates = [100 * entry["success_rate"] for entry in entries]
    # Clamped at 0: at 0% or 100% the bound equals the rate up to rounding.
    errors = [[max(0.0, rate - 100 * entry["wilson_low"]) for rate, entry in zip(rates, entries)],
              [max(0.0, 100 * entry["wilson_high"] - rate) for rate, entry in zip(rates, entries)]]
    trained_first = "sft" in summary["phases"] or "sft" in summary
    labels = {"base": "base", "sft": "after SFT", "rl": "after SFT + RL" if trained_first else "after RL"}
    colours = {"base": "tab:gray", "sft": "tab:blue", "rl": "tab:green"}
    figure, axes = plt.subplots(figsize=(5, 3.5))
    axes.bar([labels[phase] for phase in phases], rates, yerr=errors, capsize=6,
             color=[colours[phase] for phase in phases])
    for index, (rate, entry) in enumerate(zip(rates, entries)):
        axes.text(index, rate + 1, f"{rate:.0f}%\n{entry['successes']}/{entry['played']}", ha="center", va="bottom",
                  fontsize=8)
    axes.set_ylim(0, 100)
    axes.set_ylabel(f"held-out success (%), {summary['eval_episodes']} episodes")
    axes.set_title(f"{summary['env']} {summary['env_options']}", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    from longhorizon.common.config import load_config

    parser = argparse.ArgumentParser(
        prog="longhorizon experiment sft-rl",
        description="The base model, after SFT on oracle play, after RL from there: held-out success of each "
                    "([sft_rl] in the config; docs/results.md).",
    )
    parser.add_argument("config", help="TOML config file (e.g. configs/textcraft-sft-rl.toml)")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. run.total_steps=20")
    args = parser.parse_args(argv)
    summary = run_sft_rl(load_config(args.config, args.overrides), note=lambda line: print(line, flush=True),
                         progress_stream=sys.stderr)
    print(format_table(summary))
    print(f"summary: {Path(summary['run_dir']) / 'summary.json'}  plot: {Path(summary['run_dir']) / 'held_out.png'}")
    compact = {phase: {key: entry[key] for key in ("success_rate", "successes", "played", "wilson_low", "wilson_high")}
               for phase, entry in summary["phases"].items()}
    print(json.dumps({"experiment": "sft-rl", "seconds": round(summary["seconds"], 1), "phases": compact}))
    return 0
