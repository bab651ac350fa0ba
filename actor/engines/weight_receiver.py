"""The receiving end of the `collective` weights transport, for any engine that holds a torch model.

An engine hands each `CollectiveWeights` announcement to its `CollectiveReceiver`, in the process
where its model lives (the actor process for `hf`, vLLM's worker process for `vllm`). The receiver
joins the pair group the announcement names (forming it when the name is new: the first update,
a learner restart, or a group that broke), receives every bucket into fresh buffers, checks each
bucket's CRC32 when the learner sent one, and returns the tensors. The engine then swaps them in
between turns, so the model keeps generating with the old version while the bytes arrive.

A failure (the learner gone, a wait past the announced timeout, a corrupt bucket) raises
`CollectiveError` naming the learner's store and the group, and drops the group: the learner
forms a new one when it sends again.
"""

from __future__ import annotations

import logging
import zlib

from longhorizon.common.collective import (
    CollectiveError,
    broadcast_bucket,
    close_group,
    connect_store,
    layout_of,
    local_address_towards,
    open_pair_group,
    unpack_buckets,
)
from longhorizon.common.wire import CollectiveWeights

log = logging.getLogger(__name__)


class CollectiveReceiver:
    """Receives collective weight updates for one engine (rank 1 of its pair group)."""

    def __init__(self, device="cpu") -> None:
        self.device = device
        """Where NCCL buckets land (the engine's GPU); gloo buckets are always in CPU memory."""
        self._store = None
        self._store_address: tuple[str, int] | None = None
        self._group = None
        self._group_name: str | None = None

    def receive(self, update: CollectiveWeights) -> dict:
        """The tensors of `update` ({name: tensor}, views of the received buckets). Blocking."""
        import torch

        layout = layout_of(update)
        where = f"the learner at {update.store_host}:{update.store_port}"
        if update.group_name != self._group_name:
            self._join(update, where)
        device = "cpu" if update.backend == "gloo" else self.device
        buckets = [torch.empty(size, dtype=torch.uint8, device=device) for size in layout.bucket_sizes]
        try:
            for index, bucket in enumerate(buckets):
                what = (
                    f"receiving weights v{update.version} from {where} (group {update.group_name}), "
                    f"bucket {index + 1} of {len(buckets)}"
                )
                broadcast_bucket(self._group, bucket, update.timeout_s, what)
                if update.bucket_crc32:
                    arrived = zlib.crc32(bucket.numpy())
                    if arrived != update.bucket_crc32[index]:
                        raise CollectiveError(
                            f"{what}: arrived with CRC32 {arrived:08x}, the learner sent {update.bucket_crc32[index]:08x}"
                        )
        except CollectiveError:
            self.close()
            raise
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
