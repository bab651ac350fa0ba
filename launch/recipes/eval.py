"""`longhorizon eval CONFIG [k=v ...]`: play an engine on an env's held-out tasks and report success,
Avg@n and Pass@k with confidence intervals; a table for people, then one line of JSON.

Sweeps (each written as a Markdown table, a PNG plot and JSON in `--output-dir`, by default
`<run dir>/eval-<env>-<time>` for a run checkpoint, else `<run.output_dir>/eval-<env>-<time>`):
- `--sweep horizon --values 2,4,6,8,10`: success against the interaction budget (horizon cap);
- `--sweep pass-at-k --samples 64 [--values 1,2,4,...,64]`: the unbiased Pass@k for each k, with
  a bootstrap interval over tasks.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any
from longhorizon.actor.engines.factory import plan_engine
from longhorizon.actor.evaluate import play_tasks, pass_at_k_curve, summarise, default_ks
from longhorizon.actor.rollout import AgentLoopSettings
from longhorizon.common.args import key_value_options, parse_args
from longhorizon.common.config import load_config, ConfigError
from longhorizon.common.progress import ProgressBar
from longhorizon.envs.base import list_tasks
from longhorizon.launch import plot_eval
from longhorizon.actor.engines.base import EngineError
from longhorizon.common.models import ModelError

SWEEPS = ("horizon", "pass-at-k")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="longhorizon eval",
        description="Evaluate a model, checkpoint or scripted policy on an env's held-out tasks.",
    )
    parser.add_argument("config", help="TOML config (env, engine, sampling; see configs/)")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides")
    parser.add_argument("--checkpoint", help="a model folder or run checkpoint (default: model.path)")
    parser.add_argument("--tasks", type=int, default=100, help="first N tasks of env.eval_split (default %(default)s)")
    parser.add_argument("--samples", type=int, default=1, help="episodes per task, for Pass@k (default %(default)s)")
    parser.add_argument("--k", default="1", help="comma-separated k values for Pass@k (default %(default)s)")
    parser.add_argument("--horizon", type=int, default=0, help="turn limit (default: the last horizon stage)")
    parser.add_argument("--output", help="also write the summary JSON here")
    parser.add_argument("--sweep", choices=SWEEPS, help="sweep the horizon cap or k of Pass@k")
    parser.add_argument("--values", default="",
                        help="comma-separated sweep values: horizon caps, or k values (default 1,2,4,... up to --samples)")
    parser.add_argument("--output-dir", help="folder for the sweep's (or the summary's) JSON, table and plot")
    parser.add_argument("--bootstrap", type=int, default=1000, help="bootstrap resamples for Pass@k intervals (default %(default)s)")
    parser.add_argument("--engine-option", action="append", default=[], metavar="KEY=VALUE",
                        help="an engine-specific option (repeatable), e.g. base_url=http://host:8000/v1 for openai")
    return parser


def _int_list(text: str, what: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{what} must be comma-separated integers, got {text!r}") from None
    if any(v < 1 for v in values):
        raise ValueError(f"{what} must be positive, got {text!r}")
    return values


def make_eval_engine(config, checkpoint: str | Path | None = None, engine_options: dict[str, Any] | None = None,
                     announce=lambda model_path: None):
    """Build the configured engine for evaluation; returns (engine, model path or "").
    `engine_options` add to (and override) actor.engine_options; the engine checks them.
    `announce(model path)` is called once the plan is checked, before the engine starts (tens of
    seconds for vLLM or a large model), so that a user is not left waiting in silence."""
    engine_class, settings = plan_engine(
        config, "eval", model_path=str(checkpoint) if checkpoint else None, engine_options=dict(engine_options or {}),
    )
    announce(settings.model_path)
    return engine_class(settings), settings.model_path


async def _play(engine, config, tasks, *, samples: int, horizon_cap: int, on_episode=lambda record: None):
    return await play_tasks(
        engine, config.env.name, dict(config.env.options), tasks, samples=samples, horizon_cap=horizon_cap,
        max_new_tokens=config.actor.sampling.max_new_tokens, max_context_tokens=config.actor.max_context_tokens,
        loop_settings=AgentLoopSettings.from_actor(config.actor), on_episode=on_episode,
    )


def _default_output_dir(config, checkpoint: str | None) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    name = f"eval-{config.env.name}-{stamp}"
    if checkpoint and Path(checkpoint).parent.name == "checkpoints":
        return Path(checkpoint).parent.parent / name  # results live beside the run that made them
    return Path(config.run.output_dir) / name


@dataclasses.dataclass(frozen=True)
class EvalRequest:
    """What to evaluate besides the config: `longhorizon eval`'s options as values."""

    checkpoint: str | Path | None = None
    """A model folder or run checkpoint; None: model.path."""
    tasks: int = 100
    """The first N tasks of env.eval_split."""
    samples: int = 1
    """Episodes per task."""
    ks: tuple[int, ...] = (1,)
    """k values of Pass@k."""
    horizon: int = 0
    """Turn limit; 0: the last horizon stage."""
    sweep: str | None = None
    """None, "horizon" or "pass-at-k"."""
    values: tuple[int, ...] = ()
    """The sweep's horizon caps or k values (pass-at-k: default 1, 2, 4, ... up to `samples`)."""
    bootstrap: int = 1000
    """Bootstrap resamples for the Pass@k intervals."""
    engine_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Engine options beside actor.engine_options (they win)."""

    def checked(self) -> EvalRequest:
        """This request with the pass-at-k sweep's default values filled in; ValueError naming
        the option that does not fit."""
        for name in ("tasks", "samples", "bootstrap"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.horizon < 0:
            raise ValueError(f"horizon must be >= 0 (0: the last horizon stage), got {self.horizon}")
        if any(v < 1 for v in (*self.ks, *self.values)):
            raise ValueError(f"k and sweep values must be positive, got {list(self.ks)} and {list(self.values)}")
        if self.sweep not in (None, *SWEEPS):
            raise ValueError(f"sweep must be one of {', '.join(SWEEPS)}, got {self.sweep!r}")
        if max(self.ks, default=1) > self.samples:
            raise ValueError(f"--k {max(self.ks)} needs at least that many samples per task (--samples {self.samples})")
        values = self.values
        if self.sweep == "horizon" and not values:
            raise ValueError("--sweep horizon needs --values, e.g. --values 2,4,6,8,10")
        if self.sweep == "pass-at-k":
            if self.samples < 2:
                raise ValueError("--sweep pass-at-k needs several samples per task, e.g. --samples 64")
            values = tuple(sorted(set(values or default_ks(self.samples))))
            if max(values) > self.samples:
                raise ValueError(f"k={max(values)} needs at least that many samples per task (--samples {self.samples})")
        return dataclasses.replace(self, values=values)


def request_from_args(args: argparse.Namespace) -> EvalRequest:
    """The command line's options as an EvalRequest."""
    return EvalRequest(
        checkpoint=args.checkpoint, tasks=args.tasks, samples=args.samples, ks=tuple(_int_list(args.k, "--k")),
        horizon=args.horizon, sweep=args.sweep,
        values=tuple(_int_list(args.values, "--values")) if args.values else (), bootstrap=args.bootstrap,
        engine_options=key_value_options(args.engine_option),
    )


def run_eval(args: argparse.Namespace) -> dict:
    """`longhorizon eval`'s evaluation: evaluate_config on the command line's config and options."""
    return evaluate_config(load_config(args.config, args.overrides), request_from_args(args))


def evaluate_config(config, request: EvalRequest, *, status=None) -> dict:
    """Evaluate (or sweep) and return the JSON document; episode records are under "_records".
    `status(line)` receives the line that says the engine is starting (default: stderr)."""
    import trio


    request = request.checked()
    if status is None:
        def status(line: str) -> None:
            print(line, file=sys.stderr, flush=True)
    samples, ks = request.samples, list(request.ks)
    tasks = list_tasks(config.env.name, config.env.eval_split, **dict(config.env.options))[: request.tasks]
    if not tasks:
        raise ValueError(f"env {config.env.name!r} has no tasks in split {config.env.eval_split!r}")
    horizon_cap = request.horizon or max(config.horizon.stages)
    engine, model_path = make_eval_engine(config, request.checkpoint, request.engine_options, announce=lambda model: status(
        f"eval: {config.env.name} {config.env.eval_split}, {len(tasks)} tasks x {samples} samples, engine "
        f"{config.actor.engine}{f', model {model}' if model else ''}: starting the engine"))
    caps = sorted(set(request.values)) if request.sweep == "horizon" else [horizon_cap]

    bar = ProgressBar("eval", len(caps) * len(tasks) * samples)
    ended = {"episodes": 0, "successes": 0}

    def on_episode(record) -> None:
        ended["episodes"] += 1
        ended["successes"] += record.success
        bar.update(ended["episodes"], f"{ended['successes']} succeeded")

    async def play_all() -> dict[int, list]:
        try:
            return {cap: await _play(engine, config, tasks, samples=samples, horizon_cap=cap,
                                     on_episode=on_episode) for cap in caps}
        finally:
            await engine.close()

    try:
        records = trio.run(play_all)
    finally:
        bar.close()
    header = {"env": config.env.name, "split": config.env.eval_split, "engine": config.actor.engine,
              "model": model_path or None, "samples_per_task": samples,
              "max_context_tokens": config.actor.max_context_tokens}
    episodes = [{"horizon_cap": cap, **dataclasses.asdict(r)} for cap, rs in records.items() for r in rs]
    if request.sweep == "horizon":
        points = [{"horizon_cap": cap, **summarise(records[cap], samples, ks)} for cap in caps]
        return {"sweep": "horizon", **header, "tasks": points[0]["tasks"], "points": points, "_records": episodes}
    summary = summarise(records[horizon_cap], samples, ks)
    if request.sweep == "pass-at-k":
        points = pass_at_k_curve(records[horizon_cap], samples, list(request.values), resamples=request.bootstrap,
                                 seed=config.run.seed)
        return {"sweep": "pass-at-k", **header, "horizon_cap": horizon_cap, "tasks": summary["tasks"],
                "points": points, "summary": summary, "_records": episodes}
    return {**header, "horizon_cap": horizon_cap, **summary, "_records": episodes}


def context_warning(cut_by_context: int, max_context_tokens: int) -> str:
    """A line for episodes that stopped at the context limit ("" when none did): their figures
    measure the limit, not the policy (a byte-level scripted engine fills it about four times
    as fast as a model's tokenizer)."""
    if not cut_by_context:
        return ""
    return (f"warning: {cut_by_context} episodes stopped because their next turn would not fit "
            f"actor.max_context_tokens = {max_context_tokens} (prompt and replies, in the engine's tokens); "
            f"raise it to measure the policy rather than the limit")


def print_summary(summary: dict, samples: int) -> None:
    print(f"{summary['env']} {summary['split']}: {summary['tasks']} tasks x {samples} samples, "
          f"horizon {summary['horizon_cap']}")
    low, high = summary["success_rate_ci95"]
    print(f"success {summary['success_rate']:.1%} (95% CI {low:.1%}-{high:.1%}), "
          f"avg@{samples} {summary[f'avg@{samples}']:.3f}, episodes ended by an error {summary['failed_episodes']}")
    for key, value in summary.items():
        if key.startswith("pass@"):
            print(f"{key} {value:.1%}")
    played = summary["episodes"] - summary["failed_episodes"]
    print(f"episodes cut by the horizon cap {summary['cut_by_horizon']} of {played}, by the context limit "
          f"{summary['cut_by_context']}")
    warning = context_warning(summary["cut_by_context"], summary["max_context_tokens"])
    if warning:
        print(warning)
    for category, figures in summary["per_category"].items():
        print(f"  {category:24} {figures['success_rate']:6.1%} of {figures['episodes']}")


def write_outputs(document: dict, output_dir: Path) -> list[Path]:
    """The JSON document, the episodes, and for a sweep its table and plot."""
    output_dir.mkdir(parents=True, exist_ok=True)
    records = document.pop("_records")
    sweep = document.get("sweep")
    stem = {"horizon": "horizon-sweep", "pass-at-k": "pass-at-k"}.get(sweep, "summary")
    written = [output_dir / f"{stem}.json", output_dir / "episodes.jsonl"]
    written[0].write_text(json.dumps(document, indent=2) + "\n")
    written[1].write_text("".join(json.dumps(r) + "\n" for r in records))
    if sweep == "horizon":
        (output_dir / f"{stem}.md").write_text(plot_eval.horizon_table(document))
        written += [output_dir / f"{stem}.md", plot_eval.plot_horizon_sweep(document, output_dir / f"{stem}.png")]
    elif sweep == "pass-at-k":
        (output_dir / f"{stem}.md").write_text(plot_eval.pass_at_k_table(document))
        written += [output_dir / f"{stem}.md", plot_eval.plot_pass_at_k_sweep(document, output_dir / f"{stem}.png")]
    return written


def main(argv: list[str]) -> int:

    args = parse_args(build_parser(), argv)
    if isinstance(args, int):  # --help, or a usage error argparse has printed
        return args
    try:
        document = run_eval(args)
    except (ConfigError, EngineError, ModelError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    sweep = document.get("sweep")
    if sweep is None:
        print_summary(document, args.samples)
    else:
        print(f"{document['env']} {document['split']}: {document['tasks']} tasks x {args.samples} samples, "
              f"{sweep} sweep")
        print(plot_eval.horizon_table(document) if sweep == "horizon" else plot_eval.pass_at_k_table(document), end="")
        results = document["points"] if sweep == "horizon" else [document["summary"]]
        warning = context_warning(sum(r["cut_by_context"] for r in results), document["max_context_tokens"])
        if warning:
            print(warning)
    if sweep is not None or args.output_dir:
        output_dir = Path(args.output_dir) if args.output_dir else _default_output_dir(
            load_config(args.config, args.overrides), args.checkpoint)
        written = write_outputs(document, output_dir)
        print("wrote " + ", ".join(str(path) for path in written))
    document.pop("_records", None)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(document, indent=2) + "\n")
    print(json.dumps(document, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
