"""`run.save_episodes`: the chat messages on the wire (only when asked for), the episode files the
learner writes (records, rotation, a resumed run's cut), and a short codebook run whose files hold
every episode it trained on and train `sft` and feed `dpo` as they are."""

import json
from pathlib import Path
from types import SimpleNamespace

import msgpack
import numpy as np
import pytest
import trio

from longhorizon.actor.rollout import EpisodeResult, to_trajectory
from longhorizon.common.chat import ByteChatTokenizer, TokenConversation
from longhorizon.common.codec import WireError, WireLimits, decode, encode
from longhorizon.common.config import ConfigError, load_config
from longhorizon.common.conversations import read_conversations
from longhorizon.learner.episode_log import EpisodeLog, episode_files, episode_record
from longhorizon.learner.logprobs import Example
from longhorizon.learner.scoring import ScoredBatch
from tests.test_wire import make_trajectory

REPO_ROOT = Path(__file__).resolve().parent.parent
MESSAGES = [
    {"role": "system", "content": "Play."},
    {"role": "user", "content": "Observation: s0"},
    {"role": "assistant", "content": "a1"},
    {"role": "user", "content": "Observation: s1"},
]


# ---------------------------------------------------------------- the wire

def _header(frames) -> dict:
    return msgpack.unpackb(frames[0], raw=False)


def _with_messages(frames, value) -> list:
    header = _header(frames)
    header["fields"]["messages"] = value
    return [msgpack.packb(header, use_bin_type=True), *frames[1:]]


def test_messages_travel_when_given_and_nothing_travels_otherwise():
    sent = make_trajectory(messages=MESSAGES)
    received = decode(encode(sent))
    assert received.messages == MESSAGES
    plain = encode(make_trajectory())
    assert _header(plain)["fields"]["messages"] is None  # no conversation text, just the nil
    assert decode(plain).messages is None
    assert len(plain[0]) < len(encode(sent)[0])


@pytest.mark.parametrize("value, reason", [
    ("Observation: s0", "must be a list of chat messages or None"),
    ([["user", "hi"]], r"messages\[0\] must be a map with exactly the keys role and content"),
    ([{"role": "user"}], "exactly the keys role and content"),
    ([{"role": "user", "content": "hi", "name": "x"}], "exactly the keys role and content"),
    ([{"role": "tool", "content": "hi"}], r"messages\[0\].role must be one of system, user, assistant"),
    ([{"role": 1, "content": "hi"}], "role must be one of"),
    ([{"role": "user", "content": b"hi"}], r"messages\[0\].content must be a str, got bytes"),
    ([{"role": "user", "content": None}], "content must be a str, got NoneType"),
])
def test_a_malformed_messages_value_is_refused_at_decode(value, reason):
    frames = _with_messages(encode(make_trajectory()), value)
    with pytest.raises(WireError, match=reason):
        decode(frames)


def test_messages_are_bounded_by_the_receivers_limits():
    frames = encode(make_trajectory(messages=MESSAGES, text=""))
    with pytest.raises(WireError, match="4 items, more than the limit 3"):
        decode(frames, limits=WireLimits(max_list_items=3))
    with pytest.raises(WireError, match=r"messages\[1\].content has 15 characters, more than the limit 14"):
        decode(frames, limits=WireLimits(max_text_chars=14))


def test_a_sender_cannot_encode_malformed_messages():
    with pytest.raises(WireError, match="role must be one of"):
        encode(make_trajectory(messages=[{"role": "robot", "content": "x"}]))


# ---------------------------------------------------------------- the actor's side

def _episode(messages=MESSAGES) -> EpisodeResult:
    conversation = TokenConversation.start(ByteChatTokenizer(), messages[:2])
    for message in messages[2:]:
        if message["role"] == "assistant":
            ids = list(message["content"].encode()) + [ByteChatTokenizer.IM_END]
            conversation.add_generation(ids, [-0.5] * len(ids), 3, message["content"])
        else:
            conversation.add_observation(message["content"], stopped_on_eos=True)
    return EpisodeResult(conversation=conversation, reward=1.0, turn_rewards=[1.0], num_turns=1)


def _package(result, with_messages):
    task = SimpleNamespace(env_name="codebook", task_id="t1")
    return to_trajectory(result, actor_id="actor-0", task=task, group_id="g1", group_size=2, horizon_cap=3,
                         with_messages=with_messages)


def test_the_actor_adds_the_messages_only_when_asked():
    assert _package(_episode(), with_messages=False).messages is None
    sent = _package(_episode(), with_messages=True)
    assert sent.messages == MESSAGES
    assert decode(encode(sent)).messages == MESSAGES
    # An episode that failed before its first prompt has no conversation to send.
    assert _package(EpisodeResult(conversation=None, error="boom"), with_messages=True).messages is None


def test_an_agent_loop_with_other_roles_still_trains_without_its_messages():
    odd = [{"role": "developer", "content": "Play."}, *MESSAGES[1:]]
    trajectory = _package(_episode(odd), with_messages=True)
    assert trajectory.messages is None
    decode(encode(trajectory))


# ---------------------------------------------------------------- the config key

def test_the_key_is_off_by_default_and_takes_only_a_bool():
    assert load_config(None).run.save_episodes is False
    assert load_config(None, ["run.save_episodes=true"]).run.save_episodes is True
    with pytest.raises(ConfigError, match="run.save_episodes: expected bool"):
        load_config(None, ["run.save_episodes=1"])


# ---------------------------------------------------------------- the episode files

TOKENIZER = {"model": "/models/m", "fingerprint": "sha256:00"}


def _trajectory(reward=1.0, messages=MESSAGES, **overrides):
    # make_trajectory: a 4-token prompt, then 8 generated tokens; mark the last two as an observation.
    trajectory = make_trajectory(reward=reward, messages=messages, **overrides)
    trajectory.loss_mask = trajectory.loss_mask.copy()
    trajectory.loss_mask[-2:] = 0
    trajectory.policy_versions = np.where(trajectory.loss_mask == 1, 3, -1).astype(np.int32)
    trajectory.policy_versions[4] = 2
    return trajectory


def test_an_episode_record_is_a_conversation_line_with_the_runs_fields(tmp_path):
    trajectory = _trajectory()
    record, problem = episode_record(trajectory, step=7, trained_version=4, advantage=0.5, update_applied=True,
                                     tokenizer=TOKENIZER, episode=12)
    assert problem == ""
    # The trailing observation is dropped from the messages and its tokens from the ids.
    assert record["messages"] == MESSAGES[:3]
    assert record["token_ids"] == list(range(100, 110)) and record["loss_mask"] == [0] * 4 + [1] * 6
    assert record["tokenizer"] == TOKENIZER
    assert (record["reward"], record["success"], record["task_id"], record["episode"]) == (1.0, True, "craft/stick", 12)
    meta = record["metadata"]
    versions = (meta["trained_version"], meta["policy_version"], meta["policy_version_newest"])
    assert meta["step"] == 7 and versions == (4, 2, 3)
    assert (meta["staleness"], meta["advantage"], meta["update_applied"]) == (2, 0.5, True)
    assert (meta["group_id"], meta["group_size"], meta["actor_id"]) == ("actor-0/group-2", 4, "actor-0")
    path = tmp_path / "one.jsonl"
    path.write_text(json.dumps(record) + "\n")
    [read] = read_conversations(path)
    assert read.token_ids == record["token_ids"] and read.tokenizer == TOKENIZER

    assert episode_record(_trajectory(messages=None), step=1, trained_version=0, advantage=None,
                          update_applied=True, tokenizer=None, episode=0) == (None, "the actor sent no messages")
    no_reply, problem = episode_record(_trajectory(messages=MESSAGES[:2]), step=1, trained_version=0, advantage=None,
                                       update_applied=True, tokenizer=None, episode=0)
    assert (no_reply, problem) == (None, "the model wrote no reply")


def _step(trajectories, advantages=None, *, critic=False):
    """One group's step: its groups and scored batch, an example (of group 0) per trajectory given
    an advantage."""
    examples = [
        Example(token_ids=np.asarray(t.token_ids, np.int64), loss_mask=np.asarray(t.loss_mask, np.float32),
                behaviour_logprobs=np.zeros(len(t.token_ids), np.float32), advantage=a,
                token_rewards=np.zeros(len(t.token_ids), np.float32) if critic else None, group=0)
        for t, a in zip(trajectories, advantages or []) if a is not None
    ]
    group = SimpleNamespace(group_id="g", trajectories=trajectories)
    return [group], ScoredBatch(examples, 1, 0, 0, 0)


def _lines(folder):
    return [json.loads(line) for path in episode_files(folder) for line in path.read_text().splitlines()]


def test_every_member_is_written_with_its_advantage_and_files_rotate(tmp_path):
    folder = tmp_path / "episodes"
    log = EpisodeLog(folder, tokenizer=TOKENIZER, episodes_per_file=3)
    first, second = _trajectory(1.0), _trajectory(0.0, token_ids=np.arange(12, dtype=np.int32) + 200)
    failed = _trajectory(0.0, messages=MESSAGES[:2], error="EnvError: gone")
    groups, scored = _step([first, second, failed], [0.7, -0.7, None])
    assert log.write_step(1, 0, groups, scored, {"optimizer_steps_applied": 1.0}) == 2
    assert log.skipped == {"no conversation": 1}
    # A flat group: no example, so no advantage, and the update left the weights as they were.
    groups, scored = _step([_trajectory(1.0), _trajectory(1.0)])
    assert log.write_step(2, 1, groups, scored, {}) == 2
    groups, scored = _step([_trajectory(0.5)], [0.0], critic=True)
    assert log.write_step(3, 1, groups, scored, {"nonfinite_step": 1.0}) == 1

    # A step's lines stay in one file; the next file starts once a file holds 3 episodes.
    assert [p.name for p in episode_files(folder)] == ["episodes-0000.jsonl", "episodes-0001.jsonl"]
    assert [len(p.read_text().splitlines()) for p in episode_files(folder)] == [4, 1]
    lines = _lines(folder)
    assert [line["episode"] for line in lines] == [0, 1, 2, 3, 4]
    assert [line["metadata"]["step"] for line in lines] == [1, 1, 2, 2, 3]
    assert [line["metadata"]["advantage"] for line in lines] == [0.7, -0.7, None, None, None]
    assert [line["metadata"]["update_applied"] for line in lines] == [True, True, False, False, False]
    assert [len(read_conversations(p)) for p in episode_files(folder)] == [4, 1]


def test_a_resumed_run_keeps_the_steps_up_to_its_checkpoint(tmp_path):
    folder = tmp_path / "episodes"
    log = EpisodeLog(folder, tokenizer=None, episodes_per_file=2)
    for step in range(1, 5):
        groups, scored = _step([_trajectory(), _trajectory()])
        log.write_step(step, step - 1, groups, scored, {})
    with episode_files(folder)[-1].open("a") as file:
        file.write('{"messages": [')  # a write cut short by a crash
    assert len(episode_files(folder)) == 4

    # Restarted without resuming: only the torn line goes, and writing continues in a new file.
    again = EpisodeLog(folder, tokenizer=None, episodes_per_file=2)
    assert (again.episodes, again.removed) == (8, 1)
    resumed = EpisodeLog(folder, tokenizer=None, resume_step=2, episodes_per_file=2)
    assert (resumed.episodes, resumed.removed) == (4, 4)
    assert [line["metadata"]["step"] for line in _lines(folder)] == [1, 1, 2, 2]
    groups, scored = _step([_trajectory()])
    resumed.write_step(3, 2, groups, scored, {})
    lines = _lines(folder)
    assert [line["metadata"]["step"] for line in lines] == [1, 1, 2, 2, 3]
    assert lines[-1]["episode"] == 4
    assert [p.name for p in episode_files(folder)] == [f"episodes-000{i}.jsonl" for i in range(3)]


# ---------------------------------------------------------------- a run

def _spy_on_the_wire(monkeypatch) -> list:
    """The `messages` field of every trajectory the in-process transport encodes, as sent."""
    from longhorizon.common import transport

    sent = []

    def encode_and_note(message, **options):
        frames = encode(message, **options)
        if type(message).__name__ == "Trajectory":
            sent.append(_header(frames)["fields"]["messages"])
        return frames

    monkeypatch.setattr(transport, "encode", encode_and_note)
    return sent


def test_a_codebook_run_saves_every_episode_it_trained_on_for_sft_and_dpo(tmp_path, tiny_codebook_model, monkeypatch):
    from longhorizon.common.chat import HFChatTokenizer
    from longhorizon.common.conversations import tokenizer_fingerprint
    from longhorizon.common.metrics import read_metrics
    from longhorizon.common.models import load_tokenizer
    from longhorizon.common.preference_pairs import prompt_messages
    from longhorizon.launch.launchers.local import train_in_process
    from longhorizon.launch.recipes.sft import run_sft
    from longhorizon.learner.dpo import load_dpo_data

    config = load_config(REPO_ROOT / "configs" / "codebook.toml", [
        f"run.output_dir={str(tmp_path)!r}", "run.total_steps=3", f"model.path={str(tiny_codebook_model)!r}",
        "run.save_episodes=true", "actor.num_actors=1", "actor.group_size=4", "learner.groups_per_step=3",
    ])
    sent = _spy_on_the_wire(monkeypatch)
    trio.run(train_in_process, config)
    assert sent and all(messages and messages[-1]["role"] in ("assistant", "user") for messages in sent)

    records = read_metrics(config.run_dir)
    assert [r["step"] for r in records] == [1, 2, 3]
    files = episode_files(config.run_dir / "episodes")
    lines = [json.loads(line) for path in files for line in path.read_text().splitlines()]
    trained = records[-1]["trajectories_trained"]
    assert trained == 3 * 3 * 4 and len(lines) == trained  # every member of every group of every step
    assert [sum(line["metadata"]["step"] == step for line in lines) for step in (1, 2, 3)] == [12, 12, 12]
    assert all(line["metadata"]["staleness"] <= config.learner.max_staleness for line in lines)
    used = [line for line in lines if line["metadata"]["advantage"] is not None]
    assert len(used) == 4 * sum(r["groups_used"] for r in records)

    hf_tokenizer = load_tokenizer(tiny_codebook_model)
    fingerprint = tokenizer_fingerprint(hf_tokenizer)
    assert {line["tokenizer"]["fingerprint"] for line in lines} == {fingerprint}
    paths = [str(path) for path in files]
    dpo = load_dpo_data(paths, [], HFChatTokenizer(hf_tokenizer), fingerprint, vocab_size=15, max_tokens=256)
    rewards_by_group: dict = {}
    for line in lines:
        prompt = json.dumps(prompt_messages(line["messages"]))
        rewards_by_group.setdefault((line["task_id"], prompt), set()).add(line["reward"])
    assert dpo.retokenized == 0 and dpo.episodes == trained
    assert len(dpo.pairs) == sum(len(rewards) > 1 for rewards in rewards_by_group.values())

    sft_config = load_config(REPO_ROOT / "configs" / "codebook-sft.toml", [
        f"run.output_dir={str(tmp_path)!r}", f"model.path={str(tiny_codebook_model)!r}", f"sft.data={paths!r}",
        "sft.epochs=1", "sft.eval_episodes=0", "sft.eval_before=false",
    ])
    summary = run_sft(sft_config, note=lambda line: None)
    assert summary["conversations"] == trained and summary["retokenized"] == 0 and summary["steps"] >= 1
    assert np.isfinite(summary["final_loss"])


def test_a_run_without_the_key_sends_no_messages_and_writes_no_episode_files(tmp_path, tiny_codebook_model,
                                                                             monkeypatch):
    from longhorizon.launch.launchers.local import train_in_process

    config = load_config(REPO_ROOT / "configs" / "codebook.toml", [
        f"run.output_dir={str(tmp_path)!r}", "run.total_steps=1", f"model.path={str(tiny_codebook_model)!r}",
        "actor.num_actors=1", "actor.group_size=2", "learner.groups_per_step=1", "learner.sample_episodes_every=1",
    ])
    sent = _spy_on_the_wire(monkeypatch)
    trio.run(train_in_process, config)
    assert sent and all(messages is None for messages in sent)
    assert episode_files(config.run_dir / "episodes") == []
    assert list((config.run_dir / "episodes").glob("step_*.txt"))  # the sample episode is still written
