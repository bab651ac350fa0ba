"""A short training run of a vision-language policy on screenshots: learner and actor in one process
(the in-process transport, every trajectory through the wire codec), the tiny random Idefics3 of
tests/vlm_models.py, and a toy env whose answer is only in its screen."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from vlm_models import build_tiny_vlm  # noqa: E402

from longhorizon.common.config import load_config  # noqa: E402


@pytest.mark.slow
async def test_a_vision_language_policy_trains_on_screenshots(tmp_path):
    from longhorizon.common.metrics import read_metrics
    from longhorizon.common.models import load_causal_lm
    from longhorizon.launch.launchers.local import train_in_process

    folder = build_tiny_vlm(tmp_path / "tiny-vlm")
    config = load_config(None, [
        f"run.output_dir={str(tmp_path / 'runs')!r}", "run.name='vlm'", "run.total_steps=3", "run.mode='sync'",
        f"model.path={str(folder)!r}", "env.name='vlm_models:COLOUR_SPEC'", "actor.num_actors=1",
        "actor.group_size=4", "actor.max_context_tokens=256", "actor.sampling.max_new_tokens=2",
        "actor.observation_image='screenshot'", "learner.groups_per_step=2", "learner.learning_rate=1e-2",
        "horizon.schedule='fixed'", "horizon.stages=[2]",
    ])
    learner = await train_in_process(config)

    records = read_metrics(config.run_dir)
    assert [r["step"] for r in records] == [1, 2, 3]
    # In sync mode each step trains on episodes of the weights it starts from: the learner's
    # log-probs (scored with the images) are the engine's, so every importance ratio is 1.
    trained = [record for record in records if "ratio_max" in record]
    assert trained, "no step had a group with signal to train on"
    assert all(abs(record["ratio_max"] - 1.0) < 1e-3 for record in trained), trained
    untrained = load_causal_lm(folder)
    changed = [name for (name, trained), initial in zip(learner.model.named_parameters(), untrained.parameters())
               if not torch.equal(trained, initial)]
    assert any("vision" in name for name in changed), "the image encoder never trained: no images reached it"


@pytest.mark.slow
def test_evaluation_shows_the_policy_the_same_images(tmp_path, monkeypatch):
    """`eval`, `collect`, the offline recipes and the experiments score a checkpoint with the images
    training showed (actor.observation_image), and without them when the option is off."""
    from longhorizon.actor.engines.hf import HFEngine
    from longhorizon.actor.evaluate import evaluate_model_folder

    images_per_request: list[int] = []
    generate = HFEngine.generate

    async def counting(self, request):
        images_per_request.append(len(request.images))
        return await generate(self, request)

    monkeypatch.setattr(HFEngine, "generate", counting)
    folder = build_tiny_vlm(tmp_path / "tiny-vlm")
    overrides = [
        f"run.output_dir={str(tmp_path / 'runs')!r}", f"model.path={str(folder)!r}", "env.name='vlm_models:COLOUR_SPEC'",
        "actor.max_context_tokens=256", "actor.sampling.max_new_tokens=2", "horizon.schedule='fixed'", "horizon.stages=[2]",
    ]
    played = evaluate_model_folder(load_config(None, [*overrides, "actor.observation_image='screenshot'"]), folder, 4)
    assert played["episodes"] == 4 and played["failed_episodes"] == 0
    # A request shows every image of the turns so far: the first turn's one, then two (one when the
    # random policy's first reply was no action, which leaves the screen as it was).
    assert len(images_per_request) == 8 and set(images_per_request) <= {1, 2} and 2 in images_per_request
    images_per_request.clear()
    text_only = evaluate_model_folder(load_config(None, overrides), folder, 4)
    assert text_only["failed_episodes"] == 0 and images_per_request == [0] * 8
