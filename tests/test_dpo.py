"""DPO: the loss on a pair against hand-computed values, pairs built from groups and read from
files, bad input, and the learning check: DPO on sampled episodes of the codebook env raises the
held-out success of the model that sampled them."""

import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from longhorizon.common.chat import HFChatTokenizer
from longhorizon.common.config import ConfigError, load_config
from longhorizon.common.conversations import ConversationFileError, tokenizer_fingerprint
from longhorizon.common.models import load_tokenizer
from longhorizon.common.preference_pairs import pair_line, read_preference_pairs
from longhorizon.launch.cli import main as cli_main
from longhorizon.launch.recipes.dpo import run_dpo
from longhorizon.learner.dpo import (
    chosen_nll,
    dpo_loss,
    last_epoch_means,
    load_dpo_data,
    pairs_from_groups,
    plan_pair_micro_batches,
    sequence_logprobs,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
DPO_CONFIG = REPO_ROOT / "configs" / "codebook-dpo.toml"
SFT_CONFIG = REPO_ROOT / "configs" / "codebook-sft.toml"


def test_dpo_loss_on_one_pair_by_hand():
    # Policy log-likelihoods -3 (chosen) and -5 (rejected); reference -4 and -4; beta 0.5:
    # margin = 0.5 * ((-3 + 4) - (-5 + 4)) = 1, loss = -log sigmoid(1) = log(1 + e^-1).
    chosen = torch.tensor([-3.0], requires_grad=True)
    rejected = torch.tensor([-5.0], requires_grad=True)
    loss, metrics = dpo_loss(chosen, rejected, torch.tensor([-4.0]), torch.tensor([-4.0]), beta=0.5)
    assert float(loss.detach()) == pytest.approx(math.log(1 + math.exp(-1)))
    assert metrics == {"reward_margin": pytest.approx(1.0), "preference_accuracy": 1.0}
    loss.backward()
    # d loss / d chosen = -beta * sigmoid(-margin); the rejected gradient is its opposite.
    expected = -0.5 / (1 + math.exp(1))
    assert float(chosen.grad) == pytest.approx(expected)
    assert float(rejected.grad) == pytest.approx(-expected)
    with pytest.raises(ValueError, match="beta must be positive"):
        dpo_loss(chosen, rejected, chosen, rejected, beta=0)


def test_final_figures_are_the_last_epochs_pair_weighted_means():
    # Epoch 2 has a full step of 16 pairs at accuracy 1.0 and a 2-pair remainder at 0.5:
    # (16 * 1.0 + 2 * 0.5) / 18 = 17 / 18; epoch 1's steps do not count.
    records = [{"epoch": 1, "train_pairs": 16, "preference_accuracy": 0.0},
               {"epoch": 1, "train_pairs": 2, "preference_accuracy": 0.0},
               {"epoch": 2, "train_pairs": 16, "preference_accuracy": 1.0},
               {"epoch": 2, "train_pairs": 2, "preference_accuracy": 0.5}]
    assert last_epoch_means(records, ["preference_accuracy"]) == {"preference_accuracy": pytest.approx(17 / 18)}


def test_sequence_logprobs_count_only_generated_tokens():
    logprobs = torch.tensor([[-1.0, -2.0, -float("inf"), -4.0]])
    mask = torch.tensor([[1, 1, 0, 1]])
    assert float(sequence_logprobs(logprobs, mask)) == -7.0


def _member(task, reward, error=""):
    return SimpleNamespace(task_id=task, reward=reward, error=error, loss_mask=np.ones(3))


def test_pairs_take_the_best_and_worst_of_groups_that_differ():
    groups = [
        SimpleNamespace(trajectories=[_member("a", 0.0), _member("a", 1.0), _member("a", 0.5)]),
        SimpleNamespace(trajectories=[_member("b", 1.0), _member("b", 1.0)]),  # flat: no pair
        SimpleNamespace(trajectories=[_member("c", 1.0), _member("c", 0.0, error="env crashed")]),  # one usable
    ]
    [pair] = pairs_from_groups(groups)
    assert pair.task_id == "a" and pair.chosen.reward == 1.0 and pair.rejected.reward == 0.0
    assert pair.reward_margin == 1.0


def test_chosen_nll_by_hand():
    # Chosen log-likelihoods -3 over 2 tokens and -2 over 4: (1.5 + 0.5) / 2 = 1.
    assert float(chosen_nll(torch.tensor([-3.0, -2.0]), torch.tensor([2.0, 4.0]))) == pytest.approx(1.0)


def test_pair_micro_batches_keep_pairs_together_and_sort_by_length():
    # Two sequences per pair, so 4 sequences hold two pairs, shortest first.
    assert plan_pair_micro_batches([10, 3, 7, 5], max_sequences=4, max_tokens=1000) == [[1, 3], [2, 0]]
    # Tokens: pairs 1, 3, 2 padded to 7 are 2 x 3 x 7 = 42; adding pair 0 would make 2 x 4 x 10 = 80.
    assert plan_pair_micro_batches([10, 3, 7, 5], max_sequences=8, max_tokens=42) == [[1, 3, 2], [0]]
    assert plan_pair_micro_batches([10, 3, 7, 5], max_sequences=8, max_tokens=41) == [[1, 3], [2, 0]]
    assert plan_pair_micro_batches([50, 3], max_sequences=1, max_tokens=10) == [[1], [0]]  # one pair at least


# ---------------------------------------------------------------- data and bad input

def _conversation(*replies, symbols=("s0", "s1", "s2")):
    messages = []
    for symbol, reply in zip(symbols, replies):
        messages += [{"role": "user", "content": symbol}, {"role": "assistant", "content": reply}]
    return messages


def _episode(task_id, reward, *replies, symbols=("s0", "s1", "s2")):
    return {"messages": _conversation(*replies, symbols=symbols), "task_id": task_id, "reward": reward}


def _write(path, *lines):
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


@pytest.fixture
def tiny_tokenizer(tiny_codebook_model):
    hf_tokenizer = load_tokenizer(tiny_codebook_model)
    return HFChatTokenizer(hf_tokenizer), tokenizer_fingerprint(hf_tokenizer)


def _load(tiny_tokenizer, episodes=(), pairs=()):
    chat, fingerprint = tiny_tokenizer
    return load_dpo_data(list(episodes), list(pairs), chat, fingerprint, vocab_size=15, max_tokens=256)


def test_episodes_of_one_task_pair_best_against_worst(tmp_path, tiny_tokenizer):
    path = _write(
        tmp_path / "samples.jsonl",
        _episode("t1", 1 / 3, "a1", "a0", "a0"), _episode("t1", 1.0, "a1", "a2", "a3"),
        _episode("t1", 0.0, "a0", "a0", "a0"),
        _episode("t2", 0.0, "a0", "a0", "a0"), _episode("t2", 0.0, "a1", "a1", "a1"),  # equal rewards: no pair
        _episode("t3", 1.0, "a1", "a2", "a3", symbols=("s0", "s1", "s2")),
        _episode("t3", 0.0, "a1", "a2", "a3", symbols=("s3", "s1", "s2")),  # another first observation: no pair
    )
    data = _load(tiny_tokenizer, episodes=[path])
    assert (data.episodes, data.episode_groups, data.pairs_from_episodes) == (7, 4, 1)
    [pair] = data.pairs
    assert pair.task_id == "t1" and pair.where == f"{path}:2 over {path}:3"
    chat, _ = tiny_tokenizer
    replies = [t for t, m in zip(pair.chosen.token_ids, pair.chosen.loss_mask) if m and t != chat.eos_token_id]
    assert [chat.decode([token]).strip() for token in replies] == ["a1", "a2", "a3"]


def test_no_pair_with_different_rewards_is_a_clear_error(tmp_path, tiny_tokenizer):
    flat = _write(tmp_path / "flat.jsonl", _episode("t1", 0.0, "a0", "a0", "a0"), _episode("t1", 0.0, "a1", "a1", "a1"),
                  _episode("t2", 1.0, "a1", "a2", "a3"))
    with pytest.raises(ConversationFileError, match=r"no pair in .*flat.jsonl: of 2 tasks, 1 have two or more episodes "
                                                    r"and none of those has two with different rewards.*--tasks 64"):
        _load(tiny_tokenizer, episodes=[flat])
    no_reward = _write(tmp_path / "plain.jsonl", {"messages": _conversation("a0", "a0", "a0"), "task_id": "t1"})
    with pytest.raises(ConversationFileError, match=r"plain.jsonl:1: no reward: .* dpo.pairs"):
        _load(tiny_tokenizer, episodes=[no_reward])


def test_collect_plays_a_few_tasks_several_times_for_pairs(tmp_path, tiny_codebook_model, capsys):
    from longhorizon.actor.collect import run_collect

    config = load_config(SFT_CONFIG, [f"model.path={str(tiny_codebook_model)!r}"])
    output = tmp_path / "few.jsonl"
    run_collect(config, output=output, episodes=7, max_tasks=3, first_task=1998, on_note=lambda line: None)
    lines = sorted((json.loads(line) for line in output.read_text().splitlines()), key=lambda line: line["episode"])
    # Tasks 1998, 1999 and (wrapping round) 0 of the 2000-task train split, in turn.
    assert [line["task_id"] for line in lines] == ["train-1998", "train-1999", "train-0"] * 2 + ["train-1998"]
    assert cli_main(["collect", str(SFT_CONFIG), f"model.path={str(tiny_codebook_model)!r}", "--tasks", "2",
                     "--episodes", "4", "--output", str(tmp_path / "cli.jsonl")]) == 0
    assert sorted(json.loads(line)["task_id"] for line in (tmp_path / "cli.jsonl").read_text().splitlines()) == [
        "train-0", "train-0", "train-1", "train-1"]
    assert cli_main(["collect", str(SFT_CONFIG), "--tasks", "-1", "--output", str(tmp_path / "bad.jsonl")]) == 2
    assert "--tasks must be >= 0" in capsys.readouterr().err


def test_pair_files_are_read_and_checked_line_by_line(tmp_path, tiny_tokenizer):
    good = pair_line({"messages": _conversation("a1", "a2", "a3")}, {"messages": _conversation("a0", "a2", "a0")},
                     task_id="t9")
    path = _write(tmp_path / "pairs.jsonl", good.strip(), "")
    [record] = read_preference_pairs(path)
    assert record.task_id == "t9" and record.where == f"{path}:1"
    data = _load(tiny_tokenizer, pairs=[path])
    assert data.pairs_from_files == 1 and data.retokenized == 2 and data.pairs[0].task_id == "t9"

    chosen, rejected = {"messages": _conversation("a1", "a2", "a3")}, {"messages": _conversation("a0", "a2", "a0")}
    bad_lines = [
        ('{"chosen": ', r"bad.jsonl:1: not valid JSON"),
        ('[1, 2]', r"expected a JSON object, got list"),
        ({"chosen": chosen, "rejected": rejected, "score": 1}, r"unknown key 'score'; valid keys: chosen, rejected, "
                                                               r"task_id, metadata"),
        ({"messages": chosen["messages"], "reward": 1.0}, r"unknown key .*looks like a conversation-file line: list "
                                                          r"such files in dpo.data"),
        ({"chosen": chosen}, r'no "rejected"'),
        ({"chosen": chosen, "rejected": {"messages": [{"role": "user", "content": "s0"}]}},
         r"bad.jsonl:1: rejected: no assistant message"),
        ({"chosen": {**chosen, "reward": "high"}, "rejected": rejected}, r"bad.jsonl:1: chosen: reward must be"),
        ({"chosen": chosen, "rejected": {"messages": _conversation("a0", "a2", "a0", symbols=("s3", "s1", "s2"))}},
         r"different prompts"),
        ({"chosen": chosen, "rejected": chosen}, r"the same conversation"),
        ({"chosen": chosen, "rejected": rejected, "task_id": 7}, r"task_id must be a string"),
    ]
    for line, message in bad_lines:
        with pytest.raises(ConversationFileError, match=message):
            read_preference_pairs(_write(tmp_path / "bad.jsonl", line))
    with pytest.raises(ConversationFileError, match="holds no pairs"):
        _load(tiny_tokenizer, pairs=[_write(tmp_path / "empty.jsonl", "")])
    with pytest.raises(ConversationFileError, match="preference-pair file not found"):
        read_preference_pairs(tmp_path / "missing.jsonl")


def test_unknown_or_bad_dpo_keys_are_config_errors(tmp_path, tiny_codebook_model):
    with pytest.raises(ConfigError, match=r"unknown config key dpo.bta in \[dpo\]; valid keys: .*beta"):
        load_config(DPO_CONFIG, ["dpo.bta=0.5"])
    base = [f"run.output_dir={str(tmp_path)!r}", f"model.path={str(tiny_codebook_model)!r}"]
    for override, message in [
        ("dpo.data=[]", "dpo.data and dpo.pairs are both empty"),
        ("dpo.beta=0", "dpo.beta must be > 0, got 0"),
        ("dpo.batch_pairs=0", "dpo.batch_pairs must be >= 1, got 0"),
        ("learner.num_ranks=2", "learner.num_ranks=1"),
    ]:
        with pytest.raises(ConfigError, match=message):
            run_dpo(load_config(DPO_CONFIG, [*base, override]))


def test_dpo_run_starts_at_log_2_and_writes_a_checkpoint(tmp_path, tiny_codebook_model, capsys):
    samples = _write(tmp_path / "samples.jsonl",
                     _episode("t1", 1.0, "a1", "a2", "a3"), _episode("t1", 0.0, "a0", "a0", "a0"),
                     _episode("t2", 2 / 3, "a1", "a2", "a0", symbols=("s1", "s1", "s2")),
                     _episode("t2", 1 / 3, "a1", "a0", "a0", symbols=("s1", "s1", "s2")))
    overrides = [f"run.output_dir={str(tmp_path)!r}", f"model.path={str(tiny_codebook_model)!r}",
                 f"dpo.data=[{str(samples)!r}]", "dpo.epochs=2", "dpo.batch_pairs=2", "dpo.eval_episodes=0",
                 "dpo.eval_before=false", "dpo.learning_rate=1e-2", "learner.micro_batch_size=2"]
    summary = run_dpo(load_config(DPO_CONFIG, overrides), note=lambda line: None)
    # The reference is the starting model: the first step's margin is 0 and the loss log 2.
    assert summary["first_loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert summary["pairs"] == 2 and summary["steps"] == 2 and summary["final_loss"] < math.log(2)
    checkpoint = Path(summary["checkpoint"])
    assert checkpoint.name == "step_000002" and (checkpoint / "model.safetensors").is_file()
    assert json.loads((checkpoint / "longhorizon_dpo.json").read_text())["pairs"] == 2
    metrics = [json.loads(line) for line in (tmp_path / "codebook-dpo" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2] and {"dpo_loss", "reward_margin", "chosen_nll"} <= set(metrics[0])
    # Bad input through the command: one clear line, exit code 2.
    bad = _write(tmp_path / "bad.jsonl", "not json")
    assert cli_main(["dpo", str(DPO_CONFIG), *overrides[:2], "dpo.data=[]", f"dpo.pairs=[{str(bad)!r}]"]) == 2
    assert "bad.jsonl:1: not valid JSON" in capsys.readouterr().err


# ---------------------------------------------------------------- the learning checks

def _start_checkpoint(folder, model, env_overrides, conversations, epochs):
    """A partly trained start: SFT of the tiny random model on a little oracle play."""
    from longhorizon.actor.collect import run_collect
    from longhorizon.launch.recipes.sft import run_sft

    data = folder / "oracle.jsonl"
    config = load_config(SFT_CONFIG, [
        f"run.output_dir={str(folder)!r}", f"model.path={str(model)!r}", f"sft.data=[{str(data)!r}]",
        f"sft.epochs={epochs}", "sft.eval_episodes=0", "sft.eval_before=false", *env_overrides])
    run_collect(config, output=data, episodes=conversations, on_note=lambda line: None)
    # Episodes are written as they end; in episode order the start is the same model every time.
    lines = sorted(data.read_text().splitlines(), key=lambda line: json.loads(line)["episode"])
    data.write_text("\n".join(lines) + "\n")
    return run_sft(config, note=lambda line: None)["checkpoint"]


def _sample_and_train(folder, start, env_overrides, *, tasks, episodes, dpo_overrides):
    """Sample `episodes` episodes of the first `tasks` train tasks with the start at temperature 1,
    then DPO on their best-against-worst pairs; returns the summary."""
    from longhorizon.actor.collect import run_collect

    samples = folder / "samples.jsonl"
    config = load_config(DPO_CONFIG, [
        f"run.output_dir={str(folder)!r}", f"model.path={str(start)!r}", f"dpo.data=[{str(samples)!r}]",
        *env_overrides, *dpo_overrides])
    run_collect(config, output=samples, episodes=episodes, max_tasks=tasks, on_note=lambda line: None)
    return run_dpo(config, note=lambda line: None)


@pytest.mark.slow
def test_dpo_on_sampled_pairs_raises_held_out_success(tmp_path, tiny_codebook_model):
    """Three turns: a start at 9% greedy held-out success samples 8 episodes of each of 256 train
    tasks at temperature 1; DPO (with the chosen-NLL term, configs/codebook-dpo.toml) on the ~240
    pairs raises it. Measured: 100% with six sampling seeds and in two more runs, but 24.5% in one
    CI run (234 pairs, training preference accuracy 1.0, 2026-12-01): greedy success moves in
    steps as whole symbols come right, so the test asks for a rise of 10 points, not for 100%.
    The preference accuracy is the last epoch's (a run of 242 pairs in batches of 16 ended on a
    2-pair step at 0.5 while held-out success went 9% -> 100%)."""
    start = _start_checkpoint(tmp_path, tiny_codebook_model, [], conversations=64, epochs=3)
    summary = _sample_and_train(tmp_path, start, [], tasks=256, episodes=2048, dpo_overrides=[])
    before, after = summary["eval_before"], summary["eval_after"]
    print(f"dpo on {summary['pairs']} pairs: held-out greedy success {before['success_rate']:.1%} -> "
          f"{after['success_rate']:.1%}")
    assert summary["pairs"] >= 200 and after["failed_episodes"] == 0
    assert before["success_rate"] < 0.5
    assert after["success_rate"] > before["success_rate"] + 0.1
    assert summary["final_preference_accuracy"] > 0.5


@pytest.mark.slow
def test_the_dpo_loss_alone_learns_a_one_turn_codebook(tmp_path, tiny_codebook_model):
    """One turn (a bandit: each pair is a right and a wrong answer to one symbol): DPO without the
    NLL term teaches a start that answers no symbol right at least one of the four (held-out success
    moves in steps of about 25%; measured 24.5-100% over twelve sampling seeds)."""
    one_turn = ["env.options={num_turns = 1, num_symbols = 4, num_actions = 4}", "horizon.stages=[1]"]
    start = _start_checkpoint(tmp_path, tiny_codebook_model, one_turn, conversations=16, epochs=3)
    summary = _sample_and_train(tmp_path, start, one_turn, tasks=64, episodes=512, dpo_overrides=["dpo.nll_coef=0"])
    print(f"one-turn dpo on {summary['pairs']} pairs: {summary['eval_before']['success_rate']:.1%} -> "
          f"{summary['eval_after']['success_rate']:.1%}")
    assert summary["eval_before"]["success_rate"] < 0.1
    assert summary["eval_after"]["success_rate"] > 0.2
