"""The learner's side of the `collective` weights transport: a pair group per actor, buckets streamed.

The learner serves one rendezvous store. Each actor gets a two-member group of its own (learner
rank 0, actor rank 1), formed when the learner first sends it weights. Per-actor groups rather
than one group of everyone: actors are killed, restarted and join late, and a group of N members
must be re-formed by all of them whenever one leaves, so one dead actor would stall the others
until the timeout, every time; a pair only ever waits for its own actor. The price is bandwidth:
the learner sends the model once per actor instead of once (fine for the tens of actors one
learner feeds over gloo; a tree or one NCCL group per stable set of GPU engines is the next step).

Each actor is served by a thread of its own while it has something to receive, so a slow or dead
actor never delays the training loop or the other actors. A delivery: announce the update on the
actor's control socket (`CollectiveWeights`: version, tensor list, bucket layout, group), form the
group if it is new, then broadcast the buckets in order. Every wait is bounded by
`learner.weights_options.timeout_s`; a failure is logged naming the actor, its group is dropped,
and the actor is sent weights again (on a new group) once it is heard from after the failure. The
latest version wins: an actor still receiving v gets v+2 next, never a backlog.

Weights are copied into owned buckets between updates (`snapshot_weights`), so later optimiser
steps never reach bytes in flight, and a late actor is sent the current version from the same
copy. The buckets of a version that is no longer the latest and that no thread is sending are
kept for the next snapshot (its pages are already in memory, which on a VM costs several times
less to write than new pages); they are never reused while a delivery reads them.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Mapping

from longhorizon.common.collective import (
    BucketLayout,
    CollectiveError,
    RendezvousServer,
    announcement,
    bucket_checksums,
    broadcast_bucket,
    close_group,
    connect_store,
    dtype_name,
    open_pair_group,
    pack_buckets,
    plan_buckets,
)
from longhorizon.common.wire import CollectiveWeights
from longhorizon.common.transport import is_loopback_host

log = logging.getLogger(__name__)

RESEND_AFTER_S = 5.0
"""An actor that reports another version this long after a delivery finished did not get it (its
end of the group broke): it is sent the latest again, on a new group."""


@dataclass
class WeightsSnapshot:
    """One version's weights, copied into byte buckets that nothing else writes to."""

    version: int
    layout: BucketLayout
    buckets: list
    checksums: list[int]
    """CRC32 per bucket (CPU buckets only; empty on a GPU)."""
    sending: int = 0
    """Delivery threads reading the buckets now (the sender's lock guards it)."""


def snapshot_weights(
    state: Mapping, version: int, *, bucket_bytes: int, device="cpu", reuse: list | None = None,
) -> WeightsSnapshot:
    """Copy a full state dict ({name: tensor}, on any device) into buckets on `device`: the
    buckets `reuse` where they fit (nothing may read them any more), new ones otherwise."""
    import torch

    layout = plan_buckets({name: (dtype_name(t.dtype), tuple(t.shape)) for name, t in state.items()}, bucket_bytes)
    if torch.device(device).type != "cpu":
        return WeightsSnapshot(version, layout, pack_buckets(state, layout, device, into=reuse), [])
    # zlib releases the GIL on large buffers: each full bucket's CRC32 is taken in a second
    # thread while the next bucket is filled.
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="weights-crc") as checker:
        sums = []
        buckets = pack_buckets(state, layout, device, into=reuse,
                               packed=lambda bucket: sums.append(checker.submit(bucket_checksums, [bucket])))
    return WeightsSnapshot(version, layout, buckets, [future.result()[0] for future in sums])


def resolve_backend(setting: str, learner_device) -> str:
    """`auto`: nccl when the learner trains on a CUDA GPU (and torch has NCCL), else gloo."""
    if setting != "auto":
        return setting
    import torch.distributed as dist

    on_gpu = str(learner_device).startswith("cuda")
    return "nccl" if on_gpu and dist.is_nccl_available() else "gloo"


def check_collective_settings(config, backend_setting: str, learner_device: str) -> None:
    """Refuse a `collective` setting that cannot work, before any process starts (ValueError):
    `backend_setting` is its `backend` option. Whether the engine takes collective updates is
    asked of its capabilities (learner/weights)."""
    import torch.distributed as dist


    if not dist.is_available():
        raise ValueError(
            "learner.weights_transport = 'collective' needs torch.distributed, which this torch build "
            "lacks (torch.distributed.is_available() is False); use 'inline' or 'path', or install a "
            "torch build with distributed support"
        )
    backend = resolve_backend(backend_setting, learner_device)
    if backend == "gloo" and not dist.is_gloo_available():
        raise ValueError("learner.weights_options.backend 'gloo': this torch build has no gloo backend")
    if backend == "nccl":
        import torch

        if not (dist.is_nccl_available() and torch.cuda.is_available()):
            raise ValueError(
                "learner.weights_options.backend 'nccl' needs CUDA GPUs and a torch build with NCCL; use 'gloo'"
            )
    host = config.transport.host
    if not is_loopback_host(host) and not getattr(config.transport, "insecure", False):
        raise ValueError(
            f"learner.weights_transport = 'collective' with transport.host = {host!r}: the weights store "
            "and the process groups are plain TCP, without the authentication CurveZMQ gives the "
            "sockets; set transport.insecure = true to accept that on a trusted network, or use 'inline'"
        )


@dataclass(eq=False)
class _Member:
    """One actor as the sender sees it."""

    actor_id: str
    holds: int | None
    """The version the actor is known to hold (reported, or delivered since); None: unknown."""
    group: object = None
    group_name: str = ""
    store: object = None
    """The group's own connection to the store: one store client serves one request at a time,
    so a member waiting for a dead actor there would hold up every other member's rendezvous."""
    busy: bool = False
    """A thread is delivering to it."""
    delivered_at: float = -math.inf
    retired: bool = False
    """Replaced (the actor restarted) or dropped: its thread stops at the next chance."""
    deliveries: int = field(default=0)


class CollectiveSender:
    """Sends each new version to every actor over its own pair group (see the module docstring).

    `announce(actor_id, message)` sends a `CollectiveWeights` on the actor's control socket and
    raises if it cannot; it is called from the sender's threads. Thread-safe.
    """

    def __init__(
        self, *, host: str, backend: str, timeout_s: float, bucket_bytes: int,
        announce: Callable[[str, CollectiveWeights], None], device="cpu",
    ) -> None:
        self.backend = backend
        self.timeout_s = timeout_s
        self.bucket_bytes = bucket_bytes
        self.device = device if backend == "nccl" else "cpu"
        self.announce = announce
        self.server = RendezvousServer(host, timeout_s)
        # Group names never repeat, even across learner restarts (a restarted learner serves a new
        # store, but an actor compares names only).
        self._name_prefix = f"weights/{os.getpid()}-{time.time_ns()}"
        self._group_numbers = itertools.count(1)
        self._lock = threading.Lock()
        self.latest: WeightsSnapshot | None = None
        self._spare: list = []
        """Buckets of a retired version (not the latest, not being sent) for the next snapshot."""
        self.members: dict[str, _Member] = {}
        self._failed_at: dict[str, float] = {}
        self.failures = 0
        self._closed = False

    # -- called by the learner ----------------------------------------------------------------

    def snapshot(self, state: Mapping, version: int) -> WeightsSnapshot:
        with self._lock:
            spare, self._spare = self._spare, []
        return snapshot_weights(state, version, bucket_bytes=self.bucket_bytes, device=self.device, reuse=spare)

    def publish(self, snapshot: WeightsSnapshot) -> None:
        """A new version: every member gets it (those busy with an older one right after)."""
        with self._lock:
            previous, self.latest = self.latest, snapshot
            if previous is not None and previous is not snapshot:
                self._retire_if_unused(previous)
            for member in self.members.values():
                self._start_if_needed(member)

    def _retire_if_unused(self, snapshot: WeightsSnapshot) -> None:
        """Keep the buckets of a version that is not the latest once no thread sends it (lock
        held). The snapshot is emptied, so nothing can send it again by mistake."""
        if snapshot is self.latest or snapshot.sending or not snapshot.buckets:
            return
        self._spare = snapshot.buckets
        snapshot.buckets = []

    def join(self, actor_id: str, holds: int | None) -> None:
        """An actor (re)started and said hello holding version `holds`: a new member, and a new
        group when it needs weights (the old process, if any, is gone)."""
        with self._lock:
            old = self.members.pop(actor_id, None)
            if old is not None:
                old.retired = True
                if not old.busy and old.group is not None:
                    close_group(old.group)
            self._failed_at.pop(actor_id, None)
            member = self.members[actor_id] = _Member(actor_id, holds)
            self._start_if_needed(member)

    def keep_current(self, actor_id: str, reported: int | None, heard_at: float) -> None:
        """An actor heard from at `heard_at` (time.monotonic) reports version `reported`: make
        sure it gets the latest version unless it holds it."""
        with self._lock:
            member = self.members.get(actor_id)
            if member is None:
                if self._failed_at.get(actor_id, -math.inf) >= heard_at:
                    return  # not heard from since its last failure: probably gone
                member = self.members[actor_id] = _Member(actor_id, reported)
            elif (
                self.latest is not None and reported != self.latest.version and not member.busy
                and member.holds == self.latest.version and heard_at > member.delivered_at + RESEND_AFTER_S
            ):
                log.warning(
                    "actor %s reports weights v%s %.0f s after it was sent v%d: sending them again on a new group",
                    actor_id, reported, heard_at - member.delivered_at, self.latest.version,
                )
                member.holds = reported
                self._drop_group(member)
            self._start_if_needed(member)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for member in self.members.values():
                member.retired = True
                if not member.busy:
                    self._drop_group(member)
            self.members.clear()
        self.server.close()

    # -- delivery -----------------------------------------------------------------------------

    def _start_if_needed(self, member: _Member) -> None:
        """Start a delivery thread for `member` if it lacks the latest version (lock held)."""
        if self._closed or member.busy or member.retired or self.latest is None:
            return
        if member.holds == self.latest.version:
            return
        member.busy = True
        threading.Thread(
            target=self._serve, args=(member,), name=f"weights-to-{member.actor_id}", daemon=True,
        ).start()

    def _serve(self, member: _Member) -> None:
        """A member's delivery thread: send the latest version until the member holds it."""
        while True:
            with self._lock:
                snapshot = self.latest
                if self._closed or member.retired or snapshot is None or member.holds == snapshot.version:
                    member.busy = False
                    if member.retired:
                        self._drop_group(member)
                    return
                snapshot.sending += 1
            try:
                started = time.perf_counter()
                try:
                    self._deliver(member, snapshot)
                finally:
                    with self._lock:
                        snapshot.sending -= 1
                        self._retire_if_unused(snapshot)
            except Exception as error:  # anything: the training loop and other actors carry on
                with self._lock:
                    member.busy = False
                    self._drop_group(member)
                    current = self.members.get(member.actor_id) is member
                    if current:
                        self.failures += 1
                        self._failed_at[member.actor_id] = time.monotonic()
                        del self.members[member.actor_id]
                if current:
                    log.error(
                        "weights v%d to actor %s failed: %s; it is dropped from the collective until it "
                        "is heard from again", snapshot.version, member.actor_id, error,
                    )
                else:  # a process that has since been replaced by a restarted one
                    log.info("weights v%d to the previous process of actor %s ended: %s", snapshot.version, member.actor_id, error)
                return
            with self._lock:
                member.holds = snapshot.version
                member.delivered_at = time.monotonic()
                member.deliveries += 1
            log.info(
                "weights v%d sent to actor %s over group %s (%.1f MB in %.2f s)", snapshot.version,
                member.actor_id, member.group_name, snapshot.layout.total_bytes / 1e6, time.perf_counter() - started,
            )

    def _deliver(self, member: _Member, snapshot: WeightsSnapshot) -> None:
        new_group = member.group is None
        if new_group:
            member.group_name = f"{self._name_prefix}/{member.actor_id}/{next(self._group_numbers)}"
        message = announcement(
            snapshot.version, snapshot.layout, store_host=self.server.host, store_port=self.server.port,
            group_name=member.group_name, backend=self.backend, timeout_s=self.timeout_s,
            checksums=snapshot.checksums,
        )
        peer = f"actor {member.actor_id}"
        try:
            self.announce(member.actor_id, message)
        except Exception as error:
            raise CollectiveError(f"could not announce weights v{snapshot.version} to {peer}: {error!r}") from None
        if new_group:
            member.store = connect_store(self.server.host, self.server.port, self.timeout_s)
            member.group = open_pair_group(
                member.store, member.group_name, 0, backend=self.backend, timeout_s=self.timeout_s,
                local_host=self.server.host, peer=peer, device=self.device,
            )
        count = len(snapshot.buckets)
        for index, bucket in enumerate(snapshot.buckets):
            what = f"sending weights v{snapshot.version} to {peer} (group {member.group_name}), bucket {index + 1} of {count}"
            broadcast_bucket(member.group, bucket, self.timeout_s, what)

    def _drop_group(self, member: _Member) -> None:
        if member.group is not None:
            close_group(member.group)
        member.group = None
        member.store = None
