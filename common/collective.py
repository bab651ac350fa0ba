"""Pair process groups for the `collective` weights transport, and the bucket layout of a model.

Both ends use this module: the learner (learner/weight_sync.py) and each actor's engine
(actor/weights.py). torch.distributed usually joins a fixed set of processes into
one world with `init_process_group`; actors come and go, so instead the learner serves one
rendezvous store (a `TCPStore`) and forms a separate two-member group with each actor on a key
prefix of it, building the process group object directly. A group that fails is dropped and a new
one formed under a new prefix, while the other pairs carry on.

Every wait here has a timeout and raises `CollectiveError` naming what it waited for: forming a
group, connecting to the store, each bucket's broadcast. torch is imported inside the functions,
so importing this module stays cheap.
"""

from __future__ import annotations

import math
import re
import socket
import zlib
from dataclasses import dataclass
from datetime import timedelta
from typing import Mapping

from longhorizon.common.wire import TENSOR_DTYPE_BYTES, CollectiveWeights

BACKENDS = ("gloo", "nccl")
_ALIGNMENT = 64
"""Byte offsets of tensors in a bucket are multiples of this (every item size divides it)."""


class CollectiveError(RuntimeError):
    """A collective weights transfer failed or timed out; the message names the peer and the step."""


@dataclass(frozen=True)
class TensorSlot:
    """Where one tensor's bytes sit in the buckets of an update."""

    name: str
    dtype: str
    """torch's name for the dtype, e.g. "bfloat16"."""
    shape: tuple[int, ...]
    bucket: int
    offset: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * TENSOR_DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class BucketLayout:
    """The tensors of one update laid out in byte buckets, which are broadcast one after another."""

    slots: tuple[TensorSlot, ...]
    bucket_sizes: tuple[int, ...]

    @property
    def total_bytes(self) -> int:
        return sum(self.bucket_sizes)


def dtype_name(dtype) -> str:
    """torch's name for a dtype ("bfloat16"), refused if it cannot travel."""
    name = str(dtype).removeprefix("torch.")
    if name not in TENSOR_DTYPE_BYTES:
        raise CollectiveError(f"tensors of dtype {name} cannot travel; allowed: {', '.join(TENSOR_DTYPE_BYTES)}")
    return name


def plan_buckets(tensors: Mapping[str, tuple[str, tuple[int, ...]]], bucket_bytes: int) -> BucketLayout:
    """Lay tensors ({name: (dtype name, shape)}, in order) out in buckets of at most `bucket_bytes`.

    A tensor is never split: one larger than a bucket travels in a bucket of its own. Offsets are
    aligned, so the receiver views each tensor in place, without a copy.
    """
    if bucket_bytes <= 0:
        raise ValueError("bucket_bytes must be positive")
    slots: list[TensorSlot] = []
    sizes: list[int] = []
    used = 0
    for name, (dtype, shape) in tensors.items():
        nbytes = math.prod(shape) * TENSOR_DTYPE_BYTES[dtype]
        start = -(-used // _ALIGNMENT) * _ALIGNMENT
        if not sizes or (used > 0 and start + nbytes > bucket_bytes):
            sizes.append(0)
            start = 0
        slots.append(TensorSlot(name, dtype, tuple(int(d) for d in shape), len(sizes) - 1, start))
        used = start + nbytes
        sizes[-1] = used
    return BucketLayout(tuple(slots), tuple(sizes))


def pack_buckets(
    state: Mapping, layout: BucketLayout, device="cpu", *, into: list | None = None, packed=None,
) -> list:
    """Copies of the tensors of `state`, laid out in byte buckets on `device`: fresh ones, or
    the buckets `into` (`reusable_buckets`), whose memory is already in place. `packed(bucket)`,
    if given, is called with each bucket as soon as it is full (buckets fill in order)."""
    buckets = reusable_buckets(into or [], layout.bucket_sizes, device)
    filling = 0
    for slot in layout.slots:
        while packed is not None and filling < slot.bucket:
            packed(buckets[filling])
            filling += 1
        tensor = state[slot.name]
        target = buckets[slot.bucket][slot.offset:slot.offset + slot.nbytes]
        copy_into(target.view(tensor.dtype).view(tensor.shape), tensor.detach())
    while packed is not None and filling < len(buckets):
        packed(buckets[filling])
        filling += 1
    return buckets


def copy_into(target, source) -> None:
    """`target.copy_(source)`; between CPU tensors of one dtype, both contiguous, a plain memcpy
    on this thread instead. A copy is bound by memory bandwidth, which one thread nearly fills,
    while torch's copy splits it over its intra-op threads: on a machine whose cores are busy
    with other work, those threads wait for each other (on the 2-core VM of docs/benchmarks.md a
    1 GB copy took 1-2.8 s on two threads, 0.22-0.35 s on one)."""
    import numpy as np
    import torch

    plain = (torch.Tensor, torch.nn.Parameter)  # not a subclass with its own layout (a DTensor's shards)
    if (
        type(target) in plain and type(source) in plain
        and target.device.type == "cpu" and source.device.type == "cpu" and target.dtype == source.dtype
        and target.shape == source.shape and target.is_contiguous() and source.is_contiguous()
        and not source.is_conj() and not source.is_neg()
    ):
        if source.numel():
            np.copyto(_byte_array(target), _byte_array(source))
        return
    target.copy_(source)


def _byte_array(tensor):
    """The bytes of a contiguous CPU tensor as a writable numpy array over the same memory."""
    import torch

    return tensor.detach().reshape(-1).view(torch.uint8).numpy()


def sole_owner(tensor) -> bool:
    """Whether nothing but `tensor` itself refers to its memory: no view of it (a tensor another
    update handed out, a numpy array over it) is alive, so it may be written again. False when
    torch cannot say."""
    import torch

    try:
        # One reference from the tensor, one from the storage object made here to ask.
        return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata) <= 2
    except (AttributeError, RuntimeError):
        return False


def reusable_buckets(previous: list, sizes, device) -> list:
    """Byte buckets of `sizes` on `device`: each one of `previous` at the same place where it has
    that size, lives there and nothing else refers to it (`sole_owner`), else a new one.

    New memory is the expensive part of a transfer on a machine that hands out pages lazily (on
    the VM of docs/benchmarks.md, a copy into new pages ran at 0.24-3.7 GB/s against 1.3-9 GB/s
    into memory already touched), so buffers are kept from one update to the next.
    """
    import torch

    device = torch.device(device)
    buckets = []
    for index, size in enumerate(sizes):
        old = previous[index] if index < len(previous) else None
        if (
            old is not None and old.numel() == size and old.dtype == torch.uint8
            and old.device.type == device.type and (device.index is None or old.device == device)
            and sole_owner(old)
        ):
            buckets.append(old)
        else:
            buckets.append(torch.empty(size, dtype=torch.uint8, device=device))
    return buckets


def unpack_buckets(buckets: list, layout: BucketLayout) -> dict:
    """The tensors of an update as views of its received buckets (no copy)."""
    import torch

    state = {}
    for slot in layout.slots:
        raw = buckets[slot.bucket][slot.offset:slot.offset + slot.nbytes]
        state[slot.name] = raw.view(getattr(torch, slot.dtype)).view(slot.shape)
    return state


def bucket_checksums(buckets: list) -> list[int]:
    """CRC32 of each bucket (in CPU memory), so the receiver can refuse a transfer that is not
    bit-identical: zlib reads the bytes in place at about 1.7 GB/s on one core."""
    return [zlib.crc32(bucket.numpy()) for bucket in buckets]


def announcement(
    version: int, layout: BucketLayout, *, store_host: str, store_port: int, group_name: str,
    backend: str, timeout_s: float, checksums: list[int],
) -> CollectiveWeights:
    """The message that announces an update; its buckets follow over the group it names."""
    return CollectiveWeights(
        version=version, store_host=store_host, store_port=store_port, group_name=group_name,
        backend=backend, timeout_s=timeout_s,
        tensor_names=[s.name for s in layout.slots],
        tensor_dtypes=[s.dtype for s in layout.slots],
        tensor_ndims=[len(s.shape) for s in layout.slots],
        tensor_dims=[d for s in layout.slots for d in s.shape],
        tensor_buckets=[s.bucket for s in layout.slots],
        tensor_offsets=[s.offset for s in layout.slots],
        bucket_sizes=list(layout.bucket_sizes),
        bucket_crc32=list(checksums),
    )


def layout_of(message: CollectiveWeights) -> BucketLayout:
    """The bucket layout an announcement describes (the wire has checked that it is consistent)."""
    slots, start = [], 0
    for name, dtype, ndim, bucket, offset in zip(
        message.tensor_names, message.tensor_dtypes, message.tensor_ndims, message.tensor_buckets,
        message.tensor_offsets,
    ):
        shape = tuple(message.tensor_dims[start:start + ndim])
        start += ndim
        slots.append(TensorSlot(name, dtype, shape, bucket, offset))
    return BucketLayout(tuple(slots), tuple(message.bucket_sizes))


# -- rendezvous and groups ------------------------------------------------------------------


class RendezvousServer:
    """The learner's store on `host` (a free port): actors connect to it to form their groups.

    torch's store server would listen on every interface; it is handed a socket already bound to
    `host` instead, so with the default 127.0.0.1 nothing is reachable from other machines.
    """

    def __init__(self, host: str, timeout_s: float) -> None:
        import torch.distributed as dist

        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.bind((host, 0))
            listener.listen(128)
            self.host = host
            self.port = listener.getsockname()[1]
            self.store = dist.TCPStore(
                host, self.port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s),
                master_listen_fd=listener.fileno(),
            )
        except BaseException:
            listener.close()
            raise
        listener.detach()  # the store owns the socket now and closes it when it goes

    def close(self) -> None:
        self.store = None


def connect_store(host: str, port: int, timeout_s: float):
    """A client of the learner's store."""
    import torch.distributed as dist

    try:
        return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
    except Exception as error:
        raise CollectiveError(
            f"cannot reach the learner's weights store at {host}:{port} within {timeout_s:g} s: {error}"
        ) from None


def local_address_towards(host: str, port: int) -> str:
    """This machine's address on the route to `host`: where the peer can reach our end of a group."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((host, port))  # a datagram socket sends nothing on connect
        return probe.getsockname()[0]


def open_pair_group(
    store, group_name: str, rank: int, *, backend: str, timeout_s: float, local_host: str, peer: str,
    device=None,
):
    """Form the two-member group `group_name` (learner rank 0, actor rank 1) on the store.

    Blocks until the other member joins, at most `timeout_s`. `peer` names the other side in
    errors. NCCL groups need `device`, the CUDA device the buffers live on.
    """
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    prefixed = dist.PrefixStore(group_name, store)
    try:
        if backend == "gloo":
            options = dist.ProcessGroupGloo._Options()
            options._timeout = timeout
            # Gloo listens on this address only (by default it would take the hostname's).
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=local_host)]
            return dist.ProcessGroupGloo(prefixed, rank, 2, options)
        if backend == "nccl":
            import torch

            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            torch.cuda.set_device(device)
            group = dist.ProcessGroupNCCL(prefixed, rank, 2, options)
            # NCCL connects at the first collective; a small one now makes forming the group the
            # step that fails when the peer is missing.
            probe = torch.zeros(1, device=device)
            _wait(group.allreduce([probe]), timeout_s, f"forming group {group_name} with {peer}")
            return group
    except CollectiveError:
        raise
    except Exception as error:
        raise CollectiveError(
            f"could not form group {group_name} with {peer} within {timeout_s:g} s: {_first_line(error)}"
        ) from None
    raise CollectiveError(f"unknown collective backend {backend!r}; valid: {', '.join(BACKENDS)}")


def broadcast_bucket(group, bucket, timeout_s: float, what: str) -> None:
    """Broadcast one bucket from rank 0 (sends there, receives in place elsewhere) within `timeout_s`."""
    import torch.distributed as dist

    options = dist.BroadcastOptions()
    options.rootRank = 0
    options.rootTensor = 0
    options.timeout = timedelta(seconds=timeout_s)
    try:
        work = group.broadcast([bucket], options)
    except Exception as error:
        raise CollectiveError(f"{what}: {_first_line(error)}") from None
    _wait(work, timeout_s, what)


def _wait(work, timeout_s: float, what: str) -> None:
    try:
        completed = work.wait(timedelta(seconds=timeout_s))
    except Exception as error:
        raise CollectiveError(f"{what}: {_first_line(error)}") from None
    if completed is False:
        raise CollectiveError(f"{what}: not done after {timeout_s:g} s")


def close_group(group) -> None:
    """Tear a group down after a failure, or when it is replaced (never raises)."""
    for method in ("abort", "shutdown"):
        release = getattr(group, method, None)
        if release is not None:
            try:
                release()
                return
            except Exception:
                continue


def _first_line(error: BaseException) -> str:
    """The gist of a torch/gloo error: its first line, without the C++ source location."""
    lines = str(error).strip().splitlines()
    return re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\] ", "", lines[0]) if lines else type(error).__name__
