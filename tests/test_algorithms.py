"""The built-in algorithms: each one's advantages and loss against hand-computed values, and the
settings it refuses."""

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from longhorizon.common.config import ConfigError, LearnerConfig, load_config
from longhorizon.learner.advantages import overlong_penalty
from longhorizon.learner.algorithms import BUILTINS, Algorithm, AlgorithmError, algorithm_class, make_algorithm
from longhorizon.learner.losses import cispo_loss, gspo_loss
from longhorizon.learner.trainer import score_groups


def _trajectory(reward, generated=3, error=""):
    return SimpleNamespace(
        reward=reward, error=error, token_ids=np.arange(generated + 2), loss_mask=np.r_[0, 0, np.ones(generated)],
        behaviour_logprobs=np.zeros(generated + 2, np.float32),
    )


def _group(*rewards, generated=3):
    return SimpleNamespace(trajectories=[_trajectory(r, generated) for r in rewards])


def group_advantages(config, rewards):
    return make_algorithm(config).group_advantages(rewards)


def algorithm_loss(config, *tensors):
    return make_algorithm(config).loss(*tensors)


# -- advantages ----------------------------------------------------------------------------------

def test_group_estimators_by_hand():
    rewards = np.array([1.0, 0.0, 0.0, 1.0])
    # grpo: mean 0.5, population std 0.5 -> (r - 0.5) / 0.5
    np.testing.assert_allclose(group_advantages(LearnerConfig(algorithm="grpo"), rewards), [1, -1, -1, 1], atol=1e-5)
    # dr_grpo: the mean only
    np.testing.assert_allclose(group_advantages(LearnerConfig(algorithm="dr_grpo"), rewards), [0.5, -0.5, -0.5, 0.5])
    # rloo: r_i minus the mean of the other three (1/3 for a 1, 2/3 for a 0)
    np.testing.assert_allclose(
        group_advantages(LearnerConfig(algorithm="rloo"), rewards), [2 / 3, -2 / 3, -2 / 3, 2 / 3],
    )
    for name in ("dapo", "gspo", "cispo"):  # group-normalised like grpo
        np.testing.assert_allclose(group_advantages(LearnerConfig(algorithm=name), rewards), [1, -1, -1, 1], atol=1e-5)


def test_reinforce_pp_normalises_over_the_batch_and_keeps_flat_groups():
    scored = score_groups([_group(1.0, 1.0), _group(0.0, 1.0)], LearnerConfig(algorithm="reinforce_pp"))
    # Batch rewards 1, 1, 0, 1: mean 0.75, std sqrt(3)/4.
    std = math.sqrt(3) / 4
    expected = [0.25 / std, 0.25 / std, -0.75 / std, 0.25 / std]
    np.testing.assert_allclose([e.advantage for e in scored.examples], expected, rtol=1e-5)
    assert scored.groups_used == 2 and scored.groups_skipped_zero_variance == 0
    # Per-group algorithms skip the flat group.
    grpo = score_groups([_group(1.0, 1.0), _group(0.0, 1.0)], LearnerConfig(algorithm="grpo"))
    assert grpo.groups_used == 1 and grpo.groups_skipped_zero_variance == 1
    # ... but keep its generated tokens and members for the loss's denominator.
    assert (grpo.flat.tokens, grpo.flat.sequences) == (6.0, 2) and len(grpo.examples) == 2
    assert (scored.flat.tokens, scored.flat.sequences) == (0.0, 0)


def test_every_algorithm_counts_the_failed_episodes_it_left_out():
    """A group with one member whose episode failed (an env error): it is left out and counted, as
    a number (reinforce_pp's batch-wide scoring once logged a list of flags here)."""
    groups = [SimpleNamespace(trajectories=[_trajectory(1.0), _trajectory(0.0), _trajectory(0.0, error="env died")]),
              _group(0.0, 1.0)]
    for group in groups:
        for member in group.trajectories:
            member.turn_rewards = [member.reward]  # ppo's critic reads them
    for name in BUILTINS:
        scored = score_groups(groups, LearnerConfig(algorithm=name))
        assert type(scored.failed_trajectories) is int and scored.failed_trajectories == 1, name


def test_overlong_penalty_by_hand():
    assert overlong_penalty(80, max_tokens=100, buffer_tokens=20) == 0.0
    assert overlong_penalty(90, max_tokens=100, buffer_tokens=20) == -0.5
    assert overlong_penalty(100, max_tokens=100, buffer_tokens=20) == -1.0
    assert overlong_penalty(150, max_tokens=100, buffer_tokens=20) == -1.0
    with pytest.raises(ValueError):
        overlong_penalty(10, max_tokens=20, buffer_tokens=20)


def test_dapo_shapes_rewards_of_long_episodes_before_scoring():
    config = LearnerConfig(algorithm="dapo", overlong_max_tokens=10, overlong_buffer_tokens=4)
    # Both succeed, but the second ran 8 tokens: penalty (6 - 8) / 4 = -0.5, so the group has signal.
    group = SimpleNamespace(trajectories=[_trajectory(1.0, generated=3), _trajectory(1.0, generated=8)])
    scored = score_groups([group], config)
    assert scored.groups_used == 1
    np.testing.assert_allclose([e.advantage for e in scored.examples], [1, -1], atol=1e-5)
    assert score_groups([group], LearnerConfig(algorithm="dapo")).groups_skipped_zero_variance == 1


# -- losses --------------------------------------------------------------------------------------

def _batch(lengths):
    """Two sequences with generated tokens of different lengths; behaviour = proximal = current."""
    mask = torch.zeros(len(lengths), max(lengths))
    for row, length in enumerate(lengths):
        mask[row, :length] = 1
    logprobs = torch.full(mask.shape, -1.0, requires_grad=True)
    return logprobs, mask


def test_grpo_and_dr_grpo_differ_on_a_group_of_different_lengths():
    """Rewards (1, 0); the first answer has 1 token, the second 3. With all three policies equal
    every ratio is 1, so the per-token loss is -A."""
    logprobs, mask = _batch([1, 3])
    rewards = np.array([1.0, 0.0])

    def loss(config):
        advantages = torch.tensor(group_advantages(config, rewards), dtype=torch.float32)
        return float(algorithm_loss(config, logprobs, logprobs.detach(), logprobs.detach(), advantages, mask).loss.detach())

    # grpo, token level: advantages (1, -1); (-1*1 + 1*3) / 4 tokens = 0.5
    assert loss(LearnerConfig(algorithm="grpo")) == pytest.approx(0.5, abs=1e-5)
    # grpo, sequence level: mean of the per-sequence means (-1, 1) = 0
    assert loss(LearnerConfig(algorithm="grpo", aggregation="sequence")) == pytest.approx(0.0, abs=1e-5)
    # dr_grpo: advantages (0.5, -0.5); sums (-0.5, 1.5) / (2 sequences * 4 tokens) = 0.125
    assert loss(LearnerConfig(algorithm="dr_grpo", loss_normaliser_tokens=4)) == pytest.approx(0.125)


def test_dapo_clips_higher_above_than_below():
    mask = torch.ones(1, 1)
    proximal = torch.zeros(1, 1)
    logprobs = torch.log(torch.tensor([[1.25]]))  # ratio 1.25 against the proximal policy
    advantages = torch.ones(1)
    dapo = algorithm_loss(LearnerConfig(algorithm="dapo"), logprobs, proximal, proximal, advantages, mask)
    grpo = algorithm_loss(LearnerConfig(algorithm="grpo"), logprobs, proximal, proximal, advantages, mask)
    assert float(dapo.loss) == pytest.approx(-1.25)  # inside 1 + 0.28
    assert float(grpo.loss) == pytest.approx(-1.2)  # clipped at 1 + 0.2
    assert make_algorithm(LearnerConfig(algorithm="dapo", clip_eps_high=0.4)).clip_range == (0.2, 0.4)


def test_gspo_uses_one_length_normalised_ratio_per_sequence():
    mask = torch.ones(1, 2)
    proximal = torch.log(torch.tensor([[0.25, 0.25]]))
    logprobs = torch.log(torch.tensor([[0.5, 0.5]])).requires_grad_()  # each token ratio 2: s = 2
    # A = 1: the clipped branch, min(2, 1 + 4e-4) -> loss -(1 + 4e-4), no gradient.
    up = gspo_loss(logprobs, proximal, proximal, torch.ones(1), mask)
    assert float(up.loss.detach()) == pytest.approx(-(1 + 4e-4))
    # A = -1: min(-2, -(1 + 4e-4)) = -2 -> loss 2; d loss / d log pi_t = s / |y| = 1 for each token.
    down = gspo_loss(logprobs, proximal, proximal, -torch.ones(1), mask)
    assert float(down.loss.detach()) == pytest.approx(2.0)
    down.loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.ones(1, 2))
    # The off-policy weight is the geometric mean of pi_prox / mu over the sequence's tokens:
    behaviour = torch.log(torch.tensor([[0.125, 0.125]]))  # pi_prox / mu = 2 per token
    weighted = gspo_loss(logprobs.detach(), proximal, behaviour, -torch.ones(1), mask)
    assert float(weighted.loss) == pytest.approx(4.0)  # w = 2 times the loss of 2


def test_cispo_keeps_the_gradient_of_tokens_outside_the_clip():
    mask = torch.ones(1, 1)
    behaviour = torch.log(torch.tensor([[0.2]]))
    logprobs = torch.log(torch.tensor([[0.6]])).requires_grad_()  # weight pi / mu = 3, clipped to 2
    output = cispo_loss(logprobs, behaviour, torch.ones(1), mask)
    assert float(output.loss.detach()) == pytest.approx(-2 * math.log(0.6), rel=1e-5)
    output.loss.backward()
    assert float(logprobs.grad) == pytest.approx(-2.0)  # PPO's clip would give 0 here
    assert output.metrics["is_weight_clipped_fraction"] == 1.0


def test_cispo_stops_the_gradient_of_its_weight_inside_the_clip():
    """pi / mu = 0.3 / 0.2 = 1.5, inside [0, 2], advantage 2: the loss is -1.5 * 2 * log 0.3 and
    its gradient -1.5 * 2 = -3 (the weight a constant). A weight that let its gradient through
    would add -2 * 1.5 * log 0.3 (d w / d log pi = w), giving +0.61 instead."""
    mask = torch.ones(1, 1)
    behaviour = torch.log(torch.tensor([[0.2]], dtype=torch.float64))
    logprobs = torch.log(torch.tensor([[0.3]], dtype=torch.float64)).requires_grad_()
    output = cispo_loss(logprobs, behaviour, torch.full((1,), 2.0, dtype=torch.float64), mask)
    assert float(output.loss.detach()) == pytest.approx(-3.0 * math.log(0.3), rel=1e-9)
    output.loss.backward()
    assert float(logprobs.grad) == pytest.approx(-3.0, rel=1e-9)
    assert output.metrics["is_weight_clipped_fraction"] == 0.0


# -- settings ------------------------------------------------------------------------------------

def test_every_algorithm_builds_with_its_defaults():
    for name in BUILTINS:
        algorithm = make_algorithm(LearnerConfig(algorithm=name))
        assert algorithm.name == name and algorithm.summary
        assert algorithm.reads() == frozenset(algorithm.options.model_dump())  # its options hold what it takes


def test_how_each_algorithm_scores_and_aggregates():
    def built(name, **settings):
        return make_algorithm(LearnerConfig(algorithm=name, **settings))

    assert [name for name in BUILTINS if built(name).resamples_flat_groups] == ["dapo"]
    assert [name for name in BUILTINS if not built(name).runs_on_several_ranks] == ["ppo"]
    assert {name: built(name).aggregation for name in BUILTINS} == {
        "grpo": "token", "rloo": "token", "reinforce_pp": "token", "dr_grpo": "sum", "dapo": "token",
        "gspo": "sequence", "ppo": "token", "cispo": "token",
    }
    assert built("grpo", aggregation="sequence").aggregation == "sequence"
    # Only ppo brings a critic.
    assert [name for name in BUILTINS if type(built(name)).build_value_model is not Algorithm.build_value_model] == ["ppo"]


def test_unknown_algorithms_and_foreign_keys_are_refused():
    with pytest.raises(AlgorithmError, match="valid: grpo, rloo, reinforce_pp, dr_grpo, dapo, gspo, ppo, cispo"):
        make_algorithm(LearnerConfig(algorithm="ppo2"))
    with pytest.raises(AlgorithmError, match="clip_eps_high is not used by .*'grpo'.*read by dapo, gspo, cispo"):
        make_algorithm(LearnerConfig(clip_eps_high=0.28))
    with pytest.raises(AlgorithmError, match="learner.algorithm_options.clip_eps is not used by .*'gspo'"):
        make_algorithm(LearnerConfig(algorithm="gspo", clip_eps=0.3))
    with pytest.raises(AlgorithmError, match="aggregation is not used by .*'dr_grpo'"):
        make_algorithm(LearnerConfig(algorithm="dr_grpo", aggregation="sequence"))
    with pytest.raises(AlgorithmError, match="overlong_buffer_tokens must be between"):
        make_algorithm(LearnerConfig(algorithm="dapo", overlong_max_tokens=10, overlong_buffer_tokens=10))
    with pytest.raises(AlgorithmError, match="overlong_buffer_tokens needs learner.algorithm_options.overlong_max_tokens"):
        make_algorithm(LearnerConfig(algorithm="dapo", overlong_buffer_tokens=10))
    with pytest.raises(AlgorithmError, match=r"learner.algorithm_options.value_coef must be > 0, got 0.0"):
        make_algorithm(LearnerConfig(algorithm="ppo", value_coef=0.0))
    with pytest.raises(AlgorithmError, match=r"learner.algorithm_options.clip_eps_low must be in \(0, 1\], got 1.5"):
        make_algorithm(LearnerConfig(algorithm="cispo", clip_eps_low=1.5))
    # Values no loss knows fail here, not at the first update ("sum" is dr_grpo's own).
    with pytest.raises(AlgorithmError, match="learner.algorithm_options.aggregation must be one of token, sequence, got 'sum'"):
        make_algorithm(LearnerConfig(aggregation="sum"))
    with pytest.raises(AlgorithmError, match="learner.algorithm_options.weight_level must be one of"):
        make_algorithm(LearnerConfig(algorithm="dapo", weight_level="tokens"))
    for name in ("grpo", "rloo", "dr_grpo", "dapo", "ppo"):  # those that read learner.loss
        with pytest.raises(AlgorithmError, match="learner.algorithm_options.loss must be one of decoupled_ppo, truncated_is, none, "
                                                 "got 'bogus'"):
            make_algorithm(LearnerConfig(algorithm=name, loss="bogus"))


@pytest.mark.parametrize("algorithm, key", [
    ("grpo", "clip_eps"), ("rloo", "clip_eps"), ("dr_grpo", "clip_eps"), ("ppo", "clip_eps"),
    ("dapo", "clip_eps_low"), ("gspo", "clip_eps_low"), ("cispo", "clip_eps_low"),
])
@pytest.mark.parametrize("value", [0.5, 0.999, 1.0, 1.5, 0.0, -0.1])
def test_the_config_check_refuses_exactly_the_lower_clips_the_loss_refuses(monkeypatch, algorithm, key, value):
    """Whatever the config check lets through, the loss takes at the first update, and whatever it
    refuses (naming the key), the loss would have refused: a lower clip of 1 leaves a clipped
    surrogate's ratio unbounded below, so only cispo's capped weight takes it."""
    config = LearnerConfig(algorithm=algorithm, **{key: value})
    mask = torch.ones(2, 3)
    tensors = (torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3), torch.tensor([1.0, -1.0]), mask)
    try:
        chosen = make_algorithm(config)
    except AlgorithmError as error:
        assert f"learner.algorithm_options.{key} must be in" in str(error)
        refused = True
    else:
        refused = False
        chosen.loss(*tensors)  # raises if the loss disagrees
    if refused:
        from longhorizon.learner.algorithms import algorithm_class

        monkeypatch.setattr(algorithm_class(algorithm), "check_settings", lambda self: None)
        with pytest.raises(ValueError, match="clip_eps"):
            make_algorithm(config).loss(*tensors)
    assert refused == (not 0 < value < 1 and not (algorithm == "cispo" and value == 1.0))


def test_the_launcher_refuses_bad_algorithm_settings_before_starting():
    from longhorizon.launch.checks import validate_config

    base = ["env.name='codebook'", "actor.engine='scripted'"]
    with pytest.raises(ConfigError, match="unknown learner.algorithm"):
        validate_config(load_config(None, [*base, "learner.algorithm='nope'"]))
    with pytest.raises(ConfigError, match="sync mode"):
        validate_config(load_config(None, [*base, "learner.algorithm='dapo'", "run.mode='sync'"]))
    with pytest.raises(ConfigError, match="unknown config key learner.advantage"):
        load_config(None, ["learner.advantage='rloo'"])
    # An algorithm that does not run on several ranks says so; the launcher asks it.
    from longhorizon.launch.checks import _check_learner_ranks

    with pytest.raises(ConfigError, match="'ppo' runs on one rank"):
        _check_learner_ranks(load_config(None, ["learner.algorithm='ppo'", "learner.num_ranks=2"]), torch.device("cpu"))
    _check_learner_ranks(load_config(None, ["learner.algorithm='dapo'", "learner.num_ranks=2"]), torch.device("cpu"))


# -- ppo: turn rewards, GAE, value loss ----------------------------------------------------------

def test_turn_rewards_land_on_the_last_token_of_each_reply():
    from longhorizon.learner.critic import per_token_rewards

    #        prompt  reply 1   obs  reply 2
    mask = [0, 0, 1, 1, 0, 0, 1]
    np.testing.assert_array_equal(per_token_rewards(mask, [0.5, 1.0]), [0, 0, 0, 0.5, 0, 0, 1.0])
    # More rewards than replies: the rest goes to the last reply; fewer: later replies get 0.
    np.testing.assert_array_equal(per_token_rewards(mask, [0.5, 1.0, 2.0]), [0, 0, 0, 0.5, 0, 0, 3.0])
    np.testing.assert_array_equal(per_token_rewards(mask, [0.5]), [0, 0, 0, 0.5, 0, 0, 0])
    assert per_token_rewards([0, 0], [1.0]).sum() == 0


def test_gae_over_a_two_turn_episode_by_hand():
    from longhorizon.learner.critic import gae

    # Generated tokens at positions 1, 2 (turn 1) and 4 (turn 2); position 3 is an observation.
    mask = torch.tensor([[0, 1, 1, 0, 1.0]])
    rewards = torch.tensor([[0, 0, 0.5, 0, 1.0]])
    values = torch.tensor([[9.0, 0.2, 0.4, 9.0, 0.6]])  # values at uncounted positions are ignored
    advantages, returns = gae(rewards, values, mask, gamma=0.9, lam=0.5)
    # Backwards over the counted positions 4, 2, 1:
    d4 = 1.0 + 0.9 * 0 - 0.6          # 0.4
    a4 = d4
    d2 = 0.5 + 0.9 * 0.6 - 0.4        # 0.64
    a2 = d2 + 0.9 * 0.5 * a4          # 0.82
    d1 = 0.0 + 0.9 * 0.4 - 0.2        # 0.16
    a1 = d1 + 0.9 * 0.5 * a2          # 0.529
    torch.testing.assert_close(advantages, torch.tensor([[0, a1, a2, 0, a4]]))
    torch.testing.assert_close(returns, torch.tensor([[0, a1 + 0.2, a2 + 0.4, 0, a4 + 0.6]]))


def test_whitening_centres_and_scales_counted_positions_or_only_centres():
    from longhorizon.learner.critic import whiten

    values, mask = torch.tensor([[9.0, 0.1, 0.3, 9.0]]), torch.tensor([[0, 1, 1, 0.0]])
    # The step's mean 0.2 and std 0.1 (over counted positions; uncounted ones come out 0).
    torch.testing.assert_close(whiten(values, mask, 0.2, 0.1, eps=0.0), torch.tensor([[0, -1.0, 1.0, 0]]))
    torch.testing.assert_close(whiten(values, mask, 0.2, None), torch.tensor([[0, -0.1, 0.1, 0]]))


def test_the_value_loss_is_clipped_around_the_old_values():
    from longhorizon.learner.critic import value_loss

    mask = torch.ones(1, 2)
    old, target = torch.tensor([[0.0, 0.0]]), torch.tensor([[1.0, -1.0]])
    new = torch.tensor([[0.5, 0.1]])
    # Token 1: unclipped (0.5-1)^2 = 0.25; clipped to 0.2: (0.2-1)^2 = 0.64 -> max 0.64.
    # Token 2: unclipped (0.1+1)^2 = 1.21; clip leaves 0.1 -> 1.21. Loss 0.5 * mean = 0.4625.
    assert float(value_loss(new, old, target, mask, value_clip=0.2)) == pytest.approx(0.5 * (0.64 + 1.21) / 2)
    assert float(value_loss(new, old, target, mask, value_clip=0.0)) == pytest.approx(0.5 * (0.25 + 1.21) / 2)


def test_ppo_trains_its_critic_and_checkpoints_it(tmp_path, tiny_codebook_model):
    from longhorizon.common.models import load_causal_lm
    from longhorizon.learner.checkpoint import load_checkpoint, save_checkpoint
    from longhorizon.learner.curriculum import HorizonState
    from longhorizon.learner.trainer import Trainer

    config = LearnerConfig(algorithm="ppo", learning_rate=1e-2)
    trainer = Trainer(load_causal_lm(tiny_codebook_model), config)
    trajectories = [_trajectory(1.0, generated=4), _trajectory(0.0, generated=4)]
    for trajectory in trajectories:
        trajectory.turn_rewards = [trajectory.reward]
    scored = score_groups([SimpleNamespace(trajectories=trajectories)], config)
    assert scored.examples[0].token_rewards.tolist() == [0, 0, 0, 0, 0, 1.0]
    head_before = trainer.value_model.head.weight.detach().clone()
    metrics = trainer.step(scored.examples)
    assert metrics["value_loss"] > 0
    assert not torch.equal(trainer.value_model.head.weight, head_before)  # the critic learned

    save_checkpoint(tmp_path, trainer=trainer, step=1, version=1, horizon=HorizonState(cap=3, stage=0, step=1),
                    counters={})
    resumed = Trainer(load_causal_lm(tiny_codebook_model), config)
    load_checkpoint(tmp_path / "checkpoints" / "step_000001", trainer=resumed)
    torch.testing.assert_close(resumed.value_model.head.weight, trainer.value_model.head.weight)
    assert "value_model" not in " ".join(trainer.full_state_dict())  # the exported folder is the policy alone


def test_ppo_with_a_separate_critic_model(tiny_codebook_model):
    from longhorizon.common.models import load_causal_lm
    from longhorizon.learner.trainer import Trainer

    config = LearnerConfig(algorithm="ppo", critic=str(tiny_codebook_model), learning_rate=1e-2)
    trainer = Trainer(load_causal_lm(tiny_codebook_model), config)
    assert trainer.value_model.decoder is not trainer.model.get_decoder()
    trajectories = [_trajectory(1.0, generated=4), _trajectory(0.0, generated=4)]
    for trajectory in trajectories:
        trajectory.turn_rewards = [trajectory.reward]
    critic_before = [p.detach().clone() for p in trainer.value_model.decoder.parameters()]
    policy_before = [p.detach().clone() for p in trainer.model.parameters()]
    examples = score_groups([SimpleNamespace(trajectories=trajectories)], config).examples
    metrics = trainer.step(examples)
    assert metrics["value_loss"] > 0
    # The head starts at zero, so the critic's own backbone moves from the second step on.
    trainer.step(examples)
    assert any(not torch.equal(a, b) for a, b in zip(critic_before, trainer.value_model.decoder.parameters()))
    assert any(not torch.equal(a, b) for a, b in zip(policy_before, trainer.model.parameters()))


@pytest.mark.parametrize("std_scaling", [False, True], ids=["centred", "whitened"])
def test_ppo_advantages_are_centred_and_scaled_only_when_asked(tiny_codebook_model, std_scaling):
    """The zero-initialised critic values every token 0, so with gamma 1 each generated token's GAE
    advantage is its episode's reward (1, 1, 1, 1 and 0, 0, 0, 0): the step's mean 0.5 and std 0.5."""
    from longhorizon.common.models import load_causal_lm
    from longhorizon.learner.trainer import Trainer

    config = LearnerConfig(algorithm="ppo", gamma=1.0, lam=1.0, advantage_std_scaling=std_scaling)
    trainer = Trainer(load_causal_lm(tiny_codebook_model), config)
    trajectories = [_trajectory(1.0, generated=4), _trajectory(0.0, generated=4)]
    for trajectory in trajectories:
        trajectory.turn_rewards = [trajectory.reward]
    micro_batches = trainer._micro_batches(score_groups([SimpleNamespace(trajectories=trajectories)], config).examples)
    with torch.no_grad():
        values = [trainer._values(micro) for micro in micro_batches]
    scored, _ = trainer.algorithm.advantages_from_values(micro_batches, values)
    advantages = torch.cat([micro.advantages[micro.loss_mask > 0] for micro in scored])
    expected = torch.tensor([0.5] * 4 + [-0.5] * 4) / (0.5 if std_scaling else 1.0)
    torch.testing.assert_close(advantages, expected, atol=1e-4, rtol=1e-4)
    # The several-ranks path (sums of count, total and squares) on one rank gives the same.
    summed, _ = trainer.algorithm.advantages_from_values(micro_batches, values, sum_over_ranks=lambda sums: sums)
    torch.testing.assert_close(torch.cat([micro.advantages[micro.loss_mask > 0] for micro in summed]), expected,
                               atol=1e-4, rtol=1e-4)


def test_the_docs_list_each_builtins_keys_with_their_defaults():
    """docs/algorithms.md's table of keys per algorithm is what their Options models declare."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "docs" / "algorithms.md").read_text()
    table = text[text.index("| algorithm | keys under `learner.algorithm_options`"):].split("\n\n")[0]
    listed = {}
    for row in table.splitlines()[2:]:
        names, keys = [cell.strip() for cell in row.strip("|").split("|")]
        pairs = dict(re.findall(r"`(\w+) = ([^`]+)`", keys))
        if keys.startswith("grpo's"):
            pairs = {**listed["grpo"], **pairs}
        for name in names.split(", "):
            listed[name] = pairs
    assert set(listed) == set(BUILTINS)
    for name, pairs in listed.items():
        fields = algorithm_class(name).Options.model_fields
        assert set(pairs) == set(fields), name
        for key, shown in pairs.items():
            default = fields[key].default
            expected = ("true" if default else "false") if isinstance(default, bool) else (
                f'"{default}"' if isinstance(default, str) else repr(default))
            assert shown == expected, (name, key)
