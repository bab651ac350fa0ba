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
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import torch

from longhorizon.common.wire import WeightsUpdate
from longhorizon.learner.weights import WeightsPublisher


def owned_arrays(state: Mapping[str, torch.Tensor]) -> tuple[dict[str, np.ndarray], list[str]]:
    """Copies of `state`'s tensors as numpy arrays in CPU memory nothing else holds, and the names
    of those that are bfloat16 (sent as their uint16 bit patterns)."""
    arrays: dict[str, np.ndarray] = {}
    bfloat16_names: list[str] = []
    for name, tensor in state.items():
        owned = tensor.detach().to(device="cpu", memory_format=torch.contiguous_format, copy=True)
        if owned.dtype == torch.bfloat16:
            arrays[name] = owned.view(torch.int16).numpy().view(np.uint16)
            bfloat16_names.append(name)
        else:
            arrays[name] = owned.numpy()
    return arrays, bfloat16_names


class InlinePublisher(WeightsPublisher):
    """Tensors in the message itself, one broadcast to every actor."""

    sends = "inline"

    def build(self, state: Mapping[str, Any], version: int) -> WeightsUpdate:
        arrays, bfloat16_names = owned_arrays(state)
        return WeightsUpdate(version=version, tensors=arrays, bfloat16_tensors=bfloat16_names)

    def payload_bytes(self, built: WeightsUpdate) -> int:
        return int(sum(array.nbytes for array in built.tensors.values()))
