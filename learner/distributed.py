"""The learner's ranks: the process group, FSDP2 sharding, one step's examples split by tokens.

A learner of `learner.num_ranks = N` is N processes under torch.distributed (gloo on CPU, NCCL
on GPUs), started by our launcher or by `torchrun`: each reads RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR and MASTER_PORT from its environment. The model is sharded with FSDP2
(`fully_shard`): each decoder layer is one unit, and the root unit holds the rest (embeddings,
final norm, output layer).

Rank 0 alone talks to the actors. The other ranks run `follow_main_rank`: they wait for a
command from rank 0 and take part in the collective work it names (an update step on their share
of the examples, gathering the full weights, writing a checkpoint), so every rank enters the same
collectives in the same order. With one rank there is no process group and nothing here runs
beyond `Ranks.single`.
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass
from typing import NoReturn

log = logging.getLogger(__name__)

RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
STORE_FILE_VARIABLE = "LONGHORIZON_RANKS_STORE"
"""Set by the local launcher: the ranks meet through this file instead of a TCP store, whose
server would listen on every address of the machine (torch offers no way to bind it to one)."""


class RanksError(RuntimeError):
    """The ranks cannot be set up as configured."""


@dataclass(frozen=True)
class Ranks:
    """This process's place among the learner's ranks."""

    rank: int
    world_size: int
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @classmethod
    def single(cls) -> "Ranks":
        return cls(rank=0, world_size=1, local_rank=0)


def ranks_from_environment(num_ranks: int, environ=None) -> Ranks:
    """The ranks the environment describes, checked against `learner.num_ranks`.

    Without WORLD_SIZE in the environment a learner of one rank is a plain process; a learner of
    more ranks must have been started by our launcher or torchrun, which set the variables.
    """
    environ = os.environ if environ is None else environ
    if "WORLD_SIZE" not in environ:
        if num_ranks != 1:
            raise RanksError(
                f"learner.num_ranks = {num_ranks} but this process was not started as one of "
                "several ranks (no WORLD_SIZE in its environment): start it with `longhorizon "
                f"train` or `torchrun --nproc-per-node {num_ranks} -m longhorizon.launch.worker learner ...`"
            )
        return Ranks.single()
    try:
        world_size = int(environ["WORLD_SIZE"])
        rank = int(environ.get("RANK", "0"))
        local_rank = int(environ.get("LOCAL_RANK", str(rank)))
    except ValueError:
        raise RanksError("RANK, WORLD_SIZE and LOCAL_RANK must be integers") from None
    if world_size != num_ranks:
        raise RanksError(
            f"this learner was started as one of {world_size} ranks but learner.num_ranks = "
            f"{num_ranks}: set learner.num_ranks={world_size} (or start {num_ranks} ranks)"
        )
    if not 0 <= rank < world_size:
        raise RanksError(f"RANK {rank} is outside 0..{world_size - 1}")
    return Ranks(rank=rank, world_size=world_size, local_rank=local_rank)


def rank_device(device, ranks: Ranks):
    """The device of this rank: on CUDA, the GPU of its local rank."""
    import torch

    if device.type == "cuda" and ranks.distributed:
        return torch.device("cuda", ranks.local_rank)
    return device


def init_process_group(ranks: Ranks, device, timeout_s: float) -> None:
    """Join the learner's process group (gloo on CPU, NCCL on CUDA). Every collective among the
    ranks then fails after `timeout_s` instead of hanging when a rank is gone."""
    import torch
    import torch.distributed as dist

    if not ranks.distributed or dist.is_initialized():
        return
    store = None
    if os.environ.get(STORE_FILE_VARIABLE):
        store = dist.FileStore(os.environ[STORE_FILE_VARIABLE], ranks.world_size)
    else:
        missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
        if missing:
            raise RanksError(f"{', '.join(missing)} not set: the ranks cannot find rank 0")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend="nccl" if device.type == "cuda" else "gloo",
        rank=ranks.rank, world_size=ranks.world_size, store=store,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    log.info("rank %d of %d joined the learner's process group (%s)", ranks.rank, ranks.world_size, dist.get_backend())


def shard_model(policy, decoder_layers) -> None:
    """FSDP2 over the ranks: one unit per decoder layer, the root unit for the rest.

    Gradients are summed over the ranks, not averaged: each rank weights its micro-batches by
    their share of the whole step's tokens, so the sum is exactly the one-rank gradient.
    """
    from torch.distributed.fsdp import FSDPModule, fully_shard

    for layer in decoder_layers:
        fully_shard(layer)
    fully_shard(policy)
    for module in policy.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            # A plain sum on the wire: gloo has no pre-multiplied sum.
            module.set_force_sum_reduction_for_comms(True)


def decoder_layers(model):
    """The repeated decoder blocks of a Hugging Face causal LM, or of its decoder alone (the FSDP
    units)."""
    import torch

    for path in ("model.layers", "transformer.h", "gpt_neox.layers", "model.decoder.layers", "layers"):
        module = model
        for part in path.split("."):
            module = getattr(module, part, None)
            if module is None:
                break
        if isinstance(module, torch.nn.ModuleList):
            return list(module)
    raise RanksError(
        f"cannot find the decoder layers of {type(model).__name__} to shard (looked for "
        "model.layers, transformer.h, gpt_neox.layers, model.decoder.layers, layers)"
    )


def split_by_tokens(lengths: list[int], parts: int) -> list[list[int]]:
    """Indices of `lengths` dealt to `parts` ranks so that their token totals are close (the
    lengths of sequences, or the tokens computed by pieces dealt whole: `Trainer.deal_examples`).

    Longest first, each to the rank with the fewest tokens so far (ties: the lower rank, then
    fewer sequences): the largest total is at most the ideal share plus one sequence. Each rank's
    indices come back in ascending order.
    """
    if parts < 1:
        raise ValueError("parts must be at least 1")
    loads = [0] * parts
    shares: list[list[int]] = [[] for _ in range(parts)]
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        target = min(range(parts), key=lambda r: (loads[r], len(shares[r]), r))
        shares[target].append(index)
        loads[target] += lengths[index]
    return [sorted(share) for share in shares]


# -- rank 0 -> other ranks ----------------------------------------------------------------------

def send_command(command: str, payload=None) -> None:
    """Rank 0: tell the other ranks what collective work comes next."""
    import torch.distributed as dist

    dist.broadcast_object_list([(command, payload)], src=0)


def receive_command():
    """Another rank: wait for rank 0's next command; returns (command, payload)."""
    import torch.distributed as dist

    holder = [None]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def scatter_objects(per_rank: list | None, ranks: Ranks):
    """Rank 0 hands object `per_rank[r]` to rank r; every rank returns its own."""
    import torch.distributed as dist

    received = [None]
    dist.scatter_object_list(received, per_rank if ranks.is_main else None, src=0)
    return received[0]


def all_reduce_sum(values: list[float]) -> list[float]:
    """Sum a few floats over the ranks (metrics, token counts)."""
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return tensor.tolist()


def all_reduce_max(value: int) -> int:
    """The largest of an integer over the ranks."""
    return all_reduce_max_each([value])[0]


def all_reduce_max_each(values: list[int]) -> list[int]:
    """The largest of each of a few integers over the ranks (one collective for all of them)."""
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    tensor = torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return [int(value) for value in tensor.tolist()]


def destroy_process_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def exit_without_teardown(code: int = 0) -> NoReturn:
    """End a rank's process now, its work done, without the interpreter's teardown.

    A gloo collective's thread may let go of the collective's tensors after the caller has moved
    on, and a tensor that Python owns needs the interpreter lock to be freed. Once the interpreter
    is tearing down, taking that lock ends the thread inside C++ code that cannot unwind, and the
    whole process aborts ("terminate called without an active exception", SIGABRT) with its work
    done. torch joins those threads only when the last reference to the group goes, and its own
    caches keep references (device meshes), so a rank that is done leaves this way instead: logs
    and standard streams flushed, exit code kept."""
    import sys

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed, or a broken pipe: nothing more can be written
            pass
    os._exit(code)
