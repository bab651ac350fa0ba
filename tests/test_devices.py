"""Devices and precision: the learner's and the hf engine's device setting, bf16-mixed updates,
gradient checkpointing. The CPU tests run everywhere; the `gpu` ones where a CUDA GPU is lent."""

import numpy as np
import pytest
import torch
import trio

from longhorizon.actor.engines.base import EngineSettings, GenerationRequest, make_engine
from longhorizon.common.config import LearnerConfig, SamplingConfig
from longhorizon.common.models import ModelError, load_causal_lm, resolve_device
from longhorizon.learner.logprobs import Example, pad_examples, token_logprobs
from longhorizon.learner.trainer import Trainer

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_device_names_resolve_or_fail_clearly():
    assert resolve_device("cpu") == torch.device("cpu")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected
    for wrong in ("tpu", "", "cuda:x"):
        with pytest.raises(ModelError, match="device"):
            resolve_device(wrong)
    if not torch.cuda.is_available():
        with pytest.raises(ModelError, match="no CUDA GPU"):
            resolve_device("cuda")


def _examples(vocabulary: int, rows: int = 4, seed: int = 0) -> list[Example]:
    rng = np.random.default_rng(seed)
    examples = []
    for row in range(rows):
        length = int(rng.integers(8, 14))
        mask = np.zeros(length, np.float32)
        mask[length // 2:] = 1.0
        examples.append(Example(
            token_ids=rng.integers(0, vocabulary, size=length).astype(np.int64), loss_mask=mask,
            behaviour_logprobs=(-rng.random(length) * mask).astype(np.float32), advantage=1.0 if row % 2 else -1.0,
        ))
    return examples


def _gradients(model, config: LearnerConfig, examples) -> list[torch.Tensor]:
    Trainer(model, config).step(examples)
    return [parameter.grad.detach().float().cpu().clone() for parameter in model.parameters()]


def test_bf16_mixed_keeps_fp32_weights_and_stays_close_to_fp32(tiny_codebook_model):
    reference_model = load_causal_lm(tiny_codebook_model)
    examples = _examples(reference_model.get_input_embeddings().num_embeddings)
    fp32 = _gradients(reference_model, LearnerConfig(), examples)
    model = load_causal_lm(tiny_codebook_model)
    mixed = _gradients(model, LearnerConfig(precision="bf16-mixed"), examples)
    assert all(parameter.dtype == torch.float32 for parameter in model.parameters())
    assert all(torch.isfinite(grad).all() for grad in mixed)
    flat_fp32, flat_mixed = torch.cat([g.flatten() for g in fp32]), torch.cat([g.flatten() for g in mixed])
    cosine = torch.nn.functional.cosine_similarity(flat_fp32, flat_mixed, dim=0)
    assert cosine > 0.95, f"bf16-mixed gradient points elsewhere (cosine {cosine:.3f})"
    # ... yet it is not the fp32 gradient: the forward pass really ran in bfloat16.
    assert not torch.allclose(flat_fp32, flat_mixed, atol=1e-6, rtol=1e-4)
    with pytest.raises(ValueError, match="precision"):
        Trainer(load_causal_lm(tiny_codebook_model), LearnerConfig(precision="fp8"))


def test_gradient_checkpointing_gives_the_same_gradient(tiny_codebook_model):
    examples = _examples(load_causal_lm(tiny_codebook_model).get_input_embeddings().num_embeddings)
    plain = _gradients(load_causal_lm(tiny_codebook_model), LearnerConfig(), examples)
    model = load_causal_lm(tiny_codebook_model)
    checkpointed = _gradients(model, LearnerConfig(gradient_checkpointing=True), examples)
    assert model.is_gradient_checkpointing
    for grad, reference in zip(checkpointed, plain):
        torch.testing.assert_close(grad, reference, atol=1e-6, rtol=1e-4)


def test_auto_checkpointing_turns_on_where_activations_outweigh_the_training_state(tiny_codebook_model):
    """By hand: SmolLM2's shape (30 layers of 576, 135M parameters) at 4,096 tokens keeps
    4096 x 30 x 576 x 100 B = 7.1 GB of activations against 135M x 16 B = 2.2 GB of state: on. The
    tests' tiny model keeps far less than the 1 GiB floor: off. Frozen weights count 4 bytes only."""
    from types import SimpleNamespace

    from longhorizon.learner.logprobs import gradient_checkpointing_pays, use_gradient_checkpointing

    class Shaped(torch.nn.Module):
        def __init__(self, layers, hidden, parameters, trainable=True):
            super().__init__()
            self.config = SimpleNamespace(num_hidden_layers=layers, hidden_size=hidden)
            self.weight = torch.nn.Parameter(torch.empty(parameters, device="meta"), requires_grad=trainable)

    smollm2 = Shaped(30, 576, 135_000_000)
    assert gradient_checkpointing_pays(smollm2, 4096)
    # 2.2 GB of state: 4096 x 30 x 576 x 100 = 7.1e9 passes, 1024 tokens (1.8e9) does not.
    assert not gradient_checkpointing_pays(smollm2, 1024)
    # The same model frozen (LoRA trains a few adapters) holds 0.54 GB: 1,024 tokens pay then.
    assert gradient_checkpointing_pays(Shaped(30, 576, 135_000_000, trainable=False), 1024)
    # Under the 1 GiB floor whatever the state: 512 x 30 x 576 x 100 = 0.88 GB.
    assert not gradient_checkpointing_pays(Shaped(30, 576, 1000), 512)
    assert gradient_checkpointing_pays(Shaped(30, 576, 1000), 1024)
    tiny = load_causal_lm(tiny_codebook_model)
    assert not use_gradient_checkpointing("auto", tiny, 4096)
    assert use_gradient_checkpointing(True, tiny, 4096) and not use_gradient_checkpointing(False, smollm2, 4096)
    with pytest.raises(ValueError, match="true, false or \"auto\""):
        use_gradient_checkpointing("sometimes", tiny, 4096)
    assert not Trainer(tiny, LearnerConfig()).gradient_checkpointing and not tiny.is_gradient_checkpointing


def test_the_hf_engine_takes_a_device_and_refuses_unknown_options(tiny_codebook_model):
    settings = EngineSettings(model_path=str(tiny_codebook_model), engine_options={"device": "cpu"})
    assert make_engine("hf", settings).device == torch.device("cpu")
    with pytest.raises(ValueError, match="unknown config key actor.engine_options.gpu_memory_utilization .*valid keys: device"):
        make_engine("hf", EngineSettings(model_path=str(tiny_codebook_model),
                                         engine_options={"gpu_memory_utilization": 0.5}))


@pytest.mark.gpu
@needs_gpu
def test_a_learner_step_on_the_gpu_matches_the_cpu(tiny_codebook_model):
    examples = _examples(load_causal_lm(tiny_codebook_model).get_input_embeddings().num_embeddings)
    cpu = _gradients(load_causal_lm(tiny_codebook_model), LearnerConfig(), examples)
    gpu_model = load_causal_lm(tiny_codebook_model).to("cuda")
    gpu = _gradients(gpu_model, LearnerConfig(), examples)
    for grad, reference in zip(gpu, cpu):
        torch.testing.assert_close(grad, reference, atol=1e-4, rtol=1e-3)
    mixed = _gradients(load_causal_lm(tiny_codebook_model).to("cuda"), LearnerConfig(precision="bf16-mixed"), examples)
    assert all(torch.isfinite(grad).all() for grad in mixed)


@pytest.mark.gpu
@needs_gpu
async def test_the_hf_engine_generates_on_the_gpu_with_the_learners_logprobs(tiny_codebook_model):
    engine = make_engine("hf", EngineSettings(
        model_path=str(tiny_codebook_model), sampling=SamplingConfig(max_new_tokens=4), engine_options={"device": "cuda"},
    ))
    prompt = engine.tokenizer.prompt_tokens([{"role": "user", "content": "s0 s1"}])
    result = await engine.generate(GenerationRequest(token_ids=prompt, episode_id="0"))
    tokens = np.array(prompt + result.token_ids, np.int64)
    mask = np.array([0] * len(prompt) + [1] * len(result.token_ids), np.float32)
    batch = pad_examples([Example(tokens, mask, np.zeros(len(tokens), np.float32), 0.0)], pad_token_id=0)
    with torch.no_grad():
        learner = token_logprobs(load_causal_lm(tiny_codebook_model), batch)[0, len(prompt) - 1:]
    np.testing.assert_allclose(result.logprobs, learner.numpy(), atol=1e-3)
    await trio.lowlevel.checkpoint()
