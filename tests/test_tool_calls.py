"""Tool calls: the formats both ways, env actions as tools, and the tools agent loop in an episode."""

import json

import numpy as np
import pytest
import trio

from longhorizon.common.chat import ByteChatTokenizer, HFChatTokenizer
from longhorizon.common.config import ConfigError
from longhorizon.envs.agents import ActionParseError, ToolsLoop, ToolsOptions, configured_agent, episode_loop
from longhorizon.envs.base import get_env_spec
from longhorizon.envs.textcraft.env import TextCraftEnv
from longhorizon.envs.tool_calls import (
    TOOL_CALL_FORMATS,
    HermesFormat,
    JsonFormat,
    ToolCall,
    ToolCallFormat,
    ToolCallFormatError,
    ToolCallParseError,
    get_tool_call_format,
    to_openai,
)
from longhorizon.envs.tools import argument_problem, object_schema

CALLS = (
    ToolCall("get", {"item": "oak logs", "count": 1}),
    ToolCall("craft", {"item": "oak planks", "count": 4, "ingredients": [{"item": "oak logs", "count": 1}]}),
)


@pytest.mark.parametrize("format_name", ["hermes", "json"])
@pytest.mark.parametrize("calls", [CALLS[:1], CALLS], ids=["one call", "two calls"])
def test_each_format_reads_back_the_calls_it_writes(format_name, calls):
    tool_format = get_tool_call_format(format_name)
    parsed = tool_format.parse(tool_format.render(calls))
    assert parsed.calls == calls and parsed.content == ""


def test_hermes_keeps_the_text_around_its_calls_and_json_has_no_room_for_any():
    text = HermesFormat().render(CALLS[:1], content="I need a log first.")
    assert text == ('I need a log first.\n<tool_call>\n{"name": "get", "arguments": {"item": "oak logs", "count": 1}}'
                    "\n</tool_call>")
    assert HermesFormat().parse(text).content == "I need a log first."
    with pytest.raises(ValueError, match="no room for text"):
        JsonFormat().render(CALLS[:1], content="thinking")


def test_json_reads_a_fence_a_list_llama_parameters_and_arguments_as_a_json_string():
    read = JsonFormat().parse
    assert read('```json\n{"name": "inventory", "arguments": {}}\n```').calls == (ToolCall("inventory"),)
    assert read('{"name": "get", "parameters": {"item": "stone", "count": 2}}').calls == (
        ToolCall("get", {"item": "stone", "count": 2}),)
    assert read('{"name": "get", "arguments": "{\\"item\\": \\"stone\\", \\"count\\": 2}"}').calls == (
        ToolCall("get", {"item": "stone", "count": 2}),)
    assert read('[{"name": "inventory"}, {"name": "inventory"}]').calls == (ToolCall("inventory"),) * 2
    # Prose is a reply without calls, not an error: the agent loop decides what that means.
    assert read("I am not sure what to do.").calls == ()


@pytest.mark.parametrize("tool_format, reply, reason", [
    (HermesFormat(), '<tool_call>{"name": "get", "arguments": {"item": "x"}', "is not closed"),
    (HermesFormat(), 'done</tool_call>', "has no <tool_call> before it"),
    (HermesFormat(), "<tool_call>{'name': 'get'}</tool_call>", "not valid JSON"),
    (HermesFormat(), '<tool_call>{"arguments": {}}</tool_call>', 'has no "name"'),
    (HermesFormat(), '<tool_call>["get"]</tool_call>', "is not a JSON object"),
    (HermesFormat(), '<tool_call>{"name": "get", "arguments": [1]}</tool_call>', "must be a JSON object, got list"),
    (HermesFormat(), '<tool_call>{"name": "get", "arguments": "{oops"}</tool_call>', "arguments of 'get' are not valid"),
    (JsonFormat(), '{"name": "get", "arguments": {"item": ', "not valid JSON"),
    (JsonFormat(), "[]", "empty list"),
    (HermesFormat(), "<tool_call>" + "x" * 20000 + "</tool_call>", "longer than"),
])
def test_a_garbled_call_is_an_error_that_says_why(tool_format, reply, reason):
    with pytest.raises(ToolCallParseError, match=reason):
        tool_format.parse(reply)


def test_calls_in_openai_shape():
    assert to_openai(CALLS[:1]) == [{
        "id": "call_0", "type": "function",
        "function": {"name": "get", "arguments": '{"item": "oak logs", "count": 1}'},
    }]
    assert to_openai([ToolCall("inventory", call_id="abc")])[0]["id"] == "abc"


def test_formats_are_parts_found_by_name_and_a_plugin_format_is_one_of_them():
    assert {"hermes", "json"} <= set(TOOL_CALL_FORMATS.names())
    with pytest.raises(ToolCallFormatError, match="hermes"):
        get_tool_call_format("nope")

    class Shout(ToolCallFormat):
        """CALL name {json}"""

        def parse(self, reply):
            from longhorizon.envs.tool_calls import ParsedReply

            if not reply.startswith("CALL "):
                return ParsedReply(reply, ())
            name, _, arguments = reply[5:].partition(" ")
            return ParsedReply("", (ToolCall(name, json.loads(arguments or "{}")),))

        def render(self, calls, content=""):
            return "\n".join(f"CALL {call.name} {json.dumps(call.arguments)}" for call in calls)

        def tools_prompt(self, tools):
            return "Write CALL <name> <json arguments>."

    TOOL_CALL_FORMATS.register("shout", Shout)
    try:
        loop = episode_loop(configured_agent("tools", {"format": "shout"}), TextCraftEnv(), ByteChatTokenizer())
        assert loop.parse_action('CALL get {"item": "stone", "count": 3}') == "get 3 stone"
        assert "Write CALL" in loop.first_messages("", "Goal: x")[0]["content"]
    finally:
        TOOL_CALL_FORMATS.unregister("shout")


@pytest.mark.parametrize("schema, value, problem", [
    (object_schema({"n": {"type": "integer"}}), {"n": 2}, ""),
    (object_schema({"n": {"type": "integer"}}), {"n": True}, "argument 'n' must be an integer, got True"),
    (object_schema({"n": {"type": "integer", "minimum": 1}}), {"n": 0}, "argument 'n' must be at least 1, got 0"),
    (object_schema({"n": {"type": "number"}}), {"n": 0.5}, ""),
    (object_schema({"d": {"type": "string", "enum": ["left", "right"]}}), {"d": "up"},
     "argument 'd' must be one of left, right, got 'up'"),
    (object_schema({"a": {"type": "string"}, "b": {"type": "string"}}), {"a": "x"}, "missing argument 'b'"),
    (object_schema({"a": {"type": "string"}}), {"a": "x", "z": 1}, "no argument 'z' (arguments: 'a')"),
    (object_schema({"xs": {"type": "array", "minItems": 1, "items": object_schema({"k": {"type": "string"}})}}),
     {"xs": [{"k": 1}]}, "argument 'xs'[0].k must be a string, got 1"),
    (object_schema({"xs": {"type": "array", "minItems": 1}}), {"xs": []}, "argument 'xs' needs at least 1 item(s)"),
])
def test_arguments_are_checked_against_the_tool_schema(schema, value, problem):
    assert argument_problem(schema, value, "the arguments") == problem


def _textcraft_loop(**options):
    return episode_loop(ToolsLoop(ToolsOptions(**options)), TextCraftEnv(), ByteChatTokenizer())


def test_the_tools_loop_turns_one_call_into_the_env_action_and_refuses_what_is_not_one():
    loop = _textcraft_loop()
    call = HermesFormat().render(CALLS[1:])
    assert loop.parse_action(call) == "craft 4 oak planks using 1 oak logs"
    assert loop.parse_action(HermesFormat().render([ToolCall("inventory")])) == "inventory"
    for reply, reason in [
        ("Thought: get logs\nAction: get 1 oak logs", r"no tool call found: call one of the tools \(get, craft, inventory\)"),
        (HermesFormat().render(CALLS), "2 tool calls in one reply: make exactly one call per turn"),
        (HermesFormat().render([ToolCall("fly")]), "there is no tool 'fly'; the tools are get, craft, inventory"),
        (HermesFormat().render([ToolCall("get", {"item": "stone"})]), "get: missing argument 'count'"),
        ("<tool_call>{", "is not closed"),
    ]:
        with pytest.raises(ActionParseError, match=reason):
            loop.parse_action(reply)
    assert loop.env_observation("Got 1 oak logs") == "<tool_response>\nGot 1 oak logs\n</tool_response>"
    assert loop.stop_strings(TextCraftEnv()) == ("</tool_call>",)


def test_a_template_without_tools_gets_them_in_the_system_message(default_model_path):
    """SmolLM2's template renders no tools: the loop describes them in the system message, and
    the real template's tokens of a rendered call decode to text that parses to the same call."""
    from transformers import AutoTokenizer

    tokenizer = HFChatTokenizer(AutoTokenizer.from_pretrained(default_model_path))
    assert tokenizer.renders_tools is False
    env = TextCraftEnv()
    for format_name in ("hermes", "json"):
        loop = episode_loop(configured_agent("tools", {"format": format_name}), env, tokenizer)
        assert loop.prompt_tools() is None
        system = loop.first_messages(env.instructions(), "Goal: craft stick.")[0]["content"]
        assert '"name": "craft"' in system and "Thought:" not in system
        reply = loop.format.render(CALLS[1:])
        assert loop.format.parse(tokenizer.decode(tokenizer.encode(reply))).calls == CALLS[1:]
    with pytest.raises(ValueError, match="renders no tools"):
        episode_loop(configured_agent("tools", {"tools_in": "template"}), env, tokenizer)


def test_a_template_that_renders_tools_is_given_them(default_model_path):
    """A Qwen-style template (tools in its own system block) renders the env's schemas itself."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(default_model_path)
    hf.chat_template = (
        "{% if tools %}<|im_start|>system\n<tools>{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
        "</tools><|im_end|>\n{% endif %}{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
        "{{ message['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    tokenizer = HFChatTokenizer(hf)
    assert tokenizer.renders_tools is True
    loop = episode_loop(configured_agent("tools", {"format": "hermes"}), TextCraftEnv(), tokenizer)
    assert [tool["function"]["name"] for tool in loop.prompt_tools()] == ["get", "craft", "inventory"]
    messages = loop.first_messages("", "Goal: craft stick.")
    assert "<tools>" not in messages[0]["content"]  # the template shows them, not the message
    prompt = hf.decode(tokenizer.prompt_tokens(messages, tools=loop.prompt_tools()))
    assert prompt.startswith('<|im_start|>system\n<tools>{"type": "function", "function": {"name": "get"')


def test_agent_options_are_checked_where_the_loop_declares_them():
    assert configured_agent("react", {}) == "react"
    for name, options, message in [
        ("tools", {"format": "yaml"}, "actor.agent_options.format: unknown tool-call format 'yaml'"),
        ("tools", {"tools_in": "prompt"}, "actor.agent_options.tools_in must be one of auto, template, system"),
        ("tools", {"formt": "json"}, "unknown config key actor.agent_options.formt"),
        ("react", {"format": "json"}, "agent loop 'react' takes no options, got format"),
        ("", {"format": "json"}, "actor.agent_options needs actor.agent"),
    ]:
        with pytest.raises(ConfigError, match=message):
            configured_agent(name, options)


def test_the_command_line_refuses_a_tools_loop_on_an_env_without_tools(capsys):
    from longhorizon.common.config import load_config
    from longhorizon.launch.checks import check_agent_options

    config = load_config("codebook", ["actor.agent='tools'"])
    with pytest.raises(ConfigError, match="env 'codebook' offers none"):
        check_agent_options(config)
    check_agent_options(load_config("quickstart", ["actor.agent='tools'", "actor.agent_options={format='json'}"]))


class RepliesEngine:
    """Answers each turn with the next of a fixed list of replies (byte tokens, log-prob 0)."""

    def __init__(self, replies):
        from longhorizon.actor.engines.base import GenerationResult

        self._result = GenerationResult
        self.replies = list(replies)
        self.tokenizer = ByteChatTokenizer()
        self.requests = []

    async def generate(self, request):
        self.requests.append(request)
        text = self.replies.pop(0)
        tokens = self.tokenizer.encode(text) + [self.tokenizer.eos_token_id]
        return self._result(token_ids=tokens, logprobs=[0.0] * len(tokens), text=text, stopped_on_eos=True,
                            policy_version=0)

    def end_episode(self, episode_id):
        pass


def test_an_episode_played_by_tool_calls_reaches_the_goal_and_counts_its_garbled_calls():
    from longhorizon.actor.rollout import AgentLoopSettings, run_episode

    spec = get_env_spec("textcraft")
    task = next(t for t in spec.tasks("train") if t.data["goal"] == "minecraft:oak_planks")
    hermes = HermesFormat()
    engine = RepliesEngine([
        "I will just get it.",  # no call: an invalid action, the env is not stepped
        hermes.render([ToolCall("get", {"item": "oak logs", "count": "one"})]),  # a wrong argument
        hermes.render([ToolCall("get", {"item": "oak logs", "count": 1})], content="A log makes planks."),
        hermes.render([ToolCall("craft", {"item": "oak planks", "count": 4,
                                          "ingredients": [{"item": "oak logs", "count": 1}]})]),
    ])
    result = trio.run(lambda: run_episode(
        TextCraftEnv(), engine, task, horizon_cap=8, max_context_tokens=8192, max_new_tokens=256,
        loop_settings=AgentLoopSettings(agent="tools")))
    assert result.error == "" and result.success and result.num_turns == 4 and result.invalid_actions == 2
    messages = result.conversation.messages
    assert messages[0]["role"] == "system" and "<tools>" in messages[0]["content"]
    assert messages[3]["content"] == "Invalid tool call: no tool call found: call one of the tools (get, craft, inventory)."
    assert "argument 'count' must be an integer, got 'one'" in messages[5]["content"]
    assert messages[7]["content"] == "<tool_response>\nGot 1 oak logs\n</tool_response>"
    assert all(request.stop_strings == ("</tool_call>",) for request in engine.requests)
    # The replies train exactly as sampled: the conversation's generated tokens are the engine's.
    arrays = result.conversation.arrays()
    generated = bytes(int(t) for t in arrays["token_ids"][arrays["loss_mask"] == 1] if t < 256).decode()
    assert "A log makes planks." in generated and np.count_nonzero(arrays["loss_mask"]) > 0


@pytest.mark.parametrize("env_name, calls", [
    ("textcraft", [*CALLS, ToolCall("inventory")]),
    ("babyai", [ToolCall("turn", {"direction": "left"}), ToolCall("move_forward"),
                ToolCall("go_to", {"target": "red ball 1"}), ToolCall("pickup", {"target": "yellow key 2"}),
                ToolCall("go_through", {"target": "blue door 1"}),
                ToolCall("toggle_and_go_through", {"target": "blue door 1"}), ToolCall("toggle"), ToolCall("drop"),
                ToolCall("check_available_actions")]),
    ("search", [ToolCall("search", {"query": "capital of france"}), ToolCall("answer", {"answer": "Paris"})]),
    ("weblocal", [ToolCall("click", {"bid": "12"}), ToolCall("fill", {"bid": "3", "value": "it's"}),
             ToolCall("scroll", {"delta_x": 0, "delta_y": 300}), ToolCall("stop")]),
])
def test_every_tool_call_makes_an_action_that_reads_back_as_the_same_call(env_name, calls):
    from longhorizon.envs.tools import call_for_action

    env = get_env_spec(env_name).factory()
    tool_set = env.tool_set()
    for call in calls:
        action = tool_set.action_for(call)
        assert call_for_action(tool_set, action) == call, action


@pytest.mark.parametrize("env_name", ["textcraft", "babyai", "search"])
def test_the_oracle_plays_by_tool_calls_as_well_as_by_text(env_name):
    """The scripted engine turns each oracle action into the tools loop's call (its reasoning kept
    before a hermes call): every episode the oracle wins with its own loop it wins by tools."""
    from longhorizon.actor.engines.base import EngineSettings
    from longhorizon.actor.engines.scripted import ScriptedEngine
    from longhorizon.actor.rollout import AgentLoopSettings, run_episode

    spec = get_env_spec(env_name)
    tasks = spec.tasks("train")[:4]

    async def play(agent, agent_options):
        engine = ScriptedEngine(EngineSettings(env_name=env_name, agent=agent, agent_options=agent_options))
        results = []
        for number, task in enumerate(tasks):
            results.append(await run_episode(spec.factory(), engine, task, horizon_cap=60, max_context_tokens=1 << 16,
                                             max_new_tokens=512, seed=number,
                                             loop_settings=AgentLoopSettings(configured_agent(agent, agent_options))))
        return results

    text = trio.run(play, "", {})
    for options in ({}, {"format": "json"}):
        tools = trio.run(play, "tools", options)
        assert [r.error for r in tools] == [""] * len(tasks)
        assert [r.success for r in tools] == [r.success for r in text] and any(r.success for r in text)
        assert sum(r.invalid_actions for r in tools) == 0
        replies = [m["content"] for m in tools[0].conversation.messages if m["role"] == "assistant"]
        assert all(get_tool_call_format(options.get("format", "hermes")).parse(reply).calls for reply in replies)


def test_a_tiny_untrained_model_playing_by_tools_gets_its_garbled_calls_counted(tiny_codebook_model):
    """A random model's replies hold no call: each is an invalid action with the parser's reason,
    the episode runs to its cap and its sampled tokens train as they were sampled."""
    from longhorizon.actor.engines.base import EngineSettings, make_engine
    from longhorizon.actor.rollout import AgentLoopSettings, run_episode
    from longhorizon.common.config import SamplingConfig

    engine = make_engine("hf", EngineSettings(model_path=str(tiny_codebook_model),
                                              sampling=SamplingConfig(max_new_tokens=6), max_batch_size=4))
    task = get_env_spec("textcraft").tasks("train")[0]
    result = trio.run(lambda: run_episode(TextCraftEnv(), engine, task, horizon_cap=3, max_context_tokens=1 << 15,
                                          max_new_tokens=6,
                                          loop_settings=AgentLoopSettings(agent="tools")))
    assert result.error == "" and result.num_turns == 3 and result.truncated and result.cut_by == "horizon"
    assert result.invalid_actions == 3
    assert all(m["content"].startswith("Invalid tool call: no tool call found")
               for m in result.conversation.messages[3::2])
    arrays = result.conversation.arrays()
    assert np.all(arrays["behaviour_logprobs"][arrays["loss_mask"] == 1] < 0)
