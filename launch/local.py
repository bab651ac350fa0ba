"""Run a training job on this machine: one learner and N actor processes, supervised.

The launcher resolves the config (free ports filled in), prepares the model once, starts the
processes, restarts an actor that dies, restarts a learner that dies from its latest checkpoint,
prints one progress line per learner step, and on Ctrl-C or SIGTERM stops every process it
started (the learner first writes a checkpoint of its last step). Children also get SIGTERM from
the kernel if the launcher itself dies (PR_SET_PDEATHSIG), so no process is left behind.
`train_in_process` wires the same components together in one process over the in-process
transport, for tests and debugging.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from longhorizon.common.config import Config, ConfigError
# Shared by every launcher (launch/launcher.py); imported here too, where they used to live.
from longhorizon.launch.launcher import (  # noqa: F401
    StopRequested, SubprocessControl, format_progress, free_port, prepare_run_dir, process_name, supervise,
    with_ports,
)


def validate_config(config: Config) -> None:
    """Cheap checks before any process starts, so a wrong name fails once with a clear message
    instead of crashing every actor in a restart loop. A key's own range is checked on loading
    (common/config.py); these are the choices, the parts and the rules across keys."""
    from longhorizon.actor.engines.base import EngineError, capabilities_of, check_engine_settings, engine_class
    from longhorizon.actor.engines.factory import engine_settings
    from longhorizon.actor.worker import ROLLOUT_SLOTS
    from longhorizon.envs.base import get_env_spec, list_tasks
    from longhorizon.common.plugins import PluginError
    from longhorizon.learner.weights import publisher_class
    from longhorizon.learner.buffer import PARTIAL_GROUP_POLICIES, STALENESS_UNITS
    from longhorizon.learner.curriculum import make_schedule
    from longhorizon.common.models import ModelError, resolve_device
    from longhorizon.learner.trainer import PRECISIONS
    from longhorizon.learner.worker import check_sampling_for_training

    def require(condition: bool, message: str) -> None:
        if not condition:
            raise ConfigError(message)

    require(config.run.mode in ("async", "sync"), f"run.mode must be async or sync, got {config.run.mode!r}")
    require(config.actor.rollout_slots in ROLLOUT_SLOTS,
            f"actor.rollout_slots must be one of {', '.join(ROLLOUT_SLOTS)}, got {config.actor.rollout_slots!r}")
    from longhorizon.learner.algorithms import AlgorithmError, make_algorithm

    try:
        algorithm = make_algorithm(config.learner)
    except AlgorithmError as error:
        raise ConfigError(str(error)) from None
    require(not (config.learner.staleness_unit == "token" and algorithm.scores_every_generated_token()),
            f"learner.staleness_unit = \"token\" takes an episode's stale turns out of its loss mask, and "
            f"learner.algorithm = {algorithm.name!r} scores episodes by all their generated tokens as set here: "
            "use staleness_unit = \"episode\"")
    require(not (config.actor.history_turns and not algorithm.takes_turn_samples),
            f"actor.history_turns = {config.actor.history_turns} trains each turn as a sample of its own, which "
            f"learner.algorithm = {algorithm.name!r} does not take: use actor.history_turns = 0")
    require(not (algorithm.resamples_flat_groups and config.run.mode == "sync"),
            f"learner.algorithm = {algorithm.name!r} replaces groups without signal by new ones, which "
            "sync mode (one batch per version) cannot: use run.mode = \"async\"")
    try:
        publisher = publisher_class(config.learner.weights_transport)
    except (PluginError, TypeError) as error:
        raise ConfigError(f"learner.weights_transport: {error}") from None
    require(config.learner.staleness_unit in STALENESS_UNITS,
            f"learner.staleness_unit must be one of {', '.join(STALENESS_UNITS)}, got {config.learner.staleness_unit!r}")
    require(config.learner.partial_groups in PARTIAL_GROUP_POLICIES,
            f"learner.partial_groups must be one of {', '.join(PARTIAL_GROUP_POLICIES)}")
    require(config.learner.precision in PRECISIONS, f"learner.precision must be one of {', '.join(PRECISIONS)}")
    require(isinstance(config.learner.gradient_checkpointing, bool) or config.learner.gradient_checkpointing == "auto",
            f"learner.gradient_checkpointing must be true, false or \"auto\", "
            f"got {config.learner.gradient_checkpointing!r}")
    _check_wandb(config)
    try:
        learner_device = resolve_device(config.learner.device)
    except ModelError as error:
        raise ConfigError(f"learner.device: {error}") from None
    _check_learner_ranks(config, learner_device)
    try:
        engine_cls = engine_class(config.actor.engine)
    except EngineError as error:
        raise ConfigError(f"actor.engine: {error}") from None
    _check_lora(config, capabilities_of(engine_cls), publisher)
    require(config.actor.max_context_tokens > config.actor.sampling.max_new_tokens,
            "actor.max_context_tokens must be larger than actor.sampling.max_new_tokens")
    try:
        check_sampling_for_training(config)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    get_env_spec(config.env.name)
    if config.actor.agent:
        from longhorizon.envs.agents import AgentLoopError, get_agent_loop

        try:
            get_agent_loop(config.actor.agent)
        except AgentLoopError as error:
            raise ConfigError(f"actor.agent: {error}") from None
    if not list_tasks(config.env.name, config.env.train_split, **dict(config.env.options)):
        raise ConfigError(f"env {config.env.name!r} has no {config.env.train_split!r} tasks")
    try:
        publisher.check(config, learner_device, capabilities_of(engine_cls))
        check_engine_settings(engine_cls, engine_settings(config, ""))
    except ValueError as error:
        raise ConfigError(str(error)) from None
    try:
        make_schedule(config.horizon)
    except ValueError as error:
        raise ConfigError(f"[horizon]: {error}") from None
    # Transport security: CurveZMQ beyond loopback, the run's secret on loopback, unless
    # transport.insecure (common/auth.py).
    from longhorizon.common.auth import auth_mechanism

    auth_mechanism(config.transport)


def _check_wandb(config: Config) -> None:
    """[logging.wandb]: a known mode, and the optional wandb package installed when it is on."""
    import importlib.util

    from longhorizon.common.metrics import WANDB_MODES

    settings = config.logging.wandb
    if settings.mode and settings.mode not in WANDB_MODES:
        raise ConfigError(f"logging.wandb.mode must be one of {', '.join(WANDB_MODES)} or \"\" (auto), got {settings.mode!r}")
    if not all(isinstance(tag, str) for tag in settings.tags):
        raise ConfigError(f"logging.wandb.tags must be strings, got {settings.tags!r}")
    if settings.enabled and importlib.util.find_spec("wandb") is None:
        raise ConfigError("logging.wandb.enabled needs the wandb package: pip install 'longhorizon[wandb]'")


def _check_learner_ranks(config: Config, device) -> None:
    """learner.num_ranks against the devices there are: one GPU per rank on CUDA; on the CPU,
    ranks share the cores (gloo), which tests and small runs use."""
    num_ranks = config.learner.num_ranks
    if num_ranks == 1:
        return
    from longhorizon.learner.algorithms import AlgorithmError, algorithm_class

    try:
        several_ranks = algorithm_class(config.learner.algorithm).runs_on_several_ranks
    except AlgorithmError as error:
        raise ConfigError(str(error)) from None
    if not several_ranks:
        raise ConfigError(f"learner.algorithm = {config.learner.algorithm!r} runs on one rank for now: "
                          "set learner.num_ranks = 1")
    import torch.distributed

    if not torch.distributed.is_available():
        raise ConfigError("learner.num_ranks > 1 needs torch.distributed, which this torch build lacks")
    if device.type == "cuda":
        import torch

        visible = torch.cuda.device_count()
        if device.index is not None:
            raise ConfigError(
                f"learner.device = {config.learner.device!r} names one GPU, but each of the "
                f"{num_ranks} ranks takes its own: use learner.device = \"cuda\" or \"auto\""
            )
        if num_ranks > visible:
            raise ConfigError(
                f"learner.num_ranks = {num_ranks} but only {visible} CUDA GPU(s) are visible: one rank per GPU"
            )


def _check_lora(config: Config, capabilities, publisher) -> None:
    """learner.lora: its keys, that the engine takes adapters the way the transport sends them, and
    that each target names modules of the model (checked on the architecture alone, without loading
    weights)."""
    from longhorizon.common.models import resolve_model_path
    from longhorizon.common.lora import LoraError, check_targets_of_model_folder, lora_settings

    try:
        settings = lora_settings(config.learner.lora)
        if settings is None:
            return
        if not capabilities.takes_lora:
            raise LoraError(
                f"learner.lora sends adapters only, which the {config.actor.engine!r} engine cannot take: "
                "use an engine that takes LoRA adapters (capabilities.takes_lora), or full fine-tuning"
            )
        if publisher.sends not in capabilities.lora_transports():
            raise LoraError(
                f"learner.lora with the {config.actor.engine!r} engine takes adapters only as "
                f"{' or '.join(capabilities.lora_transports())} updates, not {publisher.sends!r} ones "
                f"(learner.weights_transport = {config.learner.weights_transport!r}): choose a transport that sends those"
            )
        check_targets_of_model_folder(settings, resolve_model_path(config.model.path, config.model.cache_dir))
    except LoraError as error:
        raise ConfigError(str(error)) from None


class _Child(SubprocessControl):
    def __init__(
        self, role: str, index: int, config_path: Path, log_path: Path, *, env: dict[str, str] | None = None,
    ) -> None:
        self.role, self.index = role, index
        self.config_path, self.log_path = config_path, log_path
        # Variables added to the launcher's environment for this process (secrets never go in
        # the config file, which is written to the run directory).
        self.env = dict(env or {})
        self.process: subprocess.Popen | None = None
        self.restarts = 0
        self.started_at = 0.0

    @property
    def name(self) -> str:
        return process_name(self.role, self.index)

    def start(self, *, resume: bool = False) -> None:
        command = [
            sys.executable, "-m", "longhorizon.launch.worker", self.role,
            "--config", str(self.config_path), "--index", str(self.index),
        ]
        if resume:
            command.append("--resume")
        self.started_at = time.monotonic()
        environment = {**os.environ, **self.env, **self.scratch_environment(self.name)}
        log_file = self.log_path.open("ab")
        # A session of its own: the launcher decides the order of shutdown on Ctrl-C.
        self.process = subprocess.Popen(
            command, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True, env=environment,
        )
        log_file.close()

    def poll(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def give_up(self) -> None:
        self.process = None

    def describe(self) -> dict:
        return {"pid": self.process.pid if self.process else None, "restarts": self.restarts}


def _learner_ranks(config: Config, config_path: Path, run_dir: Path) -> list[_Child]:
    """The learner's processes: one, or `learner.num_ranks` ranks that find rank 0 through
    torch.distributed's environment variables (as torchrun would set them)."""
    from longhorizon.learner.distributed import STORE_FILE_VARIABLE

    num_ranks = config.learner.num_ranks
    if num_ranks == 1:
        return [_Child("learner", 0, config_path, run_dir / "logs" / "learner.log")]
    # On one machine the ranks meet through a file and gloo talks over the loopback interface:
    # nothing of the learner's process group listens beyond this machine.
    rendezvous = {
        STORE_FILE_VARIABLE: str(run_dir / ".ranks-store"), "GLOO_SOCKET_IFNAME": "lo",
        "MASTER_ADDR": "127.0.0.1", "WORLD_SIZE": str(num_ranks),
    }
    return [
        _Child(
            "learner", rank, config_path,
            run_dir / "logs" / ("learner.log" if rank == 0 else f"learner-rank{rank}.log"),
            env={**rendezvous, "RANK": str(rank), "LOCAL_RANK": str(rank)},
        )
        for rank in range(num_ranks)
    ]


def _remove_ranks_store(run_dir: Path) -> None:
    """A new set of ranks needs a fresh meeting file: the old one holds the last group's keys."""
    (run_dir / ".ranks-store").unlink(missing_ok=True)


def launch_local(config: Config, *, progress=print) -> int:
    """Run a training job in processes; returns the exit code (0 when training finished)."""
    from longhorizon.common.models import resolve_model_path

    validate_config(config)
    config = with_ports(config)
    # Convert or build the model once here, not in every process at the same time; a model that
    # is not there fails before the run's folder is made.
    resolve_model_path(config.model.path, config.model.cache_dir)
    run_dir = prepare_run_dir(config, progress=progress)
    config_path = run_dir / "config.toml"
    _remove_ranks_store(run_dir)
    learner_ranks = _learner_ranks(config, config_path, run_dir)
    actors = [
        _Child("actor", index, config_path, run_dir / "logs" / f"actor-{index}.log")
        for index in range(config.actor.num_actors)
    ]
    children = [*learner_ranks, *actors]
    # This run's CurveZMQ keys or secret (common/auth.py), in each process's environment only
    # (never in a file).
    from longhorizon.common.auth import auth_environments

    credentials_by_role = auth_environments(config.transport)
    for child in children:
        child.env.update(credentials_by_role[child.role])
    progress(f"run directory: {run_dir}  (logs in {run_dir / 'logs'})")
    ranks_text = "" if len(learner_ranks) == 1 else f" of {len(learner_ranks)} ranks"
    progress(
        f"starting 1 learner{ranks_text} and {len(actors)} actor(s): env {config.env.name}, engine {config.actor.engine}, "
        f"model {config.model.path}, mode {config.run.mode}, {config.run.total_steps} steps"
    )
    try:
        return supervise(
            config, run_dir, learner_ranks, actors, progress=progress,
            before_learner_restart=lambda: _remove_ranks_store(run_dir),
        )
    finally:
        _remove_ranks_store(run_dir)


async def train_in_process(config: Config, *, model_path: str | None = None, engines=None):
    """Learner and actors as trio tasks in this process over the in-process transport."""
    import trio

    from longhorizon.actor.worker import run_actor
    from longhorizon.common.transport import InProcessNetwork
    from longhorizon.learner.worker import run_learner

    validate_config(config)
    prepare_run_dir(config)
    network = InProcessNetwork()
    async with trio.open_nursery() as nursery:
        for index in range(config.actor.num_actors):
            engine = engines[index] if engines else None
            nursery.start_soon(
                lambda i=index, e=engine: run_actor(config, i, network.actor_endpoints(f"actor-{i}"), engine=e)
            )
        learner = await run_learner(config, network.learner_endpoints(), model_path=model_path)
        # Actors return once they receive Stop; anything still running is cancelled.
        with trio.move_on_after(10):
            while len(nursery.child_tasks) > 0:
                await trio.sleep(0.05)
        nursery.cancel_scope.cancel()
    return learner

