"""The engine interface every actor type implements, its declared capabilities, and the engine registry.

An engine turns token ids into new token ids with the log-prob of each sampled token, loads new
weights in place, and reports the version of the weights it holds. What it can do is declared on
its class (`capabilities`, an `EngineCapabilities`): the launchers and recipes ask that, never the
engine's name. Engines are found through `ENGINES` (common/plugins.py): the built-ins below, then
the `longhorizon.engines` entry points, then a dotted path `package.module:Class` as the name.
`actor/engines/factory.py` builds the configured engine for a purpose (train, eval, collect, ...).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

from longhorizon.common.chat import ChatTokenizer
from longhorizon.common.config import SamplingConfig, check_section
from longhorizon.common.plugins import PluginError, Registry


@dataclass(frozen=True)
class EngineCapabilities:
    """What an engine can do; set as the class attribute `capabilities` of each engine."""

    uses_model: bool = True
    """Plays a language model (model.path is resolved for it); False for scripted policies."""
    needs_local_model: bool = True
    """Cannot run without a local model folder (False: it may play a hosted model by name)."""
    accepts_weights: bool = True
    """Takes weight updates from the learner, so a training run can improve what it plays."""
    takes_lora: bool = False
    """With learner.lora, takes updates of the LoRA adapters alone."""
    samples: bool = True
    """Samples with the configured temperature, recording the behaviour log-prob of each token."""
    weight_transports: tuple[str, ...] = ("inline", "path")
    """The weights messages it loads: `inline` tensors, a `path` to a safetensors folder, a
    `collective` announcement (a transport's `sends`, learner/weights/)."""
    lora_weight_transports: tuple[str, ...] | None = None
    """The messages LoRA adapters may come as, when fewer than `weight_transports` (None: the same)."""
    takes_images: bool = False
    """Shows a vision-language model the images of a request (`GenerationRequest.images`), so
    actor.observation_image can be used with it."""

    def lora_transports(self) -> tuple[str, ...]:
        return self.weight_transports if self.lora_weight_transports is None else self.lora_weight_transports


def capabilities_of(engine_class: type) -> EngineCapabilities:
    """An engine class's declared capabilities (the defaults for a class that declares none; an
    older plug-in's `needs_model = False` still reads as not needing a local model)."""
    declared = getattr(engine_class, "capabilities", None)
    if isinstance(declared, EngineCapabilities):
        return declared
    return EngineCapabilities(needs_local_model=bool(getattr(engine_class, "needs_model", True)))


def _check_engine(name: str, part: Any) -> None:
    if not isinstance(part, type):
        raise TypeError(f"engine {name!r} must be a class taking EngineSettings, got {part!r}")
    declared = getattr(part, "capabilities", None)
    if declared is not None and not isinstance(declared, EngineCapabilities):
        raise TypeError(f"engine {name!r}: `capabilities` must be an EngineCapabilities, got {declared!r}")


ENGINES: Registry[type] = Registry(
    "engine", "longhorizon.engines",
    {
        "hf": "longhorizon.actor.engines.hf:HFEngine",
        "scripted": "longhorizon.actor.engines.scripted:ScriptedEngine",
        "vllm": "longhorizon.actor.engines.vllm:VLLMEngine",
        "openai": "longhorizon.actor.engines.openai:OpenAIEngine",
    },
    check=_check_engine,
)


@dataclass
class GenerationRequest:
    """One turn to generate for one episode."""

    token_ids: list[int]
    """The whole conversation so far, ending with the assistant prompt."""
    episode_id: str
    """Lets stateful engines (scripted policies) follow an episode across turns."""
    messages: list[dict] = field(default_factory=list)
    """The same conversation as text messages (scripted engines act on text)."""
    task: Any = None
    """The env Task being played (scripted oracles may use it)."""
    stop_strings: tuple[str, ...] = ()
    """The turn ends with the first of these in the reply (kept in it), e.g. the search env's
    "</search>": what a model writes after its tool call would otherwise be trained on."""
    images: list[bytes] = field(default_factory=list)
    """Images shown in `token_ids` (PNG or JPEG bytes), in the order of their tokens: the
    screenshots of the observations in view, for a vision-language model. Empty for text."""


@dataclass
class GenerationResult:
    token_ids: list[int]
    """Sampled tokens, including the end-of-turn token when the model produced it."""
    logprobs: list[float]
    """Log-prob of each sampled token under the sampling distribution (behaviour policy)."""
    text: str
    """Decoded reply without special tokens."""
    stopped_on_eos: bool
    """False when the turn hit max_new_tokens before the end-of-turn token."""
    policy_version: int
    """Version of the weights that generated this turn."""


@dataclass(frozen=True)
class EngineSettings:
    """Everything an engine may need to start; each engine reads what it uses."""

    model_path: str = ""
    """Local model folder (already resolved)."""
    dtype: str = "float32"
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    max_batch_size: int = 16
    env_name: str = ""
    env_options: dict = field(default_factory=dict)
    scripted_policy: str = "oracle"
    agent: str = ""
    """actor.agent: a scripted policy writes its env's own replies, which the scripted engine
    turns into the chosen loop's (tool calls for `tools`)."""
    agent_options: dict = field(default_factory=dict)
    simulated_token_latency_s: float = 0.0
    seed: int = 0
    torch_threads: int = 1
    engine_options: dict = field(default_factory=dict)
    """actor.engine_options: settings only this engine understands (it rejects unknown ones)."""
    lora: dict = field(default_factory=dict)
    """learner.lora: when set, the learner sends only LoRA adapters, and an engine that takes
    them wraps its model with the same adapters (common/lora.py)."""


class Engine(Protocol):
    tokenizer: ChatTokenizer
    policy_version: int

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        """Generate one assistant turn; many calls may be in flight at once."""

    def update_weights(self, update: Any) -> None:
        """Load a weights message in place (blocking; the actor calls it from a worker thread);
        `actor.weights.WeightsReceiver` turns any of them into a state dict."""

    def end_episode(self, episode_id: str) -> None:
        """Forget per-episode state."""

    async def close(self) -> None:
        """Release resources."""


class EngineError(ValueError):
    """An engine cannot be found or started."""


def engine_names() -> list[str]:
    return ENGINES.names()


def engine_class(name: str) -> type:
    """The engine class `actor.engine` names (EngineError if there is none)."""
    try:
        return ENGINES.get(name)
    except (PluginError, TypeError) as error:
        raise EngineError(str(error)) from None


def tokens_through_stop_string(
    decode: Callable[[list[int]], str], token_ids: list[int], stop_strings: Sequence[str]
) -> int | None:
    """How many of `token_ids` it takes for their decoded text to contain one of `stop_strings`
    (the reply is cut after that token), or None if the text never does.

    Engines apply it to what they sampled; the log-probs of the kept tokens are unchanged, as a
    prefix's probability does not depend on what followed it. A binary search over prefixes: once
    a stop string appears in the decoded text, longer prefixes contain it too.
    """
    if not stop_strings or not token_ids:
        return None

    def contains_stop(count: int) -> bool:
        text = decode(token_ids[:count])
        return any(stop in text for stop in stop_strings)

    if not contains_stop(len(token_ids)):
        return None
    low, high = 1, len(token_ids)
    while low < high:
        middle = (low + high) // 2
        if contains_stop(middle):
            high = middle
        else:
            low = middle + 1
    return low


def reject_engine_options(engine_name: str, settings: EngineSettings) -> None:
    """For engines without options of their own: a setting meant for another engine is a mistake
    to report, not to ignore."""
    if settings.engine_options:
        raise ValueError(
            f"the {engine_name} engine takes no engine options, got {', '.join(sorted(settings.engine_options))}"
        )


def engine_options(engine_cls: type, options: dict) -> Any:
    """`actor.engine_options` as the engine declares them: its `Options` model (a
    `common.config.Section`, each key with its type, default and docstring) checked, or a
    ConfigError naming the key; the dict itself for an engine that declares none and reads its
    options itself."""
    declared = getattr(engine_cls, "Options", None)
    if declared is None:
        return dict(options)
    # An engine whose options may also come as text (environment variables, a command-line
    # flag) converts them in its model's `from_mapping` before the same check.
    from_mapping = getattr(declared, "from_mapping", None)
    if from_mapping is not None:
        return from_mapping(dict(options))
    return check_section(declared, dict(options), "actor.engine_options")


def engine_options_schemas() -> dict:
    """The JSON schema of each built-in engine's declared options, by name (`longhorizon config
    schema`); engines that take none are left out."""
    schemas = {}
    for name in ENGINES.builtin_names():
        declared = getattr(ENGINES.get(name), "Options", None)
        if declared is not None:
            schemas[name] = declared.model_json_schema()
    return schemas


def check_engine_settings(engine_cls: type, settings: EngineSettings) -> None:
    """The engine's own checks of its settings before any process starts (ValueError): its
    declared options (`engine_options`), then its `check_settings` (a classmethod) where it has
    one: e.g. the scripted engine's policy exists."""
    engine_options(engine_cls, settings.engine_options)
    check = getattr(engine_cls, "check_settings", None)
    if check is not None:
        check(settings)


def make_engine(name: str, settings: EngineSettings) -> Engine:
    """The engine called `name`, started with `settings` (build_engine starts the configured one)."""
    return engine_class(name)(settings)
