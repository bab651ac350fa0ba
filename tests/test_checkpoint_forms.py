"""What a checkpoint holds on disk: at one rank the parameters are stored once (in the model
folder), the optimiser state alone goes to `sharded/`, and such a checkpoint still resumes at one
rank and at two; only the newest `run.keep_checkpoints` stay, and the path transport keeps only
its newest weights version once it closes."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

from longhorizon.learner.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from longhorizon.learner.curriculum import HorizonState
from longhorizon.learner.distributed import Ranks, split_by_tokens
from tests.test_distributed import LORA, _examples, _free_port, _relative_error, _trainer


def _save(run_dir, trainer, step, model_folder, keep=3):
    return save_checkpoint(run_dir, trainer=trainer, step=step, version=step,
                           horizon=HorizonState(cap=3, stage=0, step=step), counters={},
                           model_folder=model_folder, keep=keep)


def _sharded_names(folder) -> set[str]:
    import torch.distributed.checkpoint as dcp

    return set(dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata)


@pytest.mark.parametrize("lora", [None, LORA], ids=["full", "lora"])
def test_one_rank_stores_the_parameters_once_and_resumes(tmp_path, tiny_codebook_model, lora):
    trainer = _trainer(tiny_codebook_model, Ranks.single(), lora)
    trainer.step(_examples())
    checkpoint = _save(tmp_path, trainer, 1, tiny_codebook_model)
    names = _sharded_names(checkpoint / "sharded")
    assert any(name.startswith("optimizer.") for name in names)
    # Without LoRA the model folder is the parameters; with it the adapters train, so they stay.
    assert any(name.startswith("model.") for name in names) == (lora is not None)

    resumed = _trainer(tiny_codebook_model, Ranks.single(), lora)
    assert load_checkpoint(checkpoint, trainer=resumed)["step"] == 1
    assert _relative_error(resumed.full_state_dict(), trainer.full_state_dict()) == 0.0
    more = _examples(seed=1)
    trainer.step(more)
    resumed.step(more)  # the optimiser state came back too
    assert _relative_error(resumed.full_state_dict(), trainer.full_state_dict()) == 0.0


def test_only_the_newest_checkpoints_stay(tmp_path, tiny_codebook_model):
    trainer = _trainer(tiny_codebook_model, Ranks.single())
    for step in (1, 2, 3, 4):
        _save(tmp_path, trainer, step, tiny_codebook_model, keep=2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000003", "step_000004"]
    with pytest.raises(ValueError, match="at least 1"):
        _save(tmp_path, trainer, 5, tiny_codebook_model, keep=0)
    assert latest_checkpoint(tmp_path).name == "step_000004"


def test_a_checkpoint_cut_off_before_its_rename_is_not_resumed_from(tmp_path, tiny_codebook_model, monkeypatch):
    """A learner killed after writing `state.pt` into `step_N.partial` but before renaming it
    leaves a folder that looks like a checkpoint (its state.pt may be cut short): resume takes
    the last whole one, and the next save of that step replaces the leftover."""
    from pathlib import Path

    trainer = _trainer(tiny_codebook_model, Ranks.single())
    _save(tmp_path, trainer, 4, tiny_codebook_model)

    rename = Path.rename

    def killed_before_rename(self, target):
        if self.name.endswith(".partial"):  # the checkpoint's own rename, not its files'
            raise SystemExit("killed")
        return rename(self, target)

    with monkeypatch.context() as patch:
        patch.setattr(Path, "rename", killed_before_rename)
        with pytest.raises(SystemExit):
            _save(tmp_path, trainer, 6, tiny_codebook_model)
    leftover = tmp_path / "checkpoints" / "step_000006.partial"
    state = leftover / "state.pt"
    state.write_bytes(state.read_bytes()[:100])  # the kill came while it was being written
    assert latest_checkpoint(tmp_path).name == "step_000004"
    assert load_checkpoint(latest_checkpoint(tmp_path), trainer=_trainer(tiny_codebook_model, Ranks.single()))["step"] == 4
    _save(tmp_path, trainer, 6, tiny_codebook_model)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000004", "step_000006"]
    assert latest_checkpoint(tmp_path).name == "step_000006"


def _resume_rank(rank, world_size, port, model_folder, checkpoint, out_dir):
    """One of two ranks: resume a one-rank checkpoint, take a step on its share, gather."""
    from longhorizon.learner.distributed import destroy_process_group, exit_without_teardown, init_process_group

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    ranks = Ranks(rank, world_size, rank)
    init_process_group(ranks, torch.device("cpu"), timeout_s=120)
    try:
        torch.set_num_threads(1)
        trainer = _trainer(model_folder, ranks)
        load_checkpoint(checkpoint, trainer=trainer)
        restored = trainer.full_state_dict()
        examples = _examples(seed=1)
        share = split_by_tokens([len(e.token_ids) for e in examples], world_size)[rank]
        trainer.step([examples[i] for i in share])
        stepped = trainer.full_state_dict()
        if rank == 0:
            torch.save({"restored": restored, "stepped": stepped}, os.path.join(out_dir, "resumed.pt"))
    finally:
        destroy_process_group()
    exit_without_teardown(0)


def test_a_one_rank_checkpoint_resumes_at_two_ranks(tmp_path, tiny_codebook_model):
    one = _trainer(tiny_codebook_model, Ranks.single())
    one.step(_examples())
    checkpoint = _save(tmp_path, one, 1, tiny_codebook_model)
    saved = one.full_state_dict()
    mp.spawn(_resume_rank, args=(2, _free_port(), str(tiny_codebook_model), str(checkpoint), str(tmp_path)),
             nprocs=2, join=True)
    resumed = torch.load(tmp_path / "resumed.pt")
    assert _relative_error(resumed["restored"], saved) == 0.0
    one.step(_examples(seed=1))  # two ranks with the restored optimiser state step as one does
    assert _relative_error(resumed["stepped"], one.full_state_dict()) <= 1e-5


def test_the_path_transport_leaves_only_its_newest_version(tmp_path):
    from longhorizon.learner.weights import PublisherContext, build_publisher

    publisher = build_publisher("path", PublisherContext(weights_dir=tmp_path))
    for version in (1, 2, 3, 4):
        publisher.build({"w": torch.full((4,), float(version))}, version)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v000002", "v000003", "v000004"]
    publisher.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v000004"]
