"""Advantage estimators checked against values worked out by hand."""

import math

import numpy as np
import pytest

from longhorizon.learner.advantages import (
    group_has_signal,
    grpo_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
)


def test_grpo_uses_population_std():
    # rewards 1, 0, 0, 1: mean 0.5, deviations +-0.5, population std sqrt(0.25) = 0.5.
    advantages = grpo_advantages(np.array([1.0, 0.0, 0.0, 1.0]), eps=0.0)
    np.testing.assert_allclose(advantages, [1.0, -1.0, -1.0, 1.0])


def test_grpo_uneven_group():
    # rewards 1, 0, 0, 0: mean 0.25; deviations 0.75, -0.25 x3;
    # variance (0.5625 + 3 * 0.0625) / 4 = 0.1875, std = 0.4330127.
    advantages = grpo_advantages([1.0, 0.0, 0.0, 0.0], eps=0.0)
    std = math.sqrt(0.1875)
    np.testing.assert_allclose(advantages, [0.75 / std, -0.25 / std, -0.25 / std, -0.25 / std])
    assert advantages.sum() == pytest.approx(0.0)


def test_grpo_eps_enters_denominator():
    # std 0.5, eps 0.5: 0.5 / (0.5 + 0.5) = 0.5.
    np.testing.assert_allclose(grpo_advantages([1.0, 0.0], eps=0.5), [0.5, -0.5])


def test_grpo_without_std_scaling_only_centres():
    np.testing.assert_allclose(
        grpo_advantages([3.0, 1.0, 2.0], scale_by_std=False), [1.0, -1.0, 0.0]
    )


def test_grpo_zero_variance_group_gives_zeros_not_nan():
    advantages = grpo_advantages([1.0, 1.0, 1.0])
    np.testing.assert_array_equal(advantages, [0.0, 0.0, 0.0])


def test_rloo_leave_one_out_baseline():
    # rewards 1, 0, 2: baselines (0+2)/2 = 1, (1+2)/2 = 1.5, (1+0)/2 = 0.5.
    np.testing.assert_allclose(rloo_advantages([1.0, 0.0, 2.0]), [0.0, -1.5, 1.5])


def test_rloo_needs_two_members():
    with pytest.raises(ValueError, match="at least 2"):
        rloo_advantages([1.0])


def test_reinforce_pp_normalises_over_the_batch():
    # rewards 0, 0, 0, 4 from different tasks: mean 1, deviations -1 x3 and 3,
    # variance (3 + 9) / 4 = 3, std sqrt(3).
    advantages = reinforce_pp_advantages([0.0, 0.0, 0.0, 4.0], eps=0.0)
    root3 = math.sqrt(3.0)
    np.testing.assert_allclose(advantages, [-1 / root3, -1 / root3, -1 / root3, 3 / root3])


def test_group_has_signal():
    assert not group_has_signal([0.0, 0.0, 0.0])
    assert not group_has_signal([1.0, 1.0 + 1e-10])
    assert group_has_signal([0.0, 0.0, 1.0])
    assert group_has_signal([0.5, 0.6], tol=0.05)
    assert not group_has_signal([0.5, 0.6], tol=0.2)


@pytest.mark.parametrize(
    "bad_rewards, message",
    [
        ([], "at least 1"),
        ([[1.0, 0.0]], "1-D"),
        ([1.0, float("nan")], "finite"),
        ([1.0, float("inf")], "finite"),
    ],
)
def test_bad_rewards_are_refused(bad_rewards, message):
    with pytest.raises(ValueError, match=message):
        grpo_advantages(bad_rewards)
