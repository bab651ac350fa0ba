"""Evaluation statistics as pure functions: the unbiased Pass@k estimator, Avg@n, confidence intervals."""

from __future__ import annotations

import math
from typing import Sequence


def pass_at_k(samples: int, correct: int, k: int) -> float:
    """Unbiased estimate of the chance that at least one of k samples (drawn without replacement
    from the n = `samples` taken) is correct: 1 - C(n - c, k) / C(n, k)."""
    if not 0 <= correct <= samples:
        raise ValueError(f"need 0 <= correct <= samples, got correct={correct}, samples={samples}")
    if not 1 <= k <= samples:
        raise ValueError(f"need 1 <= k <= samples ({samples}), got k={k}")
    if samples - correct < k:
        return 1.0
    # The product form avoids huge binomials: C(n-c, k)/C(n, k) = prod_{i=n-c+1}^{n} (1 - k/i).
    failure = 1.0
    for i in range(samples - correct + 1, samples + 1):
        failure *= 1.0 - k / i
    return 1.0 - failure


def mean_pass_at_k(correct_per_task: Sequence[int], samples: int, k: int) -> float:
    """Pass@k averaged over tasks that each had `samples` samples."""
    if not correct_per_task:
        raise ValueError("no tasks")
    return sum(pass_at_k(samples, c, k) for c in correct_per_task) / len(correct_per_task)


def wilson_interval(successes: int, trials: int, z: float = 1.96) -> tuple[float, float]:
    """95% (by default) Wilson score interval for a success rate; well behaved at 0 and 1."""
    if trials <= 0:
        raise ValueError("need at least one trial")
    if not 0 <= successes <= trials:
        raise ValueError(f"need 0 <= successes <= trials, got {successes}/{trials}")
    rate = successes / trials
    denominator = 1 + z * z / trials
    centre = (rate + z * z / (2 * trials)) / denominator
    spread = z * math.sqrt(rate * (1 - rate) / trials + z * z / (4 * trials * trials)) / denominator
    return max(0.0, centre - spread), min(1.0, centre + spread)


def two_proportion_test(successes_a: int, trials_a: int, successes_b: int, trials_b: int) -> dict:
    """Pooled two-proportion z-test of rate b against rate a: the difference b - a, its z score and
    the one-sided p-value that b is not above a (normal approximation; each episode counted as an
    independent trial)."""
    for successes, trials in ((successes_a, trials_a), (successes_b, trials_b)):
        if trials <= 0 or not 0 <= successes <= trials:
            raise ValueError(f"need 0 <= successes <= trials and trials > 0, got {successes}/{trials}")
    rate_a, rate_b = successes_a / trials_a, successes_b / trials_b
    pooled = (successes_a + successes_b) / (trials_a + trials_b)
    spread = math.sqrt(pooled * (1 - pooled) * (1 / trials_a + 1 / trials_b))
    if spread == 0:  # both at 0% or both at 100%: no evidence either way
        return {"difference": rate_b - rate_a, "z": 0.0, "p_one_sided": 0.5}
    z = (rate_b - rate_a) / spread
    return {"difference": rate_b - rate_a, "z": z, "p_one_sided": 0.5 * math.erfc(z / math.sqrt(2))}


def mean_interval(values: Sequence[float], z: float = 1.96) -> tuple[float, float, float]:
    """Mean and its normal-approximation interval (mean, low, high)."""
    if not values:
        raise ValueError("no values")
    count = len(values)
    mean = sum(values) / count
    if count == 1:
        return mean, mean, mean
    variance = sum((v - mean) ** 2 for v in values) / (count - 1)
    half = z * math.sqrt(variance / count)
    return mean, mean - half, mean + half
