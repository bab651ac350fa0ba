"""A vision-language policy plays MiniWoB in a real Chromium with screenshots: the env's PNGs reach
the model with each observation, ride in the trajectory, and score at the learner as sampled."""

from __future__ import annotations

import struct
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from vlm_models import build_tiny_vlm  # noqa: E402

from longhorizon.actor.engines.base import EngineSettings, make_engine  # noqa: E402
from longhorizon.actor.rollout import AgentLoopSettings, run_episode, to_trajectory  # noqa: E402
from longhorizon.common.chat import image_model_inputs  # noqa: E402
from longhorizon.common.codec import decode, encode  # noqa: E402
from longhorizon.common.config import SamplingConfig  # noqa: E402
from longhorizon.common.models import image_token_ids, load_causal_lm, load_processor  # noqa: E402
from longhorizon.envs.base import list_tasks, make_env  # noqa: E402
from longhorizon.envs.web.browser import BrowserPool  # noqa: E402
from longhorizon.learner.logprobs import Example, pad_examples, token_logprobs  # noqa: E402
from longhorizon.learner.samples import images_of  # noqa: E402


def _png_size(data: bytes) -> tuple[int, int]:
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


@pytest.mark.browser
@pytest.mark.slow
async def test_a_vision_language_policy_plays_miniwob_on_screenshots(tmp_path):
    folder = build_tiny_vlm(tmp_path / "tiny-vlm")
    engine = make_engine("hf", EngineSettings(
        model_path=str(folder), sampling=SamplingConfig(max_new_tokens=4, temperature=1.0), seed=1))
    pool = BrowserPool(1)
    options = {"task_names": ["click-button"], "instances_per_task": 1, "observation_modes": ["text", "screenshot"],
               "screenshot_size": [160, 120]}
    env = make_env("miniwob", pool=pool, **options)
    task = list_tasks("miniwob", "train", **options)[0]
    try:
        result = await run_episode(env, engine, task, horizon_cap=3, max_context_tokens=8192, max_new_tokens=4,
                                   seed=0, loop_settings=AgentLoopSettings(observation_image="screenshot"))
    finally:
        await env.close()
        pool.close()
    assert result.error == "", result.error
    trajectory = decode(encode(to_trajectory(result, actor_id="a", task=task, group_id="g", group_size=1,
                                             horizon_cap=3)))
    assert trajectory.images and {_png_size(image) for image in trajectory.images} == {(160, 120)}
    image_token = engine.tokenizer.processor.image_token_id
    assert int(np.sum(np.asarray(trajectory.token_ids) == image_token)) == 4 * len(trajectory.images)

    model, processor = load_causal_lm(folder), load_processor(folder)
    example = Example(np.asarray(trajectory.token_ids, np.int64), np.asarray(trajectory.loss_mask, np.float32),
                      np.asarray(trajectory.behaviour_logprobs, np.float32), 0.0, images=images_of(trajectory))
    batch = pad_examples([example], engine.tokenizer.tokenizer.pad_token_id,
                         image_inputs=lambda images: image_model_inputs(processor, images))
    with torch.no_grad():
        learner = token_logprobs(model, batch, suppressed_tokens=image_token_ids(model.config))
    generated = batch.loss_mask > 0
    assert (learner[generated] - batch.behaviour_logprobs[generated]).abs().max().item() < 1e-4
