"""The training gateway: sessions recorded token for token, history breaks, groups, and its OpenAI routes."""

import contextlib
import json
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest
import trio

from longhorizon.actor.engines.base import GenerationResult
from longhorizon.actor.gateway import ChatRenderer, GatewayError, GatewaySettings, SessionBook, reply_message
from longhorizon.common.chat import ByteChatTokenizer, HFChatTokenizer
from longhorizon.envs.tool_calls import HermesFormat
from longhorizon.learner.samples import sample_lengths, window_problem

TOOLS = [{"type": "function", "function": {"name": "get", "description": "Take an item.", "parameters": {
    "type": "object", "properties": {"item": {"type": "string"}}, "required": ["item"]}}}]


class ScriptEngine:
    """Replies with `reply(request)`; its tokens are the reply's characters one by one (for a real
    tokenizer, not the ids its encoder would give), ending with the end-of-turn token."""

    def __init__(self, tokenizer, reply=lambda request: "ok", version=3):
        self.tokenizer = tokenizer
        self.reply = reply
        self.policy_version = version
        self.sampled: dict[str, list[list[int]]] = {}
        self.ended: list[str] = []

    def char_tokens(self, text):
        return [token for char in text for token in self.tokenizer.encode(char)]

    async def generate(self, request):
        await trio.sleep(0)
        text = self.reply(request)
        tokens = self.char_tokens(text) + [self.tokenizer.eos_token_id]
        self.sampled.setdefault(request.episode_id, []).append(tokens)
        logprobs = [-0.5 - 0.01 * index for index in range(len(tokens))]
        return GenerationResult(token_ids=tokens, logprobs=logprobs, text=text, stopped_on_eos=True,
                                policy_version=self.policy_version)

    def end_episode(self, episode_id):
        self.ended.append(episode_id)


def _book(tokenizer=None, **settings):
    tokenizer = tokenizer or ByteChatTokenizer()
    values = {"group_size": 2, "max_context_tokens": 4096, "max_new_tokens": 64, **settings}
    return SessionBook(GatewaySettings(**values), ChatRenderer(tokenizer, HermesFormat()))


def _call(book, engine, session, messages, tools=None):
    """One chat call as the gateway makes it; the assistant message it returns."""
    prompt, continues = book.prompt_for(session, messages, tools)

    async def generate():
        from longhorizon.actor.engines.base import GenerationRequest

        return await engine.generate(GenerationRequest(token_ids=prompt, episode_id=session.session_id))

    generation = trio.run(generate)
    message, _ = reply_message(book.renderer, generation.text)
    book.record(session, messages, prompt, continues, generation, message, 0.1)
    return message, prompt


def test_a_session_that_keeps_its_history_trains_on_exactly_the_sampled_tokens():
    replies = iter(["<tool_call>\n{\"name\": \"get\", \"arguments\": {\"item\": \"log\"}}\n</tool_call>", "done"])
    engine = ScriptEngine(ByteChatTokenizer(), lambda request: next(replies))
    book = _book()
    session = book.open("s1", "task-a", horizon_cap=5)
    messages = [{"role": "system", "content": "Craft."}, {"role": "user", "content": "Goal: planks."}]
    first, first_prompt = _call(book, engine, session, messages, TOOLS)
    assert first["tool_calls"][0]["function"] == {"name": "get", "arguments": '{"item": "log"}'}
    assert first["content"] is None
    # The agent sends its history back as OpenAI clients do (call ids, arguments as a string),
    # then the tool's result.
    messages = [*messages, first, {"role": "tool", "tool_call_id": first["tool_calls"][0]["id"], "content": "Got 1 log"}]
    second, second_prompt = _call(book, engine, session, messages, TOOLS)
    assert second == {"role": "assistant", "content": "done"}
    tokenizer = ByteChatTokenizer()
    # The second prompt is the first prompt, the sampled reply, then the result's template tokens.
    expected = first_prompt + engine.sampled["s1"][0] + tokenizer.continuation_tokens(
        "<tool_response>\nGot 1 log\n</tool_response>", stopped_on_eos=True)
    assert second_prompt == expected
    trajectory = book.finish("s1", 1.0)
    assert trajectory.token_ids.tolist() == second_prompt + engine.sampled["s1"][1]
    generated = trajectory.token_ids[trajectory.loss_mask == 1].tolist()
    assert generated == engine.sampled["s1"][0] + engine.sampled["s1"][1]
    assert np.allclose(trajectory.behaviour_logprobs[trajectory.loss_mask == 1],
                       [-0.5 - 0.01 * i for tokens in engine.sampled["s1"] for i in range(len(tokens))])
    assert set(trajectory.policy_versions[trajectory.loss_mask == 1].tolist()) == {3}
    assert trajectory.prompt_length == len(first_prompt) and trajectory.sample_windows == []
    assert (trajectory.num_turns, trajectory.reward, trajectory.success, trajectory.task_id) == (2, 1.0, True, "task-a")
    assert book.counters.history_breaks == 0


def test_the_default_models_template_keeps_tokens_it_would_not_have_made(default_model_path):
    """SmolLM2's template renders no tools: they go in the system message, the reply's call in the
    text. The engine's tokens (one per character) are not what the tokenizer makes of that text,
    and the trajectory holds the engine's."""
    from transformers import AutoTokenizer

    tokenizer = HFChatTokenizer(AutoTokenizer.from_pretrained(default_model_path))
    replies = iter(["I will get a log.\n<tool_call>\n{\"name\": \"get\", \"arguments\": {\"item\": \"log\"}}\n</tool_call>",
                    "Planks made."])
    engine = ScriptEngine(tokenizer, lambda request: next(replies))
    book = _book(tokenizer)
    session = book.open("s", None, horizon_cap=4)
    messages = [{"role": "user", "content": "Goal: planks."}]
    first, prompt = _call(book, engine, session, messages, TOOLS)
    assert '"name": "get"' in tokenizer.decode(prompt) and first["content"] == "I will get a log."
    messages = [*messages, first, {"role": "tool", "content": "Got 1 log"}]
    _call(book, engine, session, messages, TOOLS)
    trajectory = book.finish("s", 0.0)
    sampled = engine.sampled["s"]
    assert tokenizer.encode(first["content"]) != engine.char_tokens(first["content"])  # the test can fail
    assert trajectory.token_ids[trajectory.loss_mask == 1].tolist() == sampled[0] + sampled[1]
    assert book.counters.history_breaks == 0 and trajectory.success is False


def test_an_edited_history_splits_the_session_and_each_reply_trains_where_it_was_sampled():
    engine = ScriptEngine(ByteChatTokenizer(), lambda request: "step")
    book = _book()
    session = book.open("s", "t", horizon_cap=5)
    messages = [{"role": "user", "content": "Go."}]
    first, _ = _call(book, engine, session, messages)
    # The agent's framework rewrote the assistant turn: a break.
    messages = [*messages, {"role": "assistant", "content": "step (edited)"}, {"role": "user", "content": "Again."}]
    _, second_prompt = _call(book, engine, session, messages)
    assert second_prompt == ByteChatTokenizer().prompt_tokens(messages)  # rendered afresh
    messages = [*messages, {"role": "assistant", "content": "step"}, {"role": "user", "content": "More."}]
    _call(book, engine, session, messages)  # continues the new segment
    trajectory = book.finish("s", 0.5)
    assert book.counters.history_breaks == 1 and trajectory.prompt_length == 0
    windows = [tuple(trajectory.sample_windows[i:i + 3]) for i in range(0, len(trajectory.sample_windows), 3)]
    segment_two = windows[1][0]
    assert windows[0][0] == 0 and windows[1][0] == windows[2][0] == segment_two == windows[0][2]
    assert window_problem(trajectory.sample_windows, trajectory.loss_mask, 0) is None
    # Each reply's sample is its segment up to its reply's end.
    assert sample_lengths(trajectory) == [windows[0][2], windows[1][2] - segment_two, windows[2][2] - segment_two]
    assert trajectory.token_ids[segment_two:windows[1][1]].tolist() == second_prompt


def test_a_break_is_refused_when_configured_and_the_record_is_kept():
    engine = ScriptEngine(ByteChatTokenizer())
    book = _book(on_history_break="refuse")
    session = book.open("s", "t", horizon_cap=5)
    _call(book, engine, session, [{"role": "user", "content": "Go."}])
    with pytest.raises(GatewayError, match="not this session's history") as refused:
        book.prompt_for(session, [{"role": "user", "content": "Something else."}], None)
    assert refused.value.status == 400 and refused.value.code == "history_break"
    assert session.calls == 1 and book.counters.calls_refused == 1


def test_calls_past_the_cap_or_the_context_are_refused_with_errors_the_agent_reads():
    engine = ScriptEngine(ByteChatTokenizer())
    book = _book(max_context_tokens=200, max_new_tokens=64)
    session = book.open("s", "t", horizon_cap=1)
    message, _ = _call(book, engine, session, [{"role": "user", "content": "Go."}])
    with pytest.raises(GatewayError, match="has made 1 calls, the horizon cap") as refused:
        book.prompt_for(session, [{"role": "user", "content": "Go."}, message, {"role": "user", "content": "x"}], None)
    assert refused.value.code == "horizon_cap_reached"
    with pytest.raises(GatewayError, match="does not fit the context of 200 tokens") as refused:
        book.check_fits(150, 64)
    assert refused.value.code == "context_length_exceeded"


def test_sessions_of_a_task_form_groups_of_the_group_size_and_idle_ones_expire():
    book = _book(group_size=2, session_idle_timeout_s=10)
    groups = [book.open(f"s{i}", "task", horizon_cap=3).group_id for i in range(5)]
    other = book.open("o", "other", horizon_cap=3).group_id
    assert groups[0] == groups[1] != groups[2] == groups[3] != groups[4] and other not in groups
    with pytest.raises(GatewayError, match="already exists"):
        book.open("s0", "task", horizon_cap=3)
    with pytest.raises(GatewayError, match="made no call"):
        book.finish("s0", 1.0)
    book.sessions["s1"].last_active -= 100
    assert book.expire() == ["s1"] and book.counters.sessions_expired == 1
    with pytest.raises(GatewayError, match="no open session 's1'") as missing:
        book.get("s1")
    assert missing.value.status == 404


@contextlib.contextmanager
def serving(engine, book, horizon_cap=6):
    """The gateway's HTTP server on a free loopback port, in a thread; yields (base URL, the
    trajectories it sends)."""
    from longhorizon.actor.gateway_server import Gateway, serve_gateway

    sent = []

    async def on_trajectory(trajectory):
        sent.append(trajectory)

    gateway = Gateway(engine, book, model_name="tiny", horizon_cap=lambda: horizon_cap, on_trajectory=on_trajectory)
    ready = threading.Event()
    state = {}

    async def main():
        async with trio.open_nursery() as nursery:
            state["url"] = await nursery.start(serve_gateway, gateway, "127.0.0.1", 0)
            state["scope"], state["token"] = nursery.cancel_scope, trio.lowlevel.current_trio_token()
            ready.set()

    thread = threading.Thread(target=trio.run, args=(main,), daemon=True)
    thread.start()
    assert ready.wait(30), "the gateway did not start"
    try:
        yield state["url"] + "/v1", sent
    finally:
        trio.from_thread.run_sync(state["scope"].cancel, trio_token=state["token"])
        thread.join(30)
        assert not thread.is_alive()


def _tool_reply(request):
    if not request.messages:  # a text completion
        return "ok"
    last = request.messages[-1]
    if last["role"] == "tool":
        return f"finished after {last['content']}"
    return "Taking one.\n<tool_call>\n{\"name\": \"get\", \"arguments\": {\"item\": \"log\"}}\n</tool_call>"


def test_the_official_client_plays_a_tool_session_streamed_and_not_and_posts_its_reward():
    engine = ScriptEngine(ByteChatTokenizer(), _tool_reply)
    with serving(engine, _book()) as (url, sent):
        client = openai.OpenAI(base_url=url, api_key="session-1")
        assert [model.id for model in client.models.list().data] == ["tiny"]
        messages = [{"role": "user", "content": "Goal: a log."}]
        reply = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == "Taking one."
        call = choice.message.tool_calls[0]
        assert (call.function.name, json.loads(call.function.arguments)) == ("get", {"item": "log"})
        messages += [choice.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "Got 1 log"}]
        stream = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, stream=True)
        text = "".join(chunk.choices[0].delta.content or "" for chunk in stream)
        assert text == "finished after Got 1 log"
        ended = httpx.post(f"{url}/sessions/session-1/reward", json={"reward": 1.0}).json()
        assert ended["num_turns"] == 2 and ended["history_breaks"] is False
        health = httpx.get(url.removesuffix("/v1") + "/health").json()
    [trajectory] = sent
    assert trajectory.token_ids[trajectory.loss_mask == 1].tolist() == [t for ts in engine.sampled["session-1"] for t in ts]
    assert health["calls"] == 2 and health["sessions_finished"] == 1 and health["history_breaks"] == 0
    assert engine.ended == ["session-1"]


def test_sixty_four_concurrent_sessions_are_kept_apart():
    engine = ScriptEngine(ByteChatTokenizer(), lambda request: "echo " + request.messages[-1]["content"])
    with serving(engine, _book(group_size=4)) as (url, sent):
        def play(index):
            client = openai.OpenAI(base_url=url, api_key="EMPTY", default_headers={
                "X-Session-Id": f"s{index}", "X-Task-Id": f"task-{index % 16}"})
            messages = [{"role": "user", "content": f"marker-{index}"}]
            for turn in range(3):
                message = client.chat.completions.create(model="tiny", messages=messages).choices[0].message
                assert message.content == f"echo {messages[-1]['content']}"
                messages += [message.model_dump(exclude_none=True), {"role": "user", "content": f"marker-{index}-{turn}"}]
            return httpx.post(f"{url}/sessions/s{index}/reward", json={"reward": index % 2}).status_code

        with ThreadPoolExecutor(16) as pool:
            assert list(pool.map(play, range(64))) == [200] * 64
    assert len(sent) == 64
    tokenizer = ByteChatTokenizer()
    played = set()
    for trajectory in sent:
        text = tokenizer.decode(trajectory.token_ids.tolist())
        # Every marker in a trajectory is its own session's (its first prompt's and its replies').
        [session] = {int(word.split("-")[1]) for word in text.split() if word.startswith("marker-")}
        assert trajectory.task_id == f"task-{session % 16}" and trajectory.reward == session % 2
        assert text.count("marker-") == 3 + 3  # three user turns, three echoes
        assert trajectory.num_turns == 3 and trajectory.sample_windows == []
        played.add(session)
    assert played == set(range(64))
    groups = {}
    for trajectory in sent:
        groups.setdefault(trajectory.group_id, set()).add(trajectory.task_id)
    assert len(groups) == 16 and all(len(tasks) == 1 for tasks in groups.values())


def test_bad_requests_get_openai_style_errors_and_the_gateway_keeps_serving():
    engine = ScriptEngine(ByteChatTokenizer())
    with serving(engine, _book(max_context_tokens=120, max_new_tokens=64)) as (url, sent):
        chat = f"{url}/chat/completions"
        cases = [
            (httpx.post(f"{url}/sessions/nobody/reward", json={"reward": 1}), 404, "session_not_found"),
            (httpx.post(chat, json={"model": "m", "messages": []}, headers={"X-Session-Id": "a"}), 400, "invalid_messages"),
            (httpx.post(chat, json={"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                    "tools": [{"type": "function", "function": {}}]},
                        headers={"X-Session-Id": "a"}), 400, "invalid_tools"),
            (httpx.post(chat, content=b"{not json", headers={"X-Session-Id": "a"}), 400, "invalid_json"),
            (httpx.post(chat, json={"model": "m", "messages": [{"role": "user", "content": "x" * 200}]},
                        headers={"X-Session-Id": "long"}), 400, "context_length_exceeded"),
            (httpx.post(chat, json={"model": "m", "messages": [{"role": "user", "content": "hi"}]}), 400,
             "missing_session"),
        ]
        for response, status, code in cases:
            assert response.status_code == status, response.text
            error = response.json()["error"]
            assert error["code"] == code and error["message"] and error["type"] == "invalid_request_error"
        ok = httpx.post(chat, json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
                        headers={"X-Session-Id": "good"})
        assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "ok"
        assert httpx.post(f"{url}/sessions/good/reward", json={"reward": "high"}).json()["error"]["code"] == "invalid_reward"
        assert httpx.post(f"{url}/sessions/good/reward", json={"reward": 1}).status_code == 200
        again = httpx.post(f"{url}/sessions/good/reward", json={"reward": 1})
        assert again.status_code == 409 and again.json()["error"]["code"] == "session_finished"
    assert len(sent) == 1


def test_streamed_tool_calls_text_completions_explicit_sessions_and_the_cap_over_http():
    engine = ScriptEngine(ByteChatTokenizer(), _tool_reply)
    with serving(engine, _book(), horizon_cap=2) as (url, sent):
        client = openai.OpenAI(base_url=url, api_key="EMPTY")
        opened = httpx.post(f"{url}/sessions", json={"task_id": "craft-7", "session_id": "x"})
        assert opened.status_code == 201 and opened.json()["horizon_cap"] == 2
        stream = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "go"}], tools=TOOLS,
                                                stream=True, extra_headers={"X-Session-Id": "x"})
        chunks = list(stream)
        calls = [call for chunk in chunks for call in (chunk.choices[0].delta.tool_calls or [])]
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("get", {"item": "log"})]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        # A text session continues while its prompt extends the recorded tokens.
        first = client.completions.create(model="m", prompt="abc", user="text-session")
        sampled = first.choices[0].model_extra["token_ids"]
        assert sampled == list(b"ok") + [ByteChatTokenizer.IM_END]
        second = client.completions.create(model="m", prompt=list(b"abc") + sampled + list(b"def"), user="text-session")
        assert second.choices[0].text == "ok"
        # The cap: a third call of a two-call session is refused in words the agent can act on.
        client.completions.create(model="m", prompt="abc", user="capped")
        client.completions.create(model="m", prompt="abc", user="capped")
        with pytest.raises(openai.BadRequestError, match="horizon cap"):
            client.completions.create(model="m", prompt="abc", user="capped")
        httpx.post(f"{url}/sessions/text-session/reward", json={"reward": 1.0}).raise_for_status()
        httpx.post(f"{url}/sessions/capped/reward", json={"reward": 0.0, "truncated": True}).raise_for_status()
    text, capped = sent
    assert text.sample_windows == [] and text.num_turns == 2
    assert text.token_ids[:len(b"abc")].tolist() == list(b"abc")
    assert capped.sample_windows != [] and capped.truncated and capped.cut_by == "horizon"  # its prompt restarted


@pytest.mark.parametrize("overrides, message", [
    (["actor.driver='gateway'", "run.mode='sync'"], 'actor.driver = "gateway" needs run.mode = "async"'),
    (["actor.driver='gateway'", "gateway.tool_format='yaml'"], "gateway.tool_format: unknown tool-call format 'yaml'"),
    (["actor.driver='portal'"], "actor.driver: unknown actor driver 'portal'"),
    (["gateway.on_history_break='ignore'"], "gateway.on_history_break must be one of split, refuse"),
])
def test_a_gateway_config_that_cannot_run_is_refused_in_one_line(overrides, message, capsys):
    from longhorizon.launch.cli import main

    assert main(["train", "codebook", "actor.engine='scripted'", *overrides]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_a_gateway_actor_reports_its_history_breaks_to_the_learner():
    from longhorizon.actor.gateway_server import GatewayActor
    from longhorizon.common.config import load_config
    from longhorizon.learner.peers import PeerTable

    config = load_config("codebook", ["actor.driver='gateway'", "actor.engine='scripted'"])
    actor = GatewayActor(config, 0, endpoints=None, engine=ScriptEngine(ByteChatTokenizer()))
    assert actor.stats().history_breaks == 0
    actor._gateway = actor.gateway()
    actor._gateway.book.counters.history_breaks = 2
    stats = actor.stats()
    assert stats.history_breaks == 2
    # The learner sums each actor's latest figure into metrics.jsonl's history_breaks.
    peers = PeerTable(timeout_s=10, counters=Counter())
    peers.heard_from("actor-0", stats)
    assert peers.stats_total("history_breaks") == 2


def test_a_second_call_or_the_reward_while_a_call_is_answered_is_refused_and_busy_sessions_do_not_expire():
    book = _book(session_idle_timeout_s=1)
    session = book.open("s", "t", horizon_cap=5)
    with book.calling(session):
        with pytest.raises(GatewayError, match="has a call in progress") as busy:
            with book.calling(session):
                pass
        assert busy.value.status == 409 and busy.value.code == "session_busy"
        with pytest.raises(GatewayError, match="post its reward after the reply"):
            book.finish("s", 1.0)
        assert book.expire(now=session.last_active + 100) == []
    assert not session.busy and book.expire(now=session.last_active + 100) == ["s"]


def test_a_resent_call_gets_the_same_answer_and_the_session_stays_one_sequence():
    """A client whose connection dropped after the gateway answered retries the same call: it gets
    the recorded reply again, nothing is generated or recorded twice, and no break is counted."""
    replies = iter(["first", "second", "third"])
    engine = ScriptEngine(ByteChatTokenizer(), lambda request: next(replies))
    with serving(engine, _book()) as (url, sent):
        client = openai.OpenAI(base_url=url, api_key="resender")
        messages = [{"role": "user", "content": "go"}]
        answer = client.chat.completions.create(model="m", messages=messages)
        again = client.chat.completions.create(model="m", messages=messages)
        assert (again.id, again.choices[0].message.content) == (answer.id, "first")
        messages += [answer.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "on"}]
        assert client.chat.completions.create(model="m", messages=messages).choices[0].message.content == "second"
        health = httpx.get(url.removesuffix("/v1") + "/health").json()
        httpx.post(f"{url}/sessions/resender/reward", json={"reward": 1.0}).raise_for_status()
    assert (health["calls"], health["calls_resent"], health["history_breaks"]) == (2, 1, 0)
    [trajectory] = sent
    assert trajectory.num_turns == 2 and trajectory.sample_windows == []
    assert len(engine.sampled["resender"]) == 2
