"""Entropy control: the adaptive coefficient, Clip-Cov and KL-Cov against hand-computed values, their
config checks, and each mode in the trainer's update for every built-in algorithm."""

import dataclasses
import math

import numpy as np
import pytest
import torch

from longhorizon.common.config import ConfigError, LearnerConfig, load_config
from longhorizon.common.models import load_causal_lm
from longhorizon.learner.algorithms import BUILTINS, AlgorithmError, make_algorithm
from longhorizon.learner.entropy import (
    EntropyController,
    adapted_coefficient,
    clip_cov_selection,
    covariance_means,
    entropy_settings,
    kl_cov_penalty,
    kl_cov_selection,
    needs_flat_members,
    selected_count,
    token_covariance,
    without_gradient_at,
)
from longhorizon.learner.logprobs import clamped_entropy, logprobs_from_logits, pad_examples, token_logprobs
from longhorizon.learner.trainer import Trainer
from tests.test_trainer import _on_policy_examples

# -- the adaptive coefficient ----------------------------------------------------------------------


def test_the_coefficient_rises_below_the_target_falls_above_and_stays_in_its_bounds():
    assert adapted_coefficient(0.1, entropy=0.5, target=1.0, step=0.05, maximum=0.2) == pytest.approx(0.15)
    assert adapted_coefficient(0.1, entropy=1.5, target=1.0, step=0.05, maximum=0.2) == pytest.approx(0.05)
    assert adapted_coefficient(0.1, entropy=1.0, target=1.0, step=0.05, maximum=0.2) == 0.1  # at the target
    assert adapted_coefficient(0.02, entropy=2.0, target=1.0, step=0.05, maximum=0.2) == 0.0  # never negative
    assert adapted_coefficient(0.18, entropy=0.1, target=1.0, step=0.05, maximum=0.2) == 0.2  # at most the ceiling


def test_the_controller_adapts_only_in_the_target_mode_and_keeps_its_state():
    target = entropy_settings(LearnerConfig(entropy_control="target", target_entropy=1.0, entropy_coef=0.01,
                                            entropy_coef_step=0.02, entropy_coef_max=0.5))
    controller = EntropyController(target)
    assert controller.coefficient == 0.01  # starts at entropy_coef
    for entropy in (0.4, 0.6, 0.9):  # below the target three times
        controller.update(entropy)
    assert controller.coefficient == pytest.approx(0.07)
    controller.update(1.3)
    assert controller.coefficient == pytest.approx(0.05)
    controller.update(math.nan)  # a skipped update says nothing
    assert controller.coefficient == pytest.approx(0.05)
    restored = EntropyController(target)
    restored.load_state_dict(controller.state_dict())
    assert restored.coefficient == pytest.approx(0.05)
    fixed = EntropyController(entropy_settings(LearnerConfig(entropy_coef=0.2)))
    fixed.update(0.0)
    fixed.load_state_dict({"coefficient": 0.9})
    assert fixed.coefficient == 0.2  # a plain bonus is the config's, whatever a checkpoint says


# -- covariance, Clip-Cov, KL-Cov ----------------------------------------------------------------

LOGPROBS = torch.tensor([[-1.0, -3.0, -9.0], [-2.0, -2.0, -9.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])  # the last column is padding
ADVANTAGES = torch.tensor([1.0, -1.0])


def test_the_covariance_of_each_token_by_hand():
    # Over the four generated tokens: mean log-prob -2, mean advantage 0.
    total_logprob, total_advantage, count = covariance_means([LOGPROBS], [ADVANTAGES], [MASK])
    assert (total_logprob, total_advantage, count) == (-8.0, 0.0, 4.0)
    covariance = token_covariance(LOGPROBS, ADVANTAGES, MASK, total_logprob / count, total_advantage / count)
    # (-1 + 2) * 1 = 1; (-3 + 2) * 1 = -1; (-2 + 2) * -1 = 0; padding 0.
    torch.testing.assert_close(covariance, torch.tensor([[1.0, -1.0, 0.0], [0.0, 0.0, 0.0]]))
    # Per-token advantages (ppo) and centring on other means.
    per_token = torch.tensor([[2.0, 0.0, 0.0], [1.0, -1.0, 0.0]])
    covariance = token_covariance(LOGPROBS, per_token, MASK, -2.5, 0.5)
    torch.testing.assert_close(covariance, torch.tensor([[1.5 * 1.5, -0.5 * -0.5, 0.0], [0.5 * 0.5, 0.5 * -1.5, 0.0]]))


def test_kl_cov_takes_the_tokens_of_largest_covariance_over_every_micro_batch():
    first = torch.tensor([[1.0, -1.0, 7.0]])  # 7.0 is padding: never chosen
    second = torch.tensor([[0.0, 0.5]])
    masks = [torch.tensor([[1.0, 1.0, 0.0]]), torch.tensor([[1.0, 1.0]])]
    assert selected_count(0.5, 4) == 2 and selected_count(0.01, 4) == 1 and selected_count(0.5, 0) == 0
    chosen = kl_cov_selection([first, second], masks, fraction=0.5)
    assert chosen[0].tolist() == [[True, False, False]] and chosen[1].tolist() == [[False, True]]
    chosen = kl_cov_selection([first, second], masks, fraction=0.01)  # at least one token
    assert chosen[0].tolist() == [[True, False, False]] and not chosen[1].any()


def test_clip_cov_draws_its_tokens_from_the_band_alone():
    covariance = [torch.tensor([[1.0, -1.0, 3.0], [0.0, 0.5, 9.0]])]
    mask = [torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])]  # 3.0 is padding; 9.0 is above the band
    band = dict(low=0.4, high=2.0)
    everything = clip_cov_selection(covariance, mask, fraction=1.0, **band)[0]  # more wanted than in the band
    assert everything.tolist() == [[True, False, False], [False, True, False]]
    drawn = set()
    for seed in range(20):  # one token of five (fraction 0.2), drawn at random from the two in the band
        [chosen] = clip_cov_selection(covariance, mask, fraction=0.2, generator=torch.Generator().manual_seed(seed),
                                      **band)
        assert int(chosen.sum()) == 1 and bool((chosen <= everything).all())
        drawn.add(tuple(chosen.reshape(-1).tolist()))
    assert len(drawn) == 2
    assert not clip_cov_selection(covariance, mask, fraction=1.0, low=10.0, high=20.0)[0].any()


def test_clip_cov_detaches_the_chosen_tokens_and_kl_cov_penalises_their_drift():
    logprobs = torch.tensor([[-1.0, -2.0, -3.0]], requires_grad=True)
    chosen = torch.tensor([[True, False, False]])
    without_gradient_at(logprobs, chosen).sum().backward()
    assert logprobs.grad.tolist() == [[0.0, 1.0, 1.0]]
    logprobs.grad = None
    # |-1 - (-1.5)| = 0.5 on the one chosen token, over three generated tokens.
    proximal = torch.tensor([[-1.5, -2.5, -3.5]])
    penalty = kl_cov_penalty(logprobs, proximal, chosen, torch.ones(1, 3), "token")
    assert float(penalty.detach()) == pytest.approx(0.5 / 3)
    penalty.backward()
    assert logprobs.grad.tolist() == [[pytest.approx(1 / 3), 0.0, 0.0]]
    sequence = kl_cov_penalty(logprobs, proximal, chosen, torch.tensor([[1.0, 1.0, 0.0]]), "sequence")
    assert float(sequence) == pytest.approx(0.25)


# -- config checks ---------------------------------------------------------------------------------


@pytest.mark.parametrize("settings, message", [
    ({"entropy_control": "adaptive"}, "learner.entropy_control must be one of none, target, clip_cov, kl_cov"),
    ({"entropy_control": "target"}, "learner.target_entropy must be positive"),
    ({"entropy_control": "target", "target_entropy": 0.5, "entropy_coef_step": 0.0}, "learner.entropy_coef_step must"),
    ({"entropy_control": "target", "target_entropy": 0.5, "entropy_coef": 0.3, "entropy_coef_max": 0.2},
     "learner.entropy_coef_max must be >= learner.entropy_coef"),
    ({"entropy_control": "clip_cov", "cov_fraction": 0.0}, r"learner.cov_fraction must be in \(0, 1\]"),
    ({"entropy_control": "clip_cov", "clip_cov_low": 5.0, "clip_cov_high": 1.0}, "learner.clip_cov_low must be <="),
    ({"entropy_control": "kl_cov", "optimizer_steps_per_batch": 2, "kl_cov_coef": -1.0}, "learner.kl_cov_coef must"),
    ({"entropy_control": "kl_cov"}, "optimizer_steps_per_batch >= 2"),
    ({"target_entropy": 0.5}, "learner.target_entropy is not used by learner.entropy_control = 'none'.*target"),
    ({"entropy_control": "clip_cov", "kl_cov_coef": 2.0}, "learner.kl_cov_coef is not used by .*'clip_cov'"),
    ({"entropy_control": "kl_cov", "optimizer_steps_per_batch": 2, "clip_cov_high": 9.0},
     "learner.clip_cov_high is not used"),
    ({"entropy_top_k": 4}, "learner.entropy_top_k = 4 clamps the entropy bonus, which is off"),
    ({"entropy_top_k": 4, "entropy_control": "clip_cov"}, "learner.entropy_top_k = 4 clamps the entropy bonus"),
    ({"entropy_top_k": 1, "entropy_coef": 0.1}, "learner.entropy_top_k = 1 leaves one token"),
    ({"entropy_top_k": 2, "entropy_coef": 0.1, "entropy_scope": "frozen_groups", "frozen_entropy": 0.8},
     "learner.entropy_scope = 'frozen_groups' picks rows by the whole distribution's entropy"),
])
def test_bad_entropy_control_settings_are_refused_naming_the_key(settings, message):
    with pytest.raises(AlgorithmError, match=message):
        make_algorithm(LearnerConfig(**settings))


def test_a_value_outside_a_keys_own_range_is_refused_by_the_config_itself():
    with pytest.raises(ConfigError, match="learner.entropy_top_k must be >= 0, got -2"):
        load_config(None, ["learner.entropy_top_k=-2", "learner.entropy_coef=0.1"])


def test_the_launcher_refuses_bad_entropy_control_before_starting():
    from longhorizon.launch.checks import validate_config

    base = ["env.name='codebook'", "actor.engine='scripted'"]
    with pytest.raises(ConfigError, match="learner.target_entropy must be positive"):
        validate_config(load_config(None, [*base, "learner.entropy_control='target'"]))
    validate_config(load_config(None, [*base, "learner.entropy_control='clip_cov'", "learner.cov_fraction=0.01"]))


def test_the_launcher_refuses_a_clamp_on_a_bonus_that_is_off():
    from longhorizon.launch.checks import validate_config

    base = ["env.name='codebook'", "actor.engine='scripted'"]
    with pytest.raises(ConfigError, match="learner.entropy_top_k = 4 clamps the entropy bonus, which is off"):
        validate_config(load_config(None, [*base, "learner.entropy_top_k=4"]))
    validate_config(load_config(None, [*base, "learner.entropy_top_k=4", "learner.entropy_coef=0.2"]))


def test_every_mode_and_a_kl_penalty_put_flat_groups_into_the_update():
    assert not needs_flat_members(LearnerConfig())
    for settings in ({"kl_coef": 0.1}, {"entropy_coef": 0.01}, {"entropy_control": "clip_cov"},
                     {"entropy_control": "target", "target_entropy": 0.3},
                     {"entropy_control": "kl_cov", "optimizer_steps_per_batch": 2}):
        assert needs_flat_members(LearnerConfig(**settings)), settings
        assert make_algorithm(LearnerConfig(**settings)).train_flat_groups, settings


# -- the clamped entropy ----------------------------------------------------------------------------


def test_the_clamped_entropy_by_hand():
    logits = torch.tensor([[2.0, 1.0, 0.0, -5.0], [0.0, 3.0, 0.0, 3.0]])
    # Top 2 of the first row: 2 and 1, p = (e, 1) / (e + 1); of the second: 3 and 3, p = (1/2, 1/2).
    p = math.e / (math.e + 1)
    expected = [-(p * math.log(p) + (1 - p) * math.log(1 - p)), math.log(2)]
    assert clamped_entropy(logits, 2).tolist() == pytest.approx(expected, rel=1e-6)
    # All four tokens: the whole distribution's entropy, as logprobs_from_logits computes it.
    whole = torch.softmax(logits, -1)
    assert clamped_entropy(logits, 4).tolist() == pytest.approx((-(whole * whole.log()).sum(-1)).tolist(), rel=1e-6)
    targets = torch.tensor([0, 1])
    _, unclamped = logprobs_from_logits(logits, targets, 1.0, with_entropy=True, entropy_top_k=4)  # k = V: whole
    assert unclamped.tolist() == pytest.approx((-(whole * whole.log()).sum(-1)).tolist(), rel=1e-6)
    logprobs, clamped = logprobs_from_logits(logits, targets, 1.0, with_entropy=True, entropy_top_k=2)
    assert clamped.tolist() == pytest.approx(expected, rel=1e-6)
    # The log-probs are the whole distribution's, whatever the clamp.
    assert logprobs.tolist() == pytest.approx(whole.log()[[0, 1], [0, 1]].tolist(), rel=1e-6)


def test_the_clamped_entropys_gradient_reaches_only_the_top_k_and_matches_its_formula():
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 11, generator=generator, dtype=torch.float64, requires_grad=True)
    weights = torch.rand(5, generator=generator, dtype=torch.float64)
    (clamped_entropy(logits, 4) * weights).sum().backward()
    # Independently: for H = -sum_i p_i log p_i over the kept set S (p = softmax over S),
    # dH/dz_i = -p_i (log p_i + H) for i in S and 0 elsewhere.
    expected = torch.zeros_like(logits)
    for row in range(5):
        kept = sorted(range(11), key=lambda i: -float(logits.detach()[row, i]))[:4]
        z = logits.detach()[row, kept]
        p = torch.exp(z - torch.logsumexp(z, 0))
        entropy = -(p * p.log()).sum()
        expected[row, kept] = -p * (p.log() + entropy) * weights[row]
    torch.testing.assert_close(logits.grad, expected, rtol=1e-10, atol=1e-12)
    assert int((logits.grad != 0).sum()) == 5 * 4


@pytest.mark.parametrize("chunk_tokens", [0, 3])
def test_the_models_clamped_entropy_is_that_of_its_logits(tiny_codebook_model, chunk_tokens):
    model = load_causal_lm(tiny_codebook_model)
    batch = pad_examples(_on_policy_examples(model), pad_token_id=0)
    with torch.no_grad():
        _, entropy = token_logprobs(model, batch, 1.0, chunk_tokens, with_entropy=True, entropy_top_k=3)
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
    torch.testing.assert_close(entropy, clamped_entropy(logits.float(), 3), rtol=1e-5, atol=1e-6)
    assert float(entropy.max()) <= math.log(3) + 1e-6


def test_a_clamped_bonus_steers_the_clamped_entropy(tiny_codebook_model):
    model = load_causal_lm(tiny_codebook_model)
    examples = _on_policy_examples(model)
    whole = Trainer(load_causal_lm(tiny_codebook_model), LearnerConfig(entropy_coef=0.1, learning_rate=1e-3)).step(
        examples)
    clamped = Trainer(model, LearnerConfig(entropy_coef=0.1, entropy_top_k=2, learning_rate=1e-3)).step(examples)
    # The logged entropy is the clamped one: at most log 2, and below the whole vocabulary's.
    assert 0 < clamped["entropy"] <= math.log(2) < whole["entropy"]
    target = Trainer(load_causal_lm(tiny_codebook_model), LearnerConfig(
        entropy_control="target", target_entropy=0.69, entropy_coef=0.01, entropy_coef_step=0.02, entropy_top_k=2,
        learning_rate=1e-3))
    metrics = target.step(examples)
    # The controller compares the clamped entropy with the target: below it, so the coefficient
    # rises a step, where the whole vocabulary's (above log 2) would have made it fall to 0.
    assert metrics["entropy"] < 0.69
    assert target.entropy_controller.coefficient == pytest.approx(0.03)


# -- in the trainer --------------------------------------------------------------------------------

MODES = {
    "target": {"entropy_control": "target", "target_entropy": 5.0, "entropy_coef": 0.01, "entropy_coef_step": 0.02},
    "clip_cov": {"entropy_control": "clip_cov", "cov_fraction": 0.2, "clip_cov_low": -100.0, "clip_cov_high": 100.0},
    "kl_cov": {"entropy_control": "kl_cov", "cov_fraction": 0.2, "optimizer_steps_per_batch": 2},
}


@pytest.mark.parametrize("algorithm", list(BUILTINS))
@pytest.mark.parametrize("mode", list(MODES))
def test_every_mode_trains_every_algorithm_and_logs_its_figures(tiny_codebook_model, algorithm, mode):
    model = load_causal_lm(tiny_codebook_model)
    examples = _on_policy_examples(model)
    if algorithm == "ppo":  # ppo's advantages come from its critic and each token's reward
        examples = [dataclasses.replace(e, token_rewards=np.r_[np.zeros(len(e.token_ids) - 1), e.advantage])
                    for e in examples]
    config = LearnerConfig(algorithm=algorithm, learning_rate=1e-3, micro_batch_size=2, **MODES[mode])
    trainer = Trainer(model, config)
    before = [p.detach().clone() for p in model.parameters()]
    metrics = trainer.step(examples)
    assert metrics["nonfinite_step"] == 0 and math.isfinite(metrics["loss"])
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    if mode == "target":
        assert metrics["entropy_coef"] == 0.01 and 0 < metrics["entropy"] < 5.0
        assert trainer.entropy_controller.coefficient == pytest.approx(0.03)  # below the target: up a step
    else:
        tokens = sum(float(e.loss_mask[1:].sum()) for e in examples)
        name = "cov_clipped_fraction" if mode == "clip_cov" else "cov_penalised_fraction"
        assert metrics[name] == pytest.approx(int(0.2 * tokens) / tokens)
    if mode == "kl_cov":  # 0 on the first pass, then the drift of the chosen tokens
        assert metrics["kl_cov_penalty"] > 0


def _step_gradient(model_folder, config, examples):
    model = load_causal_lm(model_folder)
    Trainer(model, config).step(examples)
    return [p.grad.detach().clone() for p in model.parameters()]


def test_clip_cov_removes_exactly_the_chosen_tokens_policy_gradient(tiny_codebook_model):
    """The chosen tokens (every generated token in the band when the fraction asks for more) are
    the covariance's largest ones, picked over the whole batch across micro-batches: the update
    equals the plain one computed with those tokens' log-probs detached."""
    model = load_causal_lm(tiny_codebook_model)
    examples = _on_policy_examples(model)
    batch = pad_examples(examples, pad_token_id=0)
    with torch.no_grad():
        logprobs = token_logprobs(model, batch)
    total_logprob, total_advantage, count = covariance_means([logprobs], [batch.advantages], [batch.loss_mask])
    covariance = token_covariance(logprobs, batch.advantages, batch.loss_mask, total_logprob / count,
                                  total_advantage / count)
    low = float(covariance[batch.loss_mask > 0].median())  # about half the tokens lie above
    config = LearnerConfig(grad_clip=1e9, micro_batch_size=2, entropy_control="clip_cov", cov_fraction=1.0,
                           clip_cov_low=low, clip_cov_high=1e9)
    chosen = (covariance >= low) & (batch.loss_mask > 0)
    assert 0 < int(chosen.sum()) < int((batch.loss_mask > 0).sum())

    stepped = _step_gradient(tiny_codebook_model, config, examples)
    reference_model = load_causal_lm(tiny_codebook_model)
    trainer = Trainer(reference_model, LearnerConfig(grad_clip=1e9))
    current = token_logprobs(reference_model, batch)
    trainer.algorithm.loss(without_gradient_at(current, chosen), current.detach(), batch.behaviour_logprobs,
                           batch.advantages, batch.loss_mask).loss.backward()
    expected = [p.grad.detach().clone() for p in reference_model.parameters()]
    plain = _step_gradient(tiny_codebook_model, LearnerConfig(grad_clip=1e9, micro_batch_size=2), examples)
    largest = max(float(grad.abs().max()) for grad in expected)
    for got, want in zip(stepped, expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * largest)
    assert any(not torch.allclose(a, b, atol=1e-6 * largest) for a, b in zip(stepped, plain))
    # Every token chosen: nothing is left of the policy gradient.
    everything = config.replace(clip_cov_low=-1e9)
    assert all(float(grad.abs().max()) == 0 for grad in _step_gradient(tiny_codebook_model, everything, examples))


def test_the_adaptive_coefficient_is_kept_in_checkpoints(tmp_path, tiny_codebook_model):
    from longhorizon.learner.checkpoint import load_checkpoint, save_checkpoint
    from longhorizon.learner.curriculum import HorizonState

    config = LearnerConfig(learning_rate=1e-3, **MODES["target"])
    model = load_causal_lm(tiny_codebook_model)
    trainer = Trainer(model, config)
    examples = _on_policy_examples(model)
    first = trainer.step(examples)
    second = trainer.step(examples)
    assert (first["entropy_coef"], second["entropy_coef"]) == (pytest.approx(0.01), pytest.approx(0.03))
    save_checkpoint(tmp_path, trainer=trainer, step=2, version=2, horizon=HorizonState(cap=3, stage=0, step=2),
                    counters={})
    resumed = Trainer(load_causal_lm(tiny_codebook_model), config)
    assert resumed.entropy_controller.coefficient == pytest.approx(0.01)
    load_checkpoint(tmp_path / "checkpoints" / "step_000002", trainer=resumed)
    assert resumed.entropy_controller.coefficient == pytest.approx(0.05)
    assert resumed.step(examples)["entropy_coef"] == pytest.approx(0.05)


# -- where the bonus acts -----------------------------------------------------------------------


def test_the_bonus_on_failed_groups_counts_the_other_rows_at_zero_over_every_token():
    from longhorizon.learner.entropy import bonus_entropy

    entropy = torch.tensor([[1.0, 3.0, 9.0], [2.0, 4.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    failed = torch.tensor([0.0, 1.0])
    assert float(bonus_entropy(entropy, mask, failed, "all", "token")) == pytest.approx((1 + 3 + 2 + 4 + 9) / 5)
    # Only the second row's tokens, over all five generated tokens.
    assert float(bonus_entropy(entropy, mask, failed, "failed_groups", "token")) == pytest.approx((2 + 4 + 9) / 5)
    # Sequence level: the mean of each row's mean, the first row's counted at 0.
    assert float(bonus_entropy(entropy, mask, failed, "failed_groups", "sequence")) == pytest.approx((0 + 5) / 2)


def test_the_bonus_on_frozen_groups_takes_only_the_failed_rows_below_the_entropy_level():
    from longhorizon.learner.entropy import bonus_entropy, bonus_row_weights

    entropy = torch.tensor([[0.1, 0.2, 9.0], [0.1, 0.1, 0.4], [2.0, 1.0, 0.0], [0.05, 0.05, 0.05]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    failed = torch.tensor([1.0, 1.0, 1.0, 0.0])
    # Row means over generated tokens: 0.15 (the 9.0 is not generated), 0.2, 1.0, 0.05. Row 0 is
    # below 0.18, row 1 is not (0.2 is not below it), row 2 is searching, row 3's group succeeded.
    assert bonus_row_weights(entropy, mask, failed, "frozen_groups", 0.18).tolist() == [1.0, 0.0, 0.0, 0.0]
    assert bonus_row_weights(entropy, mask, failed, "frozen_groups", 0.25).tolist() == [1.0, 1.0, 0.0, 0.0]
    assert bonus_row_weights(entropy, mask, failed, "failed_groups", 0.18).tolist() == [1.0, 1.0, 1.0, 0.0]
    assert bonus_row_weights(entropy, mask, failed, "all", 0.18) is None
    # Token level: row 0's two tokens over all 11 generated ones.
    assert float(bonus_entropy(entropy, mask, failed, "frozen_groups", "token", 0.18)) == pytest.approx(0.3 / 11)
    # A row without generated tokens is never taken (its mean is not below anything).
    empty = torch.zeros(1, 3)
    assert bonus_row_weights(empty, empty, torch.ones(1), "frozen_groups", 0.18).tolist() == [0.0]


def test_scoring_marks_the_members_of_groups_without_a_success():
    from types import SimpleNamespace

    from longhorizon.learner.scoring import score_each_group

    def member(success, reward):
        return SimpleNamespace(token_ids=[1, 2, 3], loss_mask=[0, 1, 1], behaviour_logprobs=[0.0, -1.0, -1.0],
                               error=None, success=success, reward=reward)

    groups = [SimpleNamespace(trajectories=[member(False, 0.2), member(False, 0.2)]),   # flat, failed
              SimpleNamespace(trajectories=[member(True, 1.0), member(True, 1.0)]),     # flat, solved
              SimpleNamespace(trajectories=[member(True, 1.0), member(False, 0.0)])]    # signal
    scored = score_each_group(groups, lambda members: np.array([m.reward for m in members]),
                              lambda rewards: rewards - rewards.mean(), train_flat_groups=True)
    assert [e.group_failed for e in scored.examples] == [True, True, False, False, False, False]
    assert pad_examples(scored.examples, 0).group_failed.tolist() == [1, 1, 0, 0, 0, 0]


def test_the_scope_is_checked_with_the_bonus():
    with pytest.raises(AlgorithmError, match="learner.entropy_scope must be one of all, failed_groups, frozen_groups"):
        make_algorithm(LearnerConfig(entropy_scope="failed", entropy_coef=0.1))
    with pytest.raises(AlgorithmError, match="learner.entropy_scope = 'failed_groups' places the entropy bonus"):
        make_algorithm(LearnerConfig(entropy_scope="failed_groups"))
    make_algorithm(LearnerConfig(entropy_scope="failed_groups", entropy_coef=0.1))
    make_algorithm(LearnerConfig(entropy_scope="frozen_groups", entropy_coef=0.1, frozen_entropy=0.3))
    with pytest.raises(AlgorithmError, match="learner.frozen_entropy is read only with learner.entropy_scope = "
                                             "'frozen_groups' \\(it is 'failed_groups'\\)"):
        make_algorithm(LearnerConfig(entropy_scope="failed_groups", entropy_coef=0.1, frozen_entropy=0.3))
    with pytest.raises(ValueError, match="frozen_entropy"):  # not a finite number: the config refuses it
        LearnerConfig(entropy_scope="frozen_groups", entropy_coef=0.1, frozen_entropy=float("nan"))
    for bad in (0.0, -1.0):
        with pytest.raises(AlgorithmError, match="learner.frozen_entropy must be positive"):
            make_algorithm(LearnerConfig(entropy_scope="frozen_groups", entropy_coef=0.1, frozen_entropy=bad))


def test_the_scoped_bonus_in_the_update_acts_on_the_failed_groups_rows_alone(tiny_codebook_model):
    from tests.test_trainer import _gradient

    model = load_causal_lm(tiny_codebook_model)
    examples = _on_policy_examples(model)
    failed = [dataclasses.replace(e, group_failed=True) for e in examples]
    scoped = dict(entropy_coef=0.5, entropy_scope="failed_groups", learning_rate=1e-3)

    def same(a, b):
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-7)

    # Every row failed: the bonus on every token, as with scope "all".
    same(_gradient(tiny_codebook_model, LearnerConfig(**scoped), failed),
         _gradient(tiny_codebook_model, LearnerConfig(entropy_coef=0.5, learning_rate=1e-3), failed))
    # No row failed: no bonus at all (the flat share is no matter: no example here is flat).
    same(_gradient(tiny_codebook_model, LearnerConfig(**scoped), examples),
         _gradient(tiny_codebook_model, LearnerConfig(learning_rate=1e-3), examples))
    # And the bonus does move the update where rows failed.
    moved = _gradient(tiny_codebook_model, LearnerConfig(**scoped), failed)
    plain = _gradient(tiny_codebook_model, LearnerConfig(learning_rate=1e-3), failed)
    assert any(not torch.allclose(x, y, rtol=1e-4, atol=1e-6) for x, y in zip(moved, plain))


def test_the_bonus_share_is_weighted_as_the_loss_weighs_its_tokens(tiny_codebook_model):
    """Three of six rows failed, their replies 2-4 tokens long: under token aggregation the share
    is their share of the generated tokens, under sequence aggregation their share of the rows."""
    model = load_causal_lm(tiny_codebook_model)
    examples = _on_policy_examples(model)
    for example in examples[:3]:
        example.group_failed = True
    tokens = [float(e.loss_mask[1:].sum()) for e in examples]
    by_tokens = sum(tokens[:3]) / sum(tokens)
    assert by_tokens != pytest.approx(0.5)  # the two weightings differ on these rows
    for aggregation, expected in (("token", by_tokens), ("sequence", 0.5)):
        config = LearnerConfig(entropy_coef=0.1, entropy_scope="failed_groups", aggregation=aggregation,
                               learning_rate=1e-3)
        share = Trainer(load_causal_lm(tiny_codebook_model), config).step(examples)["entropy_bonus_share"]
        assert share == pytest.approx(expected), aggregation


def test_the_frozen_groups_bonus_in_the_update_follows_the_entropy_level(tiny_codebook_model):
    from tests.test_trainer import _gradient

    model = load_causal_lm(tiny_codebook_model)
    failed = [dataclasses.replace(e, group_failed=True) for e in _on_policy_examples(model)]

    def same(a, b):
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-7)

    def frozen(level):
        return LearnerConfig(entropy_coef=0.5, entropy_scope="frozen_groups", frozen_entropy=level, learning_rate=1e-3)

    # A random tiny model is far from sure (about 2.7 nats a token): above any small level, no
    # row is frozen and the update is the one without a bonus; below a level above every row's
    # entropy, every failed row is, as with scope failed_groups.
    same(_gradient(tiny_codebook_model, frozen(0.2), failed),
         _gradient(tiny_codebook_model, LearnerConfig(learning_rate=1e-3), failed))
    same(_gradient(tiny_codebook_model, frozen(100.0), failed),
         _gradient(tiny_codebook_model, LearnerConfig(entropy_coef=0.5, entropy_scope="failed_groups",
                                                      learning_rate=1e-3), failed))
    # The step says what share of the generated tokens the bonus acted on.
    assert Trainer(load_causal_lm(tiny_codebook_model), frozen(0.2)).step(failed)["entropy_bonus_share"] == 0.0
    assert Trainer(load_causal_lm(tiny_codebook_model), frozen(100.0)).step(failed)["entropy_bonus_share"] == \
        pytest.approx(1.0)
