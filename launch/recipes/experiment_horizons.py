"""The horizon experiment: ScalingInter-RL's four arms trained to one budget of env turns.

`longhorizon experiment horizons [--seeds 3] [--budget TURNS] [--output DIR]` trains a tiny
randomly initialised model on the codechain env (configs/horizons.toml) four times per seed:

- fixed-short: the first horizon stage throughout;
- fixed-long: the last stage throughout;
- stepwise: every stage in turn, stage lengths (in learner steps) sized so each stage gets about
  a third of the budget;
- adaptive: the next stage when training success stops rising or the cap cuts too many episodes
  (the [horizon] keys of the config), a stage lasting at most as long as a stepwise one.

Every arm runs until the env turns it has played (the sum over learner steps of the batch's
episodes times their mean turns) reach the budget; a long cap spends more turns per episode, so it
gets fewer learner steps. Each run is a `longhorizon train` process: this module reads its
metrics as they come, copies the checkpoint of the first step past each of `--points` evenly
spaced shares of the budget, and stops the run (SIGTERM: the learner ends its step, checkpoints,
stops the actors) at the budget. The copies are then played greedily on the held-out split at the
last (longest) cap. Outputs in DIR: curves.json, horizons.png, one result file per run (a rerun
with the same DIR reuses finished runs) and the run directories. It prints a table, then one line
of JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from longhorizon.common.processes import stop_process
from longhorizon.envs.base import list_tasks
from longhorizon.common.metrics import read_metrics
from longhorizon.actor.engines.factory import build_engine
from longhorizon.actor.evaluate import play_tasks
from longhorizon.actor.rollout import AgentLoopSettings
from longhorizon.common.config import load_config
from longhorizon.common.models import build_tiny_model
from longhorizon.envs.toy.codechain import vocabulary

ARMS = ("fixed-short", "fixed-long", "stepwise", "adaptive")
ARM_COLOURS = {"fixed-short": "tab:blue", "fixed-long": "tab:red", "stepwise": "tab:green", "adaptive": "tab:purple"}
DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "horizons.toml"
# What of a checkpoint an engine does not need to play it: the optimiser and learner state.
_TRAINING_STATE = ("state.pt", "sharded")
_POLL_S = 0.1
_STOP_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Settings:
    """What one invocation of the experiment runs."""

    config_path: Path
    output_dir: Path
    seeds: int = 3
    budget_turns: int = 50_000
    """Env turns each arm plays before it stops."""
    points: int = 8
    """Evaluations per run, at evenly spaced shares of the budget (plus the untrained model)."""
    arms: tuple[str, ...] = ARMS
    overrides: tuple[str, ...] = ()
    """section.key=value overrides applied to every arm's config."""


# --- budget accounting (pure functions) ---------------------------------------------------------


def mean_turns_at_cap(lengths: Sequence[int], cap: int) -> float:
    """Mean turns per episode over tasks of these lengths when every reply is valid: min(L, cap)."""
    if not lengths:
        raise ValueError("no task lengths given")
    return sum(min(length, cap) for length in lengths) / len(lengths)


def stepwise_stage_steps(budget_turns: float, turns_per_step_by_stage: Sequence[float]) -> int:
    """Learner steps per stage so that equal-length stages spend the budget: each stage gets
    budget / sum(turns per step of every stage) steps (at least one)."""
    if budget_turns <= 0 or not turns_per_step_by_stage or min(turns_per_step_by_stage) <= 0:
        raise ValueError("the budget and the turns per step of each stage must be positive")
    return max(1, round(budget_turns / sum(turns_per_step_by_stage)))


def step_limit(budget_turns: float, fewest_turns_per_step: float, margin: float = 0.25) -> int:
    """A `run.total_steps` that the budget is sure to stop first: the steps the budget lasts at the
    fewest turns per step any stage can take, plus a margin (task sampling varies)."""
    if budget_turns <= 0 or fewest_turns_per_step <= 0:
        raise ValueError("the budget and the turns per step must be positive")
    return math.ceil(budget_turns / fewest_turns_per_step * (1 + margin)) + 1


def step_turns(records: Sequence[dict]) -> list[int]:
    """Env turns played in each learner step: the batch's episodes times their mean turns. The
    episodes of a step are the growth of the learner's cumulative `trajectories_trained`."""
    turns = []
    trained_before = 0
    for record in records:
        episodes = record["trajectories_trained"] - trained_before
        trained_before = record["trajectories_trained"]
        # The product is a sum of whole turns; rounding removes the float error of the mean.
        turns.append(round(episodes * record["episode_turns_mean"]))
    return turns


def cumulative_turns(records: Sequence[dict]) -> list[int]:
    """Env turns played up to and including each learner step."""
    total, result = 0, []
    for turns in step_turns(records):
        total += turns
        result.append(total)
    return result


def budget_targets(budget_turns: float, points: int) -> list[float]:
    """The shares of the budget at which a run is evaluated: budget * k / points, k = 1..points."""
    if points < 1:
        raise ValueError(f"need at least one evaluation point, got {points}")
    return [budget_turns * k / points for k in range(1, points + 1)]


def first_steps_reaching(cumulative: Sequence[float], targets: Sequence[float]) -> list[int | None]:
    """For each target, the first learner step (from 1) whose cumulative turns reach it, or None."""
    steps: list[int | None] = []
    for target in targets:
        steps.append(next((index + 1 for index, total in enumerate(cumulative) if total >= target), None))
    return steps


# --- the arms ------------------------------------------------------------------------------------


def arm_overrides(arm: str, stages: Sequence[int], stage_steps: int, min_stage_steps: int) -> list[str]:
    """The [horizon] overrides that make an arm of the experiment."""
    if arm == "fixed-short":
        return ['horizon.schedule="fixed"', f"horizon.stages=[{stages[0]}]"]
    if arm == "fixed-long":
        return ['horizon.schedule="fixed"', f"horizon.stages=[{stages[-1]}]"]
    listed = ", ".join(str(cap) for cap in stages)
    if arm == "stepwise":
        return ['horizon.schedule="stepwise"', f"horizon.stages=[{listed}]", f"horizon.stage_steps={stage_steps}"]
    if arm == "adaptive":
        # A stage ends on the config's rule, and at the latest when a stepwise stage would.
        return ['horizon.schedule="adaptive"', f"horizon.stages=[{listed}]",
                f"horizon.max_stage_steps={max(stage_steps, min_stage_steps)}"]
    raise ValueError(f"unknown arm {arm!r}; valid arms: {', '.join(ARMS)}")


@dataclass(frozen=True)
class Plan:
    """The figures every arm shares, worked out from the config and the budget."""

    stages: tuple[int, ...]
    eval_cap: int
    episodes_per_step: int
    turns_per_step_by_stage: tuple[float, ...]
    stage_steps: int
    total_steps: int


def make_plan(config, budget_turns: int) -> Plan:
    stages = tuple(config.horizon.stages)
    if len(stages) < 2:
        raise ValueError(f"the horizon experiment needs at least two horizon.stages (short and long), got {list(stages)}")
    lengths = [len(task.data["symbols"]) for task in list_tasks(config.env.name, "train", **config.env.options)]
    episodes_per_step = config.learner.groups_per_step * config.actor.group_size
    turns_by_stage = tuple(episodes_per_step * mean_turns_at_cap(lengths, cap) for cap in stages)
    return Plan(
        stages=stages, eval_cap=stages[-1], episodes_per_step=episodes_per_step,
        turns_per_step_by_stage=turns_by_stage,
        stage_steps=stepwise_stage_steps(budget_turns, turns_by_stage),
        total_steps=step_limit(budget_turns, min(turns_by_stage)),
    )


# --- one run: train to the budget, keeping the checkpoints to evaluate --------------------------


def _copy_model(checkpoint: Path, target: Path) -> None:
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    # Every file but the training state: the tiny model's tokenizer marker file matters too.
    for path in checkpoint.iterdir():
        if path.is_file() and path.name not in _TRAINING_STATE:
            shutil.copy2(path, partial / path.name)
    partial.rename(target)


def train_to_budget(config_path: Path, overrides: list[str], run_dir: Path, models_dir: Path,
                    budget_turns: float, points: int, log_path: Path, progress=print) -> dict:
    """Run `longhorizon train` until its turns reach the budget, copying the checkpoint of the
    first step past each evaluation target into models_dir/step_N. Returns the run's accounting;
    `progress` hears of each tenth of the budget reached."""
    tenths_said = 0

    targets = budget_targets(budget_turns, points)
    copied: dict[int, Path] = {}
    command = [sys.executable, "-m", "longhorizon.launch.cli", "train", str(config_path), *overrides, "--no-plots"]
    models_dir.mkdir(parents=True, exist_ok=True)
    with log_path.open("w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            stopped_at_budget = False
            while True:
                ended = process.poll() is not None  # before reading, so its last records are seen
                records = read_metrics(run_dir)
                cumulative = cumulative_turns(records)
                if cumulative and int(10 * cumulative[-1] / budget_turns) > tenths_said:
                    tenths_said = min(10, int(10 * cumulative[-1] / budget_turns))
                    progress(f"  {log_path.stem}: step {records[-1]['step']}, {cumulative[-1]:.0f} of "
                             f"{budget_turns:.0f} turns ({min(cumulative[-1] / budget_turns, 1):.0%})")
                waiting = False
                for step in first_steps_reaching(cumulative, targets):
                    if step is not None and step not in copied:
                        checkpoint = run_dir / "checkpoints" / f"step_{step:06d}"
                        if not (checkpoint / "state.pt").is_file():  # state.pt is written last
                            if step == records[-1]["step"] and not ended:
                                waiting = True  # a step's record comes out before its checkpoint
                                continue
                            raise RuntimeError(
                                f"{checkpoint} is gone before it could be copied (the learner keeps its last "
                                f"three checkpoints); the run's steps outpaced this watcher")
                        copied[step] = models_dir / f"step_{step:06d}"
                        _copy_model(checkpoint, copied[step])
                if cumulative and cumulative[-1] >= budget_turns and not waiting:
                    stopped_at_budget = True
                    break
                if ended:
                    break
                time.sleep(_POLL_S)
        finally:
            stop_process(process, _STOP_TIMEOUT_S)  # an orderly stop: the launcher stops its processes
    if not stopped_at_budget:
        raise RuntimeError(
            f"the run in {run_dir} ended (exit code {process.returncode}) before reaching the budget of "
            f"{budget_turns:.0f} turns; see {log_path}")
    records = read_metrics(run_dir)
    cumulative = cumulative_turns(records)
    budget_step = first_steps_reaching(cumulative, [budget_turns])[0]
    return {
        "budget_step": budget_step,
        "turns_at_budget_step": cumulative[budget_step - 1],
        "checkpoints": {str(step): str(path) for step, path in sorted(copied.items())},
        "turns_by_step": cumulative[:budget_step],
        "horizon_cap_by_step": [record["horizon_cap"] for record in records[:budget_step]],
        "train_success_by_step": [round(record["success_rate"], 4) for record in records[:budget_step]],
        "horizon_decisions": [record["horizon_decision"] for record in records[:budget_step]
                              if record.get("horizon_decision")],
    }


# --- evaluation ----------------------------------------------------------------------------------


def evaluate_model(config, model_folder: Path, cap: int) -> dict:
    """Greedy play of every held-out task once at `cap`: success overall, on easy and on hard tasks."""
    import trio


    engine = build_engine(config, "checkpoint", model_path=str(model_folder), greedy=True)
    tasks = list_tasks(config.env.name, config.env.eval_split, **config.env.options)
    records = trio.run(lambda: play_tasks(
        engine, config.env.name, dict(config.env.options), tasks, samples=1, horizon_cap=cap,
        max_new_tokens=config.actor.sampling.max_new_tokens, max_context_tokens=config.actor.max_context_tokens,
        loop_settings=AgentLoopSettings.from_actor(config.actor),
    ))
    failed = [record for record in records if record.error]
    if failed:
        raise RuntimeError(f"{len(failed)} evaluation episodes of {model_folder} failed: {failed[0].error}")

    def success(kind: str | None) -> float:
        chosen = [record for record in records if kind is None or record.category.startswith(kind)]
        return sum(record.success for record in chosen) / max(len(chosen), 1)

    return {"success": success(None), "easy": success("easy"), "hard": success("hard"), "episodes": len(records)}


# --- the whole experiment ------------------------------------------------------------------------


def _spread(values: Sequence[float]) -> dict:
    return {"mean": sum(values) / len(values), "min": min(values), "max": max(values)}


def summarise(runs: dict[str, dict[int, dict]], budget_turns: float) -> dict:
    """Per arm: final (at the budget) and best held-out success over seeds, and the mean curve."""
    summary = {}
    for arm, by_seed in runs.items():
        finals = [run["curve"][-1] for run in by_seed.values()]
        bests = [max(point["success"] for point in run["curve"]) for run in by_seed.values()]
        curve = []
        for index in range(len(next(iter(by_seed.values()))["curve"])):
            points = [run["curve"][index] for run in by_seed.values()]
            curve.append({
                "budget_share": points[0]["budget_share"],
                "turns": _spread([point["turns"] for point in points]),
                "success": _spread([point["success"] for point in points]),
            })
        summary[arm] = {
            "seeds": sorted(by_seed),
            "final_success": _spread([point["success"] for point in finals]),
            "final_easy": _spread([point["easy"] for point in finals]),
            "final_hard": _spread([point["hard"] for point in finals]),
            "best_success": _spread(bests),
            "steps_at_budget": _spread([run["budget_step"] for run in by_seed.values()]),
            "turns_at_budget": _spread([run["turns_at_budget_step"] for run in by_seed.values()]),
            "curve": curve,
        }
    return summary


def format_table(summary: dict) -> str:
    """A markdown table: one row per arm, success as mean [min-max] over seeds."""
    def cell(spread: dict, percent: bool = True) -> str:
        if percent:
            return f"{spread['mean']:.1%} [{spread['min']:.0%}-{spread['max']:.0%}]"
        return f"{spread['mean']:.0f} [{spread['min']:.0f}-{spread['max']:.0f}]"

    header = ["arm", "seeds", "learner steps", "final success", "best success", "final easy", "final hard"]
    rows = [[arm, str(len(entry["seeds"])), cell(entry["steps_at_budget"], percent=False),
             cell(entry["final_success"]), cell(entry["best_success"]), cell(entry["final_easy"]),
             cell(entry["final_hard"])] for arm, entry in summary.items()]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def plot_curves(summary: dict, budget_turns: float, path: Path, title: str) -> Path:
    """Held-out success against env turns: the mean over seeds, shaded from the lowest to the highest."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(6.4, 4), layout="tight")
    axes = figure.add_subplot()
    for arm, entry in summary.items():
        turns = [point["budget_share"] * budget_turns / 1000 for point in entry["curve"]]
        means = [point["success"]["mean"] for point in entry["curve"]]
        colour = ARM_COLOURS.get(arm)
        axes.plot(turns, means, marker=".", color=colour, label=arm)
        axes.fill_between(turns, [point["success"]["min"] for point in entry["curve"]],
                          [point["success"]["max"] for point in entry["curve"]], color=colour, alpha=0.15)
    axes.set_xlabel("env turns played (thousands)")
    axes.set_ylabel("held-out success (greedy)")
    axes.set_ylim(0, 1)
    axes.set_title(title, fontsize=10)
    axes.grid(alpha=0.3)
    axes.legend(loc="upper left", fontsize=8)
    FigureCanvasAgg(figure)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png", dpi=100)
    return path


def run_experiment(settings: Settings, progress=print) -> dict:
    """Train and evaluate every arm and seed; write curves.json and horizons.png; return the document."""
    for arm in settings.arms:
        if arm not in ARMS:
            raise ValueError(f"unknown arm {arm!r}; valid arms: {', '.join(ARMS)}")
    if settings.seeds < 1 or settings.budget_turns < 1:
        raise ValueError("--seeds and --budget must be positive")
    output = settings.output_dir.resolve()
    base = load_config(settings.config_path, list(settings.overrides))
    if base.env.name != "codechain":
        raise ValueError(f"the horizon experiment builds its tiny model for the codechain env, got env {base.env.name!r}")
    plan = make_plan(base, settings.budget_turns)
    progress(f"plan: stages {list(plan.stages)}, {plan.episodes_per_step} episodes per step, about "
             f"{', '.join(f'{turns:.0f}' for turns in plan.turns_per_step_by_stage)} turns per step at each cap; "
             f"stepwise stages of {plan.stage_steps} steps; evaluation at cap {plan.eval_cap}")
    runs: dict[str, dict[int, dict]] = {arm: {} for arm in settings.arms}
    started = time.monotonic()
    for seed in range(settings.seeds):
        # Seeds differ in the model's initial weights as well as in sampling and task order.
        model_dir = build_tiny_model(output / "models" / f"seed{seed}", words=vocabulary(**base.env.options), seed=seed)
        untrained = None
        for arm in settings.arms:
            name = f"{arm}-seed{seed}"
            overrides = [
                *settings.overrides, f"run.name={name!r}", f"run.output_dir={str(output / 'runs')!r}",
                f"run.seed={seed}", f"run.total_steps={plan.total_steps}", f"model.path={str(model_dir)!r}",
                'run.mode="sync"', "learner.checkpoint_every=1",
                *arm_overrides(arm, plan.stages, plan.stage_steps, base.horizon.min_stage_steps),
            ]
            result_path = output / "results" / f"{name}.json"
            if result_path.is_file():
                earlier = json.loads(result_path.read_text())
                # The overrides hold the step limit and stage lengths, which follow from the budget.
                if earlier.get("overrides") != overrides or len(earlier["curve"]) != settings.points + 1:
                    raise ValueError(f"{result_path} was made with other settings; use another --output folder")
                runs[arm][seed] = earlier
                progress(f"{name}: finished earlier, reusing {result_path}")
                continue
            run_dir = output / "runs" / name
            shutil.rmtree(run_dir, ignore_errors=True)  # an unfinished attempt: start it again
            shutil.rmtree(output / "eval_models" / name, ignore_errors=True)
            progress(f"{name}: training to {settings.budget_turns} turns ({time.monotonic() - started:.0f}s so far)")
            (output / "logs").mkdir(parents=True, exist_ok=True)
            accounting = train_to_budget(
                settings.config_path.resolve(), overrides, run_dir, output / "eval_models" / name,
                settings.budget_turns, settings.points, output / "logs" / f"{name}.log", progress=progress,
            )
            config = load_config(run_dir / "config.toml")
            if untrained is None:
                untrained = evaluate_model(config, model_dir, plan.eval_cap)
            targets = budget_targets(settings.budget_turns, settings.points)
            curve = [{"budget_share": 0.0, "step": 0, "turns": 0.0, **untrained}]
            cumulative = accounting["turns_by_step"]
            for target, step in zip(targets, first_steps_reaching(cumulative, targets)):
                folder = Path(accounting["checkpoints"][str(step)])
                curve.append({"budget_share": target / settings.budget_turns, "step": step,
                              "turns": cumulative[step - 1], **evaluate_model(config, folder, plan.eval_cap)})
            result = {"arm": arm, "seed": seed, "budget_turns": settings.budget_turns, "points": settings.points,
                      "overrides": overrides, **accounting, "curve": curve}
            result_path.parent.mkdir(parents=True, exist_ok=True)
            result_path.write_text(json.dumps(result, indent=1))
            runs[arm][seed] = result
            successes = " ".join(f"{point['success']:.2f}" for point in curve)
            progress(f"{name}: {accounting['budget_step']} steps, held-out success {successes}")
    summary = summarise(runs, settings.budget_turns)
    document = {
        "experiment": "horizons",
        "config": str(settings.config_path),
        "overrides": list(settings.overrides),
        "budget_turns": settings.budget_turns,
        "seeds": settings.seeds,
        "points": settings.points,
        "stages": list(plan.stages),
        "stepwise_stage_steps": plan.stage_steps,
        "eval_cap": plan.eval_cap,
        "summary": summary,
        "runs": {arm: {str(seed): run for seed, run in by_seed.items()} for arm, by_seed in runs.items()},
    }
    (output / "curves.json").write_text(json.dumps(document, indent=1))
    plot_curves(summary, settings.budget_turns, output / "horizons.png",
                f"codechain, {settings.seeds} seed(s), {settings.budget_turns} turns per run")
    return document


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="longhorizon experiment horizons",
        description="Fixed-short, fixed-long, stepwise and adaptive horizons at one budget of env turns "
                    "(docs/results.md).",
    )
    parser.add_argument("--seeds", type=int, default=3, help="seeds per arm (default %(default)s)")
    parser.add_argument("--budget", type=int, default=50_000, help="env turns per run (default %(default)s)")
    parser.add_argument("--points", type=int, default=8,
                        help="held-out evaluations per run, evenly spaced over the budget (default %(default)s)")
    parser.add_argument("--output", type=Path, default=Path("runs/horizons"), help="output folder (default %(default)s)")
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="base config (default configs/horizons.toml)")
    parser.add_argument("--arms", default=",".join(ARMS), help="comma-separated arms (default: all four)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="config override for every arm (repeatable)")
    args = parser.parse_args(argv)
    settings = Settings(
        config_path=args.config, output_dir=args.output, seeds=args.seeds, budget_turns=args.budget,
        points=args.points, arms=tuple(arm.strip() for arm in args.arms.split(",") if arm.strip()),
        overrides=tuple(args.set),
    )
    if threading.current_thread() is threading.main_thread():
        # SIGTERM ends the experiment like Ctrl-C, so the training run under way is stopped too.
        signal.signal(signal.SIGTERM, _interrupt)
    document = run_experiment(settings, progress=lambda line: print(line, flush=True))
    print(format_table(document["summary"]))
    print(f"curves: {settings.output_dir / 'curves.json'}  plot: {settings.output_dir / 'horizons.png'}")
    compact = {"experiment": "horizons", "budget_turns": document["budget_turns"], "seeds": document["seeds"],
               "arms": {arm: {key: entry[key] for key in ("final_success", "best_success", "final_easy", "final_hard",
                                                          "steps_at_budget", "turns_at_budget")}
                        for arm, entry in document["summary"].items()}}
    print(json.dumps(compact, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
