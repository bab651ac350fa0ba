"""The engine interface every actor type implements, and lookup of engines by name.

An engine turns token ids into new token ids with the log-prob of each sampled token, loads new
weights in place, and reports the version of the weights it holds. Engines are found by name:
the built-ins below, then anything registered under the `longhorizon.engines` entry point group.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any, Callable, Protocol, Sequence

from longhorizon.common.chat import ChatTokenizer
from longhorizon.common.config import SamplingConfig

ENTRY_POINT_GROUP = "longhorizon.engines"

_BUILTIN_ENGINES = {
    "hf": "longhorizon.actor.engines.hf:HFEngine",
    "scripted": "longhorizon.actor.engines.scripted:ScriptedEngine",
    "vllm": "longhorizon.actor.engines.vllm:VLLMEngine",
    "openai": "longhorizon.actor.engines.openai:OpenAIEngine",
}


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
        """Load a `WeightsUpdate` in place (blocking; the actor calls it from a worker thread)."""

    def end_episode(self, episode_id: str) -> None:
        """Forget per-episode state."""

    async def close(self) -> None:
        """Release resources."""


class EngineError(ValueError):
    """An engine cannot be found or started."""


def engine_names() -> list[str]:
    names = set(_BUILTIN_ENGINES)
    names.update(ep.name for ep in entry_points(group=ENTRY_POINT_GROUP))
    return sorted(names)


def load_engine_class(name: str) -> type:
    """Find an engine class by name: built-ins first, then the entry point group."""
    target = _BUILTIN_ENGINES.get(name)
    if target is None:
        matches = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == name]
        if not matches:
            raise EngineError(f"unknown engine {name!r}; available: {', '.join(engine_names())}")
        return matches[0].load()
    module_name, _, attribute = target.partition(":")
    return getattr(importlib.import_module(module_name), attribute)


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


def make_engine(name: str, settings: EngineSettings) -> Engine:
    return load_engine_class(name)(settings)
