"""Checkpoints: parameters, optimiser, step, version, horizon state and RNG, so a run resumes exactly.

Layout: `<run_dir>/checkpoints/step_000010/` holding
- `model.safetensors` with the config and tokenizer files beside it: a Hugging Face folder that
  actors, eval and users load as it is (the whole model, gathered from the ranks);
- `sharded/`: optimiser state, and with several ranks the parameters too, written by every rank
  with torch.distributed.checkpoint, which re-shards them on load, so a run saved at N ranks
  resumes at any other number (one included);
- `state.pt`: step, version, horizon, counters, RNG and the trainer's own state (the adaptive
  entropy coefficient), written by rank 0.
At one rank the parameters are the model folder's own (no LoRA, no critic: `sharded_model`), so
they are stored once, there, and a resume at any number of ranks reads them from it.
A checkpoint is written to a `.partial` folder and renamed, so a crash mid-write never leaves a
half checkpoint that resume would pick up; only the newest `keep` (run.keep_checkpoints) stay.
(Checkpoints from before the sharded layout, with the optimiser inside `state.pt`, still resume
at one rank.)
"""

from __future__ import annotations

import random
import shutil
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from longhorizon.learner.curriculum import HorizonState
from longhorizon.common.models import load_state_into


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step:06d}"


def latest_checkpoint(run_dir: Path) -> Path | None:
    folder = Path(run_dir) / "checkpoints"
    # `step_N.partial` matches the pattern too, and holds a state.pt from the moment its writer
    # saves it until the rename: a learner killed in between leaves one, perhaps cut short.
    candidates = sorted(
        p for p in folder.glob("step_*")
        if p.is_dir() and not p.name.endswith(".partial") and (p / "state.pt").is_file()
    ) if folder.is_dir() else []
    return candidates[-1] if candidates else None


def save_checkpoint(
    run_dir: Path,
    *,
    trainer,
    step: int,
    version: int,
    horizon: HorizonState,
    counters: dict,
    model_folder: Path | None = None,
    keep: int = 3,
) -> Path:
    """Write a checkpoint of `trainer`'s model and optimiser. With several ranks every rank calls
    this at the same point (it gathers and writes collectively); rank 0 writes the rest. The
    newest `keep` checkpoints stay, older ones are removed."""
    from safetensors.torch import save_file

    if keep < 1:
        raise ValueError(f"checkpoints to keep must be at least 1, got {keep}")

    ranks = trainer.ranks
    target = checkpoint_dir(run_dir, step)
    partial = target.with_name(target.name + ".partial")
    if ranks.is_main:
        if partial.exists():
            shutil.rmtree(partial)
        partial.mkdir(parents=True)
    _barrier(ranks)
    full = trainer.full_state_dict()
    if ranks.is_main:
        save_file({k: v.to("cpu").contiguous() for k, v in full.items()}, partial / "model.safetensors")
        trainer.model.config.save_pretrained(partial)
        if model_folder is not None:
            # Tokenizer files make the checkpoint a self-contained model folder (eval, new runs).
            for pattern in ("tokenizer*", "special_tokens_map.json", "chat_template.jinja", "longhorizon_tiny.json"):
                for file in Path(model_folder).glob(pattern):
                    shutil.copy2(file, partial / file.name)
    del full
    with_model = sharded_model(trainer)
    _save_sharded(trainer, partial / "sharded", with_model=with_model)
    if ranks.is_main:
        torch.save(
            {
                "sharded_model": with_model,
                "step": step,
                "version": version,
                "horizon": asdict(horizon),
                "counters": dict(counters),
                "num_ranks": ranks.world_size,
                "trainer": trainer.extra_state(),
                "rng": {
                    "python": random.getstate(),
                    "numpy": np.random.get_state(),
                    "torch": torch.get_rng_state(),
                },
            },
            partial / "state.pt",
        )
        if target.exists():
            shutil.rmtree(target)
        partial.rename(target)
        _prune(Path(run_dir) / "checkpoints", keep)
    _barrier(ranks)
    return target


def sharded_model(trainer) -> bool:
    """Whether the parameters go into `sharded/` as well as into the model folder: with several
    ranks (each writes its shard; the folder is gathered), with LoRA (the folder holds merged
    weights, not the adapters that train) or with a critic (not in the folder). At one rank
    without either, the folder holds exactly the parameters, and a second copy would only double
    the checkpoint."""
    return bool(trainer.ranks.distributed or getattr(trainer, "lora", None) is not None
                or getattr(trainer, "value_model", None) is not None)


def _barrier(ranks) -> None:
    if ranks.distributed:
        import torch.distributed as dist

        dist.barrier()


def _save_sharded(trainer, folder: Path, *, with_model: bool) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(trainer.policy, trainer.optimizer)
    state = {"model": model_state, "optimizer": optimizer_state} if with_model else {"optimizer": optimizer_state}
    dcp.save(state, checkpoint_id=str(folder), no_dist=not trainer.ranks.distributed)


def _load_sharded(trainer, folder: Path, *, with_model: bool) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_optimizer_state_dict, set_state_dict

    # The current layout's state dicts (this rank's shards) are filled in place from the files,
    # whatever number of ranks wrote them.
    model_state, optimizer_state = get_state_dict(trainer.policy, trainer.optimizer)
    state = {"model": model_state, "optimizer": optimizer_state} if with_model else {"optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=str(folder), no_dist=not trainer.ranks.distributed)
    if with_model:
        set_state_dict(
            trainer.policy, trainer.optimizer,
            model_state_dict=state["model"], optim_state_dict=state["optimizer"],
        )
    else:  # the parameters came from the model folder
        set_optimizer_state_dict(trainer.policy, trainer.optimizer, optim_state_dict=state["optimizer"])


def _load_model_folder(trainer, path: Path) -> None:
    """The parameters from the checkpoint's model folder, into this rank's part of the model."""
    from safetensors.torch import load_file

    full = load_file(path / "model.safetensors")
    if not trainer.ranks.distributed:
        load_state_into(trainer.model, full)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    # Every rank reads the whole file and keeps its own shard of each tensor; a tied output layer
    # (stored once in the folder) is the embedding's parameter, so it is set with it.
    set_model_state_dict(
        trainer.policy, {f"model.{name}": tensor for name, tensor in full.items()},
        options=StateDictOptions(full_state_dict=True, strict=False),
    )


def _prune(folder: Path, keep: int) -> None:
    done = sorted(p for p in folder.glob("step_*") if p.is_dir() and not p.name.endswith(".partial"))
    for old in done[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(path: Path, *, trainer) -> dict:
    """Restore model, optimiser and RNG in place (every rank calls it); returns step, version,
    horizon and counters."""
    path = Path(path)
    # On the CPU first: the optimiser moves its state to its parameters' device as it loads, so a
    # checkpoint written on one device resumes on another.
    state = torch.load(path / "state.pt", weights_only=False, map_location="cpu")
    with_model = state.get("sharded_model", True)  # older checkpoints: always
    if not with_model:
        _load_model_folder(trainer, path)
    if (path / "sharded").is_dir():
        _load_sharded(trainer, path / "sharded", with_model=with_model)
    elif trainer.ranks.distributed:
        raise ValueError(
            f"{path} was written before sharded checkpoints: resume it with learner.num_ranks=1"
        )
    else:
        from safetensors.torch import load_file


        load_state_into(trainer.model, load_file(path / "model.safetensors"))
        trainer.optimizer.load_state_dict(state["optimizer"])
    # Every rank restores it: the coefficient is the same on each.
    trainer.load_extra_state(state.get("trainer", {}))
    rng = state["rng"]
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    return {
        "step": int(state["step"]),
        "version": int(state["version"]),
        "horizon": HorizonState(**state["horizon"]),
        "counters": dict(state["counters"]),
    }
