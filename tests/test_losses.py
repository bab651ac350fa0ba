"""Policy losses checked against hand-worked values and gradients on tiny tensors."""

import math

import pytest
import torch

from longhorizon.learner.losses import (
    POLICY_LOSS_NAMES,
    aggregate,
    decoupled_ppo_loss,
    kl_penalty,
    policy_loss,
    ppo_clip_loss,
    sampled_entropy,
    truncated_is_loss,
)

LOG = math.log


def leaf(rows):
    return torch.tensor(rows, dtype=torch.float64, requires_grad=True)


def const(rows):
    return torch.tensor(rows, dtype=torch.float64)


# ---------------------------------------------------------------------------------------------
# aggregate


def test_aggregate_token_and_sequence_levels():
    per_token = const([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = const([[1, 1, 0], [1, 0, 0]])
    # token: (1 + 2 + 4) / 3 tokens.
    assert aggregate(per_token, mask, "token").item() == pytest.approx(7 / 3)
    # sequence: row means 1.5 and 4, then (1.5 + 4) / 2.
    assert aggregate(per_token, mask, "sequence").item() == pytest.approx(2.75)


def test_aggregate_sequence_ignores_rows_without_tokens():
    per_token = const([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = const([[1, 1, 0], [0, 0, 0]])
    # Only row 0 counts: (1 + 2) / 2.
    assert aggregate(per_token, mask, "sequence").item() == pytest.approx(1.5)
    assert aggregate(per_token, mask, "token").item() == pytest.approx(1.5)


def test_aggregate_ignores_non_finite_padding():
    per_token = const([[1.0, float("inf")], [float("nan"), 3.0]])
    mask = const([[1, 0], [0, 1]])
    assert aggregate(per_token, mask, "token").item() == pytest.approx(2.0)
    assert aggregate(per_token, mask, "sequence").item() == pytest.approx(2.0)


def test_aggregate_with_no_tokens_is_a_differentiable_zero():
    per_token = leaf([[1.0, 2.0]])
    loss = aggregate(per_token, const([[0, 0]]), "token")
    loss.backward()
    assert loss.item() == 0.0
    assert per_token.grad.tolist() == [[0.0, 0.0]]


def test_aggregate_unknown_level():
    with pytest.raises(ValueError, match="token, sequence"):
        aggregate(const([[1.0]]), const([[1]]), "batch")


# ---------------------------------------------------------------------------------------------
# ppo_clip_loss

# Ratios pi_theta / pi_old of 1.5, 0.5 and 1.1 against an old log-prob of log 0.5 everywhere.
RATIOS = [1.5, 0.5, 1.1]
OLD = [LOG(0.5)] * 3
CURRENT = [LOG(0.5 * ratio) for ratio in RATIOS]


def test_ppo_clip_positive_advantage():
    logprobs = leaf([CURRENT])
    result = ppo_clip_loss(logprobs, const([OLD]), const([1.0]), const([[1, 1, 1]]), clip_eps=0.2)
    # min(r, clip(r, 0.8, 1.2)) = min(1.5, 1.2), min(0.5, 0.8), min(1.1, 1.1) = 1.2, 0.5, 1.1.
    assert result.loss.item() == pytest.approx(-(1.2 + 0.5 + 1.1) / 3)
    result.loss.backward()
    # d r / d logprob = r; the clipped token gets no gradient.
    assert logprobs.grad.tolist()[0] == pytest.approx([0.0, -0.5 / 3, -1.1 / 3])
    # Only token 0 took the clipped branch.
    assert result.metrics["clip_fraction"] == pytest.approx(1 / 3)
    assert result.metrics["ratio_mean"] == pytest.approx((1.5 + 0.5 + 1.1) / 3)
    assert result.metrics["ratio_max"] == pytest.approx(1.5)
    assert result.metrics["tokens"] == 3


def test_ppo_clip_negative_advantage():
    logprobs = leaf([CURRENT])
    result = ppo_clip_loss(logprobs, const([OLD]), const([-1.0]), const([[1, 1, 1]]))
    # min(-r, -clip(r)) = min(-1.5, -1.2), min(-0.5, -0.8), -1.1 = -1.5, -0.8, -1.1.
    assert result.loss.item() == pytest.approx((1.5 + 0.8 + 1.1) / 3)
    result.loss.backward()
    assert logprobs.grad.tolist()[0] == pytest.approx([1.5 / 3, 0.0, 1.1 / 3])
    assert result.metrics["clip_fraction"] == pytest.approx(1 / 3)


def test_ppo_clip_token_versus_sequence_aggregation():
    logprobs = const([CURRENT, CURRENT])
    old = const([OLD, OLD])
    advantages = const([1.0, -1.0])
    mask = const([[1, 1, 1], [1, 1, 0]])
    # Row 0 sums to -(1.2 + 0.5 + 1.1) = -2.8 over 3 tokens; row 1 to 1.5 + 0.8 = 2.3 over 2.
    token = ppo_clip_loss(logprobs, old, advantages, mask, aggregation="token")
    sequence = ppo_clip_loss(logprobs, old, advantages, mask, aggregation="sequence")
    assert token.loss.item() == pytest.approx((-2.8 + 2.3) / 5)
    assert sequence.loss.item() == pytest.approx((-2.8 / 3 + 2.3 / 2) / 2)


def test_per_token_advantages_broadcast_like_per_sequence_ones():
    logprobs = const([CURRENT])
    per_sequence = ppo_clip_loss(logprobs, const([OLD]), const([0.7]), const([[1, 1, 1]]))
    per_token = ppo_clip_loss(
        logprobs, const([OLD]), const([[0.7, 0.7, 0.7]]), const([[1, 1, 1]])
    )
    assert per_sequence.loss.item() == pytest.approx(per_token.loss.item())


def test_padding_with_minus_infinity_keeps_loss_and_gradient_finite():
    logprobs = leaf([[LOG(0.6), float("-inf")]])
    old = const([[LOG(0.5), float("-inf")]])
    result = ppo_clip_loss(logprobs, old, const([1.0]), const([[1, 0]]))
    result.loss.backward()
    # Ratio 1.2 sits on the clip boundary: min(1.2, 1.2) = 1.2, one token.
    assert result.loss.item() == pytest.approx(-1.2)
    assert torch.isfinite(logprobs.grad).all()
    assert logprobs.grad[0, 1].item() == 0.0


# ---------------------------------------------------------------------------------------------
# decoupled_ppo_loss

# Behaviour weights pi_prox / mu of 1, 3 and 0.5.
BEHAVIOUR_WEIGHTS = [1.0, 3.0, 0.5]
BEHAVIOUR = [LOG(0.5 / weight) for weight in BEHAVIOUR_WEIGHTS]


def test_decoupled_token_level_weights_truncated_at_cap():
    logprobs = leaf([CURRENT])
    result = decoupled_ppo_loss(
        logprobs, const([OLD]), const([BEHAVIOUR]), const([1.0]), const([[1, 1, 1]]),
        behaviour_weight_cap=2.0,
    )
    # w = 1, min(3, 2) = 2, 0.5; surrogate 1.2, 0.5, 1.1 -> -(1.2 + 1.0 + 0.55) / 3.
    assert result.loss.item() == pytest.approx(-(1.2 + 1.0 + 0.55) / 3)
    result.loss.backward()
    assert logprobs.grad.tolist()[0] == pytest.approx([0.0, -2 * 0.5 / 3, -0.5 * 1.1 / 3])
    # Weight statistics are of the untruncated weights.
    assert result.metrics["behaviour_weight_mean"] == pytest.approx(1.5)
    assert result.metrics["behaviour_weight_max"] == pytest.approx(3.0)
    assert result.metrics["behaviour_weight_truncated_fraction"] == pytest.approx(1 / 3)
    assert result.metrics["clip_fraction"] == pytest.approx(1 / 3)


def test_decoupled_without_a_cap_uses_the_raw_weights():
    result = decoupled_ppo_loss(
        const([CURRENT]), const([OLD]), const([BEHAVIOUR]), const([1.0]), const([[1, 1, 1]]),
        behaviour_weight_cap=None,
    )
    assert result.loss.item() == pytest.approx(-(1.2 + 3 * 0.5 + 0.5 * 1.1) / 3)
    assert result.metrics["behaviour_weight_truncated_fraction"] == 0.0


def test_decoupled_sequence_and_geometric_weights():
    args = (const([CURRENT]), const([OLD]), const([BEHAVIOUR]), const([1.0]), const([[1, 1, 1]]))
    # Sequence weight: 1 * 3 * 0.5 = 1.5 (under the cap of 2) on every token.
    sequence = decoupled_ppo_loss(*args, weight_level="sequence")
    assert sequence.loss.item() == pytest.approx(-1.5 * 2.8 / 3)
    # With a cap of 1.2 the whole sequence's weight is cut to 1.2.
    capped = decoupled_ppo_loss(*args, weight_level="sequence", behaviour_weight_cap=1.2)
    assert capped.loss.item() == pytest.approx(-1.2 * 2.8 / 3)
    assert capped.metrics["behaviour_weight_truncated_fraction"] == 1.0
    # Geometric mean: 1.5 ** (1/3).
    geometric = decoupled_ppo_loss(*args, weight_level="geometric")
    assert geometric.loss.item() == pytest.approx(-(1.5 ** (1 / 3)) * 2.8 / 3)


def test_decoupled_sequence_weight_counts_only_masked_tokens():
    # The last token is masked out, so its weight of 0.5 must not enter the product: 1 * 3 = 3,
    # truncated to the cap of 2. Surrogate on the two counted tokens: 1.2 and 0.5.
    result = decoupled_ppo_loss(
        const([CURRENT]), const([OLD]), const([BEHAVIOUR]), const([1.0]), const([[1, 1, 0]]),
        weight_level="sequence", behaviour_weight_cap=2.0,
    )
    assert result.loss.item() == pytest.approx(-2.0 * (1.2 + 0.5) / 2)
    # Geometric over the two counted tokens: sqrt(3).
    geometric = decoupled_ppo_loss(
        const([CURRENT]), const([OLD]), const([BEHAVIOUR]), const([1.0]), const([[1, 1, 0]]),
        weight_level="geometric",
    )
    assert geometric.loss.item() == pytest.approx(-math.sqrt(3) * (1.2 + 0.5) / 2)


def test_decoupled_weights_carry_no_gradient():
    proximal = leaf([OLD])
    behaviour = leaf([BEHAVIOUR])
    logprobs = leaf([CURRENT])
    result = decoupled_ppo_loss(logprobs, proximal, behaviour, const([1.0]), const([[1, 1, 1]]))
    result.loss.backward()
    assert proximal.grad is None and behaviour.grad is None
    assert logprobs.grad is not None


@pytest.mark.parametrize("weight_level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("aggregation", ["token", "sequence"])
@pytest.mark.parametrize("advantage_shape", ["sequence", "token"])
def test_decoupled_equals_plain_ppo_at_zero_staleness(weight_level, aggregation, advantage_shape):
    generator = torch.Generator().manual_seed(7)
    batch, length = 4, 6
    proximal = -torch.rand(batch, length, generator=generator, dtype=torch.float64) * 3
    # Spread big enough that some tokens fall outside the clip range on both sides.
    noise = torch.randn(batch, length, generator=generator, dtype=torch.float64)
    current_values = proximal + noise * 0.4
    if advantage_shape == "sequence":
        advantages = torch.randn(batch, generator=generator, dtype=torch.float64)
    else:
        advantages = torch.randn(batch, length, generator=generator, dtype=torch.float64)
    mask = (torch.rand(batch, length, generator=generator) > 0.3).double()
    mask[0] = 0.0  # a sequence with no counted token

    plain_logprobs = current_values.clone().requires_grad_(True)
    plain = ppo_clip_loss(plain_logprobs, proximal, advantages, mask, aggregation=aggregation)
    plain.loss.backward()

    decoupled_logprobs = current_values.clone().requires_grad_(True)
    decoupled = decoupled_ppo_loss(
        decoupled_logprobs, proximal, proximal.clone(), advantages, mask,
        weight_level=weight_level, aggregation=aggregation,
    )
    decoupled.loss.backward()

    assert 0 < plain.metrics["clip_fraction"] < 1
    assert torch.equal(plain.loss, decoupled.loss)
    assert torch.equal(plain_logprobs.grad, decoupled_logprobs.grad)
    assert decoupled.metrics["behaviour_weight_mean"] == 1.0


# ---------------------------------------------------------------------------------------------
# truncated_is_loss


def test_truncated_is_value_and_gradient():
    # log pi_theta = log 0.25, log 0.6; ratios to mu of 0.5 and 3 -> weights 0.5 and min(3, 2) = 2.
    logprobs = leaf([[LOG(0.25), LOG(0.6)]])
    behaviour = const([[LOG(0.5), LOG(0.2)]])
    result = truncated_is_loss(logprobs, behaviour, const([2.0]), const([[1, 1]]), is_cap=2.0)
    expected = (-0.5 * 2 * LOG(0.25) - 2 * 2 * LOG(0.6)) / 2
    assert result.loss.item() == pytest.approx(expected)
    result.loss.backward()
    # The weight is detached: d/d logprob = -w * A / 2 tokens.
    assert logprobs.grad.tolist()[0] == pytest.approx([-0.5, -2.0])
    assert result.metrics["is_weight_mean"] == pytest.approx(1.75)
    assert result.metrics["is_weight_max"] == pytest.approx(3.0)
    assert result.metrics["is_weight_truncated_fraction"] == pytest.approx(0.5)


def test_truncated_is_ignores_masked_padding():
    logprobs = leaf([[LOG(0.5), float("-inf")]])
    result = truncated_is_loss(
        logprobs, const([[LOG(0.5), float("-inf")]]), const([1.0]), const([[1, 0]])
    )
    result.loss.backward()
    assert result.loss.item() == pytest.approx(-LOG(0.5))
    assert logprobs.grad.tolist()[0] == [-1.0, 0.0]


# ---------------------------------------------------------------------------------------------
# kl_penalty and sampled_entropy


def test_kl_penalty_k3_estimator():
    # ref - lp = log 2 and log 0.5: k3 = 2 - log 2 - 1 and 0.5 - log 0.5 - 1, which sum to 0.5.
    logprobs = leaf([[LOG(0.25), LOG(0.5)]])
    reference = const([[LOG(0.5), LOG(0.25)]])
    result = kl_penalty(logprobs, reference, const([[1, 1]]))
    assert result.loss.item() == pytest.approx(0.25)
    assert result.metrics["kl"] == pytest.approx(0.25)
    assert result.metrics["kl_max"] == pytest.approx(1 - LOG(2))
    result.loss.backward()
    # d k3 / d lp = 1 - exp(ref - lp): 1 - 2 = -1 and 1 - 0.5 = 0.5, over 2 tokens.
    assert logprobs.grad.tolist()[0] == pytest.approx([-0.5, 0.25])


def test_k3_estimates_kl_to_the_reference_and_its_gradient_is_the_reverse_kls():
    """On a three-token distribution pi = softmax(theta) against a fixed reference: the mean of k3
    over pi's samples (computed exactly, each token weighted by its probability, the weights
    fixed as sampling fixes them) is KL(pi || ref); the mean of its gradient is that of
    KL(ref || pi), not of KL(pi || ref)."""
    theta = torch.tensor([0.3, -0.2, 0.9], dtype=torch.float64, requires_grad=True)
    reference = torch.log(torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64))

    logprobs = torch.log_softmax(theta, -1)
    k3 = torch.exp(reference - logprobs) - (reference - logprobs) - 1
    mean_k3 = (logprobs.exp().detach() * k3).sum()
    forward_kl = (logprobs.exp() * (logprobs - reference)).sum()
    reverse_kl = (reference.exp() * (reference - logprobs)).sum()
    assert float(mean_k3) == pytest.approx(float(forward_kl), rel=1e-12)
    gradient, = torch.autograd.grad(mean_k3, theta, retain_graph=True)
    toward_reference, = torch.autograd.grad(reverse_kl, theta, retain_graph=True)
    away, = torch.autograd.grad(forward_kl, theta)
    torch.testing.assert_close(gradient, toward_reference)
    assert not torch.allclose(gradient, away)
    # kl_penalty computes the same per-token k3.
    per_token = torch.stack([kl_penalty(logprobs[None, [i]], reference[None, [i]],
                                        torch.ones(1, 1, dtype=torch.float64)).loss for i in range(3)])
    torch.testing.assert_close(per_token, k3)


def test_kl_penalty_is_zero_for_identical_policies():
    logprobs = const([[LOG(0.3), LOG(0.9)]])
    assert kl_penalty(logprobs, logprobs.clone(), const([[1, 1]])).loss.item() == 0.0


def test_sampled_entropy_is_minus_mean_logprob_over_counted_tokens():
    logprobs = leaf([[LOG(0.5), LOG(0.25), float("-inf")]])
    entropy = sampled_entropy(logprobs, const([[1, 1, 0]]))
    # -(log 0.5 + log 0.25) / 2 = 1.5 log 2.
    assert entropy.item() == pytest.approx(1.5 * LOG(2))
    assert not entropy.requires_grad


# ---------------------------------------------------------------------------------------------
# policy_loss and input checks


def test_policy_loss_dispatch():
    logprobs, proximal, behaviour = const([CURRENT]), const([OLD]), const([BEHAVIOUR])
    advantages, mask = const([1.0]), const([[1, 1, 1]])
    decoupled = policy_loss("decoupled_ppo", logprobs, proximal, behaviour, advantages, mask)
    assert decoupled.loss.item() == pytest.approx(-(1.2 + 1.0 + 0.55) / 3)
    # "none" ignores the proximal policy and clips against the behaviour log-probs.
    uncorrected = policy_loss("none", logprobs, None, behaviour, advantages, mask, clip_eps=0.3)
    direct = ppo_clip_loss(logprobs, behaviour, advantages, mask, clip_eps=0.3)
    assert uncorrected.loss.item() == direct.loss.item()
    truncated = policy_loss("truncated_is", logprobs, None, behaviour, advantages, mask, is_cap=1.5)
    direct = truncated_is_loss(logprobs, behaviour, advantages, mask, is_cap=1.5)
    assert truncated.loss.item() == direct.loss.item()
    assert POLICY_LOSS_NAMES == ("decoupled_ppo", "truncated_is", "none")


def test_policy_loss_unknown_name_lists_valid_ones():
    with pytest.raises(ValueError, match="decoupled_ppo, truncated_is, none"):
        policy_loss("vtrace", const([[0.0]]), None, const([[0.0]]), const([1.0]), const([[1]]))


def test_decoupled_needs_proximal_logprobs():
    with pytest.raises(ValueError, match="proximal_logprobs"):
        policy_loss(
            "decoupled_ppo", const([[0.0]]), None, const([[0.0]]), const([1.0]), const([[1]])
        )


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: ppo_clip_loss(const([[0.0, 0.0]]), const([[0.0]]), const([1.0]), const([[1, 1]])),
         "old_logprobs"),
        (lambda: ppo_clip_loss(const([[0.0]]), const([[0.0]]), const([1.0, 2.0]), const([[1]])),
         "advantages"),
        (lambda: ppo_clip_loss(const([0.0]), const([0.0]), const([1.0]), const([1])), r"\[B, T\]"),
        (lambda: ppo_clip_loss(const([[0.0]]), const([[0.0]]), const([1.0]), const([[1]]),
                               clip_eps=1.5), "clip_eps"),
        (lambda: decoupled_ppo_loss(const([[0.0]]), const([[0.0]]), const([[0.0]]), const([1.0]),
                                    const([[1]]), behaviour_weight_cap=0.5),
         "behaviour_weight_cap"),
        (lambda: decoupled_ppo_loss(const([[0.0]]), const([[0.0]]), const([[0.0]]), const([1.0]),
                                    const([[1]]), weight_level="batch"),
         "token, sequence, geometric"),
        (lambda: truncated_is_loss(const([[0.0]]), const([[0.0]]), const([1.0]), const([[1]]),
                                   aggregation="mean"), "aggregation level"),
    ],
)
def test_bad_inputs_are_refused_with_a_clear_message(call, message):
    with pytest.raises(ValueError, match=message):
        call()
