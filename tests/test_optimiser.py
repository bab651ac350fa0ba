"""The optimiser step every trainer shares (learner/optimiser.py): clipping, the learning rate, a
non-finite update dropped with the weights and Adam's state untouched, and the offline loop."""

import math

import pytest
import torch

from longhorizon.learner.optimiser import OfflineSettings, apply_update, learning_rate_at, run_offline_steps


def _parameter(values, gradient) -> torch.nn.Parameter:
    parameter = torch.nn.Parameter(torch.tensor(values, dtype=torch.float64))
    parameter.grad = torch.tensor(gradient, dtype=torch.float64)
    return parameter


def test_the_learning_rate_rises_over_the_warm_up_then_stays():
    assert [learning_rate_at(step, 1.0, 4) for step in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert learning_rate_at(0, 2e-5, 0) == 2e-5


def test_an_update_clips_the_gradient_then_steps_at_the_rate_given():
    # Gradient (3, 4): norm 5, clipped to 1 -> (0.6, 0.8); SGD at 0.5 moves (1, 1) to (0.7, 0.6).
    parameter = _parameter([1.0, 1.0], [3.0, 4.0])
    optimizer = torch.optim.SGD([parameter], lr=123.0)
    update = apply_update(optimizer, [parameter], grad_clip=1.0, learning_rate=0.5)
    assert update.applied and update.grad_norm == pytest.approx(5.0)
    assert parameter.detach().tolist() == pytest.approx([0.7, 0.6])
    assert optimizer.param_groups[0]["lr"] == 0.5


@pytest.mark.parametrize("loss_finite, gradient", [(False, [3.0, 4.0]), (True, [math.nan, 4.0]), (True, [math.inf, 0.0])])
def test_a_non_finite_update_leaves_weights_and_adam_as_they_were(loss_finite, gradient):
    parameter = _parameter([1.0, 1.0], [0.1, 0.1])
    optimizer = torch.optim.AdamW([parameter], lr=0.1)
    optimizer.step()  # Adam now holds moments and a step count
    before = parameter.detach().clone()
    state = {key: value.clone() for key, value in optimizer.state[parameter].items()}
    parameter.grad = torch.tensor(gradient, dtype=torch.float64)
    asked = []
    update = apply_update(optimizer, [parameter], grad_clip=1.0, loss_finite=loss_finite,
                          learning_rate=lambda: asked.append(1) or 0.1)
    assert not update.applied and not asked, "the rate of a dropped update is never set"
    assert torch.equal(parameter.detach(), before) and parameter.grad is None
    assert all(torch.equal(optimizer.state[parameter][key], value) for key, value in state.items())


def test_every_rank_acts_on_the_verdict_they_agree_on():
    parameter = _parameter([1.0], [1.0])
    optimizer = torch.optim.SGD([parameter], lr=1.0)
    update = apply_update(optimizer, [parameter], grad_clip=10.0, learning_rate=1.0, agree=lambda finite: False)
    assert not update.applied and parameter.item() == 1.0  # another rank's loss was not finite


def test_the_offline_loop_steps_through_its_plan_and_skips_a_non_finite_step():
    """A one-weight model trained to 0 on the squared weight: gradient 2w, no clipping at 10, SGD
    at 0.25 with a warm-up of 2 steps (rates 0.125, 0.25, 0.25); the second step's loss is NaN,
    so its update is dropped and the third starts where the first left off."""
    model = torch.nn.Linear(1, 1, bias=False).double()
    with torch.no_grad():
        model.weight.fill_(1.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    seen = []

    def accumulate(indices):
        loss = (model.weight ** 2).sum()
        loss.backward()
        return {"loss": math.nan if indices == [1] else loss.item()}

    saved = []
    records = run_offline_steps(model, optimizer, [(0, [0]), (0, [1]), (1, [2])], OfflineSettings(0.25, 2, 10.0),
                                accumulate, seen.append, checkpoint_every=1, save=lambda *at: saved.append(at))
    assert saved == [(1, 0), (2, 0)]  # every step but the last, which the caller saves
    assert seen == records and [r["step"] for r in records] == [1, 2, 3] and [r["epoch"] for r in records] == [1, 1, 2]
    assert [r["learning_rate"] for r in records] == [0.125, 0.25, 0.25]
    assert [r["nonfinite_step"] for r in records] == [0.0, 1.0, 0.0]
    # 1 -> 1 - 0.125 * 2 = 0.75; dropped; 0.75 - 0.25 * 1.5 = 0.375.
    assert [r["grad_norm"] for r in records] == pytest.approx([2.0, 1.5, 1.5])
    assert model.weight.item() == pytest.approx(0.375) and not model.training
