"""`longhorizon collect`: play a split with an engine, write conversations as JSONL for offline trainers."""

import io
import json
from pathlib import Path

import pytest
import trio

from longhorizon.actor.collect import make_play_engine, run_collect
from longhorizon.common.chat import HFChatTokenizer
from longhorizon.common.config import load_config
from longhorizon.common.conversations import (
    ConversationFileError,
    message_structure_problem,
    read_conversations,
    tokenize_conversation,
    tokenizer_fingerprint,
)
from longhorizon.common.models import load_tokenizer
from longhorizon.common.progress import ProgressBar, format_bar
from longhorizon.envs.base import list_tasks
from longhorizon.launch.cli import main as cli_main

REPO_ROOT = Path(__file__).resolve().parent.parent
SFT_CONFIG = REPO_ROOT / "configs" / "codebook-sft.toml"


def _config(tmp_path, model, *overrides):
    return load_config(SFT_CONFIG, [f"run.output_dir={str(tmp_path)!r}", f"model.path={str(model)!r}", *overrides])


def test_oracle_play_is_written_with_the_model_tokens(tmp_path, tiny_codebook_model):
    config = _config(tmp_path, tiny_codebook_model)
    output = tmp_path / "oracle.jsonl"
    progress = []
    summary = run_collect(config, output=output, episodes=12,
                          on_progress=lambda done, total, detail: progress.append((done, total)))
    assert (summary.episodes, summary.written, summary.successful, summary.failed) == (12, 12, 12, 0)
    assert progress[-1] == (12, 12) and progress[0] == (0, 12)
    assert not output.with_name(output.name + ".partial").exists()

    hf_tokenizer = load_tokenizer(tiny_codebook_model)
    tokenizer = HFChatTokenizer(hf_tokenizer)
    lines = [json.loads(line) for line in output.read_text().splitlines()]
    train_ids = {task.task_id for task in list_tasks("codebook", "train", **dict(config.env.options))}
    for line in lines:
        for key in ("messages", "token_ids", "loss_mask", "reward", "success", "task_id", "tokenizer"):
            assert key in line, key
        assert line["success"] is True and line["reward"] == 1.0 and line["task_id"] in train_ids
        assert line["engine"] == "scripted:oracle" and line["num_turns"] == 3
        assert line["tokenizer"]["fingerprint"] == tokenizer_fingerprint(hf_tokenizer)
        # The ids are the messages in the model's template, laid out as the actor lays out RL
        # trajectories; the loss covers each reply and its end-of-turn token, nothing else.
        assert line["token_ids"] == tokenize_conversation(tokenizer, line["messages"]).token_ids
        trained = [t for t, m in zip(line["token_ids"], line["loss_mask"]) if m]
        replies = [m["content"] for m in line["messages"] if m["role"] == "assistant"]
        assert trained == [t for reply in replies for t in tokenizer.encode(reply) + [tokenizer.eos_token_id]]
    assert len(read_conversations(output)) == 12  # the reader accepts what collect writes


def test_the_file_is_in_episode_order_however_the_episodes_end(tmp_path, tiny_codebook_model):
    """Early episodes made to end last (their replies wait longer) are still written first, so
    the same seed writes the same file and a trainer shuffling it with its seed sees the same batches;
    episodes left out keep their place empty."""
    config = _config(tmp_path, tiny_codebook_model, "actor.scripted_policy='random'",
                     "env.options={num_turns = 1, num_symbols = 2, num_actions = 2}")
    engine, _ = make_play_engine(config)

    class EarlyEpisodesEndLast:
        async def generate(self, request):
            await trio.sleep(0.02 * (12 - int(request.episode_id.split("-")[1])))
            return await engine.generate(request)

        def __getattr__(self, name):
            return getattr(engine, name)

    summary = run_collect(config, output=tmp_path / "ordered.jsonl", episodes=12, only_successful=True,
                          engine=EarlyEpisodesEndLast())
    lines = [json.loads(line) for line in (tmp_path / "ordered.jsonl").read_text().splitlines()]
    episodes = [line["episode"] for line in lines]
    assert 0 < summary.written == len(lines) < 12 and episodes == sorted(episodes)


def test_scripted_play_counts_the_context_in_the_model_tokens(tmp_path, default_model_path):
    """TextCraft's oracle episodes are about 600 SmolLM2 tokens and 2,000-3,000 bytes: under a
    1,024-token budget all of them fit in the model's tokens, as the model will meet them."""
    overrides = [f"run.output_dir={str(tmp_path)!r}", f"model.path={str(default_model_path)!r}",
                 "env.name='textcraft'", "env.options={max_depth = 2, num_distractors = 3}",
                 "actor.engine='scripted'", "actor.scripted_policy='oracle'", "actor.sampling.max_new_tokens=64",
                 "horizon.schedule='fixed'", "horizon.stages=[10]"]
    roomy = run_collect(load_config(None, [*overrides, "actor.max_context_tokens=1024"]),
                        output=tmp_path / "roomy.jsonl", episodes=40, on_note=lambda line: None)
    assert (roomy.written, roomy.successful, roomy.failed) == (40, 40, 0)
    lines = [json.loads(line) for line in (tmp_path / "roomy.jsonl").read_text().splitlines()]
    assert max(len(line["token_ids"]) for line in lines) <= 1024 - 64

    # A budget some episodes outgrow: they end on the cut, and what is written ends on a reply
    # (the observation after it is never trained on), so sft reads every line.
    tight = run_collect(load_config(None, [*overrides, "actor.max_context_tokens=640"]),
                        output=tmp_path / "tight.jsonl", episodes=40, on_note=lambda line: None)
    lines = [json.loads(line) for line in (tmp_path / "tight.jsonl").read_text().splitlines()]
    assert tight.written == 40 and 0 < sum(line["truncated"] for line in lines) < 40
    assert all(line["messages"][-1]["role"] == "assistant" for line in lines)
    assert len(read_conversations(tmp_path / "tight.jsonl")) == 40


def test_only_successful_keeps_the_successes(tmp_path, tiny_codebook_model):
    # One turn, two actions: the random policy succeeds about half the time.
    overrides = ["actor.scripted_policy='random'", "env.options={num_turns = 1, num_symbols = 2, num_actions = 2}"]
    config = _config(tmp_path, tiny_codebook_model, *overrides)
    everything = run_collect(config, output=tmp_path / "all.jsonl", episodes=40)
    kept = run_collect(config, output=tmp_path / "kept.jsonl", episodes=40, only_successful=True)
    assert everything.written == 40
    assert 0 < kept.successful < 40
    assert kept.written == kept.successful and kept.skipped_unsuccessful == 40 - kept.successful
    records = read_conversations(tmp_path / "kept.jsonl")
    assert len(records) == kept.written and all(record.success for record in records)
    assert {r.success for r in read_conversations(tmp_path / "all.jsonl")} == {True, False}


def test_an_existing_file_is_kept_unless_overwrite(tmp_path, tiny_codebook_model):
    config = _config(tmp_path, tiny_codebook_model)
    output = tmp_path / "data.jsonl"
    output.write_text("precious\n")
    with pytest.raises(ValueError, match="--overwrite"):
        run_collect(config, output=output, episodes=2)
    assert output.read_text() == "precious\n"
    run_collect(config, output=output, episodes=2, overwrite=True)
    assert len(read_conversations(output)) == 2


def test_nothing_to_write_is_an_error_and_writes_nothing(tmp_path, tiny_codebook_model):
    config = _config(tmp_path, tiny_codebook_model)
    output = tmp_path / "none.jsonl"
    # A one-turn limit on a three-turn task: even the oracle never reaches the goal.
    with pytest.raises(ValueError, match="none of the 4 episodes succeeded.*drop --only-successful"):
        run_collect(config, output=output, episodes=4, horizon=1, only_successful=True)
    assert not output.exists() and not output.with_name(output.name + ".partial").exists()


def test_without_a_local_model_only_messages_are_written(tmp_path):
    config = load_config(SFT_CONFIG, ["model.path='/nonexistent/model'"])
    notes = []
    output = tmp_path / "messages.jsonl"
    run_collect(config, output=output, episodes=3, on_note=notes.append)
    assert any("without token ids" in note for note in notes)
    records = read_conversations(output)
    assert len(records) == 3 and all(r.token_ids is None and r.tokenizer is None for r in records)


def test_bad_arguments_are_refused_before_playing(tmp_path, tiny_codebook_model):
    config = _config(tmp_path, tiny_codebook_model)
    with pytest.raises(ValueError, match=".jsonl"):
        run_collect(config, output=tmp_path / "data.txt")
    with pytest.raises(ValueError, match="--episodes"):
        run_collect(config, output=tmp_path / "data.jsonl", episodes=0)
    with pytest.raises(ValueError, match="unknown split"):
        run_collect(config, output=tmp_path / "data.jsonl", split="validation")
    assert list(tmp_path.glob("*.jsonl*")) == []


def test_cli_collect(tmp_path, tiny_codebook_model, capsys):
    output = tmp_path / "cli.jsonl"
    code = cli_main(["collect", str(SFT_CONFIG), f"model.path={str(tiny_codebook_model)!r}",
                     "--episodes", "5", "--output", str(output)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "collect [" in captured.err and "5/5" in captured.err  # the progress bar
    assert json.loads(captured.out.strip().splitlines()[-1])["written"] == 5
    assert len(read_conversations(output)) == 5
    # A second run onto the same file is a clear error, not a silent overwrite.
    assert cli_main(["collect", str(SFT_CONFIG), f"model.path={str(tiny_codebook_model)!r}",
                     "--episodes", "5", "--output", str(output)]) == 2
    assert "--overwrite" in capsys.readouterr().err


def test_tokenized_conversation_is_the_chat_template_rendering(default_model_path):
    """On SmolLM2's real template: what SFT trains on is the template's own rendering of the whole
    conversation (up to the newline after the last end-of-turn token, which is never generated)."""
    hf_tokenizer = load_tokenizer(default_model_path)
    messages = [
        {"role": "system", "content": "You craft.\nRules: be brief."},
        {"role": "user", "content": "Goal: craft 1 oak planks."},
        {"role": "assistant", "content": "Thought:\nI need logs.\n\nAction:\nget 1 oak logs"},
        {"role": "user", "content": "Got 1 oak logs"},
        {"role": "assistant", "content": "Action: craft 4 oak planks using 1 oak logs"},
    ]
    conversation = tokenize_conversation(HFChatTokenizer(hf_tokenizer), messages)
    rendered = hf_tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=False, return_dict=False)
    assert conversation.token_ids == rendered[: len(conversation.token_ids)]
    assert hf_tokenizer.decode(rendered[len(conversation.token_ids):]).strip() == ""
    trained = [t for t, m in zip(conversation.token_ids, conversation.loss_mask) if m]
    assert hf_tokenizer.decode(trained).count("<|im_end|>") == 2
    assert "Got 1 oak logs" not in hf_tokenizer.decode(trained)


def test_fingerprint_follows_the_tokenizer_not_the_folder(tmp_path, tiny_codebook_model, default_model_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(tiny_codebook_model, copy)
    tiny = tokenizer_fingerprint(load_tokenizer(tiny_codebook_model))
    assert tokenizer_fingerprint(load_tokenizer(copy)) == tiny
    assert tokenizer_fingerprint(load_tokenizer(default_model_path)) != tiny


@pytest.mark.parametrize("messages, problem", [
    ([], "non-empty"),
    ([{"role": "user", "content": "s0"}], "no assistant message"),
    ([{"role": "assistant", "content": "a0"}], "must follow a user message"),
    ([{"role": "user", "content": "s0"}, {"role": "assistant", "content": "a0"}, {"role": "user", "content": "s1"}],
     "last message must be the assistant's"),
    ([{"role": "user", "content": "s0"}, {"role": "assistant", "content": "a0"}, {"role": "assistant", "content": "a1"}],
     "alternate"),
    ([{"role": "user", "content": "s0"}, {"role": "system", "content": "x"}, {"role": "assistant", "content": "a0"}],
     "only the first message"),
    ([{"role": "user", "content": "s0"}, {"role": "tool", "content": "a0"}], "roles are"),
    ([{"role": "user", "content": "s0", "name": "x"}, {"role": "assistant", "content": "a0"}], "exactly the keys"),
    ([{"role": "user", "content": 3}, {"role": "assistant", "content": "a0"}], "must be a string"),
])
def test_message_structure_problems(messages, problem):
    assert problem in message_structure_problem(messages)


def test_well_formed_messages_pass():
    assert message_structure_problem([
        {"role": "system", "content": "rules"}, {"role": "user", "content": "s0"},
        {"role": "assistant", "content": "a0"}, {"role": "user", "content": "s1"}, {"role": "assistant", "content": "a1"},
    ]) is None


def test_reader_names_the_line_and_the_fix(tmp_path):
    good = json.dumps({"messages": [{"role": "user", "content": "s0"}, {"role": "assistant", "content": "a0"}]})
    path = tmp_path / "data.jsonl"
    path.write_text(good + "\n\n" + '{"messages": [}\n')
    with pytest.raises(ConversationFileError, match=r"data.jsonl:3: not valid JSON .*fix or delete the line"):
        read_conversations(path)
    path.write_text(good[:-1] + ', "sucess": true}\n')
    with pytest.raises(ConversationFileError, match=r":1: unknown key 'sucess'; valid keys: .*metadata"):
        read_conversations(path)
    path.write_text(good[:-1] + ', "token_ids": [1, 2]}\n')
    with pytest.raises(ConversationFileError, match="without loss_mask, tokenizer"):
        read_conversations(path)
    with pytest.raises(ConversationFileError, match="not found.*longhorizon collect"):
        read_conversations(tmp_path / "missing.jsonl")


def test_progress_bar():
    assert format_bar(0, 4, width=8) == "[........] 0/4"
    assert format_bar(3, 4, width=8) == "[######..] 3/4"
    assert format_bar(4, 4, width=8) == "[########] 4/4"
    stream = io.StringIO()  # not a terminal: a line per tenth of the way, not per update
    bar = ProgressBar("collect", 100, stream=stream)
    for done in range(101):
        bar.update(done, "| detail")
    bar.close()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 11 and lines[-1].startswith("collect [") and "100/100 | detail" in lines[-1]
