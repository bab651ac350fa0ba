"""Weights and horizon out to the actors: the state dict a version is built from, the horizon
message, and a one-call way to build one transport's message (tests and benchmarks).

The transports themselves are in learner/weights/. The horizon update goes out before the
weights, so an actor that sees a new version already knows the cap that comes with it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from longhorizon.common.wire import HorizonUpdate
from longhorizon.learner.curriculum import HorizonState
from longhorizon.learner.weights import PublisherContext, build_publisher


def unique_state_dict(model) -> dict[str, torch.Tensor]:
    """The model's tensors, detached, with tied (shared-storage) duplicates left out."""
    seen: set[int] = set()
    state: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        key = tensor.untyped_storage().data_ptr()
        if key in seen:
            continue
        seen.add(key)
        state[name] = tensor.detach()
    return state


def make_weights_update(model, version: int, transport: str, weights_dir: Path | None = None):
    """The message `transport` builds for `version` from a model, or from its tensors as
    `unique_state_dict` names them (a sharded learner gathers them first)."""
    state = dict(model) if isinstance(model, dict) else unique_state_dict(model)
    return build_publisher(transport, PublisherContext(weights_dir=weights_dir)).build(state, version)


def horizon_update(state: HorizonState) -> HorizonUpdate:
    return HorizonUpdate(horizon_cap=state.cap, stage=state.stage, learner_step=state.step)
