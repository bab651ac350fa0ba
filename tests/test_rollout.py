"""Episode rollout: groups with scripted engines, the horizon cap, garbled replies, broken envs."""

import dataclasses

import numpy as np
import pytest

from longhorizon.actor.engines.base import EngineSettings, GenerationResult, make_engine
from longhorizon.actor.rollout import AgentLoopSettings, EnvPool, run_episode, run_group, to_trajectory
from longhorizon.common.codec import decode, encode
from longhorizon.envs.base import list_tasks, make_env


def _scripted(env_name, policy="oracle", **options):
    return make_engine("scripted", EngineSettings(env_name=env_name, env_options=options, scripted_policy=policy))


async def test_textcraft_oracle_group_succeeds_and_streams_each_trajectory():
    engine = _scripted("textcraft")
    task = list_tasks("textcraft", "test")[5]
    pool = EnvPool(lambda: make_env("textcraft"))
    received = []

    async def collect(trajectory):
        received.append(trajectory)

    trajectories = await run_group(
        engine, pool, task, group_size=3, group_id="g1", actor_id="actor-0", horizon_cap=40,
        max_context_tokens=100_000, max_new_tokens=256, seed=7, on_trajectory=collect,
    )
    assert len(received) == 3 and trajectories == received
    for trajectory in received:
        assert trajectory.success and trajectory.reward == 1.0 and trajectory.terminated
        assert trajectory.group_id == "g1" and trajectory.group_size == 3 and trajectory.task_id == task.task_id
        generated = trajectory.loss_mask == 1
        assert generated.any() and (trajectory.policy_versions[generated] == 0).all()
        assert (trajectory.policy_versions[~generated] == -1).all()
        assert "Goal:" in trajectory.text
    assert pool.created == 3  # one env per concurrent episode, reused afterwards


async def test_horizon_cap_truncates():
    engine = _scripted("textcraft", policy="random")
    task = next(t for t in list_tasks("textcraft", "test") if t.category == "depth-3")
    result = await run_episode(
        make_env("textcraft"), engine, task, horizon_cap=2, max_context_tokens=100_000, max_new_tokens=256, seed=0,
    )
    assert result.num_turns == 2 and result.truncated and not result.terminated and result.cut_by == "horizon"
    assert result.error == ""


class _FixedReplyEngine:
    """An engine that always says the same thing (to test garbled replies)."""

    def __init__(self, reply):
        from longhorizon.common.chat import ByteChatTokenizer

        self.tokenizer = ByteChatTokenizer()
        self.policy_version = 3
        self.reply = reply

    async def generate(self, request):
        tokens = self.tokenizer.encode(self.reply) + [self.tokenizer.eos_token_id]
        return GenerationResult(tokens, [-1.0] * len(tokens), self.reply, True, self.policy_version)

    def end_episode(self, episode_id):
        pass


async def test_garbled_reply_becomes_an_error_observation():
    engine = _FixedReplyEngine("I think I should craft something")
    task = list_tasks("textcraft", "test")[0]
    result = await run_episode(
        make_env("textcraft"), engine, task, horizon_cap=3, max_context_tokens=100_000, max_new_tokens=64, seed=0,
    )
    assert result.invalid_actions == 3 and result.truncated and result.error == ""
    assert "Invalid reply: no action found" in result.conversation.messages[3]["content"]
    versions = np.array(result.conversation.policy_versions)
    assert set(versions[np.array(result.conversation.loss_mask) == 1]) == {3}
    trajectory = decode(encode(to_trajectory(result, actor_id="a", task=task, group_id="g", group_size=1, horizon_cap=3)))
    assert trajectory.invalid_actions == 3 and trajectory.num_turns == 3  # the learner's format figure


class _BrokenEnv:
    name = "broken"
    prompt_format = "bare"

    def instructions(self):
        return ""

    async def reset(self, task, *, seed=None):
        return "hello", {}

    async def step(self, action):
        raise ConnectionError("simulator died")

    async def close(self):
        pass


async def test_broken_env_fails_the_episode_not_the_actor():
    engine = _FixedReplyEngine("a0")
    task = list_tasks("codebook", "test")[0]
    result = await run_episode(_BrokenEnv(), engine, task, horizon_cap=3, max_context_tokens=1000, max_new_tokens=4)
    assert "ConnectionError: simulator died" in result.error
    assert result.reward == 0.0


class _HungEnv(_BrokenEnv):
    async def step(self, action):
        import trio

        await trio.sleep_forever()


async def test_a_hung_env_step_fails_the_episode_after_the_timeout(autojump_clock):
    engine = _FixedReplyEngine("a0")
    task = list_tasks("codebook", "test")[0]
    result = await run_episode(
        _HungEnv(), engine, task, horizon_cap=3, max_context_tokens=1000, max_new_tokens=4, env_call_timeout_s=60,
    )
    assert "TimeoutError" in result.error and "env step" in result.error and "60s" in result.error


async def test_a_first_prompt_that_leaves_no_room_fails_the_episode():
    engine = _FixedReplyEngine("a0")
    task = list_tasks("codebook", "test")[0]
    result = await run_episode(make_env("codebook"), engine, task, horizon_cap=3, max_context_tokens=10, max_new_tokens=4)
    assert "does not fit actor.max_context_tokens" in result.error and result.num_turns == 0


async def test_context_budget_truncates():
    engine = _FixedReplyEngine("a0")
    task = list_tasks("codebook", "test")[0]
    result = await run_episode(
        make_env("codebook"), engine, task, horizon_cap=10, max_context_tokens=40, max_new_tokens=4
    )
    assert result.truncated and result.num_turns < 3 and result.cut_by == "context"


async def test_invalid_reply_reward_is_added_per_garbled_reply():
    engine = _FixedReplyEngine("no idea")
    task = list_tasks("textcraft", "test")[0]
    result = await run_episode(
        make_env("textcraft"), engine, task, horizon_cap=3, max_context_tokens=100_000, max_new_tokens=64,
        seed=0, invalid_reply_reward=-0.1,
    )
    assert result.turn_rewards == [-0.1, -0.1, -0.1]
    assert result.reward == pytest.approx(-0.3)


async def test_requests_carry_the_envs_stop_strings():
    class RecordingEngine(_FixedReplyEngine):
        def __init__(self, reply):
            super().__init__(reply)
            self.stop_strings = []

        async def generate(self, request):
            self.stop_strings.append(request.stop_strings)
            return await super().generate(request)

    engine = RecordingEngine("<search>capital of France</search>")
    task = list_tasks("search", "test")[0]
    await run_episode(make_env("search"), engine, task, horizon_cap=2, max_context_tokens=100_000, max_new_tokens=64)
    assert engine.stop_strings == [("</search>", "</answer>", "</python>")] * 2
    await run_episode(make_env("textcraft"), engine, list_tasks("textcraft", "test")[0], horizon_cap=1,
                      max_context_tokens=100_000, max_new_tokens=64)
    assert engine.stop_strings[-1] == ()  # envs without stop strings


class _RecordingEngine(_FixedReplyEngine):
    """A fixed-reply engine that keeps every context it was given."""

    def __init__(self, reply):
        super().__init__(reply)
        self.contexts = []

    async def generate(self, request):
        self.contexts.append(list(request.token_ids))
        return await super().generate(request)


async def test_a_windowed_history_outlives_the_context_budget_and_each_turn_trains_in_what_it_saw():
    """Garbled replies on TextCraft: every turn is an error observation (about 180 byte tokens), so
    the episode runs to the cap. With the whole history a budget of 2,100 tokens (the first prompt
    takes about 1,880) is spent within 2 turns; with the last turn only, all 6 fit, and each turn's
    training sample is exactly the context the engine was given plus its reply."""
    from longhorizon.learner.samples import cut, reply_mask, windows_of

    task = list_tasks("textcraft", "test")[0]
    settings = dict(horizon_cap=6, max_context_tokens=2100, max_new_tokens=8, seed=0)
    whole = await run_episode(make_env("textcraft"), _RecordingEngine("no idea"), task, **settings)
    assert whole.cut_by == "context" and whole.num_turns < 3 and not whole.windowed
    engine = _RecordingEngine("no idea")
    result = await run_episode(make_env("textcraft"), engine, task, loop_settings=AgentLoopSettings(history_turns=1),
                               **settings)
    assert result.num_turns == 6 and result.cut_by == "horizon" and result.windowed
    trajectory = decode([bytes(frame) for frame in encode(
        to_trajectory(result, actor_id="a", task=task, group_id="g", group_size=1, horizon_cap=6))])
    assert len(trajectory.token_ids) > 2100 and trajectory.cut_by == "horizon"
    windows = windows_of(trajectory)
    assert len(windows) == 6 and windows[0][0] == trajectory.prompt_length  # the first turn saw it all
    for (start, reply_start, end), context in zip(windows, engine.contexts):
        sample = cut(trajectory.token_ids, trajectory.prompt_length, start, end).tolist()
        reply = trajectory.token_ids[reply_start:end].tolist()
        assert sample == context + reply and len(sample) <= 2100
        mask = reply_mask(trajectory.loss_mask, trajectory.prompt_length, (start, reply_start, end))
        assert mask.tolist() == [0.0] * len(context) + [1.0] * len(reply)
    # Without windowing the trajectory is one sample.
    assert to_trajectory(whole, actor_id="a", task=task, group_id="g", group_size=1, horizon_cap=6).sample_windows == []


async def test_with_a_history_summary_each_observation_ends_with_the_envs_account_of_the_episode():
    """TextCraft's summary is its inventory: with the last turn only in view, the model still sees
    what the earlier turns gathered, and the trajectory holds exactly what it saw."""
    task = list_tasks("textcraft", "test", min_depth=2, max_depth=2)[0]
    env, engine = make_env("textcraft", min_depth=2, max_depth=2), _scripted("textcraft", min_depth=2, max_depth=2)
    settings = dict(horizon_cap=20, max_context_tokens=100_000, max_new_tokens=256, seed=0)
    summarised = AgentLoopSettings(history_turns=1, history_summary=True)
    result = await run_episode(env, engine, task, loop_settings=summarised, **settings)
    assert result.success and result.num_turns >= 3 and result.windowed
    observations = [m["content"] for m in result.conversation.messages if m["role"] == "user"][1:]
    assert len(observations) == result.num_turns - 1  # the last step's observation ends the episode
    for observation in observations:
        observation, summary = observation.rsplit("\n\n", 1)
        assert summary.startswith("Inventory: ") and summary not in observation
    # The inventory grows with what was gathered: the last summary names more than the first.
    assert len(observations[-1].rsplit("\n\n", 1)[1]) > len(observations[0].rsplit("\n\n", 1)[1])
    plain = await run_episode(make_env("textcraft", min_depth=2, max_depth=2), engine, task,
                              loop_settings=AgentLoopSettings(history_turns=1), **settings)
    assert [m["content"] for m in plain.conversation.messages if m["role"] == "user"][1:] == \
        [observation.rsplit("\n\n", 1)[0] for observation in observations]

    # An env without a summary fails the episode with a message that names the key.
    codebook = await run_episode(make_env("codebook"), _scripted("codebook"), list_tasks("codebook", "test")[0],
                                 loop_settings=summarised, **settings)
    assert "actor.history_summary: env 'codebook' gives no summary" in codebook.error


def test_a_history_summary_is_checked_before_a_run_starts():
    from longhorizon.common.config import ConfigError, load_config
    from longhorizon.launch.checks import validate_config

    validate_config(load_config("textcraft", ["actor.history_turns=2", "actor.history_summary=true"]))
    with pytest.raises(ConfigError, match="set actor.history_turns > 0 as well"):
        validate_config(load_config("textcraft", ["actor.history_summary=true"]))
    with pytest.raises(ConfigError, match="env 'codebook' gives no summary of an episode"):
        validate_config(load_config("codebook", ["actor.history_turns=2", "actor.history_summary=true"]))


class _NoteTakingEngine:
    """The scripted oracle with notes before its replies: `<notes>turn N</notes>` on the turns
    `noting` names (1-based), the oracle's reply after them, tokens and text as an engine's."""

    def __init__(self, inner, noting):
        self.inner, self.noting, self.turns = inner, set(noting), {}
        self.tokenizer, self.policy_version = inner.tokenizer, inner.policy_version

    async def generate(self, request):
        result = await self.inner.generate(request)
        turn = self.turns[request.episode_id] = self.turns.get(request.episode_id, 0) + 1
        if turn not in self.noting:
            return result
        text = f"<notes>turn {turn}: {result.text.splitlines()[-1]}</notes>\n{result.text}"
        return dataclasses.replace(result, text=text, token_ids=self.tokenizer.encode(text) + [self.tokenizer.eos_token_id],
                                   logprobs=[0.0] * (len(self.tokenizer.encode(text)) + 1))

    def end_episode(self, episode_id):
        self.inner.end_episode(episode_id)


async def test_with_history_notes_the_policys_latest_notes_follow_each_observation():
    """The instructions ask for notes; a reply's notes are taken out before its action is read (the
    oracle still wins) and follow every later observation until newer notes replace them; a reply
    without notes leaves the last ones in view. The notes stay in the trajectory as written."""
    task = list_tasks("textcraft", "test", min_depth=3, max_depth=3)[0]
    settings = dict(horizon_cap=20, max_context_tokens=100_000, max_new_tokens=256, seed=0)
    engine = _NoteTakingEngine(_scripted("textcraft", min_depth=3, max_depth=3), noting={1, 3})
    result = await run_episode(make_env("textcraft", min_depth=3, max_depth=3), engine, task,
                               loop_settings=AgentLoopSettings(history_turns=1, history_notes=True), **settings)
    assert result.success and result.num_turns >= 4 and result.windowed and not result.invalid_actions
    messages = result.conversation.messages
    assert "Begin each reply with <notes>" in messages[0]["content"] + messages[1]["content"]
    replies = [m["content"] for m in messages if m["role"] == "assistant"]
    assert replies[0].startswith("<notes>turn 1: ") and replies[2].startswith("<notes>turn 3: ")
    observations = [m["content"] for m in messages if m["role"] == "user"][1:]
    noted = [observation.rsplit("\n\nYour notes: ", 1)[1] for observation in observations]
    assert noted[0] == noted[1] == replies[0].split("</notes>")[0].removeprefix("<notes>")
    assert all(note.startswith("turn 3: ") for note in noted[2:])

    plain = await run_episode(make_env("textcraft", min_depth=3, max_depth=3), _scripted("textcraft", min_depth=3, max_depth=3),
                              task, loop_settings=AgentLoopSettings(history_turns=1), **settings)
    assert [m["content"] for m in plain.conversation.messages if m["role"] == "user"][1:] == \
        [observation.rsplit("\n\nYour notes: ", 1)[0] for observation in observations]


def test_split_notes_reads_the_last_block_and_leaves_the_reply_without_notes():
    from longhorizon.actor.rollout import split_notes

    assert split_notes("get 1 oak log") == (None, "get 1 oak log")
    assert split_notes("<notes>a</notes>\n<notes> b\nc </notes>\nAction: craft 1 stick") == ("b\nc", "Action: craft 1 stick")
    assert split_notes("<notes>unclosed\nAction: inventory") == (None, "<notes>unclosed\nAction: inventory")


def test_history_notes_are_checked_before_a_run_starts():
    from longhorizon.common.config import ConfigError, load_config
    from longhorizon.launch.checks import validate_config

    validate_config(load_config("codebook", ["actor.history_turns=1", "actor.history_notes=true"]))
    with pytest.raises(ConfigError, match="actor.history_notes keeps .* set actor.history_turns > 0 as well"):
        validate_config(load_config("codebook", ["actor.history_notes=true"]))
