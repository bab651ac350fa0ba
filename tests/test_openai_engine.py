"""The openai engine against our OpenAI-compatible server (a real subprocess on loopback) and against
a scripted fake endpoint for the replies a real server should never send."""

import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
import torch
import trio

from longhorizon.actor.engines.base import EngineSettings, GenerationRequest, make_engine
from longhorizon.actor.engines.openai import OpenAIEndpointError, TokenLogprobsUnavailable
from longhorizon.common.config import SamplingConfig
from longhorizon.common.models import load_causal_lm
from longhorizon.common.wire import WeightsUpdate
from longhorizon.learner.broadcast import make_weights_update

# Tests that start `longhorizon serve-model` as a real process (~10 s to import torch and load).
SERVER = pytest.mark.slow


def _start_server(model_folder, ready_file):
    process = subprocess.Popen(
        [sys.executable, "-m", "longhorizon.actor.model_server", str(model_folder), "--port", "0",
         "--ready-file", str(ready_file), "--max-batch-size", "8"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 180  # importing torch on a busy 2-core machine can take a while
    while not ready_file.is_file():
        assert process.poll() is None, "the model server exited during start-up"
        if time.monotonic() > deadline:
            process.kill()
            pytest.fail("the model server did not start within 180 s")
        time.sleep(0.05)
    return process, ready_file.read_text().strip()


@pytest.fixture(scope="module")
def server(tiny_codebook_model, tmp_path_factory):
    """`longhorizon serve-model` for the tiny model; yields its base URL and checks it stops."""
    process, base_url = _start_server(tiny_codebook_model, tmp_path_factory.mktemp("serve") / "url")
    yield base_url
    process.terminate()
    assert process.wait(timeout=10) is not None
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{base_url}/models", timeout=2)


def _settings(model_folder, **sampling):
    return EngineSettings(model_path=str(model_folder), max_batch_size=8,
                          sampling=SamplingConfig(**{"max_new_tokens": 5, "temperature": 0.0, **sampling}))


def _openai(model_folder, base_url, **options):
    from longhorizon.actor.engines.openai import OpenAIEngine

    sampling = options.pop("sampling", {})
    return OpenAIEngine(_settings(model_folder, **sampling), options={"base_url": base_url, **options})


def _conversations(count):
    words = ["s0", "s1", "s2", "s3", "a0", "a1"]
    return [[{"role": "user", "content": " ".join(words[i % 6:] + words[: i % 3])}] for i in range(count)]


async def _generate_one(engine, messages, episode_id="0"):
    request = GenerationRequest(token_ids=engine.tokenizer.prompt_tokens(messages), episode_id=episode_id,
                                messages=messages)
    return await engine.generate(request)


async def _generate_all(engine, conversations):
    """Concurrently, as an actor's episodes call the engine."""
    results = [None] * len(conversations)

    async def one(index):
        results[index] = await _generate_one(engine, conversations[index], str(index))

    async with trio.open_nursery() as nursery:
        for index in range(len(conversations)):
            nursery.start_soon(one, index)
    return results


@SERVER
async def test_completions_mode_matches_the_hf_engine_token_for_token(tiny_codebook_model, server):
    engine = _openai(tiny_codebook_model, server)
    assert engine.model == tiny_codebook_model.name  # learned from /v1/models
    reference = make_engine("hf", _settings(tiny_codebook_model))
    conversations = _conversations(6)
    remote = await _generate_all(engine, conversations)
    local = await _generate_all(reference, conversations)
    for ours, theirs in zip(remote, local):
        assert ours.token_ids == theirs.token_ids and ours.text == theirs.text
        assert ours.stopped_on_eos == theirs.stopped_on_eos and ours.policy_version == 0
        assert ours.logprobs == pytest.approx(theirs.logprobs, abs=1e-4)
    await engine.close()


@SERVER
async def test_sampled_logprobs_are_the_models(tiny_codebook_model, server):
    engine = _openai(tiny_codebook_model, server, sampling={"temperature": 1.0, "max_new_tokens": 6})
    messages = _conversations(1)[0]
    prompt = engine.tokenizer.prompt_tokens(messages)
    result = await _generate_one(engine, messages)
    model = load_causal_lm(tiny_codebook_model)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + result.token_ids])).logits[0, len(prompt) - 1:-1]
    expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(result.token_ids)[:, None])[:, 0]
    assert result.logprobs == pytest.approx(expected.tolist(), abs=1e-4)
    await engine.close()


@SERVER
async def test_chat_mode_is_text_for_evaluation_and_an_error_for_training(tiny_codebook_model, server):
    conversations = _conversations(3)
    reference = await _generate_all(make_engine("hf", _settings(tiny_codebook_model)), conversations)
    evaluation = _openai(tiny_codebook_model, server, mode="chat", require_token_logprobs=False)
    replies = await _generate_all(evaluation, conversations)
    assert [r.text for r in replies] == [r.text for r in reference]
    assert all(len(r.logprobs) == len(r.token_ids) > 0 for r in replies)
    training = _openai(tiny_codebook_model, server, mode="chat")
    with pytest.raises(TokenLogprobsUnavailable, match="cannot be used for training"):
        await _generate_one(training, conversations[0])
    await evaluation.close()
    await training.close()


@SERVER
async def test_weight_reload_route_updates_version_and_output(tiny_codebook_model, server, tmp_path):
    engine = _openai(tiny_codebook_model, server, sampling={"max_new_tokens": 3})
    messages = _conversations(1)[0]
    prompt = engine.tokenizer.prompt_tokens(messages)
    model = load_causal_lm(tiny_codebook_model)
    torch.manual_seed(3)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter))
    expected = make_engine("hf", _settings(tiny_codebook_model, max_new_tokens=3))
    await trio.to_thread.run_sync(expected.update_weights, make_weights_update(model, 1, "inline"))
    wanted = await _generate_one(expected, messages)
    try:
        for version, transport in ((7, "path"), (8, "inline")):
            update = make_weights_update(model, version, transport, weights_dir=tmp_path / "weights")
            await trio.to_thread.run_sync(engine.update_weights, update)
            assert engine.policy_version == version
            result = await _generate_one(engine, messages)
            assert result.policy_version == version and result.token_ids == wanted.token_ids
    finally:
        # Put the original weights back for the other tests sharing this server.
        original = WeightsUpdate(version=0, path=str(tiny_codebook_model))
        await trio.to_thread.run_sync(engine.update_weights, original)
        await engine.close()
    assert prompt  # the prompt was built from the local tokenizer


@SERVER
def test_server_rejects_bad_requests_with_json_errors(server):
    def post(route, payload, **kwargs):
        response = httpx.post(f"{server}/{route}", timeout=30, **({"json": payload} if payload is not None else kwargs))
        return response.status_code, response.json()

    status, body = post("completions", None, content=b"{not json", headers={"Content-Type": "application/json"})
    assert status == 400 and "not JSON" in body["error"]["message"]
    status, body = post("completions", {"prompt": [1, 99999], "max_tokens": 2})
    assert status == 400 and "outside the vocabulary" in body["error"]["message"]
    status, body = post("completions", {"prompt": "s0", "temperature": -1})
    assert status == 400 and "temperature" in body["error"]["message"]
    status, body = post("completions", {"prompt": "s0", "model": "another-model"})
    assert status == 404 and "not served" in body["error"]["message"]
    status, body = post("chat/completions", {"messages": [{"role": "robot", "content": "hi"}]})
    assert status == 400 and "role" in body["error"]["message"]
    status, body = post("nowhere", {})
    assert status == 404 and "/v1/completions" in body["error"]["message"]
    status, body = post("load_weights", {"path": "/no/such/folder"})
    assert status == 400 and "the server must see" in body["error"]["message"]  # not 404: the route exists
    # A well-formed request: text prompt, n choices, stop string, vLLM's token-id labels.
    status, body = post("completions", {"prompt": "s0 s1", "max_tokens": 4, "n": 2, "logprobs": 0,
                                        "temperature": 1.0, "return_tokens_as_token_ids": True})
    assert status == 200 and len(body["choices"]) == 2
    choice = body["choices"][0]
    assert [f"token_id:{t}" for t in choice["token_ids"]] == choice["logprobs"]["tokens"]
    assert len(choice["logprobs"]["token_logprobs"]) == len(choice["token_ids"]) >= 1


# ----------------------------------------------------------------------------- a scripted fake endpoint


class _FakeEndpoint:
    """Answers each route from a queue of (status, body) the test sets up; records hits."""

    def __init__(self):
        self.replies: dict[str, list[tuple[int, bytes]]] = {}
        self.hits: list[str] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                path = self.path.rstrip("/")
                fake.hits.append(path)
                queue = fake.replies.get(path) or [(404, b'{"error": {"message": "Not Found"}}')]
                status, body = queue.pop(0) if len(queue) > 1 else queue[0]
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base_url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def set(self, route, *replies):
        self.replies[f"/v1/{route}"] = [(status, json.dumps(body).encode() if not isinstance(body, bytes) else body)
                                        for status, body in replies]
        self.hits.clear()


@pytest.fixture(scope="module")
def fake():
    endpoint = _FakeEndpoint()
    yield endpoint
    endpoint.httpd.shutdown()
    endpoint.httpd.server_close()


def _fake_engine(model_folder, fake, **options):
    return _openai(model_folder, fake.base_url, model="fake", retry_backoff_s=0.01, max_retries=2, **options)


def _text_only(text="a1"):
    return {"choices": [{"index": 0, "text": text, "finish_reason": "stop", "logprobs": None}]}


async def test_a_chat_only_endpoint_cannot_train_but_can_be_evaluated(tiny_codebook_model, fake):
    fake.set("chat/completions", (200, {"choices": [{"message": {"role": "assistant", "content": "a2"},
                                                     "finish_reason": "stop"}]}))
    engine = _fake_engine(tiny_codebook_model, fake)  # completions mode, as training uses
    with pytest.raises(OpenAIEndpointError, match="chat only.*training"):
        await _generate_one(engine, _conversations(1)[0])
    fake.set("completions", (200, _text_only()))
    with pytest.raises(TokenLogprobsUnavailable, match="no token ids and log-probs"):
        await _generate_one(engine, _conversations(1)[0])
    evaluation = _fake_engine(tiny_codebook_model, fake, mode="chat", require_token_logprobs=False)
    reply = await _generate_one(evaluation, _conversations(1)[0])
    assert reply.text == "a2" and reply.stopped_on_eos and reply.token_ids[-1] == evaluation.tokenizer.eos_token_id


@pytest.mark.parametrize("status, body, message", [
    (200, b"<html>gateway</html>", "not JSON"),
    (200, {"object": "text_completion"}, "no choices"),
    (200, {"choices": [{"text": "a1", "token_ids": [9, 10], "logprobs": {"token_logprobs": [-0.1]}}]},
     "2 token ids but 1 log-probs"),
    (200, {"choices": [{"text": "a1", "token_ids": ["x"], "logprobs": {"token_logprobs": [-0.1]}}]},
     "not a list of integers"),
    (400, {"error": {"message": "max_tokens is too large"}}, "400: 'max_tokens is too large'"),
])
async def test_malformed_replies_are_clear_errors(tiny_codebook_model, fake, status, body, message):
    fake.set("completions", (status, body))
    engine = _fake_engine(tiny_codebook_model, fake)
    with pytest.raises(OpenAIEndpointError, match=message):
        await _generate_one(engine, _conversations(1)[0])


async def test_overload_and_server_errors_are_retried(tiny_codebook_model, fake):
    good = {"choices": [{"text": "a1", "finish_reason": "length", "token_ids": [9],
                         "logprobs": {"token_logprobs": [-0.5]}}], "policy_version": 4}
    fake.set("completions", (429, {"error": {"message": "slow down"}}), (503, b"{}"), (200, good))
    engine = _fake_engine(tiny_codebook_model, fake)
    reply = await _generate_one(engine, _conversations(1)[0])
    assert fake.hits == ["/v1/completions"] * 3
    assert reply.token_ids == [9] and reply.logprobs == [-0.5] and reply.policy_version == 4
    fake.set("completions", (503, b"{}"))
    with pytest.raises(OpenAIEndpointError, match="503"):
        await _generate_one(engine, _conversations(1)[0])
    assert len(fake.hits) == 3  # the first try and two retries


def test_an_endpoint_without_a_reload_route_refuses_weights(tiny_codebook_model, fake):
    engine = _fake_engine(tiny_codebook_model, fake)
    with pytest.raises(OpenAIEndpointError, match="no weight-reload route"):
        engine.update_weights(WeightsUpdate(version=1, path=str(tiny_codebook_model)))
    assert engine.policy_version == 0


@SERVER
async def test_make_engine_starts_and_stops_its_own_server(tiny_codebook_model):
    engine = make_engine("openai", _settings(tiny_codebook_model, max_new_tokens=2))
    process = engine._server.process
    reply = await _generate_one(engine, _conversations(1)[0])
    assert 1 <= len(reply.token_ids) <= 2
    await engine.close()
    assert process.poll() is not None


@SERVER
def test_eval_runs_through_the_openai_engine(tiny_codebook_model, server, capsys):
    from pathlib import Path

    from longhorizon.launch.recipes.eval import main

    config = Path(__file__).resolve().parent.parent / "configs" / "codebook.toml"
    assert main([str(config), "actor.engine='openai'", f"model.path='{tiny_codebook_model}'",
                 "--engine-option", f"base_url={server}", "--tasks", "4", "--samples", "2"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["engine"] == "openai" and summary["episodes"] == 8 and summary["failed_episodes"] == 0


def test_options_come_from_the_environment_and_are_checked(monkeypatch):
    from longhorizon.actor.engines.openai import OpenAIOptions, resolve_options

    monkeypatch.setenv("LONGHORIZON_OPENAI_BASE_URL", "http://10.0.0.5:8000/v1")
    monkeypatch.setenv("LONGHORIZON_OPENAI_MAX_RETRIES", "7")
    monkeypatch.setenv("LONGHORIZON_OPENAI_REQUIRE_TOKEN_LOGPROBS", "false")
    monkeypatch.setenv("LONGHORIZON_OPENAI_EXTRA_BODY", '{"top_k": 5}')
    options = resolve_options(EngineSettings(), {"mode": "chat"})
    assert options == OpenAIOptions(base_url="http://10.0.0.5:8000/v1", max_retries=7, require_token_logprobs=False,
                                    extra_body={"top_k": 5}, mode="chat")
    with pytest.raises(ValueError, match="valid options: api_key_env, base_url"):
        resolve_options(EngineSettings(), {"base_uri": "x"})
    with pytest.raises(ValueError, match="completions, chat"):
        resolve_options(EngineSettings(), {"mode": "stream"})
    with pytest.raises(ValueError, match="max_retries must be a int"):
        resolve_options(EngineSettings(), {"max_retries": "many"})


def test_an_unset_api_key_variable_is_named(tiny_codebook_model, fake, monkeypatch):
    monkeypatch.delenv("LONGHORIZON_TEST_KEY", raising=False)
    from longhorizon.actor.engines.base import EngineError

    with pytest.raises(EngineError, match="LONGHORIZON_TEST_KEY is not set"):
        _fake_engine(tiny_codebook_model, fake, api_key_env="LONGHORIZON_TEST_KEY")
