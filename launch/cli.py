"""The `longhorizon` command. Thin: parses arguments and defers every heavy import to the subcommand."""

from __future__ import annotations

import argparse
import logging
import sys


def _train(args: argparse.Namespace) -> int:
    import trio

    from longhorizon.common.config import load_config

    config = load_config(args.config, args.overrides)
    if args.in_process:
        from longhorizon.launch.local import train_in_process

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        trio.run(train_in_process, config)
        code = 0
    else:
        from longhorizon.launch.local import launch_local

        code = launch_local(config)
    if code == 0 and not args.no_plots:
        from longhorizon.launch.plot import plot_run

        written = plot_run(config.run_dir)
        print(f"plots: {', '.join(str(p) for p in written)}")
        print(f"done: metrics, sample episodes, checkpoints and plots are in {config.run_dir}")
    return code


def _eval(args: argparse.Namespace) -> int:
    from longhorizon.launch.eval import main

    return main(args.rest)


def _serve_model(args: argparse.Namespace) -> int:
    from longhorizon.launch.serve_model import main

    return main(args.rest)


def _plot(args: argparse.Namespace) -> int:
    from longhorizon.launch.plot import main

    return main([args.run_dir])


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

    from longhorizon.envs.server import ServiceSettings, serve

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
            max_instances_per_client=args.max_instances_per_client,
        )
    )
    return 0


def _bench(args: argparse.Namespace) -> int:
    from longhorizon.launch.bench import main

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
                       help="seconds a client has to send a whole request (head and body)")
    serve.add_argument("--max-instances-per-client", type=int, default=None,
                       help="most instances one non-loopback address may hold (default: half of --max-instances)")
    serve.add_argument("--max-body-bytes", type=int, default=1024 * 1024, help="largest request body accepted")
    serve.add_argument("--option", action="append", default=[], metavar="KEY=VALUE", help="env option (JSON value)")
    env.set_defaults(handler=_env)

    bench = commands.add_parser("bench", help="benchmarks: transport, async-vs-sync", add_help=False)
    bench.add_argument("rest", nargs=argparse.REMAINDER)
    bench.set_defaults(handler=_bench)
    return parser


# Subcommands that parse their own arguments (their --help included).
_PASS_THROUGH = {("bench",): "bench", ("eval",): "eval", ("serve-model",): "serve-model", ("env", "play"): "play"}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    for prefix in _PASS_THROUGH:
        if tuple(argv[: len(prefix)]) == prefix and len(argv) > len(prefix) and argv[len(prefix)].startswith("-"):
            argv = [*prefix, "--", *argv[len(prefix):]]
            break
    args = build_parser().parse_args(argv)
    if getattr(args, "rest", None) and args.rest[0] == "--":
        args.rest = args.rest[1:]
    try:
        return args.handler(args)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # user-facing errors (bad config key, missing model) as one clear line
        from longhorizon.common.config import ConfigError
        from longhorizon.common.models import ModelError

        if isinstance(exc, (ConfigError, ModelError, ValueError, FileNotFoundError)):
            print(f"longhorizon: error: {exc}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
