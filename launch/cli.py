"""The `longhorizon` command. Thin: parses arguments and defers every heavy import to the subcommand."""

from __future__ import annotations

import argparse
import errno
import json
import logging
import sys

from longhorizon.common.args import take_late_overrides


def _train(args: argparse.Namespace) -> int:
    from longhorizon.launch import api
    from longhorizon.launch.report import format_report

    try:
        run = api.train(args.config, args.overrides, in_process=args.in_process)
    except api.RunFailed as failed:
        print(f"longhorizon: {failed}", file=sys.stderr)
        return failed.exit_code
    print(format_report(run.summary) if run.summary else f"no report: the run in {run.run_dir} recorded no step")
    if not args.no_plots:
        from longhorizon.launch.plot import plot_run

        written = plot_run(run.run_dir)
        print(f"plots: {', '.join(str(p) for p in written)}")
        print(f"done: metrics, sample episodes, checkpoints and plots are in {run.run_dir}")
    return 0


def _eval(args: argparse.Namespace) -> int:
    from longhorizon.launch.recipes.eval import main

    return main(args.rest)


def _serve_model(args: argparse.Namespace) -> int:
    from longhorizon.actor.model_server import main

    return main(args.rest)


def _plot(args: argparse.Namespace) -> int:
    from longhorizon.launch.plot import main

    return main([args.run_dir])


def _report(args: argparse.Namespace) -> int:
    from longhorizon.launch.report import main

    return main([args.run_dir, *(["--json"] if args.json else [])])


def _env(args: argparse.Namespace) -> int:
    if args.env_command == "list":
        from longhorizon.envs.base import env_names

        print("\n".join(env_names()))
        return 0
    if args.env_command == "play":
        from longhorizon.envs.play import main

        return main(args.rest)
    if args.env_command == "check":
        import trio

        from longhorizon.envs.checker import check_env

        trio.run(lambda: check_env(args.name, policy=args.policy))
        print(f"{args.name}: ok")
        return 0
    if args.env_command == "serve":
        return _serve(args)
    raise AssertionError(args.env_command)


def _serve(args: argparse.Namespace) -> int:
    import json

    from longhorizon.envs.server import serve
    from longhorizon.envs.service import ServiceSettings

    options = {}
    for item in args.option:
        key, separator, text = item.partition("=")
        if not separator or not key:
            raise ValueError(f"--option takes KEY=VALUE, got {item!r}")
        try:
            options[key] = json.loads(text)
        except ValueError:
            options[key] = text  # a bare word is a string
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    serve(
        ServiceSettings(
            env_name=args.name, env_options=options, host=args.host, port=args.port,
            max_instances=args.max_instances, idle_timeout_s=args.idle_timeout, max_body_bytes=args.max_body_bytes,
            unused_idle_timeout_s=args.unused_idle_timeout, request_timeout_s=args.request_timeout,
            max_instances_per_client=args.max_instances_per_client, max_connections=args.max_connections,
            header_timeout_s=args.header_timeout, keep_alive_timeout_s=args.keep_alive_timeout,
        )
    )
    return 0


def _keys(args: argparse.Namespace) -> int:
    from longhorizon.common.curve import print_new_key_files

    return print_new_key_files(args.folder)


def _collect(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from longhorizon.common.args import key_value_options
    from longhorizon.common.progress import ProgressBar
    from longhorizon.launch import api

    bars: list[ProgressBar] = []

    def on_progress(done: int, total: int, detail: str) -> None:
        if not bars:
            bars.append(ProgressBar("collect", total))
        bars[0].update(done, detail)

    try:
        summary = api.collect(
            args.config, args.overrides, output=args.output, episodes=args.episodes, split=args.split,
            tasks=args.tasks, only_successful=args.only_successful, model=args.model, horizon=args.horizon,
            concurrency=args.concurrency, engine_options=key_value_options(args.engine_option),
            overwrite=args.overwrite, on_progress=on_progress,
        )
    finally:
        for bar in bars:
            bar.close()
    print(f"wrote {summary.written} conversations to {summary.output} ({summary.successful} of {summary.episodes} "
          f"episodes successful, {summary.failed} failed) in {summary.seconds:.1f}s")
    print(json.dumps(asdict(summary), sort_keys=True))
    return 0


def _offline(args: argparse.Namespace) -> int:
    """sft, dpo and rft: train, then print the summary as one line of JSON."""
    from longhorizon.launch import api

    recipe = {"sft": api.sft, "dpo": api.dpo, "rft": api.rft}[args.command]
    print(json.dumps(recipe(args.config, args.overrides), sort_keys=True))
    return 0


def _config(args: argparse.Namespace) -> int:
    from longhorizon.common.config import dump_toml, load_config
    from longhorizon.launch.config_reference import current_reference, full_schema
    from longhorizon.learner.algorithms import with_resolved_options

    if args.config_command == "show":
        print(dump_toml(with_resolved_options(load_config(args.config, args.overrides))), end="")
    elif args.config_command == "reference":
        print(current_reference(), end="")
    else:
        print(json.dumps(full_schema(), indent=1))
    return 0


def _experiment(args: argparse.Namespace) -> int:
    if args.experiment_command == "sft-rl":
        from longhorizon.launch.recipes.experiment_sft_rl import main
    elif args.experiment_command == "freezes":
        from longhorizon.launch.recipes.experiment_freezes import main
    else:
        from longhorizon.launch.recipes.experiment_horizons import main

    return main(args.rest)


def _bench(args: argparse.Namespace) -> int:
    from longhorizon.launch.bench.cli import main

    return main(args.rest)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="longhorizon",
        description="Asynchronous actor-learner RL for long-horizon, multi-turn LLM agents.",
    )
    commands = parser.add_subparsers(dest="command", required=True)

    train = commands.add_parser("train", help="train: one learner and N actors on this machine")
    train.add_argument("config", help="TOML config file (see configs/)")
    train.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. run.total_steps=20")
    train.add_argument("--in-process", action="store_true", help="run learner and actors in one process (debugging)")
    train.add_argument("--no-plots", action="store_true", help="skip writing plots at the end")
    train.set_defaults(handler=_train)

    evaluate = commands.add_parser(
        "eval", help="evaluate a model, checkpoint or scripted policy on held-out tasks", add_help=False
    )
    evaluate.add_argument("rest", nargs=argparse.REMAINDER)
    evaluate.set_defaults(handler=_eval)

    serve_model = commands.add_parser(
        "serve-model", help="serve a model over an OpenAI-compatible HTTP API", add_help=False
    )
    serve_model.add_argument("rest", nargs=argparse.REMAINDER)
    serve_model.set_defaults(handler=_serve_model)

    plot = commands.add_parser("plot", help="write PNG curves for a run directory")
    plot.add_argument("run_dir")
    plot.set_defaults(handler=_plot)

    report = commands.add_parser("report", help="what a run's metrics say about why it learned or did not")
    report.add_argument("run_dir")
    report.add_argument("--json", action="store_true", help="print the figures as JSON")
    report.set_defaults(handler=_report)

    env = commands.add_parser("env", help="environments: list, play in the terminal, check, serve")
    env_commands = env.add_subparsers(dest="env_command", required=True)
    env_commands.add_parser("list", help="registered environments")
    play = env_commands.add_parser("play", help="play an environment yourself", add_help=False)
    play.add_argument("rest", nargs=argparse.REMAINDER)
    check = env_commands.add_parser("check", help="run the env checker (determinism, types)")
    check.add_argument("name")
    check.add_argument("--policy", default="random",
                       help="scripted policy that plays the checked episodes (default %(default)s); real web "
                            "apps show random content on some pages (Fossil suggests random passwords), so "
                            "check weblocal with --policy oracle")
    serve = env_commands.add_parser("serve", help="serve an env over HTTP (AgentGym-compatible endpoints)")
    serve.add_argument("name")
    serve.add_argument("--port", type=int, default=8700)
    serve.add_argument("--host", default="127.0.0.1", help="interface to bind (no authentication: keep it loopback)")
    serve.add_argument("--max-instances", type=int, default=128, help="most live env instances")
    serve.add_argument("--idle-timeout", type=float, default=600.0, help="seconds before an idle instance is closed")
    serve.add_argument("--unused-idle-timeout", type=float, default=60.0,
                       help="seconds before an instance never reset or stepped after /create is closed")
    serve.add_argument("--request-timeout", type=float, default=30.0,
                       help="seconds a client has to send a whole request (head and body), from its first byte")
    serve.add_argument("--header-timeout", type=float, default=10.0,
                       help="seconds a client has to send a request's head, from its first byte (from the "
                            "connect, for a connection's first request)")
    serve.add_argument("--keep-alive-timeout", type=float, default=60.0,
                       help="seconds a connection may wait idle between requests")
    serve.add_argument("--max-connections", type=int, default=1024,
                       help="most open connections; beyond it a new one replaces the connection that has waited "
                            "longest without a whole request (default %(default)s)")
    serve.add_argument("--max-instances-per-client", type=int, default=None,
                       help="most instances one non-loopback address may hold (default: half of --max-instances)")
    serve.add_argument("--max-body-bytes", type=int, default=1024 * 1024, help="largest request body accepted")
    serve.add_argument("--option", action="append", default=[], metavar="KEY=VALUE", help="env option (JSON value)")
    env.set_defaults(handler=_env)

    keys = commands.add_parser("keys", help="make a run's CurveZMQ keys, for processes you start yourself")
    keys.add_argument("folder", help="where learner.keys and actor.keys are written (readable by you only)")
    keys.set_defaults(handler=_keys)

    collect = commands.add_parser(
        "collect", help="play an env's split with any engine and write the conversations as JSONL")
    collect.add_argument("config", help="TOML config: env, engine (actor.engine; scripted for the oracle), sampling")
    collect.add_argument("overrides", nargs="*", help="section.key=value overrides")
    collect.add_argument("--output", required=True, help="the .jsonl file to write")
    collect.add_argument("--episodes", type=int, help="episodes to play (default: each task of the split once)")
    collect.add_argument("--split", help="task split to play (default: env.train_split)")
    collect.add_argument("--tasks", type=int, default=0,
                         help="play only the first N tasks of the split; with more --episodes each is played several "
                              "times (pairs for dpo). Default: every task")
    collect.add_argument("--only-successful", action="store_true", help="write only episodes that reached the goal")
    collect.add_argument("--model", help="the model to be trained on the file: token ids are written in its "
                                         "tokenizer (default: model.path)")
    collect.add_argument("--horizon", type=int, default=0, help="turn limit (default: the last horizon stage)")
    collect.add_argument("--concurrency", type=int, default=32, help="episodes played at once (default %(default)s)")
    collect.add_argument("--engine-option", action="append", default=[], metavar="KEY=VALUE",
                         help="an engine-specific option (repeatable), e.g. base_url=http://host:8000/v1 for openai")
    collect.add_argument("--overwrite", action="store_true", help="replace --output if it exists")
    collect.set_defaults(handler=_collect)

    sft = commands.add_parser("sft", help="supervised fine-tuning on collected conversations ([sft] in the config)")
    sft.add_argument("config", help="TOML config with an [sft] table (see configs/codebook-sft.toml)")
    sft.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. sft.epochs=5")
    sft.set_defaults(handler=_offline)

    dpo = commands.add_parser("dpo", help="direct preference optimisation on pairs of episodes ([dpo] in the config)")
    dpo.add_argument("config", help="TOML config with a [dpo] table (see configs/codebook-dpo.toml)")
    dpo.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. dpo.beta=0.5")
    dpo.set_defaults(handler=_offline)

    rft = commands.add_parser(
        "rft", help="rejection-sampling fine-tuning: rounds of sampling, keeping successes, SFT ([rft], [sft])")
    rft.add_argument("config", help="TOML config with [rft] and [sft] tables (see configs/codebook-rft.toml)")
    rft.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. rft.rounds=5")
    rft.set_defaults(handler=_offline)

    experiment = commands.add_parser("experiment", help="learning experiments (docs/results.md)")
    experiment_commands = experiment.add_subparsers(dest="experiment_command", required=True)
    horizons = experiment_commands.add_parser(
        "horizons", help="fixed-short, fixed-long, stepwise and adaptive horizons at one budget", add_help=False)
    horizons.add_argument("rest", nargs=argparse.REMAINDER)
    sft_rl = experiment_commands.add_parser(
        "sft-rl", help="held-out success of the base model, after SFT on oracle play, after RL", add_help=False)
    sft_rl.add_argument("rest", nargs=argparse.REMAINDER)
    freezes = experiment_commands.add_parser(
        "freezes", help="train a config over several seeds: how many runs froze, steps to 95%% success",
        add_help=False)
    freezes.add_argument("rest", nargs=argparse.REMAINDER)
    experiment.set_defaults(handler=_experiment)

    config = commands.add_parser("config", help="the resolved config of a file, or the schema of every key")
    config_commands = config.add_subparsers(dest="config_command", required=True)
    show = config_commands.add_parser("show", help="the config as a run gets it: the file, the overrides, every default")
    show.add_argument("config", help="TOML config file, or a bundled config's name (see configs/)")
    show.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. run.total_steps=20")
    config_commands.add_parser("schema", help="the JSON schema of a config: every key's type, default and meaning, "
                               "each built-in algorithm's options under algorithm_options, each engine's under "
                               "engine_options and each weights transport's under weights_options")
    config_commands.add_parser("reference", help="the key reference (docs/config.md) as Markdown, written from the schema")
    config.set_defaults(handler=_config)

    bench = commands.add_parser(
        "bench", help="benchmarks, each a table then one line of JSON (`longhorizon bench --help`)", add_help=False)
    bench.add_argument("rest", nargs=argparse.REMAINDER)
    bench.set_defaults(handler=_bench)
    return parser


# Subcommands that parse their own arguments (their --help included).
_PASS_THROUGH = {("bench",): "bench", ("eval",): "eval", ("serve-model",): "serve-model", ("env", "play"): "play",
                 ("experiment", "horizons"): "horizons", ("experiment", "sft-rl"): "sft-rl",
                 ("experiment", "freezes"): "freezes"}


# Where an output folder cannot be written: read-only, not ours, or full. Said in one line, as a
# user can act on it; other OSErrors keep their traceback.
_STORAGE_ERRORS = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.ENOTDIR}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    for prefix in _PASS_THROUGH:
        if tuple(argv[: len(prefix)]) == prefix and len(argv) > len(prefix) and argv[len(prefix)].startswith("-"):
            argv = [*prefix, "--", *argv[len(prefix):]]
            break
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    take_late_overrides(parser, args, extras)
    if getattr(args, "rest", None) and args.rest[0] == "--":
        args.rest = args.rest[1:]
    try:
        return args.handler(args)
    except KeyboardInterrupt:
        return _interrupted()
    except BaseExceptionGroup as group:
        # A command that runs trio in this process (eval, the experiments' evaluations) gets its
        # Ctrl-C, or a task's error, wrapped in a group.
        if group.subgroup(KeyboardInterrupt) is not None:
            return _interrupted()
        leaves = _leaf_exceptions(group)
        if len(leaves) == 1 and isinstance(leaves[0], Exception) and _user_error_line(leaves[0]):
            print(_user_error_line(leaves[0]), file=sys.stderr)
            return 2
        raise
    except Exception as exc:  # user-facing errors (bad config key, missing model) as one clear line
        line = _user_error_line(exc)
        if line is None:
            raise
        print(line, file=sys.stderr)
        return 2


def _interrupted() -> int:
    print("longhorizon: interrupted", file=sys.stderr)
    return 130


def _leaf_exceptions(group: BaseExceptionGroup) -> list[BaseException]:
    leaves = []
    for exc in group.exceptions:
        leaves.extend(_leaf_exceptions(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return leaves


def _user_error_line(exc: Exception) -> str | None:
    """The one line a user can act on for `exc` (a bad config key, a missing model or folder, an
    output folder that cannot be written), or None for an error whose traceback is the report."""
    from longhorizon.common.config import ConfigError
    from longhorizon.common.models import ModelError

    if isinstance(exc, (ConfigError, ModelError, ValueError, FileNotFoundError)):
        return f"longhorizon: error: {exc}"
    if isinstance(exc, OSError) and exc.errno in _STORAGE_ERRORS:
        return (f"longhorizon: error: {exc} (check the folder's permissions and free space, or choose "
                f"another with run.output_dir / --output)")
    return None


if __name__ == "__main__":
    sys.exit(main())
