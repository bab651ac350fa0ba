"""Action parsing: tolerant of layout, strict about ambiguity, never raising past the actor."""

import pytest

from longhorizon.envs.agents import ActionParseError, error_observation, parse_action


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
