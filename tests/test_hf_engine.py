"""The hf engine: batched generation whose log-probs are the learner's, and in-place weight updates."""


import numpy as np
import pytest
import torch
import trio

from longhorizon.actor.engines.base import EngineSettings, GenerationRequest, make_engine
from longhorizon.common.config import SamplingConfig
from longhorizon.common.models import load_causal_lm
from longhorizon.common.wire import WeightsUpdate
from longhorizon.learner.broadcast import make_weights_update
from longhorizon.learner.trainer import Example, pad_examples, token_logprobs


def _engine(model_folder, **sampling):
    settings = EngineSettings(
        model_path=str(model_folder), sampling=SamplingConfig(**{"max_new_tokens": 4, **sampling}), max_batch_size=8
    )
    return make_engine("hf", settings)


def _prompts(engine, count):
    symbols = ["s0", "s1", "s2", "s3"]
    return [
        engine.tokenizer.prompt_tokens([{"role": "user", "content": " ".join(symbols[: 1 + i % 4])}])
        for i in range(count)
    ]


async def test_concurrent_requests_share_batches_and_logprobs_match_the_learner(tiny_codebook_model):
    engine = _engine(tiny_codebook_model, temperature=1.0)
    prompts = _prompts(engine, 6)
    results = [None] * len(prompts)

    async def one(index):
        results[index] = await engine.generate(GenerationRequest(token_ids=prompts[index], episode_id=str(index)))

    async with trio.open_nursery() as nursery:
        for index in range(len(prompts)):
            nursery.start_soon(one, index)

    learner_model = load_causal_lm(tiny_codebook_model)
    examples = []
    for prompt, result in zip(prompts, results):
        assert 1 <= len(result.token_ids) <= 4 and len(result.logprobs) == len(result.token_ids)
        assert result.policy_version == 0
        tokens = prompt + result.token_ids
        mask = [0] * len(prompt) + [1] * len(result.token_ids)
        logprobs = [0.0] * len(prompt) + result.logprobs
        examples.append(Example(np.array(tokens), np.array(mask, np.float32), np.array(logprobs, np.float32), 0.0))
    batch = pad_examples(examples, pad_token_id=0)
    with torch.no_grad():
        learner_logprobs = token_logprobs(learner_model, batch)
    generated = batch.loss_mask > 0
    difference = (learner_logprobs[generated] - batch.behaviour_logprobs[generated]).abs().max().item()
    assert difference < 1e-4, difference


async def test_weight_update_changes_version_and_output(tiny_codebook_model):
    engine = _engine(tiny_codebook_model, temperature=0.0, max_new_tokens=3)
    prompt = _prompts(engine, 1)[0]
    before = await engine.generate(GenerationRequest(token_ids=prompt, episode_id="a"))

    model = load_causal_lm(tiny_codebook_model)
    torch.manual_seed(1)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter))
        expected = model.generate(
            torch.tensor([prompt]), max_new_tokens=3, do_sample=False, top_k=None,
            eos_token_id=engine.tokenizer.eos_token_id, pad_token_id=0,
        )[0, len(prompt):].tolist()
    eos = engine.tokenizer.eos_token_id
    expected = expected[: expected.index(eos) + 1] if eos in expected else expected
    for version, transport in ((5, "inline"), (6, "path")):
        update = make_weights_update(model, version, transport, weights_dir=tiny_codebook_model.parent / "weights-test")
        await trio.to_thread.run_sync(engine.update_weights, update)
        after = await engine.generate(GenerationRequest(token_ids=prompt, episode_id=transport))
        assert after.policy_version == version
        assert after.token_ids == expected
    assert before.token_ids != expected


async def test_mismatched_weights_are_refused(tiny_codebook_model):
    engine = _engine(tiny_codebook_model)
    with pytest.raises(ValueError, match="weights do not match"):
        engine.update_weights(WeightsUpdate(version=1, tensors={"nonsense": np.zeros(3, np.float32)}))
    assert engine.policy_version == 0
