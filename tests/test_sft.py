"""`longhorizon sft`: the loss on hand-computed values, batching, bad input, and the learning check:
oracle play of the codebook env's train split takes a tiny random model past 90% held-out success,
and an RL run starts from the checkpoint it writes."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import trio
from safetensors.torch import load_file

from longhorizon.actor.collect import run_collect
from longhorizon.common.chat import HFChatTokenizer
from longhorizon.common.config import ConfigError, load_config
from longhorizon.common.metrics import read_metrics
from longhorizon.common.conversations import ConversationFileError, tokenize_conversation, tokenizer_fingerprint
from longhorizon.common.models import load_tokenizer
from longhorizon.launch.cli import main as cli_main
from longhorizon.launch.recipes.sft import run_sft
from longhorizon.learner.logprobs import Example
from longhorizon.learner.sft import load_sft_data, plan_sft_micro_batches, plan_steps, sft_loss
from longhorizon.learner.optimiser import learning_rate_at

REPO_ROOT = Path(__file__).resolve().parent.parent
SFT_CONFIG = REPO_ROOT / "configs" / "codebook-sft.toml"
VOCAB_SIZE = 15  # the tiny codebook model: 4 specials, 3 role words, 8 env words


# ---------------------------------------------------------------- the loss, by hand

def test_sft_loss_is_the_mean_nll_of_the_masked_tokens():
    logprobs = torch.log(torch.tensor([[0.5, 0.25, 0.1], [0.8, 0.9, 0.2]]))
    mask = torch.tensor([[0.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    # -(ln 0.25 + ln 0.1 + ln 0.8) / 3 = (1.386294 + 2.302585 + 0.223144) / 3
    assert sft_loss(logprobs, mask).item() == pytest.approx(1.304008, abs=1e-6)


def test_sft_loss_gradient_and_edge_cases():
    logprobs = torch.log(torch.tensor([[0.5, 0.25], [0.8, 0.9]])).requires_grad_()
    mask = torch.tensor([[1.0, 1.0], [0.0, 1.0]])
    sft_loss(logprobs, mask).backward()
    # d/d log p of -(sum of 3 masked log-probs)/3: -1/3 on masked tokens, 0 elsewhere.
    assert torch.allclose(logprobs.grad, torch.tensor([[-1 / 3, -1 / 3], [0.0, -1 / 3]]))
    # A -inf log-prob outside the mask (a padded position) must not poison the loss.
    padded = torch.tensor([[math.log(0.5), -math.inf]])
    assert sft_loss(padded, torch.tensor([[1.0, 0.0]])).item() == pytest.approx(math.log(2))
    empty = torch.zeros(1, 2, requires_grad=True)
    loss = sft_loss(empty, torch.zeros(1, 2))
    assert loss.item() == 0.0 and loss.requires_grad
    with pytest.raises(ValueError, match="differ in shape"):
        sft_loss(torch.zeros(1, 2), torch.zeros(2, 1))


def test_token_shares_make_micro_batches_add_up_to_the_step_mean():
    first = torch.log(torch.tensor([[0.5, 0.25, 0.1]]))
    second = torch.log(torch.tensor([[0.8, 0.4, 0.9]]))
    first_mask, second_mask = torch.tensor([[1.0, 1.0, 0.0]]), torch.tensor([[1.0, 1.0, 1.0]])
    whole = sft_loss(torch.cat([first, second]), torch.cat([first_mask, second_mask]))
    accumulated = sft_loss(first, first_mask) * 2 / 5 + sft_loss(second, second_mask) * 3 / 5
    assert accumulated.item() == pytest.approx(whole.item(), rel=1e-6)


def test_plan_steps_by_sequences_and_tokens():
    lengths = [5, 3, 8, 2]
    assert plan_steps(lengths, [2, 0, 1, 3], batch_sequences=2) == [[2, 0], [1, 3]]
    # 8 + 5 > 10 tokens: a new step; 5 + 3 fits; a third sequence does not (two per step).
    assert plan_steps(lengths, [2, 0, 1, 3], batch_sequences=2, batch_tokens=10) == [[2], [0, 1], [3]]
    assert plan_steps(lengths, [0, 1, 2, 3], batch_sequences=8, batch_tokens=4) == [[0], [1], [2], [3]]


def _example(tokens):
    ids = np.asarray(tokens, dtype=np.int64)
    return Example(token_ids=ids, loss_mask=np.ones(ids.size, np.float32),
                   behaviour_logprobs=np.zeros(ids.size, np.float32), advantage=0.0)


def test_sft_micro_batches_share_the_conversations_common_prefix():
    prompt = list(range(100, 120))  # 20 tokens every conversation starts with
    conversations = [_example(prompt + [1] * 3), _example(prompt + [2] * 5), _example(prompt + [3] * 4)]
    shared = plan_sft_micro_batches(conversations, max_sequences=8, max_tokens=10_000, share_prefix=True)
    assert [([len(e.token_ids) for e in chunk], prefix) for chunk, prefix in shared] == [([23, 24, 25], 20)]
    # Two per micro-batch: each shares its own members' prefix (both start with the prompt).
    pairs = plan_sft_micro_batches(conversations, max_sequences=2, max_tokens=10_000, share_prefix=True)
    assert sorted(prefix for _, prefix in pairs) == [0, 20] and sum(len(chunk) for chunk, _ in pairs) == 3
    plain = plan_sft_micro_batches(conversations, max_sequences=8, max_tokens=10_000, share_prefix=False)
    assert [prefix for _, prefix in plain] == [0] and len(plain[0][0]) == 3
    # Less than 16 tokens in common is not worth a pass of its own.
    short = [_example(prompt[:10] + [n] * 4) for n in range(3)]
    assert [prefix for _, prefix in plan_sft_micro_batches(short, 8, 10_000, share_prefix=True)] == [0]
    assert all(example.group is None for example in conversations)  # the caller's examples are left as they were


def test_learning_rate_warmup():
    assert [learning_rate_at(step, 1.0, 4) for step in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert learning_rate_at(0, 2e-5, 0) == 2e-5


# ---------------------------------------------------------------- data and bad input

def _reply(symbols_and_actions):
    messages = []
    for symbol, action in symbols_and_actions:
        messages += [{"role": "user", "content": symbol}, {"role": "assistant", "content": action}]
    return messages


@pytest.fixture
def tiny_tokenizer(tiny_codebook_model):
    hf_tokenizer = load_tokenizer(tiny_codebook_model)
    return HFChatTokenizer(hf_tokenizer), tokenizer_fingerprint(hf_tokenizer)


def _write(path, *records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def _load(path, tiny_tokenizer, **options):
    chat, fingerprint = tiny_tokenizer
    return load_sft_data([path], chat, fingerprint, vocab_size=options.pop("vocab_size", VOCAB_SIZE),
                         max_tokens=options.pop("max_tokens", 256), **options)


def test_stored_tokens_are_used_when_the_tokenizer_matches(tmp_path, tiny_tokenizer):
    chat, fingerprint = tiny_tokenizer
    messages = _reply([("s0", "a1"), ("s2", "a3")])
    stored = tokenize_conversation(chat, messages)
    matching = {"messages": messages, "token_ids": stored.token_ids, "loss_mask": stored.loss_mask,
                "tokenizer": {"fingerprint": fingerprint}}
    other = {**matching, "token_ids": [14] * len(stored.token_ids), "tokenizer": {"fingerprint": "sha256:other"}}
    plain = {"messages": messages}
    data = _load(_write(tmp_path / "d.jsonl", matching, other, plain), tiny_tokenizer)
    assert data.conversations == 3 and data.retokenized == 2
    for example in data.examples:  # the foreign ids were replaced by this model's tokenization
        assert example.token_ids.tolist() == stored.token_ids
        assert example.loss_mask.tolist() == stored.loss_mask
    assert data.assistant_tokens == 3 * 4  # two replies, each a word and its end-of-turn token


def test_a_malformed_line_is_an_error_naming_it(tmp_path, tiny_tokenizer):
    path = _write(tmp_path / "d.jsonl", {"messages": _reply([("s0", "a0")])}, '{"messages": [{"role": "user"')
    with pytest.raises(ConversationFileError, match=r"d.jsonl:2: not valid JSON.*fix or delete the line"):
        _load(path, tiny_tokenizer)


def test_token_ids_outside_the_vocabulary_are_an_error(tmp_path, tiny_tokenizer):
    chat, fingerprint = tiny_tokenizer
    messages = _reply([("s0", "a0")])
    stored = tokenize_conversation(chat, messages)
    record = {"messages": messages, "token_ids": stored.token_ids[:-1] + [5000], "loss_mask": stored.loss_mask,
              "tokenizer": {"fingerprint": fingerprint}}
    path = _write(tmp_path / "d.jsonl", record)
    with pytest.raises(ConversationFileError, match=r"d.jsonl:1: token id 5000 is outside the model's vocabulary of 15.*"
                                                    r"--model"):
        _load(path, tiny_tokenizer)


def test_no_assistant_tokens_is_an_error(tmp_path, tiny_tokenizer):
    chat, fingerprint = tiny_tokenizer
    only_prompts = _write(tmp_path / "prompts.jsonl", {"messages": [{"role": "user", "content": "s0"}]})
    with pytest.raises(ConversationFileError, match="prompts.jsonl:1: no assistant message: nothing to learn from"):
        _load(only_prompts, tiny_tokenizer)
    messages = _reply([("s0", "a0")])
    stored = tokenize_conversation(chat, messages)
    masked_out = {"messages": messages, "token_ids": stored.token_ids, "loss_mask": [0] * len(stored.token_ids),
                  "tokenizer": {"fingerprint": fingerprint}}
    with pytest.raises(ConversationFileError, match="no assistant token .loss_mask has no 1."):
        _load(_write(tmp_path / "masked.jsonl", masked_out), tiny_tokenizer)
    with pytest.raises(ConversationFileError, match="holds no conversations"):
        _load(_write(tmp_path / "empty.jsonl", ""), tiny_tokenizer)


def test_only_successful_and_length_limits(tmp_path, tiny_tokenizer):
    win = {"messages": _reply([("s0", "a1")]), "success": True}
    loss = {"messages": _reply([("s0", "a0")]), "success": False}
    data = _load(_write(tmp_path / "d.jsonl", win, loss, loss), tiny_tokenizer, only_successful=True)
    assert len(data.examples) == 1 and data.left_out_unsuccessful == 2
    with pytest.raises(ConversationFileError, match="none of the 1 conversations .* succeeded"):
        _load(_write(tmp_path / "losses.jsonl", loss), tiny_tokenizer, only_successful=True)
    with pytest.raises(ConversationFileError, match="no \"success\" field"):
        _load(_write(tmp_path / "plain.jsonl", {"messages": win["messages"]}), tiny_tokenizer, only_successful=True)
    with pytest.raises(ConversationFileError, match="more than actor.max_context_tokens = 4"):
        _load(_write(tmp_path / "long.jsonl", win), tiny_tokenizer, max_tokens=4)


def test_unknown_sft_key_is_a_config_error():
    with pytest.raises(ConfigError, match=r"unknown config key sft.epoch in \[sft\]; valid keys: .*epochs"):
        load_config(SFT_CONFIG, ["sft.epoch=3"])


def test_bad_input_loses_nothing(tmp_path, tiny_codebook_model, capsys):
    """A bad line stops the run before anything is written: the earlier run in the folder stays."""
    earlier = tmp_path / "codebook-sft" / "checkpoints" / "step_000010"
    earlier.mkdir(parents=True)
    (earlier / "model.safetensors").write_text("earlier weights")
    data = _write(tmp_path / "bad.jsonl", {"messages": _reply([("s0", "a0")])}, "not json")
    overrides = [f"run.output_dir={str(tmp_path)!r}", f"model.path={str(tiny_codebook_model)!r}",
                 f"sft.data=[{str(data)!r}]"]
    assert cli_main(["sft", str(SFT_CONFIG), *overrides]) == 2
    assert "bad.jsonl:2: not valid JSON" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl", "codebook-sft"]
    assert [p.name for p in (tmp_path / "codebook-sft").iterdir()] == ["checkpoints"]
    assert (earlier / "model.safetensors").read_text() == "earlier weights"
    with pytest.raises(ConfigError, match="sft.data is empty"):
        run_sft(load_config(SFT_CONFIG, [*overrides[:2], "sft.data=[]"]))
    with pytest.raises(ConfigError, match="learner.num_ranks=1"):
        run_sft(load_config(SFT_CONFIG, [*overrides, "learner.num_ranks=2"]))


def test_a_second_run_moves_the_first_aside(tmp_path, tiny_codebook_model):
    data = _write(tmp_path / "d.jsonl", {"messages": _reply([("s0", "a1"), ("s1", "a2")])})
    config = load_config(SFT_CONFIG, [
        f"run.output_dir={str(tmp_path)!r}", f"model.path={str(tiny_codebook_model)!r}", f"sft.data=[{str(data)!r}]",
        "sft.epochs=2", "sft.eval_episodes=0", "sft.eval_before=false",
    ])
    notes = []
    first = run_sft(config, note=notes.append)
    assert first["steps"] == 2 and "eval_after" not in first
    assert Path(first["checkpoint"]).name == "step_000002"
    run_sft(config, note=notes.append)
    kept = [p for p in tmp_path.iterdir() if p.name.startswith("codebook-sft.")]
    assert len(kept) == 1 and (kept[0] / "checkpoints" / "step_000002" / "model.safetensors").is_file()
    assert any("moved it to" in note for note in notes)
    assert json.loads((config.run_dir / "sft_summary.json").read_text())["conversations"] == 1


def test_sharing_the_system_prompt_trains_as_the_plain_pass_does(tmp_path, tiny_codebook_model):
    """A system prompt every conversation starts with is encoded once per micro-batch: the same
    losses step by step and the same weights as encoding each conversation whole, for fewer
    positions computed."""
    system = {"role": "system", "content": " ".join(["s0 s1 a2 a3"] * 6)}
    records = [{"messages": [system, *_reply([(f"s{n % 4}", f"a{(n + 1) % 4}"), (f"s{(n + 2) % 4}", f"a{n % 4}")])]}
               for n in range(6)]
    data = _write(tmp_path / "d.jsonl", *records)
    runs = {}
    for shared in (True, False):
        config = load_config(SFT_CONFIG, [
            f"run.output_dir={str(tmp_path / str(shared))!r}", f"model.path={str(tiny_codebook_model)!r}",
            f"sft.data=[{str(data)!r}]", "sft.epochs=2", "sft.batch_sequences=6", "learner.micro_batch_size=4",
            "sft.eval_episodes=0", "sft.eval_before=false", f"learner.shared_prefix={str(shared).lower()}",
        ])
        summary = run_sft(config, note=lambda line: None)
        runs[shared] = (read_metrics(config.run_dir, required=True), load_file(Path(summary["checkpoint"]) / "model.safetensors"))
    (shared_records, shared_weights), (plain_records, plain_weights) = runs[True], runs[False]
    assert [r["sft_loss"] for r in shared_records] == pytest.approx([r["sft_loss"] for r in plain_records], rel=1e-4)
    for name, weight in plain_weights.items():
        torch.testing.assert_close(shared_weights[name], weight, rtol=1e-3, atol=1e-4)
    for shared_record, plain_record in zip(shared_records, plain_records):
        assert shared_record["sequence_tokens"] == plain_record["sequence_tokens"]
        assert shared_record["computed_tokens"] < 0.7 * plain_record["computed_tokens"]


# ---------------------------------------------------------------- the learning check

@pytest.fixture(scope="module")
def oracle_sft_run(tmp_path_factory, tiny_codebook_model):
    """Oracle play of 64 train tasks -> SFT of the tiny random model, evaluated on the test split."""
    folder = tmp_path_factory.mktemp("sft")
    data = folder / "oracle.jsonl"
    config = load_config(SFT_CONFIG, [
        f"run.output_dir={str(folder)!r}", f"model.path={str(tiny_codebook_model)!r}", f"sft.data=[{str(data)!r}]",
        "sft.epochs=12", "sft.eval_episodes=200",
    ])
    collected = run_collect(config, output=data, episodes=64, on_note=lambda line: None)
    summary = run_sft(config, note=lambda line: None)
    return config, data, collected, summary


@pytest.mark.slow
def test_sft_on_oracle_play_generalises_to_held_out_tasks(oracle_sft_run):
    from longhorizon.actor.engines.base import make_engine
    from longhorizon.actor.evaluate import greedy, play_tasks
    from longhorizon.actor.worker import engine_settings
    from longhorizon.envs.base import list_tasks
    from longhorizon.envs.toy.codebook import task_symbols

    config, data, collected, summary = oracle_sft_run
    assert collected.written == 64 and collected.successful == 64
    assert summary["eval_before"]["success_rate"] < 0.2
    assert summary["eval_after"]["episodes"] == 200 and summary["eval_after"]["failed_episodes"] == 0
    assert summary["eval_after"]["success_rate"] > 0.9
    assert summary["final_loss"] < summary["first_loss"] / 10

    # Held out: the test split's task ids never appear in the data. The codebook itself is shared
    # by every task (it is what is learned); with 4 symbols and 3 turns there are only 64 symbol
    # sequences, so the test tasks whose sequence the data never showed are checked on their own.
    options = dict(config.env.options)
    trained_ids = {json.loads(line)["task_id"] for line in data.read_text().splitlines()}
    test_tasks = list_tasks("codebook", "test", **options)
    assert trained_ids and not trained_ids & {task.task_id for task in test_tasks}
    seen = {tuple(task_symbols(task_id, options["num_turns"], options["num_symbols"])) for task_id in trained_ids}
    unseen = [task for task in test_tasks if tuple(task.data["symbols"]) not in seen]
    assert len(unseen) >= 30
    engine = make_engine("hf", greedy(engine_settings(config, summary["checkpoint"])))
    records = trio.run(lambda: play_tasks(engine, "codebook", options, unseen, samples=1, horizon_cap=3,
                                          max_new_tokens=1))
    success = sum(record.success for record in records) / len(records)
    print(f"held-out greedy success: before {summary['eval_before']['success_rate']:.1%}, after "
          f"{summary['eval_after']['success_rate']:.1%}; on {len(unseen)} unseen symbol sequences {success:.1%}")
    assert success > 0.9


@pytest.mark.slow
def test_an_rl_run_starts_from_the_sft_checkpoint(oracle_sft_run, tmp_path):
    from longhorizon.common.metrics import read_metrics
    from longhorizon.launch.launchers.local import train_in_process
    from longhorizon.learner.checkpoint import latest_checkpoint

    _, _, _, summary = oracle_sft_run
    checkpoint = Path(summary["checkpoint"])
    assert {"model.safetensors", "config.json", "tokenizer.json", "longhorizon_sft.json"} <= {
        p.name for p in checkpoint.iterdir()}
    assert not (checkpoint / "state.pt").exists()  # a start for new runs, never resumed as an RL step
    config = load_config(REPO_ROOT / "configs" / "codebook.toml", [
        f"run.output_dir={str(tmp_path)!r}", f"model.path={str(checkpoint)!r}", "run.total_steps=2",
        "actor.num_actors=1", "learner.groups_per_step=4", "actor.concurrent_groups=4", "learner.checkpoint_every=1",
    ])
    trio.run(train_in_process, config)
    records = read_metrics(config.run_dir)
    assert [record["step"] for record in records] == [1, 2]
    # The SFT model plays the RL format at once: sampled (temperature 1) episodes mostly succeed.
    assert np.mean([record["success_rate"] for record in records]) > 0.7
    assert latest_checkpoint(config.run_dir).name == "step_000002"
