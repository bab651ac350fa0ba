"""Evaluation statistics on hand-computed cases."""

import math

import pytest

from longhorizon.actor.metrics import mean_interval, mean_pass_at_k, pass_at_k, two_proportion_test, wilson_interval


def test_pass_at_k_hand_computed():
    # n=4 samples, c=1 correct, k=2: 1 - C(3,2)/C(4,2) = 1 - 3/6 = 0.5
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    # n=5, c=2, k=2: 1 - C(3,2)/C(5,2) = 1 - 3/10 = 0.7
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)
    # k=1 is the plain success rate.
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    assert pass_at_k(10, 0, 5) == 0.0
    assert pass_at_k(10, 6, 5) == 1.0  # fewer than k failures: some draw must succeed
    # Large n stays exact where the binomials would overflow floats: n=64, c=1, k=64 -> 1.
    assert pass_at_k(64, 1, 64) == 1.0
    assert pass_at_k(64, 1, 32) == pytest.approx(0.5)
    assert pass_at_k(1000, 10, 100) == pytest.approx(1 - math.comb(990, 100) / math.comb(1000, 100))


def test_pass_at_k_rejects_nonsense():
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 0)


def test_mean_pass_at_k_and_intervals():
    assert mean_pass_at_k([1, 0, 4], 4, 2) == pytest.approx((0.5 + 0.0 + 1.0) / 3)
    low, high = wilson_interval(0, 10)
    assert low == 0.0 and 0.25 < high < 0.35  # Wilson upper bound for 0/10 is ~0.278
    low, high = wilson_interval(5, 10)
    assert low < 0.5 < high and low == pytest.approx(1 - high)
    mean, low, high = mean_interval([1.0, 2.0, 3.0])
    assert mean == 2.0 and high - mean == pytest.approx(1.96 * 1.0 / math.sqrt(3))


def test_two_proportion_test_hand_computed():
    # 14/27 against 20/27: pooled rate 34/54, standard error sqrt(p(1-p) * 2/27) = 0.13143,
    # z = (20/27 - 14/27) / 0.13143 = 1.6908, one-sided p = 1 - Phi(1.6908) = 0.0454.
    test = two_proportion_test(14, 27, 20, 27)
    assert test["difference"] == pytest.approx(6 / 27)
    assert test["z"] == pytest.approx(1.6908, abs=1e-4) and test["p_one_sided"] == pytest.approx(0.0454, abs=1e-4)
    # The other way round: the same z with its sign flipped, p on the other tail.
    back = two_proportion_test(20, 27, 14, 27)
    assert back["z"] == pytest.approx(-test["z"]) and back["p_one_sided"] == pytest.approx(1 - test["p_one_sided"])
    # Unequal sizes: 50/100 against 30/40, pooled 80/140; se = sqrt(4/7 * 3/7 * (1/100 + 1/40)) = 0.092582.
    assert two_proportion_test(50, 100, 30, 40)["z"] == pytest.approx(0.25 / 0.092582, abs=1e-4)
    # Both at 0%: no evidence either way.
    assert two_proportion_test(0, 10, 0, 20) == {"difference": 0.0, "z": 0.0, "p_one_sided": 0.5}
    with pytest.raises(ValueError, match="successes <= trials"):
        two_proportion_test(5, 4, 1, 2)
    with pytest.raises(ValueError, match="trials > 0"):
        two_proportion_test(0, 0, 1, 2)


def test_eval_command_reproduces_the_scripted_policies_known_rates(tmp_path, capsys):
    import json
    from pathlib import Path

    from longhorizon.launch.cli import main

    configs = Path(__file__).resolve().parent.parent / "configs"
    output = tmp_path / "eval.json"
    assert main([
        "eval", str(configs / "textcraft.toml"), "actor.engine='scripted'", "--tasks", "111", "--horizon", "40",
        "--output", str(output),
    ]) == 0
    oracle = json.loads(output.read_text())
    assert oracle["tasks"] == 111 and oracle["success_rate"] == 1.0 and oracle["failed_episodes"] == 0
    assert set(oracle["per_category"]) == {"depth-1", "depth-2", "depth-3", "depth-4"}

    assert main([
        "eval", str(configs / "codebook.toml"), "actor.engine='scripted'", "actor.scripted_policy='random'",
        "--tasks", "100", "--samples", "8", "--k", "1,8",
    ]) == 0
    random_play = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # The random policy's true rate is (1/4)^3 = 1.6%: 800 episodes give ~12.5 successes (sd ~3.5).
    assert 0.004 < random_play["success_rate"] < 0.04
    low, high = random_play["success_rate_ci95"]
    assert low < random_play["success_rate"] < high
    assert random_play["pass@8"] > random_play["pass@1"]
