"""The hf engine: batched generation whose log-probs are the learner's, and in-place weight updates."""


import numpy as np
import pytest
import torch
import trio

from longhorizon.actor.engines.base import EngineSettings, GenerationRequest, make_engine, tokens_through_stop_string
from longhorizon.common.config import SamplingConfig
from longhorizon.common.models import WeightsRefused, load_causal_lm
from longhorizon.common.wire import WeightsUpdate
from longhorizon.learner.broadcast import make_weights_update
from longhorizon.learner.logprobs import Example, pad_examples, token_logprobs


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
    with pytest.raises(WeightsRefused, match="weights update refused, nothing loaded: unexpected name nonsense; missing name"):
        engine.update_weights(WeightsUpdate(version=1, tensors={"nonsense": np.zeros(3, np.float32)}))
    assert engine.policy_version == 0


async def test_a_reply_ends_at_its_first_stop_string(tiny_codebook_model):
    engine = _engine(tiny_codebook_model, temperature=0.0, max_new_tokens=8)
    (prompt,) = _prompts(engine, 1)
    free = await engine.generate(GenerationRequest(token_ids=prompt, episode_id="free"))
    words = [engine.tokenizer.decode([token]) for token in free.token_ids]
    assert len(words) >= 3 and all(words[:3]), words  # greedy, so the same reply comes again below
    stop = words[1]
    expected = next(index for index, word in enumerate(words) if stop in word) + 1
    cut = await engine.generate(GenerationRequest(token_ids=prompt, episode_id="cut", stop_strings=(stop, "never")))
    assert cut.token_ids == free.token_ids[:expected] and cut.logprobs == pytest.approx(free.logprobs[:expected])
    assert not cut.stopped_on_eos and cut.text.endswith(stop)


def test_tokens_through_stop_string_counts_tokens_up_to_the_first_stop():
    pieces = {1: "<sea", 2: "rch>q</", 3: "search>", 4: " more", 5: "</answer>"}

    def decode(ids):
        return "".join(pieces[i] for i in ids)

    assert tokens_through_stop_string(decode, [1, 2, 3, 4, 5], ("</search>",)) == 3  # split across tokens
    assert tokens_through_stop_string(decode, [1, 2, 3, 4, 5], ("</answer>", "</search>")) == 3  # the first one
    assert tokens_through_stop_string(decode, [1, 2, 4, 5], ("</search>",)) is None
    assert tokens_through_stop_string(decode, [5], ("</answer>",)) == 1
    assert tokens_through_stop_string(decode, [1, 2, 3], ()) is None
