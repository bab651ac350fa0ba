"""DPO: the loss on a pair against hand-computed values, and pairs built from groups."""

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from longhorizon.learner.dpo import dpo_loss, pairs_from_groups, sequence_logprobs


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
