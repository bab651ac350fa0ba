"""With max_staleness = 0 the asynchronous learner path reproduces the synchronous update exactly.

The async path: trajectories through the group buffer (max_staleness 0), decoupled PPO whose
proximal policy is the learner's parameters at the start of the update. The sync path: the same
groups straight to the update with the plain PPO objective against the behaviour policy. When the
weights that generated the batch are the learner's own (η = 0), both must give identical parameters.
"""

import dataclasses

import numpy as np
import pytest
import torch

from longhorizon.common.config import LearnerConfig
from longhorizon.common.models import load_causal_lm
from longhorizon.common.wire import Trajectory
from longhorizon.learner.buffer import GroupBuffer
from longhorizon.learner.logprobs import pad_examples, token_logprobs
from longhorizon.learner.trainer import Trainer, score_groups


def _fixed_batch(model, version, groups=3, group_size=4, seed=0):
    """Trajectories whose behaviour log-probs are the learner model's own (η = 0)."""
    rng = np.random.default_rng(seed)
    trajectories = []
    for group in range(groups):
        for member in range(group_size):
            prompt = list(rng.integers(4, 15, size=5))
            reply = list(rng.integers(4, 15, size=int(rng.integers(2, 6))))
            tokens = np.array(prompt + reply, np.int32)
            mask = np.array([0] * len(prompt) + [1] * len(reply), np.uint8)
            trajectories.append(dict(tokens=tokens, mask=mask, group=group, reward=float(rng.integers(0, 2))))
    # Make sure every group has signal.
    for group in range(groups):
        members = [t for t in trajectories if t["group"] == group]
        members[0]["reward"], members[1]["reward"] = 0.0, 1.0
    from longhorizon.learner.logprobs import Example

    batch = pad_examples(
        [Example(t["tokens"].astype(np.int64), t["mask"].astype(np.float32), np.zeros(len(t["tokens"]), np.float32), 0.0)
         for t in trajectories],
        pad_token_id=0,
    )
    with torch.no_grad():
        own = token_logprobs(model, batch)
    result = []
    for row, t in enumerate(trajectories):
        length = len(t["tokens"])
        behaviour = np.zeros(length, np.float32)
        behaviour[1:] = own[row, : length - 1].numpy() * t["mask"][1:]
        result.append(
            Trajectory(
                trajectory_id=f"t{row}", actor_id="actor-0", env_name="codebook", task_id=f"task-{t['group']}",
                group_id=f"g{t['group']}", group_size=group_size, token_ids=t["tokens"], loss_mask=t["mask"],
                behaviour_logprobs=behaviour,
                policy_versions=np.where(t["mask"] == 1, version, -1).astype(np.int32),
                prompt_length=5, reward=t["reward"], turn_rewards=[t["reward"]], num_turns=1, horizon_cap=3,
                terminated=True, truncated=False, success=bool(t["reward"]), generation_seconds=0.0,
                env_seconds=0.0, text="", error="",
            )
        )
    return result


def _updated_parameters(model_folder, config, groups):
    torch.manual_seed(0)
    model = load_causal_lm(model_folder)
    trainer = Trainer(model, config)
    scored = score_groups(groups)
    trainer.step(scored.examples)
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("optimizer_steps", [1, 2])
@pytest.mark.parametrize("micro_batch_size", [3, 64])
def test_async_with_zero_staleness_equals_sync(tiny_codebook_model, optimizer_steps, micro_batch_size):
    version = 7
    model = load_causal_lm(tiny_codebook_model)
    trajectories = _fixed_batch(model, version)

    buffer = GroupBuffer(max_staleness=0, group_timeout_s=60)
    for trajectory in trajectories:
        buffer.add(trajectory, learner_version=version)
    async_groups = buffer.pop_ready(3, learner_version=version)
    assert len(async_groups) == 3
    # The same groups a synchronous learner would have formed, in the same order.
    sync_groups = [
        dataclasses.replace(g, trajectories=[t for t in trajectories if t.group_id == g.group_id]) for g in async_groups
    ]

    base = LearnerConfig(learning_rate=1e-2, micro_batch_size=micro_batch_size, optimizer_steps_per_batch=optimizer_steps)
    asynchronous = _updated_parameters(tiny_codebook_model, base.replace(loss="decoupled_ppo"), async_groups)
    synchronous = _updated_parameters(tiny_codebook_model, base.replace(loss="none"), sync_groups)
    initial = [p.detach() for p in load_causal_lm(tiny_codebook_model).parameters()]
    assert any(not torch.equal(a, b) for a, b in zip(asynchronous, initial)), "the update changed nothing"
    for a, s in zip(asynchronous, synchronous):
        assert torch.equal(a, s)


def test_one_step_more_staleness_is_refused_at_zero(tiny_codebook_model):
    model = load_causal_lm(tiny_codebook_model)
    trajectories = _fixed_batch(model, version=3)
    buffer = GroupBuffer(max_staleness=0, group_timeout_s=60)
    for trajectory in trajectories:
        buffer.add(trajectory, learner_version=4)
    assert buffer.pop_ready(3, learner_version=4) == []
