"""Checkpoints: parameters, optimiser, step, version, horizon state and RNG, so a run resumes exactly.

Layout: `<run_dir>/checkpoints/step_000010/` holding `model.safetensors` (loadable on its own,
with the tokenizer and config files beside it, as a Hugging Face folder) and `state.pt` (the
rest). A checkpoint is written to a `.partial` folder and renamed, so a crash mid-write never
leaves a half checkpoint that resume would pick up.
"""

from __future__ import annotations

import random
import shutil
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from longhorizon.learner.broadcast import unique_state_dict
from longhorizon.learner.curriculum import HorizonState


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step:06d}"


def latest_checkpoint(run_dir: Path) -> Path | None:
    folder = Path(run_dir) / "checkpoints"
    candidates = sorted(
        p for p in folder.glob("step_*") if p.is_dir() and (p / "state.pt").is_file()
    ) if folder.is_dir() else []
    return candidates[-1] if candidates else None


def save_checkpoint(
    run_dir: Path,
    *,
    model,
    optimizer,
    step: int,
    version: int,
    horizon: HorizonState,
    counters: dict,
    model_folder: Path | None = None,
    keep: int = 3,
) -> Path:
    from safetensors.torch import save_file

    target = checkpoint_dir(run_dir, step)
    partial = target.with_name(target.name + ".partial")
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    save_file({k: v.to("cpu").contiguous() for k, v in unique_state_dict(model).items()}, partial / "model.safetensors")
    model.config.save_pretrained(partial)
    if model_folder is not None:
        # Tokenizer files make the checkpoint a self-contained model folder (eval, new runs).
        for pattern in ("tokenizer*", "special_tokens_map.json", "chat_template.jinja", "longhorizon_tiny.json"):
            for file in Path(model_folder).glob(pattern):
                shutil.copy2(file, partial / file.name)
    torch.save(
        {
            "optimizer": optimizer.state_dict(),
            "step": step,
            "version": version,
            "horizon": asdict(horizon),
            "counters": dict(counters),
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
    return target


def _prune(folder: Path, keep: int) -> None:
    done = sorted(p for p in folder.glob("step_*") if p.is_dir() and not p.name.endswith(".partial"))
    for old in done[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(path: Path, *, model, optimizer) -> dict:
    """Restore model, optimiser and RNG in place; returns step, version, horizon and counters."""
    from safetensors.torch import load_file

    from longhorizon.actor.engines.hf import load_state_into

    path = Path(path)
    load_state_into(model, load_file(path / "model.safetensors"))
    # On the CPU first: the optimiser moves its state to its parameters' device as it loads, so a
    # checkpoint written on one device resumes on another.
    state = torch.load(path / "state.pt", weights_only=False, map_location="cpu")
    optimizer.load_state_dict(state["optimizer"])
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
