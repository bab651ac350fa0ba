"""The SFT-then-RL experiment: does a model get better on held-out tasks, first from oracle play,
then from RL?

`longhorizon experiment sft-rl CONFIG [overrides]` runs, into the config's run directory:

1. base: model.path played on env.eval_split (`sft_rl.eval_episodes` tasks, `sft_rl.eval_samples`
   episodes each, greedy or at `sft_rl.eval_temperature`, at the last horizon stage);
2. sft: `sft_rl.oracle_episodes` episodes of env.train_split played by the env's scripted oracle
   (`longhorizon collect`'s code), the successful ones kept, and `longhorizon sft`'s run on them
   ([sft] settings), the result evaluated the same way; or `sft_rl.sft_checkpoint`, made before, evaluated;
3. rl: `longhorizon train` ([run], [actor], [learner], [horizon]) from the SFT checkpoint, once
   per seed of `sft_rl.rl_seeds`, each final checkpoint evaluated the same way (and at each of
   `sft_rl.rl_temperatures`, as SFT's at `sft_rl.sft_temperatures`); with several seeds their
   held-out episodes are also pooled.

The same command with run.resume=true continues an experiment that stopped (a killed process, a
machine that went away): the phases summary.json records are kept, the SFT checkpoint is reused,
an RL run that went to its end is not trained again and one cut short resumes from its latest
checkpoint. The config must be the one the experiment began with, but for its torch thread counts.

The held-out split is checked first: no task of env.eval_split may equal a task of
env.train_split, so nothing evaluated was fine-tuned or trained on. Every evaluation reports its
successes with a 95% Wilson interval, every phase its wall time, and each RL result a pooled
two-proportion test against the SFT checkpoint's. Outputs: `summary.json`, `held_out.png`
(held-out success per phase), `oracle.jsonl`, `sft/` and `rl/` (or `rl-seed<N>/`: the runs, with
their training curves). It prints a table, then one line of JSON.

SFT and every evaluation run in a process of their own (launch/recipes/child.py), so this one holds no
model while the RL phase's learner and actors run beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

from longhorizon.common.config import Config, ConfigError, dump_toml, load_config
from longhorizon.common.metrics import read_metrics
from longhorizon.envs.base import list_tasks, get_env_spec
from longhorizon.common.models import ModelError, require_model_folder, resolve_model_path
from longhorizon.actor.engines.base import EngineError, engine_class
from longhorizon.actor.engines.factory import plays_local_weights
from longhorizon.actor.metrics import wilson_interval, two_proportion_test
from longhorizon.actor.collect import run_collect
from longhorizon.launch.recipes.child import run_in_child
from longhorizon.launch.launchers.supervise import fresh_run_dir, launch
from longhorizon.actor.evaluate import evaluate_model_folder
from longhorizon.launch.plot import plot_run
from longhorizon.launch.report import format_report, load_summary

def held_out_overlap(config: Config) -> list[str]:
    """The eval-split task ids whose task data is also a train-split task's (a leak), sorted."""
    def key(task) -> str:
        return json.dumps(dict(task.data), sort_keys=True, default=str)

    options = dict(config.env.options)
    trained = {key(task) for task in list_tasks(config.env.name, config.env.train_split, **options)}
    return sorted(task.task_id for task in list_tasks(config.env.name, config.env.eval_split, **options)
                  if key(task) in trained)


def _check_temperatures(key: str, temperatures: list, eval_temperature: float) -> None:
    if any(isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t < float("inf") for t in temperatures):
        raise ConfigError(f"sft_rl.{key} must be numbers >= 0 (0: greedy), got {temperatures!r}")
    if len(set(map(float, temperatures))) != len(temperatures) or eval_temperature in map(float, temperatures):
        raise ConfigError(f"sft_rl.{key} {temperatures!r} repeats a temperature (sft_rl.eval_temperature "
                          f"{eval_temperature:g} is evaluated anyway)")


def check_sft_rl_config(config: Config) -> None:
    """What cannot work, as errors naming the key and the fix, before anything runs."""
    settings = config.sft_rl
    if not settings.oracle_episodes and not settings.sft_checkpoint and not settings.rl:
        raise ConfigError("sft_rl.oracle_episodes = 0 and sft_rl.rl = false leave nothing to train")
    if settings.eval_samples > 1 and settings.eval_temperature == 0:
        raise ConfigError(f"sft_rl.eval_samples = {settings.eval_samples} plays each task alike when greedy: set "
                          f"sft_rl.eval_temperature > 0 (e.g. actor.sampling.temperature) or eval_samples = 1")
    for key in ("sft_temperatures", "rl_temperatures"):
        _check_temperatures(key, getattr(settings, key), settings.eval_temperature)
    seeds = settings.rl_seeds
    if any(not isinstance(seed, int) or isinstance(seed, bool) for seed in seeds) or len(set(seeds)) != len(seeds):
        raise ConfigError(f"sft_rl.rl_seeds must be distinct integers, got {seeds!r}")
    if settings.sft_checkpoint:
        try:
            require_model_folder(settings.sft_checkpoint)
        except ModelError as error:
            raise ConfigError(f"sft_rl.sft_checkpoint: {error}") from None
    if config.env.train_split == config.env.eval_split:
        raise ConfigError(f"env.eval_split and env.train_split are both {config.env.eval_split!r}: the "
                          f"evaluation must be on tasks nothing trained on")
    leaked = held_out_overlap(config)
    if leaked:
        raise ConfigError(f"{len(leaked)} task(s) of env.eval_split {config.env.eval_split!r} are also in "
                          f"env.train_split {config.env.train_split!r} (first: {leaked[0]}): choose disjoint splits")
    if settings.rl:
        try:
            trains_a_model = plays_local_weights(engine_class(config.actor.engine))
        except EngineError as error:
            raise ConfigError(f"actor.engine: {error}") from None
        if not trains_a_model:
            raise ConfigError(f"the RL phase trains a model: set actor.engine to an engine that samples from a "
                              f"local model and takes its weight updates (got {config.actor.engine!r})")
    if settings.oracle_episodes and not settings.sft_checkpoint:
        policies = get_env_spec(config.env.name).policies
        if settings.oracle_policy not in policies:
            raise ConfigError(f"env {config.env.name!r} has no scripted policy {settings.oracle_policy!r} for "
                              f"sft_rl.oracle_policy; available: {', '.join(sorted(policies))}")


def wilson_entry(evaluation: dict) -> dict:
    """An evaluation (evaluate_model_folder's dict) with its successes and 95% Wilson interval added."""
    played = evaluation["episodes"] - evaluation["failed_episodes"]
    successes = round(evaluation["success_rate"] * played)
    low, high = wilson_interval(successes, played)
    return {**evaluation, "played": played, "successes": successes, "wilson_low": low, "wilson_high": high}


def pooled_entry(entries: list[dict]) -> dict:
    """Several runs' evaluations of the same tasks as one: episodes, successes and times summed,
    the Wilson interval of the pooled rate."""
    played = sum(entry["played"] for entry in entries)
    successes = sum(entry["successes"] for entry in entries)
    low, high = wilson_interval(successes, played)
    by_task: dict[str, list[int]] = {}
    for entry in entries:
        for task_id, (wins, tries) in entry.get("by_task", {}).items():
            counts = by_task.setdefault(task_id, [0, 0])
            counts[0] += wins
            counts[1] += tries
    return {"runs": len(entries), "episodes": sum(entry["episodes"] for entry in entries), "played": played,
            "failed_episodes": sum(entry["failed_episodes"] for entry in entries), "successes": successes,
            "success_rate": successes / played, "wilson_low": low, "wilson_high": high,
            "train_seconds": sum(entry.get("train_seconds", 0.0) for entry in entries),
            "eval_seconds": sum(entry.get("eval_seconds", 0.0) for entry in entries),
            "by_task": dict(sorted(by_task.items()))}


def decoding_phase_name(phase: str, temperature: float) -> str:
    """A phase's checkpoint evaluated at another temperature: `sft-t0.7`, `rl-seed1-t0`."""
    return f"{phase}-t{float(temperature):g}"


def best_sft(summary: dict) -> str | None:
    """The SFT evaluation with the highest held-out success (`sft` or an `sft-t<T>`; the first of
    equals), None without one."""
    phases = [phase for phase in summary["phases"] if phase == "sft" or phase.startswith("sft-t")]
    return max(phases, key=lambda phase: summary["phases"][phase]["success_rate"], default=None)


def against_sft(summary: dict) -> dict:
    """Each RL result (every run, and the pooled one) against the SFT checkpoint at its best
    decoding (`best_sft`): the pooled two-proportion test (`two_proportion_test`) and the SFT phase
    it was tested against, keyed by phase."""
    baseline = best_sft(summary)
    if baseline is None:
        return {}
    sft = summary["phases"][baseline]
    return {phase: {**two_proportion_test(sft["successes"], sft["played"], entry["successes"], entry["played"]),
                    "sft_phase": baseline}
            for phase, entry in summary["phases"].items() if phase.startswith("rl")}


def _without_resume(config: Config) -> Config:
    return config.replace(run=config.run.replace(resume=False))


def _results_config(config: Config) -> str:
    """The config as far as results depend on it: without run.resume and the torch thread counts,
    which a resumed experiment may change (a machine with more cores)."""
    return dump_toml(_without_resume(config).replace(
        actor=config.actor.replace(torch_threads=1), learner=config.learner.replace(torch_threads=1),
        sft_rl=config.sft_rl.replace(torch_threads=0)))


def resumed_summary(config: Config) -> dict | None:
    """With run.resume = true and an earlier experiment in the run directory, its summary (the
    phases it recorded); None for a fresh experiment. An earlier experiment of another config
    (but for thread counts) is refused: its phases would not be this one's."""
    summary_file = config.run_dir / "summary.json"
    if not config.run.resume or not summary_file.is_file():
        return None
    saved_file = config.run_dir / "config.toml"
    saved = _results_config(load_config(saved_file)) if saved_file.is_file() else ""
    wanted = _results_config(config)
    if saved != wanted:
        differs = next((f"{line!r} (now {other!r})" for line, other in zip(saved.splitlines(), wanted.splitlines())
                        if line != other), "its length")
        raise ConfigError(f"run.resume=true: the experiment in {config.run_dir} ran with another config "
                          f"(first difference: {differs}); resume it with the same config, or drop run.resume")
    return json.loads(summary_file.read_text())


def _sft_model_of(summary: dict) -> str:
    """The SFT checkpoint an earlier part of a resumed experiment made, if it is still there."""
    entry = summary["phases"].get("sft") or summary.get("sft") or {}
    model = entry.get("model", "")
    return model if model and Path(model).is_dir() else ""


def _finished_run(config: Config) -> Path | None:
    """The final checkpoint of an RL run that went to the end, else None."""
    from longhorizon.learner.checkpoint import latest_checkpoint

    checkpoint = latest_checkpoint(config.run_dir)
    if checkpoint is None or not (config.run_dir / "metrics.jsonl").is_file():
        return None
    records = read_metrics(config.run_dir)
    last = records[-1] if records else {}
    ended = last.get("step") == config.run.total_steps or bool(last.get("target_reached"))
    return checkpoint if ended and checkpoint.name == f"step_{last['step']:06d}" else None


def _run_seconds(run_dir: Path) -> float:
    records = read_metrics(run_dir) if (run_dir / "metrics.jsonl").is_file() else []
    return float(records[-1].get("time", 0.0)) if records else 0.0


def _phase_config(config: Config, run_dir: Path, name: str, **sections) -> Config:
    run = config.run.replace(output_dir=str(run_dir), name=name)
    return config.replace(run=run, **sections)


def run_sft_rl(config: Config, *, note: Callable[[str], None] = print, progress_stream=None) -> dict:
    """Every phase; returns the summary (also written to `<run dir>/summary.json`)."""
    from longhorizon.learner.checkpoint import latest_checkpoint
    from longhorizon.launch.recipes.sft import run_sft
    from longhorizon.learner.sft import check_sft_config

    check_sft_rl_config(config)
    settings = config.sft_rl
    if settings.oracle_episodes:
        check_sft_config(config.replace(sft=config.sft.replace(data=["oracle.jsonl"])))
    base_model = str(resolve_model_path(config.model.path, config.model.cache_dir))
    earlier = resumed_summary(config)
    if earlier is not None:
        run_dir = config.run_dir
        note(f"resuming the experiment in {run_dir}: {', '.join(earlier['phases']) or 'no phase'} recorded before")
    else:
        run_dir = fresh_run_dir(config.run_dir, note, markers=("config.toml", "summary.json"))
        (run_dir / "config.toml").write_text(dump_toml(_without_resume(config)))
    summary: dict = {"run_dir": str(run_dir), "env": config.env.name, "env_options": dict(config.env.options), "model": base_model,
                     "eval_split": config.env.eval_split, "eval_episodes": settings.eval_episodes,
                     "eval_samples": settings.eval_samples, "eval_temperature": settings.eval_temperature,
                     "eval_horizon": max(config.horizon.stages), "phases": {}}
    if earlier is not None:
        summary["phases"] = earlier["phases"]
        if "sft" in earlier:
            summary["sft"] = earlier["sft"]
    started = time.perf_counter() - (earlier or {}).get("seconds", 0.0)

    def save() -> None:
        summary["seconds"] = time.perf_counter() - started
        summary["against_sft"] = against_sft(summary)
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")

    # Evaluations and SFT run alone on the machine: they take every core unless told otherwise.
    threads = settings.torch_threads or os.cpu_count() or 1
    eval_config = config.replace(actor=config.actor.replace(torch_threads=threads))

    def evaluate(phase: str, model: str, extra: dict, temperature: float | None = None) -> None:
        if phase in summary["phases"]:  # resumed: evaluated before
            note(f"{phase}: held-out success {summary['phases'][phase]['success_rate']:.1%}, evaluated before")
            return
        temperature = settings.eval_temperature if temperature is None else float(temperature)
        samples = settings.eval_samples if temperature > 0 else 1
        began = time.perf_counter()
        decoding = "greedy" if temperature == 0 else f"{samples} sampled at temperature {temperature:g} per task"
        note(f"{phase}: evaluating {model} on {settings.eval_episodes} {config.env.eval_split} tasks ({decoding})")
        entry = wilson_entry(run_in_child(evaluate_model_folder, eval_config, model, settings.eval_episodes,
                                          samples_per_task=samples, temperature=temperature))
        entry.update({"eval_seconds": time.perf_counter() - began, **extra, "model": model})
        summary["phases"][phase] = entry
        note(f"{phase}: held-out success {entry['success_rate']:.1%} "
             f"[{entry['wilson_low']:.1%}, {entry['wilson_high']:.1%}] ({entry['successes']}/{entry['played']})")
        save()

    if settings.eval_base:
        evaluate("base", base_model, {"train_seconds": 0.0})
    policy = base_model
    if settings.sft_checkpoint:
        policy = str(Path(settings.sft_checkpoint).resolve())
        summary["sft"] = {"model": policy, "train_seconds": 0.0, "made_before": True}
    elif settings.oracle_episodes and _sft_model_of(summary):
        # Resumed after SFT: its checkpoint is where RL starts.
        policy = _sft_model_of(summary)
        summary.setdefault("sft", summary["phases"].get("sft"))
        note(f"sft: {policy}, trained before")
    elif settings.oracle_episodes:
        began = time.perf_counter()
        oracle_file = run_dir / "oracle.jsonl"
        collect_config = config.replace(actor=config.actor.replace(
            engine="scripted", scripted_policy=settings.oracle_policy, engine_options={}))
        # Only the episodes the oracle won are imitated: a browser oracle whose click timed out on a
        # loaded machine gives up with stop(), and fine-tuning on that teaches giving up.
        collected = run_collect(collect_config, output=oracle_file, episodes=settings.oracle_episodes,
                                model=base_model, overwrite=True, only_successful=True, on_note=note)
        if not collected.written:
            raise ConfigError(f"sft_rl.oracle_policy {settings.oracle_policy!r} won none of its "
                              f"{settings.oracle_episodes} episodes of {config.env.train_split}: nothing to fine-tune on")
        note(f"sft: {collected.written} successful oracle conversations of {config.env.train_split} "
             f"(of {settings.oracle_episodes} played) in {oracle_file}")
        sft_config = _phase_config(
            config, run_dir, "sft", learner=config.learner.replace(torch_threads=threads),
            sft=config.sft.replace(data=[str(oracle_file)], eval_episodes=0, eval_before=False))
        sft_summary = run_in_child(run_sft, sft_config, note=note, progress_stream=progress_stream)
        policy = sft_summary["checkpoint"]
        sft_entry = {"model": policy, "train_seconds": time.perf_counter() - began,
                     "oracle_conversations": collected.written, "sft_steps": sft_summary["steps"]}
        summary["sft"] = sft_entry
        save()
    if "sft" in summary and (settings.eval_sft or not settings.rl):
        evaluate("sft", policy, summary["sft"])
        for temperature in settings.sft_temperatures:
            evaluate(decoding_phase_name("sft", temperature), policy, summary["sft"], temperature)
    if settings.rl:
        seeds = settings.rl_seeds or [config.run.seed]
        names = [f"rl-seed{seed}" for seed in seeds] if settings.rl_seeds else ["rl"]
        for seed, name in zip(seeds, names):
            began = time.perf_counter()
            rl_config = _phase_config(config, run_dir, name, model=config.model.replace(path=policy))
            rl_config = rl_config.replace(run=rl_config.run.replace(seed=seed))
            finished = earlier is not None and _finished_run(rl_config)
            if finished:
                note(f"{name}: trained before, to {finished}")
            else:
                latest = latest_checkpoint(rl_config.run_dir) if earlier is not None else None
                note(f"{name}: {'resuming' if latest else 'training'} from {latest or policy} (run.seed = {seed})")
                code = launch(rl_config, progress=note)
                if code != 0:
                    save()
                    raise RuntimeError(f"the RL run {name} ended with exit code {code}; see {rl_config.run_dir / 'logs'}; "
                                       f"the same command with run.resume=true continues the experiment")
                plot_run(rl_config.run_dir)
                note(format_report(load_summary(rl_config.run_dir)))
            # A resumed run's wall time is its learner's, which its record carries over the parts.
            train_seconds = time.perf_counter() - began if earlier is None else _run_seconds(rl_config.run_dir)
            checkpoint = latest_checkpoint(rl_config.run_dir)
            run_entry = {"train_seconds": train_seconds, "rl_steps": config.run.total_steps, "seed": seed}
            evaluate(name, str(checkpoint), run_entry)
            for temperature in settings.rl_temperatures:
                evaluate(decoding_phase_name(name, temperature), str(checkpoint), run_entry, temperature)
        if len(names) > 1:
            summary["phases"]["rl"] = pooled_entry([summary["phases"][name] for name in names])
            for temperature in settings.rl_temperatures:
                summary["phases"][decoding_phase_name("rl", temperature)] = pooled_entry(
                    [summary["phases"][decoding_phase_name(name, temperature)] for name in names])
    save()
    plot_held_out(summary, run_dir / "held_out.png")
    return summary


def _decoding(phase: str) -> str:
    """The decoding a `<phase>-t<T>` phase names (`greedy`, `temperature 0.3`); "" for another phase."""
    temperature = phase.partition("-t")[2]
    if not temperature:
        return ""
    return "greedy" if float(temperature) == 0 else f"temperature {float(temperature):g}"


def phase_label(phase: str, summary: dict) -> str:
    """A phase's name in tables and plots: `rl-seed3` reads `rl, seed 3`, `rl-seed3-t0` `rl, seed 3,
    greedy`; a pooled row names its runs."""
    base = phase.partition("-t")[0]
    parts = [base.replace("-seed", ", seed ")]
    if _decoding(phase):
        parts.append(_decoding(phase))
    runs = summary["phases"].get(phase, {}).get("runs", 1)
    if base == "rl" and runs > 1:
        parts.append(f"{runs} runs pooled")
    return ", ".join(parts)


def format_table(summary: dict) -> str:
    rows = ["| phase | held-out success | 95% Wilson | successes | train wall time | eval wall time |",
            "|---|---|---|---|---|---|"]
    if "sft" not in summary["phases"] and "sft" in summary:  # trained, not evaluated (sft_rl.eval_sft = false)
        rows.insert(2 + ("base" in summary["phases"]),
                    f"| sft | not evaluated | | | {summary['sft']['train_seconds'] / 60:.1f} min | - |")
    for phase, entry in summary["phases"].items():
        trained = f"{entry['train_seconds'] / 60:.1f} min" if phase != "base" else "-"
        rows.append(f"| {phase_label(phase, summary)} | {entry['success_rate']:.1%} | [{entry['wilson_low']:.1%}, "
                    f"{entry['wilson_high']:.1%}] | {entry['successes']}/{entry['played']} | {trained} | "
                    f"{entry['eval_seconds'] / 60:.1f} min |")
    tests = summary.get("against_sft") or {}
    for phase, test in tests.items():
        against = test.get("sft_phase", "sft")
        best = " (the best SFT decoding)" if any(p.startswith("sft-t") for p in summary["phases"]) else ""
        rows.append(f"\n{phase_label(phase, summary)} against {against}{best}: {100 * test['difference']:+.1f} points, "
                    f"z = {test['z']:.2f}, one-sided p = {test['p_one_sided']:.3g}")
    return "\n".join(rows)


def plot_held_out(summary: dict, path: Path) -> Path:
    """Held-out success of each phase with its Wilson interval, as bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases = list(summary["phases"])
    entries = [summary["phases"][phase] for phase in phases]
    rates = [100 * entry["success_rate"] for entry in entries]
    # Clamped at 0: at 0% or 100% the bound equals the rate up to rounding.
    errors = [[max(0.0, rate - 100 * entry["wilson_low"]) for rate, entry in zip(rates, entries)],
              [max(0.0, 100 * entry["wilson_high"] - rate) for rate, entry in zip(rates, entries)]]
    trained_first = "sft" in summary["phases"] or "sft" in summary
    labels = {"base": "base", "sft": "after SFT", "rl": "after SFT + RL" if trained_first else "after RL"}
    if summary["phases"].get("rl", {}).get("runs", 1) > 1:
        labels["rl"] += ", pooled"
    pooled = labels["rl"].endswith(", pooled")
    for phase in phases:
        if phase.startswith("rl-seed"):
            labels[phase] = f"RL seed {phase[len('rl-seed'):].partition('-t')[0]}" + (
                f", {_decoding(phase)}" if _decoding(phase) else "")
        elif phase.startswith("rl-t"):  # the RL checkpoint(s) at another decoding
            labels[phase] = f"{labels['rl'].removesuffix(', pooled')}, {_decoding(phase)}{', pooled' if pooled else ''}"
        elif phase.startswith("sft-t"):
            labels[phase] = f"after SFT, {_decoding(phase)}"
    colours = {"base": "tab:gray", "sft": "tab:blue", "rl": "tab:green",
               **{phase: "tab:cyan" for phase in phases if phase.startswith("sft-t")},
               **{phase: "tab:green" for phase in phases if phase.startswith("rl-t")}}
    figure, axes = plt.subplots(figsize=(max(5.0, 1.4 * len(phases)), 3.5))
    axes.bar([labels[phase].replace(", ", ",\n") for phase in phases], rates, yerr=errors, capsize=6,
             color=[colours.get(phase, "tab:olive") for phase in phases])
    for index, (rate, entry) in enumerate(zip(rates, entries)):
        axes.text(index, rate + 1, f"{rate:.0f}%\n{entry['successes']}/{entry['played']}", ha="center", va="bottom",
                  fontsize=8)
    axes.set_ylim(0, 100)
    per_task = f" x {summary['eval_samples']}" if summary.get("eval_samples", 1) > 1 else ""
    axes.set_ylabel(f"held-out success (%), {summary['eval_episodes']}{per_task} episodes")
    axes.set_title(f"{summary['env']} {summary['env_options']}", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def main(argv: Sequence[str] | None = None) -> int:
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
    print(json.dumps({"experiment": "sft-rl", "seconds": round(summary["seconds"], 1), "phases": compact,
                      "against_sft": summary["against_sft"]}))
    return 0
