"""One way to build the configured engine, whatever it is for.

`build_engine(config, purpose)` picks the class `actor.engine` names (actor/engines/base.py:
`ENGINES`), resolves the model it plays when its capabilities say it plays one, lets the class
adjust its options to the purpose (`options_for`, optional), and starts it. Purposes:

- `train`: an actor of a training run (`actor_index` varies the sampling seed);
- `eval`, `collect`: play episodes for a score or for data; an engine that can run without a
  local model (a hosted endpoint) takes model.path as the hosted model's name;
- `checkpoint`: play a model folder the run wrote (`model_path`), greedily or not: the configured
  engine when it is one that loads local weights, otherwise the default model engine, since the
  data may have been played by a scripted oracle or an endpoint.
"""

from __future__ import annotations

import dataclasses

from longhorizon.actor.engines.base import (
    Engine,
    EngineSettings,
    capabilities_of,
    engine_class,
)
from longhorizon.common.config import Config
from longhorizon.common.models import ModelError, require_model_folder, resolve_model_path

PURPOSES = ("train", "eval", "collect", "checkpoint")

DEFAULT_MODEL_ENGINE = "hf"
"""What plays a model folder when the configured engine plays no local weights (`checkpoint`)."""


def engine_settings(config: Config, model_path: str, actor_index: int = 0) -> EngineSettings:
    actor = config.actor
    return EngineSettings(
        model_path=model_path,
        dtype=config.model.dtype,
        sampling=actor.sampling,
        max_batch_size=actor.max_batch_size,
        env_name=config.env.name,
        env_options=dict(config.env.options),
        scripted_policy=actor.scripted_policy,
        agent=actor.agent,
        agent_options=dict(actor.agent_options),
        simulated_token_latency_s=actor.simulated_token_latency_s,
        seed=config.run.seed * 1000 + actor_index,  # actors must not sample identical streams
        torch_threads=actor.torch_threads,
        engine_options=dict(actor.engine_options),
        lora=dict(config.learner.lora),
    )


def plays_local_weights(engine_cls: type) -> bool:
    """Whether the engine loads a local model folder and its weight updates: what a recipe that
    trains the model it samples with (RL, rejection sampling) or plays a checkpoint needs."""
    capabilities = capabilities_of(engine_cls)
    return capabilities.needs_local_model and capabilities.accepts_weights and capabilities.samples


def plan_engine(
    config: Config, purpose: str, *, model_path: str | None = None, actor_index: int = 0,
    engine_options: dict | None = None, greedy: bool = False,
) -> tuple[type, EngineSettings]:
    """The engine class and the settings `build_engine` would start it with."""
    if purpose not in PURPOSES:
        raise ValueError(f"unknown engine purpose {purpose!r}; valid: {', '.join(PURPOSES)}")
    name = config.actor.engine
    engine_cls = engine_class(name)
    options = dict(config.actor.engine_options)
    if purpose == "checkpoint" and not plays_local_weights(engine_cls):
        # Its options were written for the configured engine, not this one.
        engine_cls, options = engine_class(DEFAULT_MODEL_ENGINE), {}
    options.update(engine_options or {})
    capabilities = capabilities_of(engine_cls)
    hosted_model = None
    if model_path and capabilities.uses_model:
        require_model_folder(model_path)
    if model_path is None:
        model_path = ""
        if capabilities.uses_model:
            try:
                model_path = str(resolve_model_path(config.model.path, config.model.cache_dir))
            except ModelError:
                if capabilities.needs_local_model or purpose == "train":
                    raise
                hosted_model = config.model.path  # an endpoint serving the model by that name
    adjust = getattr(engine_cls, "options_for", None)
    if adjust is not None:
        options = adjust(options, purpose=purpose, hosted_model=hosted_model)
    settings = dataclasses.replace(engine_settings(config, str(model_path), actor_index), engine_options=options)
    if greedy:
        settings = dataclasses.replace(settings, sampling=settings.sampling.replace(temperature=0.0))
    return engine_cls, settings


def build_engine(config_or_settings: Config | EngineSettings, purpose: str = "train", *, name: str | None = None,
                 **plan) -> Engine:
    """The engine for `purpose`, started (blocking; tens of seconds for vLLM). Given a Config,
    `actor.engine` as `plan_engine` resolves it (keywords: model_path, actor_index,
    engine_options, greedy); given EngineSettings, the engine called `name` with them as they are."""
    if isinstance(config_or_settings, EngineSettings):
        if name is None:
            raise ValueError("build_engine(settings, ...) needs the engine's name")
        return engine_class(name)(config_or_settings)
    engine_cls, settings = plan_engine(config_or_settings, purpose, **plan)
    return engine_cls(settings)
