"""Weights and horizon out to the actors.

`inline` sends every tensor as its own zero-copy frame over the broadcast socket and works
across hosts; `path` writes a safetensors folder that actors read from a shared filesystem and
sends only its location; `collective` streams byte buckets over a torch.distributed group per
actor (learner/weight_sync.py), announced on each actor's control socket. The horizon update goes
first, so an actor that sees a new version already knows the cap that comes with it.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import torch

from longhorizon.common.wire import HorizonUpdate, WeightsUpdate
from longhorizon.learner.curriculum import HorizonState

log = logging.getLogger(__name__)

WEIGHTS_TRANSPORTS = ("inline", "path", "collective")


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


def _tensors(model) -> dict[str, torch.Tensor]:
    return dict(model) if isinstance(model, dict) else unique_state_dict(model)


def make_weights_update(model, version: int, transport: str, weights_dir: Path | None = None) -> WeightsUpdate:
    """The weights of `version`, as a message that owns its bytes. `model` is a model, or its
    tensors as `unique_state_dict` names them (a sharded learner gathers them first).

    `inline` copies every tensor: ZeroMQ sends large frames without copying, from a thread of its
    own and possibly long after `send` returned, and the same message is re-sent to actors that
    join later, while the learner keeps training in place. Frames that were views of the live
    parameters would go out holding values of later versions (torn weights).
    """
    if transport == "inline":
        tensors = {}
        for name, tensor in _tensors(model).items():
            # numpy has no bfloat16: sent as float32, the engine casts back on load.
            dtype = torch.float32 if tensor.dtype == torch.bfloat16 else tensor.dtype
            owned = tensor.to(device="cpu", dtype=dtype, memory_format=torch.contiguous_format, copy=True)
            tensors[name] = owned.numpy()
        return WeightsUpdate(version=version, tensors=tensors)
    if transport == "path":
        if weights_dir is None:
            raise ValueError("weights_transport 'path' needs a weights folder")
        from safetensors.torch import save_file

        folder = weights_dir / f"v{version:06d}"
        partial = folder.with_name(folder.name + ".partial")
        partial.mkdir(parents=True, exist_ok=True)
        save_file({k: v.to("cpu").contiguous() for k, v in _tensors(model).items()}, partial / "model.safetensors")
        if folder.exists():
            shutil.rmtree(folder)
        partial.rename(folder)
        _prune(weights_dir, keep=3)
        return WeightsUpdate(version=version, path=str(folder.resolve()))
    if transport == "collective":
        raise ValueError("the collective transport sends no WeightsUpdate: use learner.weight_sync.CollectiveSender")
    raise ValueError(f"unknown weights_transport {transport!r}; valid: {', '.join(WEIGHTS_TRANSPORTS)}")


def _prune(weights_dir: Path, keep: int) -> None:
    """Keep the newest folders: actors may still be reading the previous version."""
    folders = sorted(p for p in weights_dir.glob("v*") if p.is_dir() and not p.name.endswith(".partial"))
    for old in folders[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def horizon_update(state: HorizonState) -> HorizonUpdate:
    return HorizonUpdate(horizon_cap=state.cap, stage=state.stage, learner_step=state.step)


async def broadcast(sender, horizon: HorizonState, weights: WeightsUpdate | None) -> None:
    await sender.send(horizon_update(horizon))
    if weights is not None:
        await sender.send(weights)
