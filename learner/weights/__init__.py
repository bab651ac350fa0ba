"""Weight transports, learner side: how a new version of the policy reaches the actors.

A transport is a `WeightsPublisher` subclass, found by name in `TRANSPORTS` (the setting
`learner.weights_transport`): the built-ins `inline` (tensors as frames on the broadcast socket),
`path` (a safetensors folder on a filesystem the actors share) and `collective` (byte buckets over
a torch.distributed pair group per actor), then the `longhorizon.weights` entry points, then a
dotted path `package.module:Class`.

The learner worker only talks to this interface: it builds each version between optimiser steps
(`build`, in a worker thread), publishes it (`publish`), tells per-actor transports who joined and
what they hold, and asks the class what it needs (`needs_control_channel`, `shared_filesystem`).
Whatever the transport, the actor receives one of three messages (`sends`): a `WeightsUpdate`
holding tensors, a `WeightsUpdate` naming a safetensors folder, or a `CollectiveWeights`
announcement; `actor/weights.py` turns any of them into a state dict, and an engine declares
which of the three it takes (`EngineCapabilities.weight_transports`).

A transport's own settings are the keys of `learner.weights_options`, declared by its `Options`
model (a `common.config.Section`: each key's type, default, range and docstring), checked before
any process starts and read as `self.options`; a transport that declares none takes none.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Mapping

from longhorizon.common.config import ConfigError, Section, check_section
from longhorizon.common.plugins import Registry

OPTIONS_KEY = "learner.weights_options"
"""The table of a transport's own keys, as errors name it."""

MESSAGE_FORMS = ("inline", "path", "collective")
"""What a transport may send: tensors in the message, a folder's location, or a collective
announcement whose bytes follow over a process group."""


@dataclass(frozen=True)
class PublisherContext:
    """What a publisher may need at start; each reads what it uses."""

    weights_dir: Path | None = None
    """A folder of the run the learner may write versions into (`run_dir/weights`)."""
    host: str = "127.0.0.1"
    """The address the learner's sockets listen on (the collective's rendezvous store uses it too)."""
    device: Any = "cpu"
    """The learner's device (a collective over NCCL keeps its buckets there)."""
    options: Mapping[str, Any] = field(default_factory=dict)
    """`learner.weights_options` as the config gives them: the publisher checks them against its
    `Options` when it is made (`self.options`)."""
    announce: Callable[[str, Any, float], None] | None = None
    """`announce(actor_id, message, timeout_s)` sends a message to one actor on its control socket,
    from any thread, blocking at most `timeout_s` seconds (the transport knows how long it may
    wait); only transports with `needs_control_channel` get it."""


class WeightsPublisher:
    """One transport's learner side. Subclass it, set the class attributes, implement `build`.

    `build` runs in a worker thread between optimiser steps and must copy what it keeps: the
    parameters change in place at the next step while the version may still be on its way.
    """

    sends: ClassVar[str] = "inline"
    """Which of MESSAGE_FORMS reaches the actors; engines declare the forms they take."""
    shared_filesystem: ClassVar[bool] = False
    """The actors read what the learner wrote to its disk: they must share its filesystem."""
    needs_control_channel: ClassVar[bool] = False
    """Each actor is served on its own (announced on its control socket) rather than by one
    broadcast to all; the learner then reports every actor's joins and versions to it."""
    Options: ClassVar[type[Section] | None] = None
    """Its keys, under `learner.weights_options`; None: it has none, and the table must be empty."""

    def __init__(self, context: PublisherContext) -> None:
        self.context = context
        self.options = transport_options(type(self), context.options)

    @classmethod
    def check(cls, config, learner_device, engine_capabilities) -> None:
        """Refuse settings this transport cannot work with, before any process starts (ValueError).
        The default: the engine must take the message this transport sends."""
        accepted = tuple(engine_capabilities.weight_transports)
        if cls.sends not in accepted:
            raise ValueError(
                f"actor.engine {config.actor.engine!r} cannot take weights sent as {cls.sends!r} "
                f"(learner.weights_transport = {config.learner.weights_transport!r}); it takes "
                f"{', '.join(accepted) or 'none'}: set learner.weights_transport to a transport that sends one of those"
            )

    def build(self, state: Mapping[str, Any], version: int) -> Any:
        """The message (or snapshot) of `version` from a full state dict ({name: tensor}); it owns
        its bytes. Has a `.version`."""
        raise NotImplementedError

    def payload_bytes(self, built: Any) -> int:
        """Tensor bytes one version moves (for the metrics)."""
        raise NotImplementedError

    async def publish(self, built: Any, broadcast) -> None:
        """Send `built` to every actor; `broadcast` is the learner's broadcast socket. The
        default sends the message on it (every subscriber gets it)."""
        await broadcast.send(built)

    def actor_joined(self, actor_id: str, holds: int | None) -> None:
        """An actor (re)started holding version `holds` (per-actor transports only)."""

    def keep_current(self, actor_id: str, reported: int | None, heard_at: float) -> None:
        """An actor heard from at `heard_at` (time.monotonic) reports `reported` (per-actor
        transports only): make sure it gets the latest version."""

    def close(self) -> None:
        """Release what the transport holds (sockets, threads); old versions on disk may stay."""


def transport_options(transport: type[WeightsPublisher], options: Mapping[str, Any], name: str = "") -> Any:
    """`learner.weights_options` checked against the transport's `Options` (a ConfigError naming the
    key), or None for a transport that declares none, which then takes no keys. `name`: what
    `learner.weights_transport` says, for the message."""
    if transport.Options is None:
        if options:
            which = f"learner.weights_transport = {name!r}" if name else f"the weights transport {transport.__name__}"
            raise ConfigError(f"{OPTIONS_KEY} sets {', '.join(_with_readers(sorted(options)))}, but {which} "
                              "declares no options of its own: remove them")
        return None
    return check_section(transport.Options, dict(options), OPTIONS_KEY)


def _with_readers(keys: list[str]) -> list[str]:
    """Each key, with the built-in transports that read it where there are some: "bucket_mb (read
    by collective)"."""
    named = []
    for key in keys:
        readers = [builtin for builtin in TRANSPORTS.builtin_names()
                   if key in getattr(TRANSPORTS.get(builtin).Options, "model_fields", ())]
        named.append(f"{key} (read by {', '.join(readers)})" if readers else key)
    return named


def _check_publisher(name: str, part: Any) -> None:
    if not (isinstance(part, type) and issubclass(part, WeightsPublisher)):
        raise TypeError(f"weights transport {name!r} must be a WeightsPublisher subclass, got {part!r}")
    if part.sends not in MESSAGE_FORMS:
        raise TypeError(f"weights transport {name!r} sends {part.sends!r}; it must be one of {', '.join(MESSAGE_FORMS)}")
    if part.Options is not None and not (isinstance(part.Options, type) and issubclass(part.Options, Section)):
        raise TypeError(f"weights transport {name!r}: its Options must be a "
                        f"longhorizon.common.config.Section, got {part.Options!r}")


TRANSPORTS: Registry[type[WeightsPublisher]] = Registry(
    "weights transport", "longhorizon.weights",
    {
        "inline": "longhorizon.learner.weights.inline:InlinePublisher",
        "path": "longhorizon.learner.weights.path:PathPublisher",
        "collective": "longhorizon.learner.weights.collective:CollectivePublisher",
    },
    check=_check_publisher,
)


def publisher_class(name: str) -> type[WeightsPublisher]:
    """The transport class `learner.weights_transport` names (PluginError if there is none)."""
    return TRANSPORTS.get(name)


def build_publisher(name: str, context: PublisherContext) -> WeightsPublisher:
    return publisher_class(name)(context)


def weights_options_schemas() -> dict:
    """The JSON schema of each built-in transport's declared options, by name (`longhorizon config
    schema`); transports that take none are left out."""
    return {name: TRANSPORTS.get(name).Options.model_json_schema()
            for name in TRANSPORTS.builtin_names() if TRANSPORTS.get(name).Options is not None}
