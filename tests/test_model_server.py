"""`serve-model` as agent clients use it: streamed replies (through the official `openai` client),
top log-probs from the sampling distribution, /health and /metrics, and the errors for bad values."""

import contextlib
import http.client
import json
import math
import re
import threading

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from longhorizon.actor.model_server import ModelServer, StreamedText, start_http_server
from longhorizon.common.chat import ByteChatTokenizer
from longhorizon.common.models import load_causal_lm

MESSAGES = [{"role": "user", "content": "s0 s1 a2"}]


@pytest.fixture(scope="module")
def served(tiny_codebook_model):
    """The server in this process on a free loopback port: (ModelServer, base URL)."""
    server = ModelServer(str(tiny_codebook_model), max_batch_size=8)
    httpd = start_http_server(server, "127.0.0.1", 0)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield server, f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    finally:
        httpd.shutdown()
        httpd.server_close()
        server.stop()


@pytest.fixture(scope="module")
def client(served):
    openai = pytest.importorskip("openai", reason="the official openai client package is not installed")
    with openai.OpenAI(base_url=served[1], api_key="unused", max_retries=0, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def model(tiny_codebook_model):
    return load_causal_lm(tiny_codebook_model).eval()


def _step_logprobs(model, prompt: list[int], reply: list[int], temperature: float = 1.0) -> torch.Tensor:
    """The model's log-probs over the vocabulary at each reply position (rows: positions)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + reply])).logits[0, len(prompt) - 1: len(prompt) + len(reply) - 1]
    return torch.log_softmax(logits.float() / temperature, dim=-1)


# ----------------------------------------------------------------------------- streaming


def _streamed(text: StreamedText, tokens: list[int]) -> list[str]:
    return [text.add(token) for token in tokens]


def test_streamed_text_holds_back_incomplete_characters_and_stop_strings():
    decode = ByteChatTokenizer().decode
    tokens = list("hé✓!".encode())  # é is 2 bytes, ✓ is 3
    assert _streamed(StreamedText(decode, None, []), tokens) == ["h", "", "é", "", "", "✓", "!"]
    # A stop string: its possible beginnings wait until the text goes on past them; the text
    # ends before the stop string and the token that completes it finishes the reply.
    text = StreamedText(decode, None, ["ab!"])
    assert _streamed(text, list(b"xaybab!")) == ["", "", "x", "a", "y", "b", ""]
    assert text.finished and text.text[: text.sent] == "xayb"
    # The end-of-turn token sends whatever was held back.
    text = StreamedText(decode, 257, ["ab!"])
    assert _streamed(text, [*b"xa", 257]) == ["", "", "xa"] and text.finished


def test_openai_client_streams_a_chat_completion_equal_to_the_whole_reply(served, client):
    server, _ = served
    whole = client.chat.completions.create(model=server.served_name, messages=MESSAGES, max_tokens=8, temperature=0)
    chunks = list(client.chat.completions.create(
        model=server.served_name, messages=MESSAGES, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True},
    ))
    assert all(chunk.object == "chat.completion.chunk" for chunk in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    deltas = [chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices]
    assert "".join(deltas) == whole.choices[0].message.content
    finishes = [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices]
    assert finishes[-1] == whole.choices[0].finish_reason and not any(finishes[:-1])
    # One content chunk per token; the last chunk holds only the usage.
    assert len(chunks) == 1 + whole.usage.completion_tokens + 1 + 1
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()
    assert all(chunk.usage is None for chunk in chunks[:-1])


def test_openai_client_streams_a_completion_with_logprobs(served, client):
    server, _ = served
    request = {"model": server.served_name, "prompt": "s0 s1 s2", "max_tokens": 6, "temperature": 0, "logprobs": 2}
    whole = client.completions.create(**request)
    chunks = list(client.completions.create(**request, stream=True))
    assert all(chunk.object == "text_completion" for chunk in chunks)
    assert "".join(chunk.choices[0].text for chunk in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    streamed = [chunk.choices[0].logprobs for chunk in chunks[:-1]]
    assert [lp.tokens[0] for lp in streamed] == whole.choices[0].logprobs.tokens
    assert [lp.token_logprobs[0] for lp in streamed] == whole.choices[0].logprobs.token_logprobs
    assert [lp.top_logprobs[0] for lp in streamed] == whole.choices[0].logprobs.top_logprobs


def test_stream_keeps_the_connection_for_the_next_request(served):
    _, base_url = served
    port = int(base_url.rsplit(":", 1)[1].split("/")[0])
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        body = {"messages": MESSAGES, "max_tokens": 3, "temperature": 0, "stream": True}
        connection.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        assert response.status == 200 and response.getheader("Content-Type") == "text/event-stream"
        assert response.getheader("Transfer-Encoding") == "chunked" and not response.will_close
        events = response.read().decode().split("\n\n")
        assert events[-2:] == ["data: [DONE]", ""]
        assert all(event.startswith("data: {") for event in events[:-2])
        socket_before = connection.sock
        connection.request("GET", "/health")
        assert connection.getresponse().status == 200 and connection.sock is socket_before
    finally:
        connection.close()


# ----------------------------------------------------------------------------- top log-probs


def test_chat_top_logprobs_are_the_greedy_distributions_best_tokens(served, client, model):
    server, _ = served
    reply = client.chat.completions.create(
        model=server.served_name, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3,
    )
    entries = reply.choices[0].logprobs.content
    tokens = reply.choices[0].model_extra["token_ids"]
    assert len(entries) == len(tokens) >= 1
    expected = _step_logprobs(model, server.tokenizer.prompt_tokens(MESSAGES), tokens).topk(3, dim=-1)
    for position, entry in enumerate(entries):
        top = entry.top_logprobs
        assert len(top) == 3
        assert [t.logprob for t in top] == sorted((t.logprob for t in top), reverse=True)
        # Greedy: the chosen token is the most likely one, with the same log-prob.
        assert top[0].token == entry.token and top[0].logprob == entry.logprob
        labels = [server.tokenizer.tokenizer.decode([i]) for i in expected.indices[position].tolist()]
        assert [t.token for t in top] == labels
        assert [t.logprob for t in top] == pytest.approx(expected.values[position].tolist(), abs=1e-4)


def test_top_logprobs_come_from_the_sampling_distribution(served, model):
    server, base_url = served
    body = {"messages": MESSAGES, "max_tokens": 6, "temperature": 2.0, "logprobs": True, "top_logprobs": 4,
            "return_tokens_as_token_ids": True}
    reply = httpx.post(f"{base_url}/chat/completions", json=body, timeout=60).json()
    choice = reply["choices"][0]
    expected = _step_logprobs(model, server.tokenizer.prompt_tokens(MESSAGES), choice["token_ids"], temperature=2.0)
    for position, (token, entry) in enumerate(zip(choice["token_ids"], choice["logprobs"]["content"])):
        assert entry["logprob"] == pytest.approx(expected[position, token].item(), abs=1e-4)
        best = expected[position].topk(4)
        assert [t["token"] for t in entry["top_logprobs"]] == [f"token_id:{i}" for i in best.indices.tolist()]
        assert [t["logprob"] for t in entry["top_logprobs"]] == pytest.approx(best.values.tolist(), abs=1e-4)
    # Top-p leaves out tokens that cannot be drawn: the lists only hold finite log-probs.
    body.update(top_p=0.3, top_logprobs=20)
    reply = httpx.post(f"{base_url}/chat/completions", json=body, timeout=60).json()
    for entry in reply["choices"][0]["logprobs"]["content"]:
        values = [t["logprob"] for t in entry["top_logprobs"]]
        assert 1 <= len(values) < server.vocab_size and all(math.isfinite(v) for v in values)
        assert entry["token"] in [t["token"] for t in entry["top_logprobs"]]


def test_completion_logprobs_list_the_top_tokens_and_the_sampled_one(served):
    _, base_url = served
    body = {"prompt": "s0 s1", "max_tokens": 5, "temperature": 1.0, "logprobs": 3, "n": 2,
            "return_tokens_as_token_ids": True}
    reply = httpx.post(f"{base_url}/completions", json=body, timeout=60).json()
    for choice in reply["choices"]:
        block = choice["logprobs"]
        for label, logprob, top in zip(block["tokens"], block["token_logprobs"], block["top_logprobs"]):
            assert top[label] == logprob
            assert len(top) in (3, 4)  # the 3 most likely, and the sampled token when not among them
            best = sorted(top.values(), reverse=True)[:3]
            assert len(top) == 3 or logprob < best[-1]


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize("route, extra, message", [
    ("chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat/completions", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("chat/completions", {"top_logprobs": 2}, "needs 'logprobs': true"),
    ("chat/completions", {"logprobs": False, "top_logprobs": 2}, "needs 'logprobs': true"),
    ("chat/completions", {"logprobs": 3}, "'logprobs' must be true or false"),
    ("chat/completions", {"stream": "yes"}, "'stream' must be true or false"),
    ("chat/completions", {"stream_options": {"include_usage": True}}, "only allowed with 'stream': true"),
    ("chat/completions", {"stream": True, "stream_options": {"include_usage": 1}}, "include_usage"),
    ("chat/completions", {"stream": True, "temperature": -1}, "temperature"),  # refused before the stream
    ("completions", {"logprobs": 6}, "'logprobs' must be an integer in [0, 5]"),
    ("completions", {"logprobs": True}, "'logprobs' must be an integer"),
    ("completions", {"stream": True, "max_tokens": 0}, "max_tokens"),
    ("chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}, "takes no images"),
    ("chat/completions", {"messages": [{"role": "user", "content": 3}]}, "a string or a list of {type, ...} parts"),
])
def test_bad_values_are_json_400s(served, route, extra, message):
    _, base_url = served
    body = {"prompt": "s0", "max_tokens": 2} if route == "completions" else {"messages": MESSAGES, "max_tokens": 2}
    response = httpx.post(f"{base_url}/{route}", json={**body, **extra}, timeout=60)
    assert response.status_code == 400 and response.headers["Content-Type"] == "application/json"
    assert message in response.json()["error"]["message"]


def test_content_as_text_parts_is_the_same_chat_as_a_string(served):
    """OpenAI's clients may send a message's content as a list of parts: the text parts, joined
    by newlines, are the content."""
    _, base_url = served
    request = {"max_tokens": 4, "temperature": 0, "logprobs": True}
    as_string = httpx.post(f"{base_url}/chat/completions", json={
        **request, "messages": [{"role": "user", "content": "s0 s1\na2"}]}, timeout=60).json()
    as_parts = httpx.post(f"{base_url}/chat/completions", json={**request, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "s0 s1"}, {"type": "text", "text": "a2"}]}]}, timeout=60).json()
    assert as_parts["usage"] == as_string["usage"]
    assert as_parts["choices"][0]["token_ids"] == as_string["choices"][0]["token_ids"]
    assert as_parts["choices"][0]["logprobs"] == as_string["choices"][0]["logprobs"]


def test_openai_client_raises_bad_request_for_too_many_top_logprobs(served, client):
    import openai

    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(model=served[0].served_name, messages=MESSAGES, logprobs=True, top_logprobs=21)


def _raw_reply(base_url: str, request: bytes) -> bytes:
    """Send raw bytes on a new connection; everything the server sends back until it closes."""
    import socket
    from urllib.parse import urlsplit

    address = urlsplit(base_url)
    with socket.create_connection((address.hostname, address.port), timeout=30) as connection:
        connection.sendall(request)
        reply = b""
        while piece := connection.recv(65536):
            reply += piece
    return reply


def test_a_body_over_the_limit_is_refused_with_a_413_before_it_is_read(served):
    from longhorizon.actor.http_serving import MAX_BODY_BYTES

    _, base_url = served
    # Only the headers are sent: the refusal must not wait for a body of that size.
    reply = _raw_reply(base_url, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                 b"Content-Length: %d\r\n\r\n" % (MAX_BODY_BYTES + 1))
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413")
    assert json.loads(body)["error"]["message"] == f"request body over {MAX_BODY_BYTES} bytes"


def test_a_chunked_body_is_read_and_capped_as_it_arrives(served, monkeypatch):
    from longhorizon.actor import model_server

    _, base_url = served
    data = json.dumps({"prompt": "s0 s1", "max_tokens": 2, "temperature": 0}).encode()

    def pieces():  # no length known up front: httpx sends it chunked
        yield from (data[i:i + 7] for i in range(0, len(data), 7))

    reply = httpx.post(f"{base_url}/completions", content=pieces(), headers={"Content-Type": "application/json"},
                       timeout=60)
    assert reply.status_code == 200 and len(reply.json()["choices"][0]["token_ids"]) >= 1
    monkeypatch.setattr(model_server, "MAX_BODY_BYTES", len(data) - 1)
    reply = httpx.post(f"{base_url}/completions", content=pieces(), headers={"Content-Type": "application/json"},
                       timeout=60)
    assert reply.status_code == 413 and reply.json()["error"]["message"] == f"request body over {len(data) - 1} bytes"


@pytest.mark.parametrize("method, path, status, message", [
    ("GET", "/v1/no/such/route", 404, "no route GET /v1/no/such/route"),
    ("GET", "/v1/completions", 404, "no route GET /v1/completions"),
    ("POST", "/health", 404, "no route POST /health; routes: /v1/chat/completions, /v1/completions, /v1/load_weights"),
    ("POST", "/v1/completions", 400, "request body is not JSON"),
    ("POST", "/v1/chat/completions", 400, "request body must be a JSON object"),
])
def test_unknown_routes_and_bodies_that_are_not_json_objects_get_json_errors(served, method, path, status, message):
    _, base_url = served
    root = base_url.removesuffix("/v1")
    content = b"[1, 2]" if path == "/v1/chat/completions" else b"{not json"
    response = httpx.request(method, f"{root}{path}", content=content if method == "POST" else None, timeout=30)
    assert response.status_code == status and response.headers["Content-Type"] == "application/json"
    error = response.json()["error"]
    assert error["message"].startswith(message) and error["code"] == status
    assert error["type"] == "invalid_request_error"


def test_a_trailing_slash_reaches_the_route(served):
    server, base_url = served
    assert httpx.get(f"{base_url}/models/", timeout=30).json()["data"][0]["id"] == server.served_name
    reply = httpx.post(f"{base_url}/completions/", json={"prompt": "s0", "max_tokens": 1}, timeout=60)
    assert reply.status_code == 200

# ----------------------------------------------------------------------------- health and metrics


_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(?:[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\.)*",?)*\})? (\S+)$')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\.)*)"')


def _parse_prometheus(text: str) -> dict[tuple[str, frozenset], float]:
    """A strict reading of the Prometheus text format: every line a HELP, a TYPE or a sample of a
    declared family; returns {(name, labels): value}."""
    assert text.endswith("\n")
    types: dict[str, str] = {}
    samples = {}
    for line in text.splitlines():
        if line.startswith("# HELP "):
            continue
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert kind in ("counter", "gauge", "histogram", "summary") and name not in types
            types[name] = kind
            continue
        match = _SAMPLE.match(line)
        assert match, f"not a Prometheus sample line: {line!r}"
        name, labels, value = match.group(1), match.group(2) or "", match.group(3)
        family = re.sub(r"_(bucket|sum|count)$", "", name) if name not in types else name
        assert family in types, f"sample {name} has no TYPE line before it"
        samples[(name, frozenset(_LABEL.findall(labels)))] = float(value)
    return samples


def _metric(samples, name, **labels) -> float:
    return samples.get((f"longhorizon_serve_{name}", frozenset(labels.items())), 0.0)


def test_metrics_are_prometheus_text_and_count_requests_and_tokens(served):
    server, base_url = served
    root = base_url.removesuffix("/v1")
    response = httpx.get(f"{root}/metrics", timeout=30)
    assert response.status_code == 200 and response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
    before = _parse_prometheus(response.text)
    chat = {"method": "POST", "endpoint": "/v1/chat/completions"}
    reply = httpx.post(f"{base_url}/chat/completions", json={"messages": MESSAGES, "max_tokens": 3}, timeout=60).json()
    httpx.post(f"{base_url}/chat/completions", json={"messages": MESSAGES, "top_logprobs": 99}, timeout=60)
    httpx.get(f"{root}/no/such/page", timeout=30)
    after = _parse_prometheus(httpx.get(f"{root}/metrics", timeout=30).text)
    assert _metric(after, "requests_total", **chat, status="200") == _metric(before, "requests_total", **chat, status="200") + 1
    assert _metric(after, "requests_total", **chat, status="400") == _metric(before, "requests_total", **chat, status="400") + 1
    assert _metric(after, "requests_total", method="GET", endpoint="other", status="404") >= 1
    usage = reply["usage"]
    for name, grown in (("generated_tokens_total", usage["completion_tokens"]), ("prompt_tokens_total", usage["prompt_tokens"])):
        assert _metric(after, name) == _metric(before, name) + grown
    latency = {"endpoint": "/v1/chat/completions"}
    assert _metric(after, "request_duration_seconds_count", **latency) == _metric(before, "request_duration_seconds_count", **latency) + 2
    assert _metric(after, "request_duration_seconds_bucket", **latency, le="+Inf") == _metric(after, "request_duration_seconds_count", **latency)
    assert _metric(after, "request_duration_seconds_sum", **latency) > 0
    assert _metric(after, "policy_version") == server.policy_version
    assert _metric(after, "queue_depth") == 0 and _metric(after, "requests_in_flight") == 0
    assert ("longhorizon_serve_weights_refused_total", frozenset()) in after
    # prometheus_client's own parser reads it too.
    names = {family.name for family in text_string_to_metric_families(response.text)}
    assert {"longhorizon_serve_requests", "longhorizon_serve_request_duration_seconds"} <= names


def test_health_reports_what_a_load_balancer_needs(served):
    server, base_url = served
    health = httpx.get(f"{base_url.removesuffix('/v1')}/health", timeout=30).json()
    assert health == {"status": "ok", "model": server.served_name, "policy_version": 0, "queue_depth": 0,
                      "requests_in_flight": 0, "weights_refused": 0}


def test_requests_batched_together_get_their_own_number_of_top_tokens(served):
    _, base_url = served
    asked = [None, 0, 2, 5]
    replies = [None] * len(asked)

    def ask(index):
        body = {"messages": MESSAGES, "max_tokens": 4, "temperature": 0}
        if asked[index] is not None:
            body.update(logprobs=True, top_logprobs=asked[index])
        replies[index] = httpx.post(f"{base_url}/chat/completions", json=body, timeout=60).json()

    threads = [threading.Thread(target=ask, args=(index,)) for index in range(len(asked))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert replies[0]["choices"][0]["logprobs"] is None
    texts = {reply["choices"][0]["message"]["content"] for reply in replies}
    assert len(texts) == 1  # greedy: the same reply whichever batch each request joined
    for top, reply in zip(asked[1:], replies[1:]):
        assert all(len(entry["top_logprobs"]) == top for entry in reply["choices"][0]["logprobs"]["content"])


@contextlib.contextmanager
def _model_held_at(server, call: int, seconds: float):
    """The served model stops at its `call`-th forward pass until the test sets the yielded event
    (at most `seconds`); also yields the list that counts the passes. Restored on leaving."""
    model = server.engine.model
    release, calls = threading.Event(), []
    original = model.forward

    def held_forward(*args, **kwargs):
        calls.append(1)
        if len(calls) == call:
            assert release.wait(seconds), "the test never released the model"
        return original(*args, **kwargs)

    model.forward = held_forward
    try:
        yield release, calls
    finally:
        release.set()
        del model.forward


def test_tokens_are_streamed_while_the_batch_is_still_generating(served):
    """The model is held at its third forward pass, so the reply cannot be complete until the test
    releases it: the first token must arrive before that."""
    server, base_url = served
    with _model_held_at(server, 3, 20) as (release, calls):
        body = {"prompt": "s0 s1", "max_tokens": 6, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{base_url}/completions", json=body, timeout=30) as response:
            lines = response.iter_lines()
            first = json.loads(next(line for line in lines if line.startswith("data: "))[len("data: "):])
            assert first["choices"][0]["token_ids"] and len(calls) <= 3
            assert httpx.get(f"{base_url.removesuffix('/v1')}/health", timeout=30).json()["requests_in_flight"] == 1
            release.set()
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"


@pytest.mark.parametrize("failing_call, streamed_tokens", [(1, 0), (3, 2)])
def test_a_generation_failure_is_a_json_error_or_an_error_event(served, failing_call, streamed_tokens):
    server, base_url = served
    model = server.engine.model
    calls = []
    original = model.forward

    def failing_forward(*args, **kwargs):
        calls.append(1)
        if len(calls) == failing_call:
            raise RuntimeError("the device went away")
        return original(*args, **kwargs)

    model.forward = failing_forward
    try:
        body = {"prompt": "s0 s1", "max_tokens": 6, "temperature": 0, "stream": True}
        response = httpx.post(f"{base_url}/completions", json=body, timeout=60)
    finally:
        del model.forward
    if streamed_tokens == 0:  # nothing was sent yet: a plain JSON error
        assert response.status_code == 500 and "the device went away" in response.json()["error"]["message"]
        return
    events = [line[len("data: "):] for line in response.text.split("\n\n") if line]
    chunks = [json.loads(event) for event in events[:-1]]
    assert [len(chunk["choices"][0]["token_ids"]) for chunk in chunks[:-1]] == [1] * streamed_tokens
    assert "the device went away" in chunks[-1]["error"]["message"] and events[-1] == "[DONE]"


def test_streams_with_stop_strings_and_several_choices_end_as_the_whole_reply(served):
    _, base_url = served
    body = {"prompt": "s0 s1", "max_tokens": 8, "temperature": 0, "n": 2}
    words = httpx.post(f"{base_url}/completions", json=body, timeout=60).json()["choices"][0]["text"].split()
    # A stop string that begins inside the first token: the stream holds that token's text back
    # and sends only what precedes the stop string.
    body["stop"] = ["a9", f"{words[0][1:]} {words[1]}"]
    whole = httpx.post(f"{base_url}/completions", json=body, timeout=60).json()
    response = httpx.post(f"{base_url}/completions", json={**body, "stream": True}, timeout=60)
    events = [line for line in response.text.split("\n\n") if line]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(event[len("data: "):]) for event in events[:-1]]
    for choice in whole["choices"]:
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == choice["index"]]
        assert "".join(c["text"] for c in mine) == choice["text"] == words[0][0]
        assert [t for c in mine for t in c.get("token_ids", [])] == choice["token_ids"]
        assert mine[-1]["finish_reason"] == choice["finish_reason"] == "stop"


# ----------------------------------------------------------------------------- clients that leave


def _wait_for(condition, seconds: float = 20.0) -> bool:
    import time

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def _raw_post(base_url: str, path: str, body: dict):
    """A request on a socket of the test's own, so the test can close it mid-reply."""
    import socket
    from urllib.parse import urlsplit

    address = urlsplit(base_url)
    data = json.dumps(body).encode()
    connection = socket.create_connection((address.hostname, address.port), timeout=30)
    connection.sendall(f"POST /v1/{path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return connection


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_is_not_generated_for(served, stream, monkeypatch):
    """One client's request is in the running batch (held at its second decoding step), another
    waits in the queue behind it; both close their connections. Once the model is released the
    batch ends at its next step rather than after its 60 tokens, the queued request is never
    generated, and both are counted as abandoned."""
    server, base_url = served
    abandoned_before = server.metrics.abandoned
    batches = []  # the batches the engine was given: the queued request must never be one
    generate = server.engine._generate_batch
    def counted(requests, *args, **kwargs):
        batches.append(len(requests))
        return generate(requests, *args, **kwargs)

    monkeypatch.setattr(server.engine, "_generate_batch", counted)
    with _model_held_at(server, 2, 30) as (release, calls):
        body = {"messages": MESSAGES, "max_tokens": 60, "temperature": 0, "stream": stream}
        running = _raw_post(base_url, "chat/completions", body)
        assert _wait_for(lambda: len(calls) == 2)
        # Other sampling settings: it cannot join the running batch, so it waits in the queue.
        queued = _raw_post(base_url, "chat/completions", {**body, "temperature": 0.5})
        assert _wait_for(lambda: server.queue_depth == 1)
        running.close()
        queued.close()
        # A request waiting for its reply, or a stream for its next token, notices within a quarter second.
        assert _wait_for(lambda: server.metrics.abandoned == abandoned_before + 2)
        release.set()
        assert _wait_for(lambda: server.in_flight == 0)
    assert batches == [1]
    assert len(calls) <= 4  # the step under way, at most one more: not the 60 the reply could have
    assert server.metrics.abandoned == abandoned_before + 2
    samples = _parse_prometheus(httpx.get(f"{base_url.removesuffix('/v1')}/metrics", timeout=30).text)
    assert _metric(samples, "requests_abandoned_total") == server.metrics.abandoned
    # The server goes on serving.
    reply = httpx.post(f"{base_url}/chat/completions", json={"messages": MESSAGES, "max_tokens": 2}, timeout=60)
    assert reply.status_code == 200


def test_a_client_that_stays_gets_its_whole_reply(served):
    """The check that notices clients leaving does not mistake a waiting one for gone: a slowed
    model keeps the requests waiting through several checks, and their replies are the ones the
    same requests get unhurried."""
    import time

    server, base_url = served
    body = {"messages": MESSAGES, "max_tokens": 12, "temperature": 0}
    quick = httpx.post(f"{base_url}/chat/completions", json=body, timeout=60).json()
    streamed_quick = httpx.post(f"{base_url}/chat/completions", json={**body, "stream": True}, timeout=60).text
    model = server.engine.model
    original = model.forward

    def slow_forward(*args, **kwargs):
        time.sleep(0.1)
        return original(*args, **kwargs)

    abandoned_before = server.metrics.abandoned
    model.forward = slow_forward
    try:
        slow = httpx.post(f"{base_url}/chat/completions", json=body, timeout=60).json()
        streamed_slow = httpx.post(f"{base_url}/chat/completions", json={**body, "stream": True}, timeout=60).text
    finally:
        del model.forward
    assert slow["choices"][0]["token_ids"] == quick["choices"][0]["token_ids"]
    assert len(slow["choices"][0]["token_ids"]) >= 4  # slower than several checks

    def tokens(events: str) -> list[int]:
        chunks = [json.loads(line[len("data: "):]) for line in events.split("\n\n") if line.startswith("data: {")]
        return [t for chunk in chunks for choice in chunk["choices"] for t in choice.get("token_ids", [])]

    assert tokens(streamed_slow) == tokens(streamed_quick) == quick["choices"][0]["token_ids"]
    assert server.metrics.abandoned == abandoned_before


# ----------------------------------------------------------------------------- stopping


def test_stopping_cuts_the_running_batch_short_and_fails_the_queued_requests(tiny_codebook_model):
    """Ctrl-C under load: the batcher thread must have returned before the interpreter exits (a
    thread left inside torch aborts the process), so the running batch ends at its next step and
    the queued requests are answered with an error rather than generated."""
    import time

    from longhorizon.actor.model_server import Sampling, ServerStopping

    server = ModelServer(str(tiny_codebook_model), max_batch_size=1)
    generate = server.engine._generate_batch
    running = threading.Event()

    def long_batch(requests, top, on_step=None, cancelled=None):
        running.set()
        while not all(cancelled()):  # as a long generation would run on, step after step
            time.sleep(0.01)
        return generate(requests, top, on_step, cancelled)

    server.engine._generate_batch = long_batch
    sampling = Sampling(max_tokens=8, temperature=1.0, top_p=1.0)
    prompt = server.tokenizer.prompt_tokens(MESSAGES)
    jobs = [server.submit([prompt], sampling) for _ in range(3)]
    assert running.wait(30)
    started = time.monotonic()
    server.stop()
    assert time.monotonic() - started < 10 and not server.running
    assert all(job.done.is_set() and isinstance(job.error, ServerStopping) for job in jobs)
    assert server.in_flight == 0


def test_a_stop_signal_answers_the_requests_under_way_and_stops_serving(tiny_codebook_model):
    """`serve-model` on SIGINT or SIGTERM (here SIGWINCH, harmless should the test go wrong):
    one request is in the running batch (its model held), one waits in the queue. The queued one
    is answered with a 503 at once; the running one with a 503 once its decoding step ends; then
    the server stops serving and its port refuses connections."""
    import os
    import signal

    server = ModelServer(str(tiny_codebook_model), max_batch_size=1)
    httpd = start_http_server(server, "127.0.0.1", 0)
    base_url = f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    replies, failures, signalled = {}, [], threading.Event()
    body = {"messages": MESSAGES, "max_tokens": 60, "temperature": 0}

    def ask(name: str, request: dict) -> None:
        replies[name] = httpx.post(f"{base_url}/chat/completions", json=request, timeout=60)

    with _model_held_at(server, 2, 30) as (release, calls):
        def drive() -> None:
            try:
                running = threading.Thread(target=ask, args=("running", body))
                running.start()
                assert _wait_for(lambda: len(calls) == 2)
                queued = threading.Thread(target=ask, args=("queued", {**body, "temperature": 0.5}))
                queued.start()
                assert _wait_for(lambda: server.queue_depth == 1)
                os.kill(os.getpid(), signal.SIGWINCH)
                signalled.set()
                queued.join(30)
                release.set()
                running.join(30)
            except BaseException as error:  # seen by the test's thread
                failures.append(error)
            finally:
                release.set()
                if not signalled.is_set():
                    httpd.shutdown()

        driver = threading.Thread(target=drive)
        driver.start()
        try:
            httpd.serve_forever(stop_signals=(signal.SIGWINCH,), before_stop=server.stop)
        finally:
            driver.join(60)
            httpd.server_close()
            server.stop()
    assert not failures, failures
    for name in ("queued", "running"):
        assert replies[name].status_code == 503, name
        assert replies[name].json()["error"]["message"] == "the server is stopping"
    assert not server.running and server.in_flight == 0
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{base_url}/models", timeout=5)


def test_a_cancelled_batch_ends_after_one_step(tiny_codebook_model):

    from longhorizon.actor.engines.base import GenerationRequest

    server = ModelServer(str(tiny_codebook_model), max_batch_size=2)
    try:
        server.engine.sampling = server.engine.sampling.replace(max_new_tokens=20, temperature=1.0)
        prompt = server.tokenizer.prompt_tokens(MESSAGES)
        requests = [GenerationRequest(token_ids=prompt, episode_id=f"e{row}") for row in range(2)]
        whole = server.engine._generate_batch(requests)
        cut = server.engine._generate_batch(requests, cancelled=lambda: True)
        assert max(len(result.token_ids) for result in whole) > 1
        assert [len(result.token_ids) for result in cut] == [1, 1]
    finally:
        server.stop()


def test_the_model_server_bench_measures_a_running_server(served, capsys):
    import json
    import os

    from longhorizon.launch.bench.cli import main as bench

    base_url = served[1].removesuffix("/v1")
    arguments = ["model-server", "--server", f"here={base_url}", "--pid", f"here={os.getpid()}",
                 "--seconds", "0.3", "--rounds", "1", "--tokens", "4"]
    assert bench(arguments) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert sorted(result["cases"]) == ["plain x1", "plain x16", "streamed x1", "streamed x16"]
    for case in result["cases"].values():
        (run,) = case["here"]
        assert run["requests_per_s"] > 0 and run["server_cpu_ms_per_request"] > 0
    assert bench(["model-server", "--server", "http://127.0.0.1:1"]) == 2  # no LABEL=
