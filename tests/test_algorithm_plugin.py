"""An algorithm from outside the repository: a package registers it under the
`longhorizon.algorithms` entry point (or is named by a dotted path), and a run trains with it
through `learner.algorithm` alone, its own scoring and loss doing the work."""

from pathlib import Path

import numpy as np
import pytest
import torch

from longhorizon.common.config import ConfigError, LearnerConfig, load_config
from longhorizon.learner.algorithms import ALGORITHMS, AlgorithmError, make_algorithm

REPO_ROOT = Path(__file__).resolve().parent.parent

# REINFORCE against a constant baseline, importance-weighted against the behaviour policy; the
# baseline and the weight's cap are its keys (learner.algorithm_options.baseline). It counts its
# calls, so the tests can tell that its code, not a built-in's, ran.
CONSTANT_BASELINE = """
from longhorizon.common.config import Section, bounded
from longhorizon.learner.algorithms import Algorithm
from longhorizon.learner.losses import truncated_is_loss
from longhorizon.learner.scoring import score_whole_batch

calls = {"score": 0, "loss": 0}


class Options(Section):
    baseline: float = bounded(0.5, ge=0, le=1)
    \"\"\"The constant every reward is measured against.\"\"\"
    behaviour_weight_cap: float = bounded(2.0, ge=1)
    \"\"\"The importance weight pi / mu is truncated at this.\"\"\"


class ConstantBaseline(Algorithm):
    summary = "REINFORCE with a constant baseline"
    Options = Options
    aggregation = "token"

    def score(self, groups):
        calls["score"] += 1
        return score_whole_batch(groups, self.shaped_rewards, lambda rewards: rewards - self.options.baseline)

    def loss(self, logprobs, proximal_logprobs, behaviour_logprobs, advantages, mask):
        calls["loss"] += 1
        return truncated_is_loss(logprobs, behaviour_logprobs, advantages, mask,
                                 is_cap=self.options.behaviour_weight_cap)
"""


@pytest.fixture
def plugin(install_plugin):
    """install(package, entry_point_name or None) -> the plug-in's module; with None, the code is
    in the submodule `package.reinforce`, found by the dotted path `package.reinforce:ConstantBaseline`."""
    import importlib

    names = []

    def install(package: str, entry_point: str | None):
        if entry_point is None:
            folder = install_plugin(package, "")
            (folder / package / "reinforce.py").write_text(CONSTANT_BASELINE)
            names.append(f"{package}.reinforce:ConstantBaseline")
            return importlib.import_module(f"{package}.reinforce")
        install_plugin(package, CONSTANT_BASELINE,
                       {"longhorizon.algorithms": {entry_point: f"{package}:ConstantBaseline"}})
        names.append(entry_point)
        return importlib.import_module(package)

    yield install
    for name in names:  # the registry keeps what it loaded; the package is gone after the test
        ALGORITHMS.unregister(name)


def _trajectory(reward):
    return type("Trajectory", (), dict(reward=reward, error="", token_ids=np.arange(5), loss_mask=np.r_[0, 0, 1, 1, 1],
                                       behaviour_logprobs=np.zeros(5, np.float32)))()


def _group(*rewards):
    return type("Group", (), dict(trajectories=[_trajectory(r) for r in rewards]))()


def test_an_installed_algorithm_is_found_by_its_name_and_checked_like_a_builtin(plugin):
    module = plugin("outside_algorithms", "constant_baseline")
    algorithm = make_algorithm(LearnerConfig(algorithm="constant_baseline"))
    assert isinstance(algorithm, module.ConstantBaseline) and algorithm.name == "constant_baseline"
    assert algorithm.options == module.Options(baseline=0.5, behaviour_weight_cap=2.0)
    # Its own scoring: r - 0.5 for every member, the flat group kept.
    scored = algorithm.score([_group(1.0, 0.0), _group(1.0, 1.0)])
    assert [e.advantage for e in scored.examples] == [0.5, -0.5, 0.5, 0.5]
    assert (scored.groups_used, scored.groups_skipped_zero_variance) == (2, 0) and module.calls["score"] == 1
    # Its own key, checked by its own model: a value, a value out of range, a key it lacks.
    quarter = make_algorithm(LearnerConfig(algorithm="constant_baseline", algorithm_options={"baseline": 0.25}))
    assert [e.advantage for e in quarter.score([_group(1.0, 0.0)]).examples] == [0.75, -0.25]
    with pytest.raises(AlgorithmError, match=r"^learner.algorithm_options.baseline must be in \[0, 1\], got 2$"):
        make_algorithm(LearnerConfig(algorithm="constant_baseline", algorithm_options={"baseline": 2}))
    with pytest.raises(AlgorithmError, match=r"^unknown config key learner.algorithm_options.basline in "
                                             r"\[learner.algorithm_options\]; valid keys: baseline, behaviour_weight_cap$"):
        make_algorithm(LearnerConfig(algorithm="constant_baseline", algorithm_options={"basline": 0.1}))
    # Its key is not a built-in's.
    with pytest.raises(AlgorithmError, match=r"unknown config key learner.algorithm_options.baseline in "
                                             r"\[learner.algorithm_options\]; valid keys: aggregation, "):
        make_algorithm(LearnerConfig(algorithm_options={"baseline": 0.1}))
    # A built-in's key it does not take is refused as for a built-in, and the names on offer include it.
    with pytest.raises(AlgorithmError, match=r"learner.algorithm_options.clip_eps is not used by "
                                             r"learner.algorithm = 'constant_baseline' \(it is read by grpo, "):
        make_algorithm(LearnerConfig(algorithm="constant_baseline", clip_eps=0.3))
    with pytest.raises(AlgorithmError, match=r"valid: grpo, .*, cispo, constant_baseline"):
        make_algorithm(LearnerConfig(algorithm="constant_baselin"))


def test_a_bad_value_of_a_plugins_own_key_is_one_line_from_the_command_line(plugin, tmp_path, capsys):
    from longhorizon.launch.cli import main

    plugin("cli_algorithms", "constant_baseline_cli")
    runs = tmp_path / "runs"
    base = ["train", "codebook", f"run.output_dir={str(runs)!r}", "learner.algorithm='constant_baseline_cli'"]
    assert main([*base, "learner.algorithm_options.baseline=2"]) == 2
    assert capsys.readouterr().err == (
        "longhorizon: error: learner.algorithm_options.baseline must be in [0, 1], got 2\n")
    assert not runs.exists()  # refused before the run folder was made


def test_what_is_not_an_algorithm_is_refused_before_the_run(install_plugin):
    from longhorizon.launch.checks import validate_config

    install_plugin("not_algorithms", "class Helper:\n    pass\n")
    base = ["env.name='codebook'", "actor.engine='scripted'"]
    with pytest.raises(ConfigError, match="not a subclass of longhorizon.learner.algorithms.Algorithm"):
        validate_config(load_config(None, [*base, "learner.algorithm='not_algorithms:Helper'"]))
    with pytest.raises(ConfigError, match="has no attribute 'Missing'"):
        validate_config(load_config(None, [*base, "learner.algorithm='not_algorithms:Missing'"]))
    ALGORITHMS.unregister("not_algorithms:Helper")


@pytest.mark.parametrize("found_by", ["entry point", "dotted path"])
async def test_a_run_trains_with_an_algorithm_from_outside(tmp_path, tiny_codebook_model, plugin, found_by):
    """A short in-process run on the codebook env: every step is scored by the plug-in (every
    group used, flat ones too, which grpo would skip) and its loss moves the weights."""
    from longhorizon.common.metrics import read_metrics
    from longhorizon.common.models import load_causal_lm
    from longhorizon.launch.launchers.local import train_in_process

    if found_by == "entry point":
        module, name = plugin("run_algorithms", "constant_baseline_run"), "constant_baseline_run"
    else:
        module, name = plugin("loose_algorithms", None), "loose_algorithms.reinforce:ConstantBaseline"
    config = load_config(REPO_ROOT / "configs" / "codebook.toml", [
        f"run.output_dir={str(tmp_path)!r}", "run.total_steps=3", f"model.path={str(tiny_codebook_model)!r}",
        "actor.num_actors=1", "actor.group_size=4", "learner.groups_per_step=2", "learner.learning_rate=1e-2",
        f"learner.algorithm={name!r}", "learner.algorithm_options.baseline=0.25",
    ])
    learner = await train_in_process(config)
    assert learner.trainer.algorithm.options.baseline == 0.25

    records = read_metrics(config.run_dir)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["groups_used"] == 2 and r["groups_skipped_zero_variance"] == 0 for r in records)
    # Each step says how much memory the learner holds and the machine has left.
    assert all(r["rss_peak_mb"] >= r["rss_mb"] > 100 and 0 < r["memory_available_mb"] < r["memory_total_mb"]
               for r in records)
    assert module.calls["score"] >= 3 and module.calls["loss"] >= 3
    untrained = load_causal_lm(tiny_codebook_model)
    assert any(not torch.equal(trained, initial)
               for trained, initial in zip(learner.model.parameters(), untrained.parameters()))
