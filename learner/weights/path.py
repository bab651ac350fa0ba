"""The `path` transport: each version is written as a safetensors folder under the run, and only
its location is broadcast; the actors read it from a filesystem they share with the learner.

Suits large models over many actors (the broadcast stays tiny, each actor reads at its own pace).
A version is written to `vNNNNNN.partial` and renamed when complete, so an actor never reads half
a folder; the newest few are kept, as actors may still be reading the previous one.

Copies on the way: one, from the parameters into the file's pages in the page cache (safetensors
writes each CPU tensor from its own memory; a GPU tensor is first copied to the CPU). The actor
maps the file and reads the tensors in place (`actor/weights.py`), so its engine's copy into its
parameters is the only copy on that side. The oldest version is removed before the new one is
written, not after: the new file's pages then come from memory just freed, which a virtual
machine has already backed (new pages cost several times more to write on the VM of
docs/benchmarks.md).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Mapping

from longhorizon.common.wire import WeightsUpdate
from longhorizon.learner.weights import WeightsPublisher

KEEP_VERSIONS = 3
"""Folders kept: an actor may still be reading the one before the newest."""


WRITE_ATTEMPTS = 2
"""A version folder removed from under the learner while it is written (a cleanup script, a
person) is written again once; a second loss is an error naming the folder."""


def write_version(weights_dir: Path, state: Mapping[str, Any], version: int) -> Path:
    """Write `state` as `weights_dir/vNNNNNN/model.safetensors`, atomically (rename when done)."""
    from safetensors.torch import save_file

    folder = weights_dir / f"v{version:06d}"
    partial = folder.with_name(folder.name + ".partial")
    tensors = {name: tensor.detach().to("cpu").contiguous() for name, tensor in state.items()}
    lost: FileNotFoundError | None = None
    for _ in range(WRITE_ATTEMPTS):
        try:
            partial.mkdir(parents=True, exist_ok=True)
            save_file(tensors, partial / "model.safetensors")
            if folder.exists():
                shutil.rmtree(folder)
            partial.rename(folder)
            return folder
        except FileNotFoundError as error:
            lost = error
    raise RuntimeError(f"weights v{version}: {partial} was removed while it was written, "
                       f"{WRITE_ATTEMPTS} times: {lost}") from lost


def prune_versions(weights_dir: Path, keep: int = KEEP_VERSIONS) -> None:
    """Remove all but the newest `keep` complete version folders."""
    folders = sorted(p for p in weights_dir.glob("v*") if p.is_dir() and not p.name.endswith(".partial"))
    for old in folders[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


class PathPublisher(WeightsPublisher):
    """A safetensors folder per version; the broadcast names it."""

    sends = "path"
    shared_filesystem = True

    def build(self, state: Mapping[str, Any], version: int) -> WeightsUpdate:
        weights_dir = self.context.weights_dir
        if weights_dir is None:
            raise ValueError("weights_transport 'path' needs a weights folder")
        # Room for the new version first (the newest KEEP_VERSIONS - 1 stay): see the docstring.
        prune_versions(weights_dir, keep=KEEP_VERSIONS - 1)
        folder = write_version(weights_dir, state, version)
        return WeightsUpdate(version=version, path=str(folder.resolve()))

    def payload_bytes(self, built: WeightsUpdate) -> int:
        return int(sum(file.stat().st_size for file in Path(built.path).glob("*.safetensors")))

    def close(self) -> None:
        # The run is over (or this learner is): only the newest version can still be read, by an
        # actor taking it as it stops or by a restarted learner's actors until its first update.
        if self.context.weights_dir is not None and self.context.weights_dir.is_dir():
            prune_versions(self.context.weights_dir, keep=1)
