"""The rules a run's config must meet across its parts, checked once before any process starts.

A key's own type and range are checked where it is declared, on loading (common/config.py), and
an algorithm's own options where the algorithm is made. What is left lives here: the choices
that name a part (an engine, a weights transport, an env, an agent loop), the options such a part
declares for itself (`actor.engine_options`, `learner.weights_options`) and the rules between
parts, such as a staleness unit the algorithm can score, LoRA adapters the engine can take over
the chosen transport, or ranks the devices can hold. Every launcher calls `validate_config`, so a
wrong config fails once, with a one-line message, instead of crashing every process it starts.
"""

from __future__ import annotations

from longhorizon.common.config import Config, ConfigError
from longhorizon.actor.engines.base import EngineError, capabilities_of, check_engine_settings, engine_class
from longhorizon.actor.engines.factory import engine_settings
from longhorizon.envs.base import get_env_spec, list_tasks
from longhorizon.common.plugins import PluginError
from longhorizon.learner.weights import publisher_class, transport_options
from longhorizon.learner.curriculum import make_schedule
from longhorizon.common.models import (
    IMAGE_PROCESSOR_FILES, ModelError, has_image_processor, resolve_device, resolve_model_path,
)
from longhorizon.actor.worker import actor_driver
from longhorizon.common.auth import auth_mechanism
from longhorizon.envs.agents import AgentLoopError, configured_agent, get_agent_loop
from longhorizon.common.lora import LoraError, check_targets_of_model_folder, lora_settings


def validate_config(config: Config) -> None:
    """Cheap checks before any process starts, so a wrong name fails once with a clear message
    instead of crashing every actor in a restart loop. A key's own range is checked on loading
    (common/config.py); these are the choices, the parts and the rules across keys."""
    from longhorizon.learner.worker import check_sampling_for_training

    def require(condition: bool, message: str) -> None:
        if not condition:
            raise ConfigError(message)

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
    transport_options(publisher, config.learner.weights_options, config.learner.weights_transport)
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
    _check_observation_image(config, capabilities_of(engine_cls))
    require(config.actor.max_context_tokens > config.actor.sampling.max_new_tokens,
            "actor.max_context_tokens must be larger than actor.sampling.max_new_tokens")
    try:
        check_sampling_for_training(config)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    get_env_spec(config.env.name)
    if config.actor.agent:
        try:
            get_agent_loop(config.actor.agent)
        except AgentLoopError as error:
            raise ConfigError(f"actor.agent: {error}") from None
    check_agent_options(config)
    require(not config.actor.history_summary or config.actor.history_turns > 0,
            "actor.history_summary adds the env's summary for the turns actor.history_turns leaves out of "
            "the model's view: set actor.history_turns > 0 as well")
    require(not config.actor.history_notes or config.actor.history_turns > 0,
            "actor.history_notes keeps the policy's notes in view when actor.history_turns leaves the turns that "
            "wrote them out: set actor.history_turns > 0 as well")
    env_class = get_env_spec(config.env.name).factory
    require(not (config.actor.history_summary and isinstance(env_class, type) and not hasattr(env_class, "summary")),
            f"actor.history_summary: env {config.env.name!r} gives no summary of an episode (it has no summary() "
            "method): set actor.history_summary = false")

    try:
        driver = actor_driver(config.actor.driver)
    except (PluginError, TypeError) as error:
        raise ConfigError(f"actor.driver: {error}") from None
    check_driver = getattr(driver, "check_config", None)
    if check_driver is not None:
        try:
            check_driver(config)
        except ValueError as error:
            raise ConfigError(str(error)) from None
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

    auth_mechanism(config.transport)


def _check_wandb(config: Config) -> None:
    """[logging.wandb]: the optional wandb package installed when it is on."""
    import importlib.util

    settings = config.logging.wandb
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


def _check_observation_image(config: Config, capabilities) -> None:
    """actor.observation_image: an engine that shows the model images, and a model folder with an
    image processor (looked for, not loaded)."""
    if not config.actor.observation_image:
        return
    if not capabilities.takes_images:
        raise ConfigError(f"actor.observation_image: the {config.actor.engine!r} engine cannot show the model "
                          "images (capabilities.takes_images): use the hf or vllm engine")
    try:
        folder = resolve_model_path(config.model.path, config.model.cache_dir)
    except ModelError as error:
        raise ConfigError(f"model.path: {error}") from None
    if not has_image_processor(folder):
        raise ConfigError(f"actor.observation_image: the model folder {folder} has no image processor "
                          f"(none of {', '.join(IMAGE_PROCESSOR_FILES)}): use a vision-language model's folder")


def _check_lora(config: Config, capabilities, publisher) -> None:
    """learner.lora: its keys, that the engine takes adapters the way the transport sends them, and
    that each target names modules of the model (checked on the architecture alone, without loading
    weights)."""
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


def check_agent_options(config: Config) -> None:
    """`actor.agent_options` against the loop's declared options, and, for a loop that plays an
    env by its tools, an env class that offers some (ConfigError)."""
    configured_agent(config.actor.agent, config.actor.agent_options)
    if not config.actor.agent:
        return
    loop = get_agent_loop(config.actor.agent)
    factory = get_env_spec(config.env.name).factory
    if getattr(loop, "needs_env_tools", False) and isinstance(factory, type) and not hasattr(factory, "tool_set"):
        raise ConfigError(
            f"actor.agent = {config.actor.agent!r} plays an env by its tools, and env {config.env.name!r} "
            "offers none: use a text agent loop (\"react\", \"bare\" or \"\" for the env's own)")

