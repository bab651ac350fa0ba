"""Weight updates that do not fit the model are refused whole, before any tensor is touched.

Each fault sits in the last tensor of the update, so a loader that copies as it goes would have
copied every other one before finding it. The hf engine (full and LoRA updates; inline, path and
collective), the actor (counts, logs, keeps serving its version), the model server behind the
openai engine, and the vllm engine's checks that run without vLLM (the model folder's tensors, a
path folder, the worker-side check of a collective's tensors). The vllm engine itself:
tests/test_vllm_engine.py.
"""

import logging
import queue
import re
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
import trio

from longhorizon.actor.engines.base import EngineSettings, GenerationRequest, make_engine
from longhorizon.actor.weights import folder_problems
from longhorizon.common.config import SamplingConfig
from longhorizon.common.lora import adapter_specs, adapter_state_dict, apply_lora, lora_settings
from longhorizon.common.models import WeightsRefused, load_causal_lm, tensor_specs, weights_problems
from longhorizon.common.wire import WeightsUpdate
from longhorizon.learner.broadcast import make_weights_update, unique_state_dict

LORA = {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "k_proj", "v_proj"]}
"""Three adapted modules in each of the tiny model's two layers: twelve adapter tensors."""


def _engine(model_folder, lora=None):
    return make_engine("hf", EngineSettings(
        model_path=str(model_folder), sampling=SamplingConfig(temperature=0.0, max_new_tokens=4),
        max_batch_size=4, lora=lora or {},
    ))


def _bytes(model) -> dict:
    """Every tensor of a model as bytes: equal means bit-identical."""
    return {name: tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            for name, tensor in model.state_dict().items()}


async def _greedy(engine):
    """The engine's greedy reply to one prompt, and the version that wrote it."""
    prompt = engine.tokenizer.prompt_tokens([{"role": "user", "content": "s0 s1 s2"}])
    result = await engine.generate(GenerationRequest(token_ids=prompt, episode_id="probe"))
    return result.token_ids, result.policy_version


def _shape_text(shape) -> str:
    return str(tuple(shape))


def _faults(good: dict, extra_name: str) -> list[tuple[str, dict, str]]:
    """(fault, update, the problem it must be refused with), each fault in the last tensor."""
    last = list(good)[-1]
    tensor = good[last]
    wider = torch.zeros(*tensor.shape[:-1], tensor.shape[-1] + 1)
    with_nan = tensor.clone()
    with_nan.reshape(-1)[-1] = float("nan")
    return [
        ("wrong shape", {**good, last: wider},
         f"shape of {last} is {_shape_text(wider.shape)}, the model's is {_shape_text(tensor.shape)}"),
        ("unknown name", {**good, extra_name: torch.zeros(2)}, f"unexpected name {extra_name}"),
        ("missing name", {name: t for name, t in good.items() if name != last}, f"missing name {last}"),
        ("NaN value", {**good, last: with_nan}, f"{last} holds NaN/inf"),
        ("integer dtype", {**good, last: torch.ones(tensor.shape, dtype=torch.int64)},
         f"dtype of {last} is int64, the model's is float32"),
    ]


def _perturbed(state: dict, seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return {name: t + 0.5 * torch.randn(t.shape, generator=generator) for name, t in state.items()}


# -- the check itself ---------------------------------------------------------------------------


def test_the_check_names_every_problem_and_takes_what_an_engine_can_cast():
    expected = {
        "a": ((2, 3), torch.float32), "b": ((4,), torch.float32), "c": ((2,), torch.int64),
        "d": ((1,), torch.float32), "tied": ((2, 3), torch.float32), "e": ((2,), torch.bfloat16),
        "f": ((2,), torch.float16),
    }
    good = {"a": torch.zeros(2, 3, dtype=torch.float16), "b": torch.ones(4), "c": torch.tensor([1, 2]),
            "d": torch.zeros(1, dtype=torch.bfloat16), "e": torch.zeros(2),
            "f": torch.tensor([60000.0, 60000.0], dtype=torch.float16)}  # finite, though their sum is not
    assert weights_problems(good, expected, optional={"tied"}) == []
    bad = {
        "a": torch.zeros(3, 2), "b": torch.tensor([1.0, float("inf"), 0.0, 0.0]), "c": torch.zeros(2),
        "d": torch.ones(1, dtype=torch.int32), "e": torch.tensor([0.0, float("nan")], dtype=torch.bfloat16),
        "f": torch.tensor([float("inf"), -float("inf")], dtype=torch.float16), "zzz": torch.zeros(1),
    }
    assert weights_problems(bad, expected) == [
        "unexpected name zzz",
        "missing name tied",
        "shape of a is (3, 2), the model's is (2, 3)",
        "b holds NaN/inf",
        "dtype of c is float32, the model's is int64",
        "dtype of d is int32, the model's is float32",
        "e holds NaN/inf",
        "f holds NaN/inf",
    ]
    refused = WeightsRefused(weights_problems(bad, expected))
    assert len(refused.problems) == 8
    assert str(refused).startswith("weights update refused, nothing loaded: unexpected name zzz; missing name tied;")
    assert str(refused).endswith("; and 3 more")


def test_lora_adapters_are_checked_against_the_shapes_their_base_gives():
    base = {"model.layers.0.self_attn.q_proj": torch.zeros(6, 5)}
    specs = adapter_specs(base, rank=2)
    assert specs == {
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": ((2, 5), torch.float32),
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": ((6, 2), torch.float32),
    }
    swapped = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(2, 6),
               "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(6, 2)}
    assert weights_problems(swapped, specs) == [
        "shape of base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight is (2, 6), the model's is (2, 5)"
    ]


# -- the hf engine --------------------------------------------------------------------------------


@pytest.mark.parametrize("transport", ["inline", "path"])
async def test_a_full_update_that_does_not_fit_leaves_every_parameter_as_it_was(tiny_codebook_model, tmp_path, transport):
    engine = _engine(tiny_codebook_model)
    before_bytes = _bytes(engine.model)
    before_reply = await _greedy(engine)
    good = _perturbed(unique_state_dict(load_causal_lm(tiny_codebook_model)), seed=1)
    for fault, state, problem in _faults(good, "model.layers.0.mlp.extra.weight"):
        update = make_weights_update(state, 3, transport, weights_dir=tmp_path / fault.replace(" ", "-"))
        with pytest.raises(WeightsRefused) as refused:
            await trio.to_thread.run_sync(engine.update_weights, update)
        assert refused.value.problems == [problem], fault
        assert engine.policy_version == 0, fault
        assert _bytes(engine.model) == before_bytes, f"{fault}: a parameter changed"
        assert await _greedy(engine) == before_reply, fault

    await trio.to_thread.run_sync(engine.update_weights, make_weights_update(good, 3, transport, weights_dir=tmp_path / "good"))
    assert engine.policy_version == 3
    loaded = engine.model.state_dict()
    assert all(torch.equal(loaded[name], tensor) for name, tensor in good.items())
    assert (await _greedy(engine))[1] == 3


async def test_a_path_version_whose_folder_is_gone_is_refused_not_fatal(tiny_codebook_model, tmp_path):
    """The run's finished version folders removed while it goes on (or an empty one): the hf
    engine refuses the update and keeps its version, and so does vLLM's folder check."""
    import shutil

    engine = _engine(tiny_codebook_model)
    good = _perturbed(unique_state_dict(load_causal_lm(tiny_codebook_model)), seed=2)
    update = make_weights_update(good, 4, "path", weights_dir=tmp_path / "weights")
    shutil.rmtree(update.path)
    with pytest.raises(WeightsRefused, match=r"the weights folder .* does not exist"):
        await trio.to_thread.run_sync(engine.update_weights, update)
    Path(update.path).mkdir(parents=True)
    with pytest.raises(WeightsRefused, match=r"the weights folder .* holds no safetensors files"):
        await trio.to_thread.run_sync(engine.update_weights, update)
    with pytest.raises(WeightsRefused, match="holds no safetensors files"):
        folder_problems(update.path, tensor_specs(good))
    assert engine.policy_version == 0


async def test_a_lora_update_that_does_not_fit_leaves_every_adapter_as_it_was(tiny_codebook_model):
    engine = _engine(tiny_codebook_model, lora=LORA)
    adapted = apply_lora(load_causal_lm(tiny_codebook_model), lora_settings(LORA))
    good = _perturbed(adapter_state_dict(adapted), seed=2)
    assert len(good) == 12
    before_bytes = _bytes(engine.model)
    before_reply = await _greedy(engine)
    extra = "base_model.model.model.layers.0.mlp.up_proj.lora_A.weight"  # a module not adapted
    for fault, state, problem in _faults(good, extra):
        with pytest.raises(WeightsRefused, match="learner and actor must use the same learner.lora") as refused:
            await trio.to_thread.run_sync(engine.update_weights, make_weights_update(state, 1, "inline"))
        assert refused.value.problems == [problem], fault
        assert engine.policy_version == 0, fault
        assert _bytes(engine.model) == before_bytes, f"{fault}: an adapter changed"
        assert await _greedy(engine) == before_reply, fault

    await trio.to_thread.run_sync(engine.update_weights, make_weights_update(good, 1, "inline"))
    assert engine.policy_version == 1
    loaded = adapter_state_dict(engine.model)
    assert all(torch.equal(loaded[name], tensor) for name, tensor in good.items())


async def test_a_refused_update_over_the_collective_leaves_the_hf_engine_as_it_was(tiny_codebook_model):
    """The bytes are taken (the learner's send completes), then the update is refused whole; the
    next version over the same group loads."""
    from longhorizon.learner.weight_sync import CollectiveSender

    engine = _engine(tiny_codebook_model)
    before_bytes = _bytes(engine.model)
    good = _perturbed(unique_state_dict(load_causal_lm(tiny_codebook_model)), seed=3)
    (_, with_nan, problem) = _faults(good, "unused")[3]
    outcomes = queue.Queue()

    def announce(actor_id, message):
        def load():
            try:
                engine.update_weights(message)
                outcomes.put(message.version)
            except Exception as error:
                outcomes.put(error)

        threading.Thread(target=load, daemon=True).start()

    sender = CollectiveSender(host="127.0.0.1", backend="gloo", timeout_s=10, bucket_bytes=1 << 20, announce=announce)
    try:
        sender.join("actor-0", 0)
        sender.publish(sender.snapshot(with_nan, 1))
        outcome = await trio.to_thread.run_sync(lambda: outcomes.get(timeout=30))
        assert isinstance(outcome, WeightsRefused) and outcome.problems == [problem]
        assert engine.policy_version == 0 and _bytes(engine.model) == before_bytes
        sender.publish(sender.snapshot(good, 2))
        assert await trio.to_thread.run_sync(lambda: outcomes.get(timeout=30)) == 2
        assert engine.policy_version == 2
    finally:
        sender.close()


# -- the actor ------------------------------------------------------------------------------------


def _in_process_actor(model, *overrides):
    """An hf actor on `model` in an in-process network: its router, publisher, engine and actor."""
    from longhorizon.actor.worker import Actor
    from longhorizon.common.config import load_config
    from longhorizon.common.transport import InProcessNetwork

    config = load_config(None, [
        "env.name='codebook'", "actor.engine='hf'", f"model.path={str(model)!r}",
        "actor.group_size=2", "actor.concurrent_groups=1", *overrides,
    ])
    network = InProcessNetwork()
    router, publisher = network.router(), network.publisher()
    engine = _engine(model)
    return router, publisher, engine, Actor(config, 0, network.actor_endpoints("actor-0"), engine)


async def test_the_actor_counts_a_refused_update_logs_it_and_keeps_serving_its_version(tiny_codebook_model, caplog):
    from longhorizon.common.wire import Heartbeat

    router, publisher, engine, actor = _in_process_actor(tiny_codebook_model, "actor.heartbeat_s=0.05")
    good = {name: t.numpy() for name, t in _perturbed(unique_state_dict(engine.model), seed=4).items()}
    name = "model.layers.1.self_attn.o_proj.weight"
    wrong_shape = WeightsUpdate(version=1, tensors={**good, name: np.zeros((64, 63), np.float32)})

    async def until(condition):
        with trio.fail_after(30):
            while not condition():
                await trio.sleep(0.01)

    async def next_heartbeat():
        while True:
            _, message = await router.receive()
            if isinstance(message, Heartbeat):
                return message

    with caplog.at_level(logging.WARNING, logger="longhorizon.actor.worker"):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(actor.run)
            await publisher.send(wrong_shape)
            await until(lambda: actor.counters.weights_refused == 1)
            refused_at = time.time()
            assert engine.policy_version == 0
            heartbeat = await next_heartbeat()
            while heartbeat.time <= refused_at:  # those queued before the refusal
                heartbeat = await next_heartbeat()
            assert heartbeat.policy_version == 0  # what the learner hears
            assert heartbeat.refused_version == 1  # and which version it need not send again
            assert actor.stats().weights_refused == 1
            await publisher.send(wrong_shape)  # re-sent for another actor: not tried again
            await trio.sleep(0.2)
            assert actor.counters.weights_refused == 1
            await publisher.send(WeightsUpdate(version=2, tensors=good))
            await until(lambda: engine.policy_version == 2)  # still taking updates
            assert actor.counters.weights_refused == 1
            nursery.cancel_scope.cancel()
    warnings = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert any(f"actor-0: refused weights v1, still serving v0 (1 refused so far): weights update refused, "
               f"nothing loaded: shape of {name} is (64, 63), the model's is (64, 64)" in w for w in warnings), warnings
    router.close()


async def test_a_sync_actor_that_refused_the_version_it_must_play_says_so_and_stops(tiny_codebook_model):
    """In sync mode the learner trains nothing until the batch of its current version arrives, so
    an actor whose engine refused that version would wait for ever."""
    from longhorizon.actor.worker import SyncVersionRefused
    from longhorizon.common.wire import HorizonUpdate

    router, publisher, engine, actor = _in_process_actor(
        tiny_codebook_model, "run.mode='sync'", "learner.groups_per_step=1")
    good = {name: t.numpy() for name, t in unique_state_dict(engine.model).items()}
    name = list(good)[-1]
    with_nan = good[name].copy()
    with_nan.reshape(-1)[-1] = np.nan
    with trio.fail_after(60):
        with pytest.raises(BaseExceptionGroup) as raised:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(actor.run)
                await publisher.send(HorizonUpdate(horizon_cap=2, stage=0, learner_step=0))
                while actor.counters.episodes < 2:  # the batch of v0 is played
                    await trio.sleep(0.01)
                await publisher.send(HorizonUpdate(horizon_cap=2, stage=0, learner_step=1))
                await publisher.send(WeightsUpdate(version=1, tensors={**good, name: with_nan}))
    refusals = raised.value.subgroup(SyncVersionRefused)
    while isinstance(refusals, BaseExceptionGroup):
        refusals = refusals.exceptions[0]
    assert re.match(r"actor-0: sync mode needs the learner's v1 to play its batch, and the engine refused those "
                    r"weights \(.*holds NaN/inf", str(refusals)), raised.value
    assert engine.policy_version == 0
    router.close()


# -- the model server behind the openai engine ----------------------------------------------------


async def test_the_model_server_refuses_weights_that_do_not_fit_and_the_openai_engine_says_so(tiny_codebook_model, tmp_path):
    from longhorizon.actor.engines.openai import OpenAIEngine
    from longhorizon.actor.model_server import ModelServer, start_http_server

    server = ModelServer(str(tiny_codebook_model), max_batch_size=4)
    httpd = start_http_server(server, "127.0.0.1", 0)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    base_url = f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    engine = OpenAIEngine(
        EngineSettings(model_path=str(tiny_codebook_model), sampling=SamplingConfig(temperature=0.0, max_new_tokens=4)),
        options={"base_url": base_url},
    )
    try:
        before_bytes = _bytes(server.engine.model)
        before_reply = await _greedy(engine)
        good = _perturbed(unique_state_dict(load_causal_lm(tiny_codebook_model)), seed=5)
        (_, with_nan, problem) = _faults(good, "unused")[3]
        for number, transport in enumerate(("inline", "path"), start=1):
            update = make_weights_update(with_nan, 4, transport, weights_dir=tmp_path / "nan")
            with pytest.raises(WeightsRefused) as refused:
                await trio.to_thread.run_sync(engine.update_weights, update)
            assert refused.value.problems == [problem]
            assert engine.policy_version == 0 == server.policy_version
            assert server.weights_refused == number
            assert _bytes(server.engine.model) == before_bytes
            assert await _greedy(engine) == before_reply
        health = (await trio.to_thread.run_sync(lambda: httpx.get(f"{base_url}/health", timeout=10))).json()
        assert health["weights_refused"] == 2 and health["policy_version"] == 0

        await trio.to_thread.run_sync(engine.update_weights, make_weights_update(good, 5, "inline"))
        assert engine.policy_version == 5 == server.policy_version
    finally:
        await engine.close()
        httpd.shutdown()
        httpd.server_close()
        server.stop()


# -- the vllm engine's checks, without vLLM ------------------------------------------------------


def test_vllm_checks_a_path_folder_and_the_model_folder_tensors(tiny_codebook_model, tmp_path):
    from longhorizon.actor.engines.vllm import checkpoint_tensor_specs

    model = load_causal_lm(tiny_codebook_model)
    expected = checkpoint_tensor_specs(tiny_codebook_model)
    assert expected == tensor_specs(unique_state_dict(model))  # the tied output is stored once
    good = _perturbed(unique_state_dict(model), seed=6)
    assert folder_problems(make_weights_update(good, 1, "path", weights_dir=tmp_path).path, expected) == []
    for fault, state, problem in _faults(good, "model.extra.weight"):
        folder = make_weights_update(state, 1, "path", weights_dir=tmp_path / fault.replace(" ", "-")).path
        assert folder_problems(folder, expected) == [problem], fault


def test_vllm_worker_drops_a_received_collective_update_that_does_not_fit():
    """vLLM's worker process checks a collective's tensors where they arrived, before its reload;
    the engine sends the expected tensors as plain data."""
    from longhorizon.actor.engines.vllm import WorkerExtension

    worker = WorkerExtension()
    expected = {"w": [[2, 2], "float32"], "b": [[2], "bfloat16"], "free": [[1], None]}
    worker._longhorizon_received = {"w": torch.zeros(2, 2), "b": torch.zeros(2, dtype=torch.bfloat16),
                                    "free": torch.zeros(1, dtype=torch.int8)}
    assert worker.longhorizon_check_received_weights(expected, []) == []
    assert worker._longhorizon_received is not None  # kept for the load
    worker._longhorizon_received = {"w": torch.tensor([[0.0, float("nan")], [0.0, 0.0]]), "b": torch.zeros(3)}
    assert worker.longhorizon_check_received_weights(expected, ["free"]) == [
        "w holds NaN/inf", "shape of b is (3,), the model's is (2,)",
    ]
    assert worker._longhorizon_received is None  # dropped: nothing of it can be loaded
