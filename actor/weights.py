"""Weights, actor side: any weights message the learner sends, turned into a state dict.

Whatever `learner.weights_transport` the learner uses, an actor receives one of three messages:
a `WeightsUpdate` holding the tensors (inline), a `WeightsUpdate` naming a safetensors folder
(path), or a `CollectiveWeights` announcement whose bytes follow over a torch.distributed pair
group. `WeightsReceiver.receive` takes any of them and returns {name: torch tensor}; an engine
holds one receiver (the collective's group lives in it, across updates) and loads what it
returns. Engines do not branch on the transport.

Before an engine copies a single tensor it checks the whole update against its model
(`common.models.weights_problems`: names, shapes, dtypes, finite values; LoRA adapters against
their base layers) and refuses one that does not fit with `WeightsRefused`, keeping its version;
the actor counts and logs the refusal and goes on with the weights it holds.
`folder_problems` makes that check on a folder, one tensor at a time.

Inline tensors come back as views of the received frames, without a copy: they are read-only,
and the engine copies them into its parameters (`load_state_dict`, `load_adapters`). bfloat16
travels as its uint16 bit patterns (the message names those tensors) and is viewed back as
bfloat16, bit for bit.

The collective's receiving end (`CollectiveReceiver`) runs in the process where the model lives
(the actor process for `hf`, vLLM's worker process for `vllm`). It joins the pair group the
announcement names (forming it when the name is new: the first update, a learner restart, or a
group that broke), receives every bucket, checks each bucket's CRC32 when the learner sent one
(in a second thread, while the next bucket arrives), and returns the tensors as views of the
buckets. The buckets are received into the previous update's buffers when nothing refers to
them any more (the engine has loaded or dropped that update), so their pages are already in
memory. The engine swaps the tensors in between turns, so the model keeps generating with the
old version while the bytes arrive. A failure (the learner gone, a
wait past the announced timeout, a corrupt bucket) raises `CollectiveError` naming the learner's
store and the group, and drops the group: the learner forms a new one when it sends again.
"""

from __future__ import annotations

import logging
import warnings
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from longhorizon.common.collective import (
    CollectiveError,
    broadcast_bucket,
    close_group,
    connect_store,
    layout_of,
    local_address_towards,
    open_pair_group,
    reusable_buckets,
    unpack_buckets,
)
from longhorizon.common.models import WeightsRefused, weights_problems
from longhorizon.common.wire import CollectiveWeights, WeightsUpdate

log = logging.getLogger(__name__)


class WeightsReceiver:
    """One engine's end of every weights transport: `receive(update)` -> {name: tensor}."""

    def __init__(self, device="cpu") -> None:
        self.device = device
        """Where collective NCCL buckets land (the engine's GPU)."""
        self._collective: CollectiveReceiver | None = None  # made on the first collective update

    def receive(self, update: Any) -> dict:
        """The tensors of any weights message (blocking: call it from a worker thread)."""
        if isinstance(update, CollectiveWeights):
            if self._collective is None:
                self._collective = CollectiveReceiver(self.device)
            return self._collective.receive(update)
        if isinstance(update, WeightsUpdate):
            if update.path is not None:
                return read_weights_folder(update.path)
            return tensors_of_arrays(update.tensors, update.bfloat16_tensors)
        raise TypeError(f"not a weights message: {type(update).__name__}")

    def close(self) -> None:
        if self._collective is not None:
            self._collective.close()


def _safetensors_files(folder: str | Path) -> list[Path]:
    """The weights files of a path-transport version: a folder gone (removed while the run goes
    on) or empty is a refused update, which the actor counts and serves on through, not an error
    that ends it."""
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        reason = "does not exist" if not Path(folder).is_dir() else "holds no safetensors files"
        raise WeightsRefused([f"the weights folder {folder} {reason}"])
    return files


def read_weights_folder(folder: str | Path) -> dict:
    """Every tensor of the safetensors files in `folder`."""
    from safetensors.torch import load_file

    state: dict = {}
    for file in _safetensors_files(folder):
        state.update(load_file(file))
    return state


def folder_problems(folder: str | Path, expected: dict, *, optional=()) -> list[str]:
    """`weights_problems` (common/models.py) for the safetensors files in `folder`, read one
    tensor at a time: for an engine that loads the folder from where it lies (vLLM's worker), so
    the check never holds a whole model in this process's memory."""
    from contextlib import ExitStack

    from safetensors import safe_open


    files = _safetensors_files(folder)
    with ExitStack() as stack:
        handles = {}
        for file in files:
            handle = stack.enter_context(safe_open(str(file), framework="pt"))
            handles.update((name, handle) for name in handle.keys())
        return weights_problems(_LazyTensors(handles), expected, optional=optional)


class _LazyTensors(Mapping):
    """{name: tensor} over open safetensors files, each tensor read when asked for."""

    def __init__(self, handles: dict) -> None:
        self._handles = handles

    def __getitem__(self, name: str):
        return self._handles[name].get_tensor(name)

    def __iter__(self):
        return iter(self._handles)

    def __len__(self) -> int:
        return len(self._handles)

    def __contains__(self, name) -> bool:
        return name in self._handles


def tensors_of_arrays(arrays: dict, bfloat16_names=()) -> dict:
    """Torch tensors over the arrays of an inline update, sharing their memory; the named uint16
    arrays are viewed as bfloat16."""
    import torch

    bfloat16 = set(bfloat16_names)
    state = {}
    with warnings.catch_warnings():
        # Arrays decoded from the wire are read-only views of the receive buffer. Nothing writes
        # to these tensors (engines copy them into their parameters), so they are used in place
        # rather than copied once more.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        for name, array in arrays.items():
            if name in bfloat16:
                state[name] = torch.from_numpy(np.asarray(array).view(np.int16)).view(torch.bfloat16)
            else:
                state[name] = torch.from_numpy(np.asarray(array))
    return state


class CollectiveReceiver:
    """Receives collective weight updates for one engine (rank 1 of its pair group)."""

    def __init__(self, device="cpu") -> None:
        self.device = device
        """Where NCCL buckets land (the engine's GPU); gloo buckets are always in CPU memory."""
        self._store = None
        self._store_address: tuple[str, int] | None = None
        self._group = None
        self._group_name: str | None = None
        self._buckets: list = []
        """The last update's buffers, received into again once nothing else refers to them."""

    def receive(self, update: CollectiveWeights) -> dict:
        """The tensors of `update` ({name: tensor}, views of the received buckets). Blocking."""
        from concurrent.futures import ThreadPoolExecutor

        layout = layout_of(update)
        where = f"the learner at {update.store_host}:{update.store_port}"
        if update.group_name != self._group_name:
            self._join(update, where)
        device = "cpu" if update.backend == "gloo" else self.device
        buckets = reusable_buckets(self._buckets, layout.bucket_sizes, device)
        self._buckets = buckets
        checks = []
        try:
            # zlib releases the GIL on large buffers: bucket i is checked while bucket i+1 arrives.
            with ThreadPoolExecutor(max_workers=1, thread_name_prefix="weights-crc") as checker:
                for index, bucket in enumerate(buckets):
                    what = (
                        f"receiving weights v{update.version} from {where} (group {update.group_name}), "
                        f"bucket {index + 1} of {len(buckets)}"
                    )
                    broadcast_bucket(self._group, bucket, update.timeout_s, what)
                    if update.bucket_crc32:
                        checks.append((what, update.bucket_crc32[index], checker.submit(zlib.crc32, bucket.numpy())))
            for what, sent, check in checks:
                arrived = check.result()
                if arrived != sent:
                    raise CollectiveError(f"{what}: arrived with CRC32 {arrived:08x}, the learner sent {sent:08x}")
        except CollectiveError:
            self.close()
            raise
        finally:
            del checks  # the checker's numpy views, so the buffers can be reused next time
        return unpack_buckets(buckets, layout)

    def _join(self, update: CollectiveWeights, where: str) -> None:
        self.close_group()
        address = (update.store_host, update.store_port)
        if address != self._store_address:
            self._store = connect_store(update.store_host, update.store_port, update.timeout_s)
            self._store_address = address
        local_host = local_address_towards(update.store_host, update.store_port)
        self._group = open_pair_group(
            self._store, update.group_name, 1, backend=update.backend, timeout_s=update.timeout_s,
            local_host=local_host, peer=where, device=self.device,
        )
        self._group_name = update.group_name
        log.info("joined weights group %s with %s", update.group_name, where)

    def close_group(self) -> None:
        if self._group is not None:
            close_group(self._group)
        self._group = None
        self._group_name = None

    def close(self) -> None:
        """Drop the group and the store connection (the next update forms new ones)."""
        self.close_group()
        self._store = None
        self._store_address = None
        self._buckets = []
