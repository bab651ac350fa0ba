"""Agent loops: action parsing tolerant of layout, strict about ambiguity, never raising past the
actor; the built-in loops are the two prompt formats."""

import pytest

from longhorizon.envs.agents import (
    ActionParseError,
    BareLoop,
    ReactLoop,
    agent_loop_for,
    error_observation,
    get_agent_loop,
    parse_action,
    register_agent_loop,
    unregister_agent_loop,
)


@pytest.mark.parametrize(
    "reply, action",
    [
        ("Thought:\nI need logs.\n\nAction:\nget 1 oak log", "get 1 oak log"),
        ("Thought: easy\nAction: inventory", "inventory"),
        ("action:   craft 4 oak planks using 1 oak log  \n", "craft 4 oak planks using 1 oak log"),
        ("Thought: x\n**Action:**\n`get 2 stick`\n", "get 2 stick"),
    ],
)
def test_react_actions(reply, action):
    assert parse_action(reply, "react") == action


@pytest.mark.parametrize(
    "reply, message",
    [
        ("I will get a log", "no action found"),
        ("Action: get 1 log\nAction: inventory", "more than one"),
        ("Thought: hmm\nAction:\n\n  ", "followed by nothing"),
    ],
)
def test_react_garbled(reply, message):
    with pytest.raises(ActionParseError, match=message):
        parse_action(reply, "react")


def test_bare_and_unknown_format():
    assert parse_action("  a3 ", "bare") == "a3"
    with pytest.raises(ActionParseError):
        parse_action("   ", "bare")
    with pytest.raises(ValueError, match="unknown prompt format"):
        parse_action("x", "json")


def test_error_observation_tells_the_format():
    text = error_observation(ActionParseError("no action found"), "react")
    assert "Action:" in text and "no action found" in text


def test_the_builtin_loops_open_with_the_envs_instructions_and_observation():
    react, bare = get_agent_loop("react"), get_agent_loop("bare")
    assert react.first_messages("rules", "s1") == [{"role": "system", "content": "rules"}, {"role": "user", "content": "s1"}]
    assert bare.first_messages("", "s1") == [{"role": "user", "content": "s1"}]  # no empty system message
    assert bare.error_observation(ActionParseError("empty reply")) == "Invalid reply: empty reply."
    assert react.error_observation(ActionParseError("x")) == error_observation(ActionParseError("x"), "react")


def test_an_episode_runs_the_envs_own_loop_unless_one_is_chosen():
    class BareEnv:
        prompt_format = "bare"

    assert isinstance(agent_loop_for(BareEnv()), BareLoop)
    assert isinstance(agent_loop_for(BareEnv(), "react"), ReactLoop)
    chosen = ReactLoop()
    assert agent_loop_for(BareEnv(), chosen) is chosen


def test_a_loop_registered_in_process_parses_and_names_its_format():
    class ShoutLoop(BareLoop):
        def parse_action(self, reply):
            return super().parse_action(reply).upper()

    register_agent_loop("shout", ShoutLoop)
    try:
        assert parse_action(" go north ", "shout") == "GO NORTH"  # a prompt format may name any loop
        with pytest.raises(ValueError, match="already registered"):
            register_agent_loop("shout", BareLoop)
        with pytest.raises(TypeError, match="lacks first_messages, parse_action, error_observation, model_view"):
            register_agent_loop("nothing", object())
    finally:
        unregister_agent_loop("shout")
    with pytest.raises(ValueError, match="unknown prompt format 'shout'"):
        parse_action("go", "shout")
