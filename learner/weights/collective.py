"""The `collective` transport's publisher: byte buckets over a torch.distributed pair group per
actor, each delivery announced on the actor's control socket (the sender itself, its threads and
its failure handling are in learner/weight_sync.py)."""

from __future__ import annotations

import logging
from typing import Any, Literal, Mapping

from longhorizon.common.config import Section, bounded
from longhorizon.learner.weights import WeightsPublisher, transport_options
from longhorizon.learner.weight_sync import check_collective_settings, CollectiveSender, resolve_backend

log = logging.getLogger(__name__)


class CollectiveOptions(Section):
    """The collective transport's keys of `learner.weights_options`."""

    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """The process-group backend. auto (nccl when the learner trains on a CUDA GPU, else gloo),
    gloo (buffers in CPU memory) or nccl (GPU buffers; the engines must be on GPUs)."""
    bucket_mb: int = bounded(128, ge=1)
    """Tensors travel in buckets of about this many MiB, one broadcast each (a larger tensor
    travels alone); dtypes are kept (bf16 stays bf16)."""
    timeout_s: float = bounded(120.0, gt=0)
    """The longest any one wait may take (forming an actor's group, sending or receiving a bucket,
    announcing an update on the actor's control socket); past it the waiting side raises an error
    naming its peer, the learner drops that actor's group and the others carry on. It must cover
    the time an engine needs to take an update between turns (the hf engine waits for its batch in
    progress)."""


class CollectivePublisher(WeightsPublisher):
    """Each actor served on its own over a pair group; nothing goes on the broadcast socket."""

    sends = "collective"
    needs_control_channel = True
    Options = CollectiveOptions

    def __init__(self, context) -> None:
        super().__init__(context)
        self.sender = None  # started on first use (it serves a rendezvous store and threads)

    @classmethod
    def check(cls, config, learner_device, engine_capabilities) -> None:
        super().check(config, learner_device, engine_capabilities)
        options = transport_options(cls, config.learner.weights_options, config.learner.weights_transport)
        check_collective_settings(config, options.backend, learner_device)

    def _sender(self):
        if self.sender is None:
            options, announce = self.options, self.context.announce
            if announce is None:
                raise ValueError("the collective transport needs a control channel to announce updates on")
            self.sender = CollectiveSender(
                host=self.context.host, backend=resolve_backend(options.backend, self.context.device),
                timeout_s=options.timeout_s, bucket_bytes=options.bucket_mb << 20,
                announce=lambda actor_id, message: announce(actor_id, message, options.timeout_s),
                device=self.context.device,
            )
            log.info(
                "collective weights: store at %s:%d, backend %s, buckets of %d MiB, timeout %.0f s",
                self.sender.server.host, self.sender.server.port, self.sender.backend,
                options.bucket_mb, options.timeout_s,
            )
        return self.sender

    def build(self, state: Mapping[str, Any], version: int):
        # Copied into owned buckets: the actors' transfers read those, never the parameters.
        return self._sender().snapshot(state, version)

    def payload_bytes(self, built) -> int:
        return int(built.layout.total_bytes)

    async def publish(self, built, broadcast) -> None:
        # In the background, per actor (training goes on meanwhile); actors that hold this
        # version are sent nothing.
        self._sender().publish(built)

    def actor_joined(self, actor_id: str, holds: int | None) -> None:
        # A new process: a new group (the old one, if any, died with its process).
        self._sender().join(actor_id, holds)

    def keep_current(self, actor_id: str, reported: int | None, heard_at: float) -> None:
        if self.sender is not None:
            self.sender.keep_current(actor_id, reported, heard_at)

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
