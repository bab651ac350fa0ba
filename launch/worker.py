"""Process entry point for one learner or one actor: `python -m longhorizon.launch.worker ROLE --config F`.

A learner of several ranks is several such processes with torch.distributed's variables (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) in their environment, set by the local
launcher or by `torchrun --nproc-per-node N -m longhorizon.launch.worker learner --config F`.

The local launcher starts these; a cluster launcher would too. Each reads the resolved config
the launcher wrote, connects its sockets from the addresses in it, and runs until it is told to
stop (learner: after the last step; actor: on the learner's Stop, or SIGTERM/SIGINT). A learner
stopped by a signal writes a checkpoint of its last finished step first. On the way out the
sockets close and their ZeroMQ context is terminated before the process exits.

The process proves it belongs to the run with what its environment hands it (common/auth.py):
with CurveZMQ (a non-loopback `transport.host`, or `transport.curve = "on"`) its keys, in the
LONGHORIZON_CURVE_KEYS environment variable (set by the launcher, or by hand from the files
`longhorizon keys DIR` writes; see common/curve.py); on loopback the run's secret, in
LONGHORIZON_RUN_SECRET (set by the launcher, or by hand to the same value for every process);
nothing with `transport.insecure = true`.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from typing import NoReturn

import trio

from longhorizon.common.config import Config, load_config, ConfigError
from longhorizon.common.processes import die_with_parent
from longhorizon.common.auth import RunSecret, credentials_for_process
from longhorizon.common.transport import zmq_actor_endpoints, zmq_learner_endpoints
from longhorizon.common.codec import DEFAULT_LIMITS, WEIGHTS_LIMITS
from longhorizon.learner.distributed import exit_without_teardown, ranks_from_environment, RanksError
from longhorizon.actor.worker import run_actor, ActorRefused, SyncVersionRefused
from longhorizon.common.memory import keep_freed_message_memory
from longhorizon.launch.launchers.supervise import EXIT_DO_NOT_RESTART


def transport_addresses(config: Config) -> dict[str, str]:
    transport = config.transport
    return {
        "trajectory_address": f"tcp://{transport.host}:{transport.trajectory_port}",
        "broadcast_address": f"tcp://{transport.host}:{transport.broadcast_port}",
        "control_address": f"tcp://{transport.host}:{transport.control_port}",
    }


async def _until_signal(cancel_scope: trio.CancelScope, received: list[int]) -> None:
    """Cancel the role on the first SIGTERM or SIGINT. Later ones are logged and ignored: the
    receiver stays open so they cannot take the default action (ending the process) while a
    learner writes its final checkpoint."""
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            if received:
                logging.getLogger(__name__).info("received signal %d again, still stopping", signum)
                continue
            logging.getLogger(__name__).info("received signal %d, stopping", signum)
            received.append(signum)
            cancel_scope.cancel()


async def _main(role: str, config: Config, index: int, credentials=None) -> int:
    """Run one role; 0 when it finished normally, 128 + signal number when a signal stopped it."""
    received: list[int] = []
    async with trio.open_nursery() as nursery:
        # The signal receiver lives outside the role's cancel scope, so it stays open (and
        # ignores repeats) while the role shuts down.
        role_scope = trio.CancelScope()
        nursery.start_soon(_until_signal, role_scope, received)
        with role_scope:
            await _run_role(role, config, index, credentials)
        nursery.cancel_scope.cancel()
    # An actor stopped by a signal rather than by the learner exits non-zero so the launcher
    # restarts it.
    return 128 + received[0] if received else 0


async def _run_role(role: str, config: Config, index: int, credentials=None) -> None:
    import dataclasses


    addresses = transport_addresses(config)
    transport = config.transport
    # CurveZMQ keys, or the run's secret (loopback), or nothing (transport.insecure).
    if isinstance(credentials, RunSecret):
        auth = {"secret": credentials}
    else:
        auth = {"curve": credentials}
    if role == "learner":
        from longhorizon.learner.worker import run_learner, run_learner_rank

        ranks = ranks_from_environment(config.learner.num_ranks)
        if not ranks.is_main:
            # No sockets: this rank follows rank 0 until it says stop. A stop signal does not end
            # it early, since rank 0 needs every rank to write its final checkpoint.
            await trio.to_thread.run_sync(run_learner_rank, config, ranks)
            return
        endpoints = zmq_learner_endpoints(
            **addresses,
            trajectory_hwm=transport.trajectory_hwm,
            trajectory_limits=dataclasses.replace(DEFAULT_LIMITS, max_message_bytes=transport.max_trajectory_bytes),
            # Another connection may speak for an actor id once its holder is silent this long.
            control_takeover_after_s=config.learner.peer_timeout_s,
            **auth,
        )
        try:
            await run_learner(config, endpoints, ranks=ranks)
        finally:
            endpoints.close()
    else:
        endpoints = zmq_actor_endpoints(
            f"actor-{index}",
            **addresses,
            trajectory_hwm=transport.trajectory_hwm,
            broadcast_limits=dataclasses.replace(WEIGHTS_LIMITS, max_message_bytes=transport.max_weights_bytes),
            **auth,
        )
        try:
            await run_actor(config, index, endpoints)
        finally:
            endpoints.close()


def nonfinite_error_in(error: BaseException):
    """The `NonfiniteUpdatesError` that ended the learner, alone or inside trio's exception
    groups, or None when something else did."""
    from longhorizon.learner.worker import NonfiniteUpdatesError

    return error_of_kind(error, NonfiniteUpdatesError)


def error_of_kind(error: BaseException, kind: type[BaseException]):
    """The error of `kind` that ended a process, alone or inside trio's exception groups, or None
    when something else did."""
    while isinstance(error, BaseExceptionGroup):
        found = error.split(kind)[0]
        if found is None:
            return None
        error = found.exceptions[0]
    return error if isinstance(error, kind) else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="longhorizon-worker")
    parser.add_argument("role", choices=["learner", "actor"])
    parser.add_argument("--config", required=True)
    parser.add_argument("--index", type=int, default=0)
    parser.add_argument("--resume", action="store_true",
                        help="continue from the run's latest checkpoint (a restarted learner)")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value",
                        help="config overrides, as for `longhorizon train` (e.g. learner.num_ranks=4 under torchrun)")
    args = parser.parse_intermixed_args(argv)
    # SIGTERM if the launcher dies (it starts workers from its main thread, which the kernel
    # tracks), so no worker outlives it.
    die_with_parent()
    if args.role == "learner":
        # Ranks of a multi-rank learner (started by our launcher or torchrun) name themselves.
        name = "learner" if int(os.environ.get("WORLD_SIZE", "1")) <= 1 else f"learner-rank{os.environ.get('RANK', '0')}"
    else:
        name = f"actor-{args.index}"
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s",
    )

    try:
        config = load_config(args.config, [*args.overrides, *(["run.resume=true"] if args.resume else [])])
    except ConfigError as error:
        parser.exit(2, f"longhorizon-worker: error: {error}\n")

    try:
        # CurveZMQ keys and the run's secret leave the environment here, before this process
        # starts anything that could inherit them; none where needed is an error before any
        # socket opens.
        credentials = credentials_for_process(args.role, config.transport)
    except ValueError as error:
        parser.exit(2, f"longhorizon-worker: error: {error}\n")
    if config.transport.keep_freed_memory:
        keep_freed_message_memory()
    from longhorizon.learner.worker import NonfiniteUpdatesError

    try:
        return trio.run(_main, args.role, config, args.index, credentials)
    except (NonfiniteUpdatesError, ActorRefused, SyncVersionRefused, RanksError, BaseExceptionGroup) as error:
        # Restarting would meet the same failure: the learner's checkpoint replays the same
        # inputs into it, an actor's credentials are refused again, the version a sync actor
        # refused is sent again, the rank count still differs.
        final = (nonfinite_error_in(error) or error_of_kind(error, ActorRefused)
                 or error_of_kind(error, SyncVersionRefused) or error_of_kind(error, RanksError))
        if final is None:
            raise
        logging.getLogger(__name__).error("%s", final)

        return EXIT_DO_NOT_RESTART


def run_as_process(argv: list[str] | None = None) -> NoReturn:
    """Run `main` as the whole process, then exit with its code: for `python -m` and for a worker
    the fork server started (launch/launchers/fork_server.py)."""
    code = main(argv)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # A rank of a learner with several ranks: its collectives' threads must not outlive the
        # interpreter's teardown (see exit_without_teardown).
        exit_without_teardown(0 if code is None else code)
    sys.exit(code)


if __name__ == "__main__":
    run_as_process()
