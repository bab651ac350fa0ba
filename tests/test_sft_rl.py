"""`longhorizon experiment sft-rl`: the base model, SFT on oracle play, RL from there, each
evaluated on held-out tasks that nothing trained on."""

import json
from pathlib import Path

import pytest

from longhorizon.common.config import ConfigError, load_config
from longhorizon.launch.recipes.experiment_sft_rl import (
    against_sft, check_sft_rl_config, format_table, held_out_overlap, pooled_entry, run_sft_rl, wilson_entry)

REPO_ROOT = Path(__file__).resolve().parent.parent
HELD_OUT = "env.options={num_turns = 3, num_symbols = 4, num_actions = 4, held_out_sequences = true}"


def _config(tmp_path, model, *overrides):
    """RL after SFT at a tenth of SFT's learning rate, warmed up: at the codebook config's 2e-3
    (made to learn from scratch), training success from the SFT checkpoint fell within 4-8 steps
    in 3 of 7 runs of 16 steps (to 74%, 72% and 20%; held out once 46% after 4 steps), at 3e-4
    with a 4-step warm-up it stayed at 91% or more in 4 of 4 (2026-12-02)."""
    return load_config(REPO_ROOT / "configs" / "codebook.toml", [
        f"run.output_dir={str(tmp_path)!r}", "run.name='sft-rl'", f"model.path={str(model)!r}", HELD_OUT,
        "sft_rl.oracle_episodes=256", "sft_rl.eval_episodes=100", "sft.epochs=3", "sft.learning_rate=3e-3",
        "sft.batch_sequences=16", "run.total_steps=4", "learner.checkpoint_every=2",
        "learner.learning_rate=3e-4", "learner.warmup_steps=4",
        # One actor process: the recipe's phases are under test, not the actors' number. The
        # evaluations and SFT on one thread, as every other process of the suite (they take every
        # core otherwise, which on the suite's busy cores only adds threads waiting on each other).
        "actor.num_actors=1", "sft_rl.torch_threads=1", *overrides,
    ])


def test_splits_that_share_tasks_are_refused(tmp_path, tiny_codebook_model):
    # The default codebook draws both splits from the same 64 sequences: most test tasks leak.
    leaky = load_config(REPO_ROOT / "configs" / "codebook.toml", [f"run.output_dir={str(tmp_path)!r}"])
    assert held_out_overlap(leaky)
    with pytest.raises(ConfigError, match="also in env.train_split"):
        check_sft_rl_config(leaky)
    with pytest.raises(ConfigError, match="both 'train'"):
        check_sft_rl_config(load_config(None, ["env.eval_split='train'"]))
    config = _config(tmp_path, tiny_codebook_model)
    assert held_out_overlap(config) == []
    check_sft_rl_config(config)
    with pytest.raises(ConfigError, match="no scripted policy 'expert'"):
        check_sft_rl_config(_config(tmp_path, tiny_codebook_model, "sft_rl.oracle_policy='expert'"))
    with pytest.raises(ConfigError, match="the RL phase trains a model: set actor.engine to an engine that samples"):
        check_sft_rl_config(_config(tmp_path, tiny_codebook_model, "actor.engine='scripted'"))


@pytest.mark.parametrize("name", ["quickstart.toml", "textcraft-sft-rl.toml", "textcraft-rl-over-sft.toml"])
def test_the_shipped_textcraft_configs_hold_out_their_goals(name):
    config = load_config(REPO_ROOT / "configs" / name)
    check_sft_rl_config(config)
    from longhorizon.envs.base import list_tasks

    options = dict(config.env.options)
    held_out = {t.data["goal"] for t in list_tasks("textcraft", config.env.eval_split, **options)}
    # Every goal of any depth in the train split: RL and the oracle data draw from it.
    trained = {t.data["goal"] for t in list_tasks("textcraft", config.env.train_split, min_depth=1, max_depth=4)}
    assert held_out and not held_out & trained


def test_the_shipped_web_config_holds_out_its_pages_and_its_oracles_solve_every_type():
    from longhorizon.envs.base import list_tasks, get_env_spec
    from longhorizon.envs.web.miniwob import ORACLE_TASKS

    config = load_config(REPO_ROOT / "configs" / "web-rl-over-sft.toml")
    check_sft_rl_config(config)
    options = dict(config.env.options)
    held_out = list_tasks("miniwob", config.env.eval_split, **options)
    trained = list_tasks("miniwob", config.env.train_split, **options)
    assert len(held_out) == config.sft_rl.eval_episodes  # every held-out page is played
    assert not {(t.data["task"], t.data["seed"]) for t in held_out} & {(t.data["task"], t.data["seed"]) for t in trained}
    assert set(options["task_names"]) <= set(ORACLE_TASKS) and config.sft_rl.oracle_policy in get_env_spec("miniwob").policies
    assert config.sft_rl.oracle_episodes == len(trained)  # each train page once


def test_the_oracle_data_of_textcraft_never_names_a_held_out_goal(tmp_path, default_model_path):
    """Every train goal of depth 1-2 played by the oracle, as the sft-rl experiment collects it."""
    import re

    from longhorizon.actor.collect import run_collect
    from longhorizon.envs.base import list_tasks

    config = load_config(REPO_ROOT / "configs" / "textcraft-sft-rl.toml", [
        "actor.engine='scripted'", "actor.scripted_policy='oracle'", f"model.path={str(default_model_path)!r}"])
    output = tmp_path / "oracle.jsonl"
    summary = run_collect(config, output=output, on_note=lambda line: None)
    assert summary.written == summary.successful == 337
    goals = set()
    for line in output.read_text().splitlines():
        first_observation = next(m["content"] for m in json.loads(line)["messages"] if m["role"] == "user")
        goals.add(re.search(r"Goal: craft (.+)\.", first_observation).group(1))
    held_out = {t.data["goal"].split(":")[-1].replace("_", " ")
                for t in list_tasks("textcraft", "test", **dict(config.env.options))}
    assert len(goals) == 337 and len(held_out) == 84 and not goals & held_out


def test_wilson_entry_counts_the_episodes_played():
    entry = wilson_entry({"episodes": 12, "failed_episodes": 2, "success_rate": 0.5, "mean_reward": 0.5})
    assert (entry["played"], entry["successes"]) == (10, 5)
    assert entry["wilson_low"] == pytest.approx(0.2366, abs=1e-4) and entry["wilson_high"] == pytest.approx(0.7634, abs=1e-4)


@pytest.mark.slow
def test_each_phase_improves_on_held_out_sequences_it_never_trained_on(tmp_path, tiny_codebook_model):
    config = _config(tmp_path, tiny_codebook_model)
    lines = []
    summary = run_sft_rl(config, note=lines.append)
    print(format_table(summary))
    phases = summary["phases"]
    assert list(phases) == ["base", "sft", "rl"]
    assert phases["base"]["success_rate"] < 0.2
    assert phases["sft"]["success_rate"] > phases["base"]["success_rate"] + 0.3
    assert phases["rl"]["success_rate"] >= phases["sft"]["success_rate"] - 0.1  # 4 RL steps: kept, not lost
    for entry in phases.values():
        assert entry["played"] == 100 and entry["wilson_low"] - 1e-9 <= entry["success_rate"] <= entry["wilson_high"] + 1e-9
    run_dir = config.run_dir
    assert phases["rl"]["model"].startswith(str(run_dir / "rl" / "checkpoints"))
    assert phases["sft"]["model"].startswith(str(run_dir / "sft" / "checkpoints"))
    assert json.loads((run_dir / "summary.json").read_text())["phases"] == phases
    assert (run_dir / "held_out.png").stat().st_size > 0
    # Nothing trained on a held-out sequence: not the oracle data, not the RL run's episodes.
    held_out = {" ".join(t) for t in _sequences(config, "test")}
    oracle = [json.loads(line) for line in (run_dir / "oracle.jsonl").read_text().splitlines()]
    assert len(oracle) == 256 and all(line["split"] == "train" for line in oracle)
    shown = {" ".join(m["content"] for m in line["messages"] if m["role"] == "user") for line in oracle}
    assert shown and not shown & held_out
    rl_config = load_config(run_dir / "rl" / "config.toml")
    assert rl_config.model.path == phases["sft"]["model"] and rl_config.env.train_split == "train"
    table = format_table(summary)
    assert "| rl |" in table and "rl against sft: " in table
    assert summary["against_sft"]["rl"]["difference"] == pytest.approx(
        phases["rl"]["success_rate"] - phases["sft"]["success_rate"])
    assert any(line.startswith("steps 4 (last 4)") for line in lines)  # the RL run's report


@pytest.mark.slow
def test_the_sft_checkpoint_may_go_unevaluated(tmp_path, tiny_codebook_model):
    """SFT trains, RL starts from its checkpoint, and only RL's is played. The base model goes
    unevaluated too: its evaluation (a process of its own) is the test above's."""
    config = _config(tmp_path, tiny_codebook_model, "sft_rl.eval_sft=false", "sft_rl.eval_base=false",
                     "sft_rl.oracle_episodes=32", "sft.epochs=1", "run.total_steps=1", "sft_rl.eval_episodes=20")
    summary = run_sft_rl(config, note=lambda line: None)
    assert list(summary["phases"]) == ["rl"] and summary["sft"]["sft_steps"] == 2
    assert load_config(config.run_dir / "rl" / "config.toml").model.path == summary["sft"]["model"]
    table = format_table(summary)
    assert "| sft | not evaluated |" in table and table.index("| sft | not evaluated |") < table.index("| rl |")


def test_sampled_evaluations_and_several_seeds_are_checked(tmp_path, tiny_codebook_model):
    with pytest.raises(ConfigError, match="plays each task alike when greedy"):
        check_sft_rl_config(_config(tmp_path, tiny_codebook_model, "sft_rl.eval_samples=4"))
    with pytest.raises(ConfigError, match="sft_rl.eval_temperature must be >= 0, got -1.0"):
        check_sft_rl_config(_config(tmp_path, tiny_codebook_model, "sft_rl.eval_temperature=-1.0"))
    with pytest.raises(ConfigError, match="distinct integers"):
        check_sft_rl_config(_config(tmp_path, tiny_codebook_model, "sft_rl.rl_seeds=[1, 1]"))
    with pytest.raises(ConfigError, match="sft_rl.sft_checkpoint: .*nowhere"):
        check_sft_rl_config(_config(tmp_path, tiny_codebook_model, "sft_rl.sft_checkpoint='nowhere'"))
    with pytest.raises(ConfigError, match=r"sft_rl.sft_temperatures must be numbers >= 0 \(0: greedy\), got \[-0.5\]"):
        check_sft_rl_config(_config(tmp_path, tiny_codebook_model, "sft_rl.sft_temperatures=[-0.5]"))
    with pytest.raises(ConfigError, match=r"sft_rl.rl_temperatures \[0.5, 0.5\] repeats a temperature"):
        check_sft_rl_config(_config(tmp_path, tiny_codebook_model, "sft_rl.rl_temperatures=[0.5, 0.5]"))
    with pytest.raises(ConfigError, match="repeats a temperature"):
        check_sft_rl_config(_config(tmp_path, tiny_codebook_model, "sft_rl.sft_temperatures=[0]"))  # greedy anyway
    check_sft_rl_config(_config(tmp_path, tiny_codebook_model, "sft_rl.eval_samples=4", "sft_rl.eval_temperature=1.0",
                                "sft_rl.rl_seeds=[1, 2]", f"sft_rl.sft_checkpoint={str(tiny_codebook_model)!r}"))


def test_runs_pool_into_one_entry_tested_against_sft():
    runs = [wilson_entry({"episodes": 40, "failed_episodes": 0, "success_rate": 0.75, "mean_reward": 0.75,
                          "by_task": {"a": [15, 20], "b": [15, 20]}, "train_seconds": 60.0, "eval_seconds": 5.0}),
            wilson_entry({"episodes": 42, "failed_episodes": 2, "success_rate": 0.5, "mean_reward": 0.5,
                          "by_task": {"a": [12, 20], "b": [8, 20]}, "train_seconds": 70.0, "eval_seconds": 6.0})]
    pooled = pooled_entry(runs)
    assert (pooled["runs"], pooled["played"], pooled["successes"]) == (2, 80, 50)
    assert pooled["success_rate"] == pytest.approx(50 / 80) and pooled["failed_episodes"] == 2
    assert pooled["by_task"] == {"a": [27, 40], "b": [23, 40]}
    assert (pooled["train_seconds"], pooled["eval_seconds"]) == (130.0, 11.0)
    sft = wilson_entry({"episodes": 40, "failed_episodes": 0, "success_rate": 0.5, "mean_reward": 0.5})
    summary = {"phases": {"sft": sft, "rl-seed1": runs[0], "rl-seed2": runs[1], "rl": pooled}}
    tests = against_sft(summary)
    assert list(tests) == ["rl-seed1", "rl-seed2", "rl"]
    # 20/40 against 50/80: pooled 70/120, se = sqrt(7/12 * 5/12 * (1/40 + 1/80)) = 0.095470.
    assert tests["rl"]["z"] == pytest.approx(0.125 / 0.095470, abs=1e-4)
    assert against_sft({"phases": {"rl": pooled}}) == {}
    assert {test["sft_phase"] for test in tests.values()} == {"sft"}


def test_rl_is_tested_against_the_sft_checkpoint_at_its_best_decoding():
    """SFT scores 20/40 at the evaluation's temperature, 28/40 greedy and 24/40 at 0.5: RL's 30/40
    is tested against the greedy 28/40, the best of the three."""
    def entry(successes):
        return wilson_entry({"episodes": 40, "failed_episodes": 0, "success_rate": successes / 40, "mean_reward": 0.0,
                             "train_seconds": 60.0, "eval_seconds": 6.0})

    summary = {"phases": {"sft": entry(20), "sft-t0": entry(28), "sft-t0.5": entry(24), "rl": entry(30)}}
    test = against_sft(summary)["rl"]
    assert test["sft_phase"] == "sft-t0" and test["difference"] == pytest.approx(2 / 40)
    table = format_table({**summary, "against_sft": against_sft(summary)})
    assert "| sft, greedy |" in table and "| sft, temperature 0.5 |" in table
    assert "rl against sft-t0 (the best SFT decoding): +5.0 points" in table


@pytest.mark.slow
def test_rl_runs_per_seed_from_a_checkpoint_made_before_with_sampled_evaluations(tmp_path, tiny_codebook_model):
    config = _config(tmp_path, tiny_codebook_model, "sft_rl.eval_base=false",
                     f"sft_rl.sft_checkpoint={str(tiny_codebook_model)!r}", "sft_rl.rl_seeds=[5, 6]",
                     "run.total_steps=1", "sft_rl.eval_episodes=10", "sft_rl.eval_samples=3",
                     "sft_rl.eval_temperature=1.0", "sft_rl.sft_temperatures=[0.0]", "sft_rl.rl_temperatures=[0]")
    lines = []
    summary = run_sft_rl(config, note=lines.append)
    phases = summary["phases"]
    assert list(phases) == ["sft", "sft-t0", "rl-seed5", "rl-seed5-t0", "rl-seed6", "rl-seed6-t0", "rl", "rl-t0"]
    for phase in ("sft-t0", "rl-seed5-t0", "rl-seed6-t0"):  # greedy: one per task
        assert phases[phase]["played"] == 10 and phases[phase]["temperature"] == 0.0
    for seed in (5, 6):  # each run's one checkpoint, played both ways
        assert phases[f"rl-seed{seed}-t0"]["model"] == phases[f"rl-seed{seed}"]["model"]
    assert phases["rl-t0"]["played"] == 20 and phases["rl-t0"]["runs"] == 2
    assert phases["rl-t0"]["successes"] == phases["rl-seed5-t0"]["successes"] + phases["rl-seed6-t0"]["successes"]
    assert not (config.run_dir / "oracle.jsonl").exists() and phases["sft"]["model"] == str(tiny_codebook_model)
    for phase in ("sft", "rl-seed5", "rl-seed6"):
        entry = phases[phase]
        assert entry["played"] == 30 and entry["samples_per_task"] == 3 and entry["temperature"] == 1.0
        assert len(entry["by_task"]) == 10 and all(tries == 3 for _, tries in entry["by_task"].values())
        assert sum(wins for wins, _ in entry["by_task"].values()) == entry["successes"]
    for seed in (5, 6):
        rl_config = load_config(config.run_dir / f"rl-seed{seed}" / "config.toml")
        assert rl_config.run.seed == seed and rl_config.model.path == str(tiny_codebook_model)
        assert phases[f"rl-seed{seed}"]["model"].startswith(str(config.run_dir / f"rl-seed{seed}" / "checkpoints"))
    assert phases["rl"]["played"] == 60
    assert phases["rl"]["successes"] == phases["rl-seed5"]["successes"] + phases["rl-seed6"]["successes"]
    assert list(summary["against_sft"]) == ["rl-seed5", "rl-seed5-t0", "rl-seed6", "rl-seed6-t0", "rl", "rl-t0"]
    best = max(("sft", "sft-t0"), key=lambda phase: phases[phase]["success_rate"])
    assert all(test["sft_phase"] == best for test in summary["against_sft"].values())
    table = format_table(summary)
    assert "| rl, seed 5 |" in table and "| rl, 2 runs pooled |" in table
    assert "| rl, seed 6, greedy |" in table and "| rl, greedy, 2 runs pooled |" in table
    assert f"rl, 2 runs pooled against {best} (the best SFT decoding)" in table
    assert json.loads((config.run_dir / "summary.json").read_text())["against_sft"] == summary["against_sft"]
    assert any("3 sampled at temperature 1 per task" in line for line in lines)


def _sequences(config, split):
    from longhorizon.envs.base import list_tasks

    return [tuple(t.data["symbols"]) for t in list_tasks(config.env.name, split, **dict(config.env.options))]


@pytest.mark.slow
def test_only_the_episodes_the_oracle_won_are_fine_tuned_on(tmp_path, tiny_codebook_model):
    """A policy that fails some episodes (random play of a one-turn codebook: 1 in 4 wins) stands
    for a browser oracle whose click timed out: what it lost is not imitated."""
    one_turn = "env.options={num_turns = 1, num_symbols = 4, num_actions = 4, held_out_sequences = true}"
    config = _config(tmp_path, tiny_codebook_model, one_turn, "sft_rl.oracle_policy='random'", "sft_rl.rl=false",
                     "sft_rl.eval_base=false", "sft_rl.oracle_episodes=64", "sft.epochs=1", "sft_rl.eval_episodes=4")
    lines = []
    summary = run_sft_rl(config, note=lines.append)
    oracle = [json.loads(line) for line in (config.run_dir / "oracle.jsonl").read_text().splitlines()]
    assert 0 < len(oracle) < 64 and all(line["success"] for line in oracle)
    assert summary["phases"]["sft"]["oracle_conversations"] == len(oracle)
    assert f"sft: {len(oracle)} successful oracle conversations of train (of 64 played)" in "\n".join(lines)


@pytest.mark.slow
def test_a_stopped_experiment_resumes_where_it_stopped(tmp_path, tiny_codebook_model):
    """The experiment stopped during its second RL run, after that run's step-2 checkpoint: the
    same command with run.resume=true keeps the oracle data, the SFT checkpoint, the first run
    and every evaluation made, and trains the second run on from step 3."""
    from longhorizon.common.metrics import read_metrics

    overrides = ["sft_rl.eval_base=false", "sft_rl.oracle_episodes=32", "sft.epochs=1", "sft_rl.rl_seeds=[1, 2]",
                 "learner.checkpoint_every=2", "sft_rl.eval_episodes=10"]
    config = _config(tmp_path, tiny_codebook_model, *overrides)
    first = run_sft_rl(config, note=lambda line: None)
    run_dir = config.run_dir
    # As the experiment left things when it was stopped after seed 2's step-2 checkpoint.
    stopped = run_dir / "rl-seed2"
    import shutil

    shutil.rmtree(stopped / "checkpoints" / "step_000004")
    metrics = (stopped / "metrics.jsonl").read_text().splitlines()
    (stopped / "metrics.jsonl").write_text("\n".join(metrics[:2]) + "\n")
    recorded = json.loads((run_dir / "summary.json").read_text())
    for phase in ("rl-seed2", "rl"):
        del recorded["phases"][phase]
    (run_dir / "summary.json").write_text(json.dumps(recorded))
    kept = [run_dir / "oracle.jsonl", Path(first["phases"]["sft"]["model"]), run_dir / "rl-seed1" / "metrics.jsonl"]
    stamps = [path.stat().st_mtime_ns for path in kept]

    with pytest.raises(ConfigError, match="ran with another config"):
        run_sft_rl(_config(tmp_path, tiny_codebook_model, *overrides, "run.resume=true", "learner.learning_rate=1e-3"),
                   note=lambda line: None)
    lines = []
    # More threads for the rest (another machine): how fast, not what is computed.
    resumed = run_sft_rl(_config(tmp_path, tiny_codebook_model, *overrides, "run.resume=true", "learner.torch_threads=2"),
                         note=lines.append)
    text = "\n".join(lines)
    assert "resuming the experiment in" in text and "oracle conversations" not in text
    assert "rl-seed1: trained before" in text and "rl-seed2: resuming from" in text and "step_000002" in text
    assert [path.stat().st_mtime_ns for path in kept] == stamps
    assert [r["step"] for r in read_metrics(stopped)] == [1, 2, 3, 4]
    phases = resumed["phases"]
    assert list(phases) == ["sft", "rl-seed1", "rl-seed2", "rl"]
    assert phases["sft"] == first["phases"]["sft"] and phases["rl-seed1"] == first["phases"]["rl-seed1"]
    assert phases["rl-seed2"]["model"].endswith("step_000004") and phases["rl"]["played"] == 20
    assert json.loads((run_dir / "summary.json").read_text())["phases"] == phases
