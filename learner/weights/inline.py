"""The `inline` transport: every tensor travels as a frame of one message on the broadcast socket.

Works across hosts and needs nothing shared. bfloat16 goes as its raw 2-byte patterns (uint16
arrays, named in `WeightsUpdate.bfloat16_tensors`), so a bf16 model moves half the bytes it would
widened to float32 and comes back bit for bit.

Copies on the way: one here (the parameters into owned CPU memory, which `build` must make: ZeroMQ
sends large frames without copying, from a thread of its own and possibly long after `send`
returned, and the same message is re-sent to actors that join later, while the learner keeps
training in place); the kernel's socket copies; ZeroMQ's receive buffer; and the engine's copy into
its parameters (`load_state_dict`). Nothing else: frames go out as views of the owned tensors, and
the actor reads the received frames in place.

The owned copy goes into the memory of an earlier version once nothing refers to it any more (no
message, no frame ZeroMQ still holds): memory already in place costs several times less to write
than new pages on a virtual machine (docs/benchmarks.md). The price is a second copy of the
weights kept in the learner between updates (the one being sent, and the spare).
"""

from __future__ import annotations

import sys
from typing import Any, Mapping

import numpy as np
import torch

from longhorizon.common.collective import copy_into, sole_owner
from longhorizon.common.wire import WeightsUpdate
from longhorizon.learner.weights import WeightsPublisher

KEPT_COPIES = 2
"""Owned copies the publisher keeps: the latest version's, and one to write the next into."""


def owned_arrays(
    state: Mapping[str, torch.Tensor], into: Mapping[str, torch.Tensor] | None = None,
) -> tuple[dict[str, np.ndarray], list[str], dict[str, torch.Tensor]]:
    """Copies of `state`'s tensors as numpy arrays in CPU memory nothing else holds, the names of
    those that are bfloat16 (sent as their uint16 bit patterns), and the torch tensors that own
    that memory. `into`: tensors to copy into (the caller knows nothing refers to them and that
    they match `state`'s names, shapes and dtypes); new ones are made otherwise."""
    arrays: dict[str, np.ndarray] = {}
    bfloat16_names: list[str] = []
    owners: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        tensor = tensor.detach()
        owned = into[name] if into is not None else torch.empty(tensor.shape, dtype=tensor.dtype)
        copy_into(owned, tensor)
        owners[name] = owned
        if owned.dtype == torch.bfloat16:
            arrays[name] = owned.view(torch.int16).numpy().view(np.uint16)
            bfloat16_names.append(name)
        else:
            arrays[name] = owned.numpy()
    return arrays, bfloat16_names, owners


def _unreferenced(owners: dict[str, torch.Tensor]) -> bool:
    """Whether only the publisher still refers to these tensors' memory. A numpy array over a
    tensor (and every view of that array, down to a frame ZeroMQ holds) refers to the tensor
    object; a torch view (bfloat16 viewed as int16) shares its storage: both are counted."""
    # getrefcount's argument, the dict's value and the generator's variable: 3.
    return all(sys.getrefcount(tensor) <= 3 and sole_owner(tensor) for tensor in owners.values())


def _fits(owners: dict[str, torch.Tensor], state: Mapping[str, torch.Tensor]) -> bool:
    return owners.keys() == state.keys() and all(
        owners[name].shape == tensor.shape and owners[name].dtype == tensor.dtype for name, tensor in state.items()
    )


class InlinePublisher(WeightsPublisher):
    """Tensors in the message itself, one broadcast to every actor."""

    sends = "inline"

    def __init__(self, context) -> None:
        super().__init__(context)
        self._copies: list[dict[str, torch.Tensor]] = []
        """The owned tensors of the latest builds, oldest first (at most KEPT_COPIES)."""

    def build(self, state: Mapping[str, Any], version: int) -> WeightsUpdate:
        reuse = None
        for index, owners in enumerate(self._copies):
            if _fits(owners, state) and _unreferenced(owners):
                reuse = self._copies.pop(index)
                break
        arrays, bfloat16_names, owners = owned_arrays(state, reuse)
        del reuse
        self._copies.append(owners)
        del self._copies[:-KEPT_COPIES]
        return WeightsUpdate(version=version, tensors=arrays, bfloat16_tensors=bfloat16_names)

    def payload_bytes(self, built: WeightsUpdate) -> int:
        return int(sum(array.nbytes for array in built.tensors.values()))

    def close(self) -> None:
        self._copies.clear()
