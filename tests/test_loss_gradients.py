"""Every loss's value and its gradient with respect to the new log-probs (or values, or logits) at
points inside, above and below each clip range, for a positive and a negative advantage, against
numbers worked out by hand in the comments. A lost stop-gradient, a min taken for a max, or a
clip bound moved changes one of these numbers.

Each policy batch is two rows of three tokens: row 0 has advantage +2, row 1 advantage -0.5, and
the three tokens of a row sit inside the clip range, above it and below it. With "token"
aggregation the loss is the sum of the six per-token losses over 6, so a token's gradient is
its own per-token derivative over 6. For a PPO surrogate min(r * A, clip(r) * A) that derivative
(d/d log pi, and d r / d log pi = r) is r * A on the branch that is not clipped and 0 on the
clipped one: with A > 0 the clip acts above the range, with A < 0 below it.
"""

import math

import pytest
import torch

from longhorizon.common.config import LearnerConfig
from longhorizon.learner.algorithms import AlgorithmError, make_algorithm
from longhorizon.learner.critic import value_loss
from longhorizon.learner.entropy import bonus_entropy, bonus_row_weights, kl_cov_penalty, without_gradient_at
from longhorizon.learner.logprobs import clamped_entropy, logprobs_from_logits
from longhorizon.learner.losses import (
    cispo_loss,
    decoupled_ppo_loss,
    gspo_loss,
    kl_penalty,
    ppo_clip_loss,
    truncated_is_loss,
)

LOG = math.log
LN2 = math.log(2)


def leaf(rows):
    """A float64 tensor that takes a gradient: a loss must not send it one unless it is the policy's."""
    return torch.tensor(rows, dtype=torch.float64, requires_grad=True)


def const(rows):
    return torch.tensor(rows, dtype=torch.float64)


def check(output, wrt, expected_loss, expected_gradient, held=(), tolerance=1e-12):
    """The loss's value, its gradient with respect to `wrt`, and no gradient at all into the
    tensors in `held` (the stop-gradients). Float64 throughout, so the tolerance is tight, except
    where the code under test computes in float32 (log-probs from logits)."""
    loss = output.loss if hasattr(output, "loss") else output
    assert loss.item() == pytest.approx(expected_loss, rel=tolerance, abs=tolerance)
    loss.backward()
    torch.testing.assert_close(wrt.grad, const(expected_gradient), rtol=tolerance, atol=tolerance)
    for tensor in held:
        assert tensor.grad is None


ADVANTAGES = [2.0, -0.5]
MASK = [[1, 1, 1], [1, 1, 1]]

# -- the PPO clip: ratios 1.1 (inside [0.8, 1.2]), 1.5 (above), 0.5 (below) -------------------------
#
# pi_old = 0.4 on every token, pi_theta = 0.4 * r = 0.44, 0.6, 0.2.
PPO_RATIOS = (1.1, 1.5, 0.5)
PPO_OLD = [[LOG(0.4)] * 3] * 2
PPO_CURRENT = [[LOG(0.4 * ratio) for ratio in PPO_RATIOS]] * 2
# Surrogates min(r A, clip(r, 0.8, 1.2) A):
#   A = +2:   r 1.1: min(2.2, 2.2) = 2.2 (inside, d = rA = 2.2)
#             r 1.5: min(3.0, 2.4) = 2.4 (clipped, d = 0)
#             r 0.5: min(1.0, 1.6) = 1.0 (below: not clipped for A > 0, d = 1.0)
#   A = -0.5: r 1.1: -0.55 (inside, d = -0.55)
#             r 1.5: min(-0.75, -0.6) = -0.75 (above: not clipped for A < 0, d = -0.75)
#             r 0.5: min(-0.25, -0.4) = -0.4 (clipped, d = 0)
# Loss -(2.2 + 2.4 + 1.0 - 0.55 - 0.75 - 0.4) / 6 = -3.9 / 6; gradient -d / 6.
PPO_LOSS = -3.9 / 6
PPO_GRADIENT = [[-2.2 / 6, 0.0, -1.0 / 6], [0.55 / 6, 0.75 / 6, 0.0]]


def test_ppo_clip_inside_above_and_below_the_range_for_both_signs():
    logprobs, old, advantages = leaf(PPO_CURRENT), leaf(PPO_OLD), leaf(ADVANTAGES)
    output = ppo_clip_loss(logprobs, old, advantages, const(MASK), clip_eps=0.2)
    check(output, logprobs, PPO_LOSS, PPO_GRADIENT, held=(old, advantages))
    # Clipped: (A > 0, above) and (A < 0, below), 2 of 6.
    assert output.metrics["clip_fraction"] == pytest.approx(2 / 6)


# -- decoupled PPO: the same ratios against pi_prox, behaviour weights pi_prox / mu --------------------
#
# Per token w = 0.5 (below 1), 1.5 (inside the cap of 2), 3 (above: truncated to 2), in both rows:
# mu = 0.4 / w = 0.8, 0.4 / 1.5, 0.4 / 3.
WEIGHTS = (0.5, 1.5, 3.0)
DECOUPLED_BEHAVIOUR = [[LOG(0.4 / w) for w in WEIGHTS]] * 2
# Per-token -w * surrogate, w = 0.5, 1.5, 2:
#   A = +2:   0.5 * 2.2 = 1.1, 1.5 * 2.4 = 3.6, 2 * 1.0 = 2.0            (sum 6.7)
#   A = -0.5: 0.5 * -0.55 = -0.275, 1.5 * -0.75 = -1.125, 2 * -0.4 = -0.8 (sum -2.2)
# Loss -(6.7 - 2.2) / 6 = -0.75; gradient -w * d / 6 (w a constant).
DECOUPLED_LOSS = -0.75
DECOUPLED_GRADIENT = [[-1.1 / 6, 0.0, -2.0 / 6], [0.275 / 6, 1.125 / 6, 0.0]]


def test_decoupled_ppo_weights_each_tokens_clipped_surrogate_by_a_constant():
    logprobs, proximal, behaviour = leaf(PPO_CURRENT), leaf(PPO_OLD), leaf(DECOUPLED_BEHAVIOUR)
    output = decoupled_ppo_loss(logprobs, proximal, behaviour, const(ADVANTAGES), const(MASK),
                                clip_eps=0.2, behaviour_weight_cap=2.0)
    check(output, logprobs, DECOUPLED_LOSS, DECOUPLED_GRADIENT, held=(proximal, behaviour))
    assert output.metrics["behaviour_weight_truncated_fraction"] == pytest.approx(2 / 6)


def test_decoupled_ppo_with_a_geometric_weight_per_sequence():
    # Each row's weight: (0.5 * 1.5 * 3) ** (1/3) = 2.25 ** (1/3) ~ 1.31, under the cap, on every
    # token: the loss and gradient are plain PPO's times it.
    weight = 2.25 ** (1 / 3)
    logprobs, proximal, behaviour = leaf(PPO_CURRENT), leaf(PPO_OLD), leaf(DECOUPLED_BEHAVIOUR)
    output = decoupled_ppo_loss(logprobs, proximal, behaviour, const(ADVANTAGES), const(MASK),
                                weight_level="geometric")
    check(output, logprobs, weight * PPO_LOSS, [[weight * g for g in row] for row in PPO_GRADIENT],
          held=(proximal, behaviour))


# -- truncated IS (REINFORCE with a bounded weight) ------------------------------------------------------
#
# Weights pi / mu = 0.5 (below 1), 1.5 (inside the cap of 2), 3 (above: 2); pi = 0.2, 0.6, 0.9.
IS_CURRENT = [[LOG(0.2), LOG(0.6), LOG(0.9)]] * 2
IS_BEHAVIOUR = [[LOG(0.2 / 0.5), LOG(0.6 / 1.5), LOG(0.9 / 3.0)]] * 2
# Per token -w * A * log pi, w detached: loss -(2 - 0.5) * S / 6 with S = 0.5 log 0.2 + 1.5 log 0.6
# + 2 log 0.9; gradient -w * A / 6: row 0 (-1, -3, -4) / 6, row 1 (0.25, 0.75, 1) / 6. A weight
# that kept its gradient (d w / d log pi = w inside the cap) would add -w * A * log pi / 6.
IS_SUM = 0.5 * LOG(0.2) + 1.5 * LOG(0.6) + 2.0 * LOG(0.9)


def test_truncated_is_weight_below_inside_and_above_its_cap():
    logprobs, behaviour = leaf(IS_CURRENT), leaf(IS_BEHAVIOUR)
    output = truncated_is_loss(logprobs, behaviour, const(ADVANTAGES), const(MASK), is_cap=2.0)
    check(output, logprobs, -1.5 * IS_SUM / 6, [[-1 / 6, -3 / 6, -4 / 6], [0.25 / 6, 0.75 / 6, 1 / 6]],
          held=(behaviour,))


# -- CISPO: the weight pi / mu clipped to [0.8, 1.28], detached, every token's gradient kept ----------
#
# pi / mu = 1.1 (inside), 1.5 (above: 1.28), 0.5 (below: 0.8); mu = 0.4, pi = 0.44, 0.6, 0.2.
CISPO_CURRENT = PPO_CURRENT
CISPO_BEHAVIOUR = PPO_OLD
# Per token -w * A * log pi: loss -(2 - 0.5) * (1.1 log 0.44 + 1.28 log 0.6 + 0.8 log 0.2) / 6;
# gradient -w * A / 6: row 0 (-2.2, -2.56, -1.6) / 6, row 1 (0.55, 0.64, 0.4) / 6. PPO's clip would
# give 0 at (A > 0, above) and (A < 0, below); CISPO keeps them.
CISPO_LOSS = -1.5 * (1.1 * LOG(0.44) + 1.28 * LOG(0.6) + 0.8 * LOG(0.2)) / 6
CISPO_GRADIENT = [[-2.2 / 6, -2.56 / 6, -1.6 / 6], [0.55 / 6, 0.64 / 6, 0.4 / 6]]


def test_cispo_weight_inside_above_and_below_its_clip_for_both_signs():
    logprobs, behaviour = leaf(CISPO_CURRENT), leaf(CISPO_BEHAVIOUR)
    output = cispo_loss(logprobs, behaviour, const(ADVANTAGES), const(MASK), clip_eps_low=0.2, clip_eps_high=0.28)
    check(output, logprobs, CISPO_LOSS, CISPO_GRADIENT, held=(behaviour,))
    assert output.metrics["is_weight_clipped_fraction"] == pytest.approx(4 / 6)


# -- GSPO: one length-normalised ratio per sequence, clipped to [0.9, 1.2] -------------------------------
#
# Six rows of two tokens, pi_prox = 0.2 and 0.4; token ratios 2s and s/2, so the sequence ratio
# s = sqrt(2s * s/2) is 1.05 (inside), 1.5 (above), 0.5 (below), for A = +2 (rows 0-2) and A = -0.5
# (rows 3-5). Behaviour weights pi_prox / mu of 2 and 1.125 per token: the sequence's geometric
# mean sqrt(2.25) = 1.5, under the cap of 2, in every row.
SEQUENCE_RATIOS = (1.05, 1.5, 0.5) * 2
GSPO_PROXIMAL = [[LOG(0.2), LOG(0.4)]] * 6
GSPO_CURRENT = [[LOG(0.4 * s), LOG(0.2 * s)] for s in SEQUENCE_RATIOS]
GSPO_BEHAVIOUR = [[LOG(0.2 / 2.0), LOG(0.4 / 1.125)]] * 6
GSPO_ADVANTAGES = [2.0] * 3 + [-0.5] * 3
# Surrogates min(s A, clip(s, 0.9, 1.2) A):
#   A = +2:   2.1 (inside), min(3.0, 2.4) = 2.4 (clipped), min(1.0, 1.8) = 1.0
#   A = -0.5: -0.525 (inside), min(-0.75, -0.6) = -0.75, min(-0.25, -0.45) = -0.45 (clipped)
# Loss -1.5 * (2.1 + 2.4 + 1.0 - 0.525 - 0.75 - 0.45) / 6 rows = -1.5 * 3.775 / 6.
# d s / d log pi_t = s / 2 tokens, so a token's gradient is -1.5 * A * s / 2 / 6 where the
# surrogate is not clipped: rows 0, 2 give -1.5 * 2 * 0.525 / 6, -1.5 * 2 * 0.25 / 6; rows 3, 4
# give 1.5 * 0.5 * 0.525 / 6, 1.5 * 0.5 * 0.75 / 6.
GSPO_LOSS = -1.5 * 3.775 / 6
GSPO_GRADIENT = [[g, g] for g in (-1.575 / 6, 0.0, -0.75 / 6, 0.39375 / 6, 0.5625 / 6, 0.0)]


def test_gspo_sequence_ratio_inside_above_and_below_its_clip_for_both_signs():
    logprobs, proximal, behaviour = leaf(GSPO_CURRENT), leaf(GSPO_PROXIMAL), leaf(GSPO_BEHAVIOUR)
    output = gspo_loss(logprobs, proximal, behaviour, const(GSPO_ADVANTAGES), const([[1, 1]] * 6),
                       clip_eps_low=0.1, clip_eps_high=0.2, behaviour_weight_cap=2.0)
    check(output, logprobs, GSPO_LOSS, GSPO_GRADIENT, held=(proximal, behaviour))
    assert output.metrics["clip_fraction"] == pytest.approx(2 / 6)


def test_gspo_behaviour_weight_truncated_at_its_cap():
    # A cap of 1.2 cuts every row's weight 1.5 to 1.2: loss and gradient scale by 1.2 / 1.5 = 0.8.
    logprobs = leaf(GSPO_CURRENT)
    output = gspo_loss(logprobs, const(GSPO_PROXIMAL), const(GSPO_BEHAVIOUR), const(GSPO_ADVANTAGES),
                       const([[1, 1]] * 6), clip_eps_low=0.1, clip_eps_high=0.2, behaviour_weight_cap=1.2)
    check(output, logprobs, 0.8 * GSPO_LOSS, [[0.8 * g for g in row] for row in GSPO_GRADIENT])


# -- the built-in algorithms' losses, as make_algorithm builds them --------------------------------------
#
# DAPO's batch: ratios 1.25 (inside its [0.8, 1.28], above grpo's 1.2), 1.4 (above both), 0.7
# (below both) against pi_prox = 0.4, and behaviour = proximal (w = 1).
DAPO_CURRENT = [[LOG(0.4 * ratio) for ratio in (1.25, 1.4, 0.7)]] * 2
# dapo, min(r A, clip(r, 0.8, 1.28) A):
#   A = +2:   2.5 (inside), min(2.8, 2.56) = 2.56 (clipped), min(1.4, 1.6) = 1.4
#   A = -0.5: -0.625 (inside), min(-0.7, -0.64) = -0.7, min(-0.35, -0.4) = -0.4 (clipped)
#   loss -(2.5 + 2.56 + 1.4 - 0.625 - 0.7 - 0.4) / 6 = -4.735 / 6
# grpo on the same batch, clip(r, 0.8, 1.2): 1.25 is clipped too for A = +2:
#   A = +2:   min(2.5, 2.4) = 2.4 (clipped), 2.4 (clipped), 1.4
#   A = -0.5: min(-0.625, -0.6) = -0.625, -0.7, -0.4 (clipped)
#   loss -(2.4 + 2.4 + 1.4 - 0.625 - 0.7 - 0.4) / 6 = -4.475 / 6
#
# With a mask that drops row 1's last token (decoupled batch), per-token losses -1.1, -3.6, -2.0 and
# 0.275, 1.125: token level -(6.7 - 1.4) / 5; sequence level (-6.7 / 3 + 1.4 / 2) / 2; dr_grpo's
# sum over the tokens / (2 sequences * 4 normaliser tokens). The gradients divide the same way.
#
# grpo with loss = "none" clips against mu: ratios pi / mu = 0.44 / 0.8 = 0.55, 0.6 * 1.5 / 0.4 =
# 2.25, 0.2 * 3 / 0.4 = 1.5:
#   A = +2:   min(1.1, 1.6) = 1.1 (d 1.1), 2.4 (clipped), 2.4 (clipped)
#   A = -0.5: min(-0.275, -0.4) = -0.4 (clipped), -1.125 (d -1.125), -0.75 (d -0.75)
#   loss -(1.1 + 2.4 + 2.4 - 0.4 - 1.125 - 0.75) / 6 = -3.625 / 6
# grpo with loss = "truncated_is" and behaviour_weight_cap 1.6: weights pi / mu = 0.55, 2.25 -> 1.6, 1.5:
#   loss -(2 - 0.5) * (0.55 log 0.44 + 1.6 log 0.6 + 1.5 log 0.2) / 6, gradient -w A / 6.
#
# The decoupled batch with each option of grpo's changed from its default:
# - behaviour_weight_cap 1.2: w = 0.5, 1.2, 1.2; per-token -w * surrogate: -1.1, -2.88, -1.2 and
#   0.275, 0.9, 0.48: loss -(5.18 - 1.655) / 6, gradient -w * d / 6;
# - clip_eps 0.6: every ratio inside [0.4, 1.6], so no token is clipped: surrogates 2.2, 3.0, 1.0
#   and -0.55, -0.75, -0.25, times w = 0.5, 1.5, 2: loss -(7.6 - 1.9) / 6, gradient -w * r * A / 6;
# - weight_level geometric: as test_decoupled_ppo_with_a_geometric_weight_per_sequence.
SHORT_MASK = [[1, 1, 1], [1, 1, 0]]
DECOUPLED_ROWS = ([-1.1, 0.0, -2.0], [0.275, 1.125, 0.0])


def scaled(rows, *divisors):
    return [[value / divisor for value in row] for row, divisor in zip(rows, divisors)]


ALGORITHM_CASES = {
    "grpo": ({}, PPO_CURRENT, PPO_OLD, DECOUPLED_BEHAVIOUR, MASK, DECOUPLED_LOSS, DECOUPLED_GRADIENT),
    "rloo": ({}, PPO_CURRENT, PPO_OLD, DECOUPLED_BEHAVIOUR, MASK, DECOUPLED_LOSS, DECOUPLED_GRADIENT),
    "reinforce_pp": ({}, PPO_CURRENT, PPO_OLD, DECOUPLED_BEHAVIOUR, MASK, DECOUPLED_LOSS, DECOUPLED_GRADIENT),
    "ppo": ({}, PPO_CURRENT, PPO_OLD, DECOUPLED_BEHAVIOUR, MASK, DECOUPLED_LOSS, DECOUPLED_GRADIENT),
    "grpo, short row": ({}, PPO_CURRENT, PPO_OLD, DECOUPLED_BEHAVIOUR, SHORT_MASK, -5.3 / 5,
                        scaled(DECOUPLED_ROWS, 5, 5)),
    "grpo, sequence": ({"aggregation": "sequence"}, PPO_CURRENT, PPO_OLD, DECOUPLED_BEHAVIOUR, SHORT_MASK,
                       (-6.7 / 3 + 1.4 / 2) / 2, scaled(DECOUPLED_ROWS, 3 * 2, 2 * 2)),
    "dr_grpo": ({"loss_normaliser_tokens": 4.0}, PPO_CURRENT, PPO_OLD, DECOUPLED_BEHAVIOUR, SHORT_MASK,
                -5.3 / 8, scaled(DECOUPLED_ROWS, 8, 8)),
    "grpo, none": ({"loss": "none"}, PPO_CURRENT, PPO_OLD, DECOUPLED_BEHAVIOUR, MASK, -3.625 / 6,
                   [[-1.1 / 6, 0.0, 0.0], [0.0, 1.125 / 6, 0.75 / 6]]),
    "grpo, truncated_is": ({"loss": "truncated_is", "behaviour_weight_cap": 1.6}, PPO_CURRENT, PPO_OLD,
                           DECOUPLED_BEHAVIOUR, MASK, -1.5 * (0.55 * LOG(0.44) + 1.6 * LOG(0.6) + 1.5 * LOG(0.2)) / 6,
                           [[-1.1 / 6, -3.2 / 6, -3 / 6], [0.275 / 6, 0.8 / 6, 0.75 / 6]]),
    "grpo, cap 1.2": ({"behaviour_weight_cap": 1.2}, PPO_CURRENT, PPO_OLD, DECOUPLED_BEHAVIOUR, MASK,
                      -(5.18 - 1.655) / 6, [[-1.1 / 6, 0.0, -1.2 / 6], [0.275 / 6, 0.9 / 6, 0.0]]),
    "grpo, clip 0.6": ({"clip_eps": 0.6}, PPO_CURRENT, PPO_OLD, DECOUPLED_BEHAVIOUR, MASK, -(7.6 - 1.9) / 6,
                       [[-1.1 / 6, -4.5 / 6, -2.0 / 6], [0.275 / 6, 1.125 / 6, 0.5 / 6]]),
    "grpo, geometric": ({"weight_level": "geometric"}, PPO_CURRENT, PPO_OLD, DECOUPLED_BEHAVIOUR, MASK,
                        2.25 ** (1 / 3) * PPO_LOSS, [[2.25 ** (1 / 3) * g for g in row] for row in PPO_GRADIENT]),
    "dapo": ({}, DAPO_CURRENT, PPO_OLD, PPO_OLD, MASK, -4.735 / 6,
             [[-2.5 / 6, 0.0, -1.4 / 6], [0.625 / 6, 0.7 / 6, 0.0]]),
    "grpo, dapo's batch": ({}, DAPO_CURRENT, PPO_OLD, PPO_OLD, MASK, -4.475 / 6,
                           [[0.0, 0.0, -1.4 / 6], [0.625 / 6, 0.7 / 6, 0.0]]),
    "cispo": ({"clip_eps_low": 0.2, "clip_eps_high": 0.28}, CISPO_CURRENT, PPO_OLD, CISPO_BEHAVIOUR, MASK,
              CISPO_LOSS, CISPO_GRADIENT),
}


@pytest.mark.parametrize("case", ALGORITHM_CASES)
def test_each_builtin_algorithms_loss_and_gradient_by_hand(case):
    options, current, proximal_rows, behaviour_rows, mask, expected_loss, expected_gradient = ALGORITHM_CASES[case]
    algorithm = make_algorithm(LearnerConfig(algorithm=case.split(",")[0], **options))
    logprobs, proximal, behaviour, advantages = leaf(current), leaf(proximal_rows), leaf(behaviour_rows), leaf(ADVANTAGES)
    output = algorithm.loss(logprobs, proximal, behaviour, advantages, const(mask))
    check(output, logprobs, expected_loss, expected_gradient, held=(proximal, behaviour, advantages))


def test_gspo_as_the_algorithm_builds_it():
    algorithm = make_algorithm(LearnerConfig(algorithm="gspo", clip_eps_low=0.1, clip_eps_high=0.2))
    logprobs, proximal, behaviour = leaf(GSPO_CURRENT), leaf(GSPO_PROXIMAL), leaf(GSPO_BEHAVIOUR)
    output = algorithm.loss(logprobs, proximal, behaviour, const(GSPO_ADVANTAGES), const([[1, 1]] * 6))
    check(output, logprobs, GSPO_LOSS, GSPO_GRADIENT, held=(proximal, behaviour))


# -- ppo's clipped value loss --------------------------------------------------------------------------
#
# Old values 0, value_clip 0.2, value_coef 0.5. Per token 0.5 * max((V - R)^2, (clip(V, -0.2, 0.2) - R)^2):
#   V  0.1, R  1: inside the clip, both 0.81;                       d/dV = V - R = -0.9
#   V  0.5, R  1: above; 0.25 against (0.2 - 1)^2 = 0.64, clipped;  d/dV = 0
#   V  0.5, R -1: above; 2.25 against (0.2 + 1)^2 = 1.44, unclipped; d/dV = 1.5
#   V -0.5, R -1: below; 0.25 against (-0.2 + 1)^2 = 0.64, clipped; d/dV = 0
#   V -0.5, R  1: below; 2.25 against 1.44, unclipped;              d/dV = -1.5
#   V -0.1, R -1: inside, both 0.81;                                 d/dV = 0.9
# Critic loss 0.5 * (0.81 + 0.64 + 2.25 + 0.64 + 2.25 + 0.81) / 6 = 0.5 * 7.4 / 6; ppo's value loss
# is 0.5 times that, with the gradient 0.5 * (V - R) / 6 where unclipped.
VALUES = [[0.1, 0.5, 0.5], [-0.5, -0.5, -0.1]]
RETURNS = [[1.0, 1.0, -1.0], [-1.0, 1.0, -1.0]]
OLD_VALUES = [[0.0] * 3] * 2


def test_the_clipped_value_loss_inside_above_and_below_its_range():
    values = leaf(VALUES)
    critic = value_loss(values, const(OLD_VALUES), const(RETURNS), const(MASK), value_clip=0.2)
    check(critic, values, 0.5 * 7.4 / 6, [[-0.9 / 6, 0.0, 1.5 / 6], [0.0, -1.5 / 6, 0.9 / 6]])


def test_ppo_weights_its_value_loss_by_value_coef():
    values = leaf(VALUES)
    output = make_algorithm(LearnerConfig(algorithm="ppo")).value_loss(
        values, const(OLD_VALUES), const(RETURNS), const(MASK))
    check(output, values, 0.5 * 0.5 * 7.4 / 6, [[-0.45 / 6, 0.0, 0.75 / 6], [0.0, -0.75 / 6, 0.45 / 6]])
    assert output.metrics["value_loss"] == pytest.approx(0.5 * 7.4 / 6)


def test_the_value_loss_without_a_clip_is_the_squared_error():
    # 0.5 * (0.81 + 0.25 + 2.25 + 0.25 + 2.25 + 0.81) / 6 = 0.5 * 6.62 / 6; gradient (V - R) / 6.
    values = leaf(VALUES)
    critic = value_loss(values, const(OLD_VALUES), const(RETURNS), const(MASK), value_clip=0.0)
    check(critic, values, 0.5 * 6.62 / 6, [[-0.9 / 6, -0.5 / 6, 1.5 / 6], [0.5 / 6, -1.5 / 6, 0.9 / 6]])


# -- the KL penalty ------------------------------------------------------------------------------------
#
# k3 = exp(ref - lp) - (ref - lp) - 1, d k3 / d lp = 1 - exp(ref - lp). Tokens with ref - lp = log 2
# (pi below the reference), -log 2 (above) and 0: k3 = 1 - log 2, log 2 - 0.5, 0 (sum 0.5); the
# gradient 1 - 2 = -1, 1 - 0.5 = 0.5, 0, over 3 tokens.


def test_the_kl_penalty_below_above_and_at_the_reference():
    logprobs = leaf([[LOG(0.25), LOG(0.5), LOG(0.3)]])
    reference = leaf([[LOG(0.5), LOG(0.25), LOG(0.3)]])
    output = kl_penalty(logprobs, reference, const([[1, 1, 1]]))
    check(output, logprobs, 0.5 / 3, [[-1 / 3, 0.5 / 3, 0.0]], held=(reference,))


# -- entropy terms -------------------------------------------------------------------------------------


def test_the_full_entropy_and_the_chosen_log_prob_and_their_gradients_in_the_logits():
    # p = (0.25, 0.5, 0.25): H = 2 * 0.25 * log 4 + 0.5 * log 2 = 1.5 log 2.
    # d H / d z_i = -p_i (log p_i + H): 0.25 * 0.5 log 2 for the quarters, -0.5 * 0.5 log 2 for the half.
    # d log p_1 / d z = onehot(1) - p = (-0.25, 0.5, -0.25).
    rows = [[[LOG(0.25), LOG(0.5), LOG(0.25)]]]
    logits = leaf(rows)
    _, entropy = logprobs_from_logits(logits, torch.tensor([[1]]), 1.0, with_entropy=True)
    check(entropy.sum(), logits, 1.5 * LN2, [[[0.125 * LN2, -0.25 * LN2, 0.125 * LN2]]], tolerance=1e-6)
    logits = leaf(rows)
    check(logprobs_from_logits(logits, torch.tensor([[1]]), 1.0).sum(), logits, LOG(0.5), [[[-0.25, 0.5, -0.25]]],
          tolerance=1e-6)


def test_the_clamped_entropy_and_its_gradient_reach_only_the_top_k_logits():
    # p = (0.1, 0.6, 0.3), k = 2: the top two renormalised are q = (2/3, 1/3), H = log 3 - (2/3) log 2.
    # d H / d z_i = -q_i (log q_i + H) on the top two: -(2/3)(log 2 - (2/3) log 2) = -(2/9) log 2 and
    # -(1/3)(-(2/3) log 2) = (2/9) log 2; the tail token 0 gets nothing.
    logits = leaf([LOG(0.1), LOG(0.6), LOG(0.3)])
    check(clamped_entropy(logits, 2), logits, LOG(3) - 2 / 3 * LN2, [0.0, -2 / 9 * LN2, 2 / 9 * LN2])


def test_the_entropy_bonus_reaches_only_its_rows():
    # Rows: failed with mean entropy 0.3 (below frozen_entropy 0.5: frozen), failed with 0.6 on its one
    # generated token (not frozen), succeeded with 0.1. Token level over the 5 generated tokens:
    # (0.2 + 0.4) / 5, gradient 1/5 on row 0's tokens; sequence level: row 0's mean 0.3 over 3 rows,
    # gradient 1 / (2 tokens * 3 rows). "failed_groups" takes rows 0 and 1: (0.2 + 0.4 + 0.6) / 5.
    mask, failed = const([[1, 1], [1, 0], [1, 1]]), const([1.0, 1.0, 0.0])
    rows = [[0.2, 0.4], [0.6, 9.0], [0.1, 0.1]]
    entropy = leaf(rows)
    check(bonus_entropy(entropy, mask, failed, "frozen_groups", "token", 0.5), entropy, 0.6 / 5,
          [[0.2, 0.2], [0.0, 0.0], [0.0, 0.0]])
    entropy = leaf(rows)
    check(bonus_entropy(entropy, mask, failed, "frozen_groups", "sequence", 0.5), entropy, 0.1,
          [[1 / 6, 1 / 6], [0.0, 0.0], [0.0, 0.0]])
    entropy = leaf(rows)
    check(bonus_entropy(entropy, mask, failed, "failed_groups", "token"), entropy, 1.2 / 5,
          [[0.2, 0.2], [0.2, 0.0], [0.0, 0.0]])


def test_frozen_groups_are_judged_by_the_full_entropy_so_a_clamped_one_is_refused():
    """A policy spread evenly over 8 tokens is searching, not frozen: its full entropy log 8 ~ 2.08
    is above frozen_entropy 0.8. Its entropy clamped to the top 2 is log 2 ~ 0.69, below 0.8 (a
    clamped entropy is never above log k), so judged by it the row would get the bonus, as would
    every failed row: the pair is refused when the algorithm is made."""
    logits = torch.zeros(1, 1, 8, dtype=torch.float64)
    _, full = logprobs_from_logits(logits, torch.tensor([[0]]), 1.0, with_entropy=True)
    _, clamped = logprobs_from_logits(logits, torch.tensor([[0]]), 1.0, with_entropy=True, entropy_top_k=2)
    assert full.item() == pytest.approx(LOG(8)) and clamped.item() == pytest.approx(LN2)
    failed, mask = torch.ones(1, dtype=torch.float64), torch.ones(1, 1, dtype=torch.float64)
    assert bonus_row_weights(full, mask, failed, "frozen_groups", 0.8).tolist() == [0.0]
    assert bonus_row_weights(clamped, mask, failed, "frozen_groups", 0.8).tolist() == [1.0]
    with pytest.raises(AlgorithmError) as refused:
        make_algorithm(LearnerConfig(entropy_coef=0.1, entropy_scope="frozen_groups", frozen_entropy=0.8,
                                     entropy_top_k=2))
    message = str(refused.value)
    assert "\n" not in message and "frozen_groups" in message and "entropy_top_k = 2" in message
    make_algorithm(LearnerConfig(entropy_coef=0.1, entropy_scope="frozen_groups", frozen_entropy=0.8))
    make_algorithm(LearnerConfig(entropy_coef=0.1, entropy_scope="failed_groups", entropy_top_k=2))


# -- Clip-Cov and KL-Cov -------------------------------------------------------------------------------


def test_kl_cov_penalises_the_drift_of_its_chosen_tokens_only():
    # log pi - log pi_prox = 0.3, -0.2, 0.5; tokens 0 and 1 chosen: (0.3 + 0.2) / 3 tokens, gradient
    # sign(drift) / 3 on them and 0 on the unchosen one.
    proximal = leaf([[-1.0, -2.0, -0.5]])
    logprobs = leaf([[-0.7, -2.2, 0.0]])
    penalty = kl_cov_penalty(logprobs, proximal, torch.tensor([[True, True, False]]), const([[1, 1, 1]]), "token")
    check(penalty, logprobs, 0.5 / 3, [[1 / 3, -1 / 3, 0.0]], held=(proximal,))


def test_clip_cov_takes_the_policy_gradient_of_its_chosen_tokens_away():
    # The PPO batch with tokens (0, 0) and (1, 1) chosen: the same loss, their gradient 0.
    logprobs = leaf(PPO_CURRENT)
    chosen = torch.tensor([[True, False, False], [False, True, False]])
    output = ppo_clip_loss(without_gradient_at(logprobs, chosen), const(PPO_OLD), const(ADVANTAGES), const(MASK))
    check(output, logprobs, PPO_LOSS, [[0.0, 0.0, -1.0 / 6], [0.55 / 6, 0.0, 0.0]])
