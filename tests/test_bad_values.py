"""Bad values are refused before they touch state: numbers a trajectory may not carry are refused
at the buffer by field, a non-finite update is never applied, a run of them stops the learner,
metrics stay strict JSON, and the report names non-finite steps first.

The fault behind them: a group with two finite but huge rewards (1.7e308, 1e308) passed the wire
and the buffer, overflowed its advantages, and its NaN update broke the policy for good."""

import copy
import dataclasses
import json
import logging

import numpy as np
import pytest
import torch

from longhorizon.common.codec import decode, encode
from longhorizon.common.config import Config, LearnerConfig
from longhorizon.common.metrics import MetricsWriter, read_metrics
from longhorizon.common.models import load_causal_lm
from longhorizon.common.wire import Trajectory
from longhorizon.launch.report import diagnose, format_report, summarise_run
from longhorizon.learner.advantages import grpo_advantages, reinforce_pp_advantages, rloo_advantages
from longhorizon.learner.buffer import Group
from longhorizon.learner.trainer import Trainer, score_groups
from longhorizon.learner.worker import NonfiniteSteps, NonfiniteUpdatesError, build_buffer


def wire_trajectory(trajectory_id: str, group_id: str, reward: float, *, group_size: int = 2, **fields) -> Trajectory:
    """A well-formed wire Trajectory: a 3-token prompt and a 2-token reply at policy version 0."""
    values = dict(
        trajectory_id=trajectory_id, actor_id="actor-0", env_name="toy", task_id="task-0", group_id=group_id,
        group_size=group_size, token_ids=np.array([4, 5, 6, 7, 8], np.int32),
        loss_mask=np.array([0, 0, 0, 1, 1], np.uint8),
        behaviour_logprobs=np.array([0, 0, 0, -0.5, -1.5], np.float32),
        policy_versions=np.array([-1, -1, -1, 0, 0], np.int32), prompt_length=3, reward=reward,
        turn_rewards=[reward], num_turns=1, horizon_cap=4, terminated=True, truncated=False, success=reward > 0,
        generation_seconds=0.1, env_seconds=0.1,
    )
    values.update(fields)
    return Trajectory(**values)


def over_the_wire(trajectory: Trajectory) -> Trajectory:
    return decode([bytes(frame) for frame in encode(trajectory)])


# ---------------------------------------------------------------------------------------------
# The buffer refuses what a trajectory may not carry, by field


def test_the_poisoned_group_passes_the_wire_but_is_refused_at_the_buffer_under_reward(caplog):
    buffer = build_buffer(Config(), vocab_size=100)
    poisoned = [wire_trajectory("a", "g", 1.7e308), wire_trajectory("b", "g", 1.0e308)]
    with caplog.at_level(logging.WARNING, logger="longhorizon.learner.buffer"):
        for trajectory in poisoned:
            buffer.add(over_the_wire(trajectory), learner_version=0)  # finite: the wire lets it through
    assert buffer.counters["dropped_malformed"] == 2 and buffer.counters["accepted"] == 0
    assert buffer.refused_fields == {"reward": 2}
    assert buffer.pop_ready(8, learner_version=0, give_up_waiting=True) == []
    [line] = [r.getMessage() for r in caplog.records if r.name == "longhorizon.learner.buffer"]  # rate-limited
    assert "malformed reward" in line and "1.7e+308" in line and "learner.max_abs_reward" in line
    assert "'a'" in line and "actor-0" in line


@pytest.mark.parametrize("field, changes", [
    ("turn_rewards", {"turn_rewards": [1e300]}),
    ("turn_rewards", {"turn_rewards": [float("nan")]}),
    ("behaviour_logprobs", {"behaviour_logprobs": np.array([0, 0, 0, 0.5, -1], np.float32)}),
    ("behaviour_logprobs", {"behaviour_logprobs": np.array([0, 0, 0, -np.inf, -1], np.float32)}),
    ("behaviour_logprobs", {"behaviour_logprobs": np.zeros(4, np.float32)}),
    ("loss_mask", {"loss_mask": np.array([0, 0, 0, 1, 2], np.uint8)}),
    ("token_ids", {"token_ids": np.zeros((5, 1), np.int32)}),
    ("prompt_length", {"prompt_length": 6}),
    ("num_turns", {"num_turns": -1}),
    ("invalid_actions", {"invalid_actions": 2}),
    ("generation_seconds", {"generation_seconds": -1.0}),
    ("env_seconds", {"env_seconds": float("inf")}),
])
def test_each_bad_number_is_refused_and_counted_under_its_field(field, changes):
    """Built in process (as a stand-in actor or the in-process transport could), past the wire's
    own checks: the buffer is where every value is checked."""
    buffer = build_buffer(Config(), vocab_size=100)
    buffer.add(wire_trajectory("good", "g", 1.0), learner_version=0)
    bad = wire_trajectory("bad", "g", 0.0)
    for name, value in changes.items():
        setattr(bad, name, value)
    buffer.add(bad, learner_version=0)
    assert buffer.counters["accepted"] == 1 and buffer.counters["dropped_malformed"] == 1
    assert buffer.refused_fields == {field: 1}


def test_rewards_at_the_configured_bound_give_the_hand_computed_advantages():
    """The bound is the config's; rewards of +-bound are accepted and every estimator's
    advantages come out finite, equal to the values by hand; a hair beyond is refused."""
    bound = LearnerConfig().max_abs_reward
    assert bound == 1e6
    buffer = build_buffer(Config(), vocab_size=100)
    rewards = [bound, -bound, bound, -bound]
    for index, reward in enumerate(rewards):
        buffer.add(wire_trajectory(f"t{index}", "g", reward, group_size=4), learner_version=0)
    buffer.add(wire_trajectory("over", "h", np.nextafter(bound, np.inf)), learner_version=0)
    assert buffer.refused_fields == {"reward": 1}
    [group] = buffer.pop_ready(8, learner_version=0)
    np.testing.assert_array_equal(group.rewards, rewards)
    # Mean 0, population std = bound: (r - 0) / (bound + 1e-6).
    by_hand = np.array([1, -1, 1, -1]) * bound / (bound + 1e-6)
    np.testing.assert_array_equal(grpo_advantages(group.rewards), by_hand)
    np.testing.assert_array_equal(reinforce_pp_advantages(group.rewards), by_hand)
    # Leave-one-out: bound - (-bound / 3) = 4/3 bound, and its negative.
    np.testing.assert_allclose(rloo_advantages(group.rewards), np.array([1, -1, 1, -1]) * 4 * bound / 3, rtol=1e-15)
    np.testing.assert_array_equal(grpo_advantages(group.rewards, scale_by_std=False), rewards)
    for algorithm in ("grpo", "rloo", "dr_grpo", "reinforce_pp"):
        advantages = [example.advantage for example in score_groups([group], LearnerConfig(algorithm=algorithm)).examples]
        assert len(advantages) == 4 and all(np.isfinite(advantages)), algorithm
        assert max(abs(a) for a in advantages) <= 2 * bound


def test_the_largest_allowed_bound_still_gives_finite_advantages():
    from longhorizon.learner.buffer import MAX_ABS_REWARD_LIMIT

    rewards = [MAX_ABS_REWARD_LIMIT, -MAX_ABS_REWARD_LIMIT] * 64
    for advantages in (grpo_advantages(rewards), rloo_advantages(rewards), reinforce_pp_advantages(rewards),
                       grpo_advantages(rewards, scale_by_std=False)):
        assert np.all(np.isfinite(advantages.astype(np.float32)))


# ---------------------------------------------------------------------------------------------
# The trainer never applies a non-finite update


def _examples(model):
    from tests.test_trainer import _on_policy_examples

    return _on_policy_examples(model)


def _optimizer_state(trainer: Trainer) -> dict:
    return copy.deepcopy(trainer.optimizer.state_dict())


def _assert_same_state(before: dict, after: dict) -> None:
    assert before["param_groups"] == after["param_groups"]  # the learning rate included
    assert before["state"].keys() == after["state"].keys()
    for index, state in before["state"].items():
        for name, value in state.items():
            assert torch.equal(value, after["state"][index][name]), (index, name)


@pytest.mark.parametrize("poison", ["nan-advantage", "inf-advantage", "nan-behaviour-logprob"])
def test_a_non_finite_step_leaves_weights_and_optimiser_state_bit_identical(tiny_codebook_model, poison):
    model = load_causal_lm(tiny_codebook_model)
    good = _examples(model)
    trainer = Trainer(model, LearnerConfig(learning_rate=1e-2, warmup_steps=4))
    first = trainer.step(good)
    assert first["nonfinite_step"] == 0.0 and first["optimizer_steps_applied"] == 1.0
    parameters = [p.detach().clone() for p in model.parameters()]
    state = _optimizer_state(trainer)

    if poison == "nan-advantage":
        bad = [dataclasses.replace(good[0], advantage=float("nan")), *good[1:]]
    elif poison == "inf-advantage":
        bad = [dataclasses.replace(good[0], advantage=float("inf")), *good[1:]]
    else:
        logprobs = good[0].behaviour_logprobs.copy()
        logprobs[-1] = np.nan
        bad = [dataclasses.replace(good[0], behaviour_logprobs=logprobs), *good[1:]]
    skipped = trainer.step(bad)
    assert skipped["nonfinite_step"] == 1.0 and skipped["optimizer_steps_applied"] == 0.0
    assert skipped["train_sequences"] == 0.0 and skipped["train_tokens"] == 0.0
    assert not (np.isfinite(skipped["loss"]) and np.isfinite(skipped["grad_norm"]))
    for before, after in zip(parameters, model.parameters()):
        assert torch.equal(before, after.detach())
    _assert_same_state(state, _optimizer_state(trainer))
    assert all(p.grad is None for p in model.parameters())

    following = trainer.step(good)
    assert following["nonfinite_step"] == 0.0 and following["optimizer_steps_applied"] == 1.0
    assert trainer.optimizer_steps_taken() == 2  # the skipped step did not count
    moved = [not torch.equal(before, after.detach()) for before, after in zip(parameters, model.parameters())]
    assert any(moved)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_several_optimiser_steps_per_batch_stop_at_the_first_non_finite_one(tiny_codebook_model):
    model = load_causal_lm(tiny_codebook_model)
    good = _examples(model)
    trainer = Trainer(model, LearnerConfig(learning_rate=1e-2, optimizer_steps_per_batch=3))
    trainer.step(good)
    parameters = [p.detach().clone() for p in model.parameters()]
    state = _optimizer_state(trainer)
    metrics = trainer.step([dataclasses.replace(good[0], advantage=float("nan")), *good[1:]])
    assert metrics["nonfinite_step"] == 1.0 and metrics["optimizer_steps_applied"] == 0.0
    for before, after in zip(parameters, model.parameters()):
        assert torch.equal(before, after.detach())
    _assert_same_state(state, _optimizer_state(trainer))
    assert trainer.optimizer_steps_taken() == 3


def _two_rank_main(rank, world_size, port, model_folder, out_dir):
    """One of two gloo ranks: a step whose NaN is on rank 1 only, then a clean step."""
    import os

    from longhorizon.learner.distributed import (
        Ranks, destroy_process_group, exit_without_teardown, init_process_group, split_by_tokens,
    )
    from tests.test_distributed import _examples, _trainer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    ranks = Ranks(rank, world_size, rank)
    init_process_group(ranks, torch.device("cpu"), timeout_s=120)
    try:
        torch.set_num_threads(1)
        trainer = _trainer(model_folder, ranks)
        examples = _examples()
        mine = [examples[i] for i in split_by_tokens([len(e.token_ids) for e in examples], world_size)[rank]]
        poisoned = [dataclasses.replace(mine[0], advantage=float("nan")), *mine[1:]] if rank == 1 else mine
        before = trainer.full_state_dict()
        bad = trainer.step(poisoned)
        after_bad = trainer.full_state_dict()
        good = trainer.step(mine)
        after_good = trainer.full_state_dict()
        torch.save({"bad": bad, "good": good, "before": before, "after_bad": after_bad, "after_good": after_good},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        destroy_process_group()
    exit_without_teardown(0)


@pytest.mark.slow
def test_two_ranks_skip_a_step_whose_nan_is_on_one_rank_only_together(tmp_path, tiny_codebook_model):
    import torch.multiprocessing as mp

    from tests.test_distributed import _free_port

    mp.spawn(_two_rank_main, args=(2, _free_port(), str(tiny_codebook_model), str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in (0, 1)]
    for result in ranks:
        assert result["bad"]["nonfinite_step"] == 1.0 and result["bad"]["optimizer_steps_applied"] == 0.0
        assert result["good"]["nonfinite_step"] == 0.0 and result["good"]["optimizer_steps_applied"] == 2.0
    gathered = ranks[0]  # rank 0 holds the whole model
    assert all(torch.equal(gathered["before"][name], gathered["after_bad"][name]) for name in gathered["before"])
    assert any(not torch.equal(gathered["before"][name], gathered["after_good"][name]) for name in gathered["before"])
    assert all(torch.isfinite(tensor).all() for tensor in gathered["after_good"].values())


# ---------------------------------------------------------------------------------------------
# The learner counts skipped steps and stops a run of them


def test_non_finite_steps_in_a_row_stop_the_run_and_a_finite_one_resets_the_count():
    streak = NonfiniteSteps(3)
    assert [streak.record(skipped) for skipped in (True, True, False, True, True)] == [False] * 5
    assert streak.in_a_row == 2
    assert streak.record(True) is True
    error = streak.error()
    assert isinstance(error, NonfiniteUpdatesError)
    assert "3 update steps in a row" in str(error) and "learner.max_nonfinite_steps = 3" in str(error)
    assert "learner.max_abs_reward" in str(error)
    assert NonfiniteSteps(1).record(True) is True
    assert LearnerConfig().max_nonfinite_steps == 3
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="max_nonfinite_steps"):
            NonfiniteSteps(bad)


async def test_the_learner_counts_and_logs_a_skipped_step_with_its_groups(tmp_path, caplog):
    """The learner's own bookkeeping of a skipped step: the counter in its record, and one WARNING
    naming the batch's groups."""
    import trio

    from longhorizon.common.models import build_tiny_model
    from longhorizon.common.transport import InProcessNetwork
    from longhorizon.learner.scoring import ScoredBatch
    from longhorizon.learner.worker import Learner
    from tests.test_learner_faults import _config

    model = build_tiny_model(tmp_path / "model", words=[f"w{i}" for i in range(260)])
    config = _config(tmp_path, model)
    learner = await trio.to_thread.run_sync(
        Learner, config, InProcessNetwork().learner_endpoints(), config.run_dir, str(model),
    )
    learner.buffer.add(wire_trajectory("a", "poisoned", 1.7e308), learner_version=0)
    groups = [Group("g-one", [], 2), Group("g-two", [], 2)]
    with caplog.at_level(logging.WARNING, logger="longhorizon.learner.worker"):
        learner._report_nonfinite_step(groups, {"loss": float("nan"), "grad_norm": float("nan")})
    [line] = [r.getMessage() for r in caplog.records if r.name == "longhorizon.learner.worker"]
    assert "step 1" in line and "not finite" in line and "g-one, g-two" in line
    record = learner._record([], ScoredBatch([], 0, 0, 0, 0), {}, 1.0, 0)
    assert record["steps_nonfinite"] == 1
    assert record["trajectories_malformed"] == 1 and record["trajectories_malformed_by_field"] == {"reward": 1}
    learner.metrics.close()


# ---------------------------------------------------------------------------------------------
# Metrics stay strict JSON; the report names non-finite steps first


def _strict(line: str) -> dict:
    def refuse(constant):
        raise ValueError(f"not strict JSON: {constant}")

    return json.loads(line, parse_constant=refuse)


def test_non_finite_metrics_are_written_as_null_and_named(tmp_path):
    writer = MetricsWriter(tmp_path, tensorboard=False)
    writer.write({"step": 1, "loss": float("nan"), "grad_norm": float("inf"), "entropy": np.float32("-inf"),
                  "reward_mean": 0.5, "by_field": {"x": float("nan")}, "ok": [1.0, float("nan")]})
    writer.write({"step": 2, "loss": 0.25})
    writer.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    first, second = (_strict(line) for line in lines)
    assert first["loss"] is None and first["grad_norm"] is None and first["entropy"] is None
    assert first["reward_mean"] == 0.5 and first["by_field"] == {"x": None} and first["ok"] == [1.0, None]
    assert first["nonfinite_metrics"] == ["loss", "grad_norm", "entropy", "by_field.x", "ok[1]"]
    assert second == {"step": 2, "loss": 0.25}
    assert read_metrics(tmp_path) == [first, second]


def test_old_metrics_files_with_bare_nan_and_infinity_read_as_new_ones(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(
        '{"step": 1, "loss": NaN, "grad_norm": Infinity, "reward_mean": -Infinity}\n{"step": 2, "loss": 0.5}\n'
    )
    first, second = read_metrics(tmp_path, required=True)
    assert first == {"step": 1, "loss": None, "grad_norm": None, "reward_mean": None,
                     "nonfinite_metrics": ["loss", "grad_norm", "reward_mean"]}
    assert second == {"step": 2, "loss": 0.5}


def _record(step, **fields):
    from tests.test_report import record

    return record(step, **fields)


def test_the_report_names_skipped_non_finite_steps_first(tmp_path):
    from tests.test_report import updated

    records = [updated(step, nonfinite_step=0.0) for step in range(1, 4)]
    records += [_record(step, nonfinite_step=1.0, train_sequences=0.0, loss=None, grad_norm=None,
                        nonfinite_metrics=["loss", "grad_norm"]) for step in (4, 5, 6)]
    records += [_record(step) for step in range(7, 24)]  # then nothing but flat groups without a success
    writer = MetricsWriter(tmp_path, tensorboard=False)
    for record in records:
        writer.write(record)
    writer.close()
    summary = summarise_run(read_metrics(tmp_path))
    assert summary["nonfinite_steps"] == [4, 5, 6]
    findings = diagnose(summary)
    assert len(findings) > 1
    assert "3 step(s) had a non-finite loss or gradient norm (step 4-6)" in findings[0]
    assert "skipped" in findings[0]
    report = format_report(summary)
    assert report.index("non-finite loss") < report.index("groups were flat")


def test_the_report_of_an_old_run_says_the_weights_took_the_non_finite_steps(tmp_path):
    """Before the trainer skipped them, a NaN step was written as a bare NaN and trained on."""
    lines = [json.dumps(_record(1, train_sequences=8.0, grad_norm=1.0)),
             json.dumps(_record(2, train_sequences=8.0, grad_norm=float("nan"), loss=float("nan"))),
             *(json.dumps(_record(step)) for step in range(3, 6))]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    assert "NaN" in (tmp_path / "metrics.jsonl").read_text()
    summary = summarise_run(read_metrics(tmp_path))
    assert summary["nonfinite_steps"] == [2]
    assert summary["grad_norm_mean"] == 1.0  # the NaN is not averaged in
    first = diagnose(summary)[0]
    assert "(step 2)" in first and "the weights took those updates" in first


@pytest.mark.slow
async def test_a_run_whose_updates_turn_non_finite_skips_them_then_stops(tmp_path):
    """The worker's loop end to end, in process: a learning rate of 1e30 blows the weights up in the
    first update, so every later update is NaN. Those are skipped (the version stays), counted
    and recorded as strict JSON, and the second in a row stops the run with the error."""
    import trio

    from longhorizon.actor.worker import run_actor
    from longhorizon.common.models import build_tiny_model
    from longhorizon.common.transport import InProcessNetwork
    from longhorizon.learner.worker import run_learner
    from tests.test_learner_faults import _config

    model = build_tiny_model(tmp_path / "model", words=[f"w{i}" for i in range(260)])
    config = _config(tmp_path, model, "run.total_steps=20", "learner.learning_rate=1e30",
                     "learner.max_nonfinite_steps=2", "actor.concurrent_groups=1", "actor.group_size=8",
                     # The scripted actor shares this process: unpaced, it floods the event loop
                     # with episodes and the update thread waits for the GIL between its ops.
                     "actor.simulated_token_latency_s=0.005",
                     "horizon.stages=[6]")
    network = InProcessNetwork()
    with pytest.raises(BaseException) as caught:  # trio wraps it in nurseries' exception groups
        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(run_actor, config, 0, network.actor_endpoints("actor-0"))
                await run_learner(config, network.learner_endpoints(), model_path=str(model))
    errors = caught.value.exceptions if isinstance(caught.value, BaseExceptionGroup) else [caught.value]
    while any(isinstance(error, BaseExceptionGroup) for error in errors):
        errors = [inner for error in errors for inner in getattr(error, "exceptions", [error])]
    assert [type(error) for error in errors] == [NonfiniteUpdatesError]
    records = [_strict(line) for line in (config.run_dir / "metrics.jsonl").read_text().splitlines()]
    updates = [r for r in records if "nonfinite_step" in r]
    skipped = [r for r in updates if r["nonfinite_step"] == 1.0]
    assert len(skipped) == 2 and skipped[-1] is records[-1] and records[-1]["steps_nonfinite"] == 2
    assert updates[0]["nonfinite_step"] == 0.0  # the first update was finite, and applied
    assert all(r["loss"] is None and "loss" in r["nonfinite_metrics"] for r in skipped)
    assert all(r["version"] == updates[0]["version"] for r in skipped)  # no new version for a skip


def test_the_worker_process_finds_the_nonfinite_error_inside_trios_groups():
    """The learner's process exits with EXIT_DO_NOT_RESTART for this error (a restart would replay
    the same inputs), however deep trio's nurseries wrapped it, and only for it."""
    from longhorizon.launch.worker import nonfinite_error_in

    error = NonfiniteUpdatesError("3 in a row")
    nested = BaseExceptionGroup("outer", [ExceptionGroup("inner", [error])])
    assert nonfinite_error_in(nested) is error
    assert nonfinite_error_in(error) is error
    assert nonfinite_error_in(ExceptionGroup("other", [ValueError("x")])) is None
    assert nonfinite_error_in(ValueError("x")) is None
