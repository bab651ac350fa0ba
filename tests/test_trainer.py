"""The update step: micro-batch planning, the behaviour log-probs reaching the loss, the proximal
pass without dropout, and the two run modes building the same update."""

import dataclasses

import numpy as np
import pytest
import torch

from longhorizon.common.config import Config, LearnerConfig, RunConfig
from longhorizon.common.models import load_causal_lm
from longhorizon.learner.logprobs import (
    Example,
    chunked_logprobs_match,
    logprobs_from_logits,
    pad_examples,
    token_logprobs,
)
from longhorizon.learner.shared_prefix import plan_micro_batches
from longhorizon.learner.scoring import FlatShare
from longhorizon.learner.trainer import Trainer, has_dropout, score_groups
from longhorizon.learner.worker import build_buffer, build_trainer


def _example(length: int) -> Example:
    return Example(
        token_ids=np.arange(length), loss_mask=np.ones(length, np.float32),
        behaviour_logprobs=np.zeros(length, np.float32), advantage=0.0,
    )


def test_micro_batches_are_cut_by_sequences_and_by_padded_tokens():
    examples = [_example(n) for n in (9, 2, 5, 3, 5)]
    plan = plan_micro_batches(examples, max_sequences=3, max_tokens=12)
    # Sorted 2,3,5,5,9: [2,3] (a third of length 5 would pad to 15), [5,5] (then 3 x 9 = 27), [9].
    assert [[len(e.token_ids) for e in chunk] for chunk in plan] == [[2, 3], [5, 5], [9]]
    # The sequence cap alone.
    plan = plan_micro_batches(examples, max_sequences=2, max_tokens=10_000)
    assert [len(chunk) for chunk in plan] == [2, 2, 1]
    # A sequence longer than the budget still trains, alone.
    plan = plan_micro_batches([_example(50), _example(2)], max_sequences=8, max_tokens=10)
    assert [[len(e.token_ids) for e in chunk] for chunk in plan] == [[2], [50]]
    for chunk in plan_micro_batches(examples, max_sequences=4, max_tokens=12):
        assert len(chunk) == 1 or len(chunk) * max(len(e.token_ids) for e in chunk) <= 12


def _on_policy_examples(model, seed: int = 0) -> list[Example]:
    """Examples whose behaviour log-probs are the model's own, with advantages of both signs."""
    rng = np.random.default_rng(seed)
    examples = []
    for row in range(6):
        prompt = rng.integers(4, 15, size=4)
        reply = rng.integers(4, 15, size=int(rng.integers(2, 5)))
        tokens = np.concatenate([prompt, reply]).astype(np.int64)
        mask = np.array([0] * len(prompt) + [1] * len(reply), np.float32)
        examples.append(Example(tokens, mask, np.zeros(len(tokens), np.float32), advantage=1.0 if row % 2 else -1.0))
    with torch.no_grad():
        own = token_logprobs(model, pad_examples(examples, pad_token_id=0))
    for row, example in enumerate(examples):
        length = len(example.token_ids)
        example.behaviour_logprobs[1:] = own[row, : length - 1].numpy() * example.loss_mask[1:]
    return examples


def _gradient(model_folder, config: LearnerConfig, examples: list[Example],
              flat: FlatShare = FlatShare()) -> list[torch.Tensor]:
    """The gradient of one update step (left on the parameters after the step), whose scale,
    unlike an Adam step's, follows the loss's."""
    model = load_causal_lm(model_folder)
    Trainer(model, config).step(examples, flat)
    return [p.grad.detach().clone() for p in model.parameters()]


def _noise(update: list[torch.Tensor]) -> float:
    """float32 rounding of summed gradients, relative to the largest entry."""
    return 1e-5 * max(float(delta.abs().max()) for delta in update)


@pytest.mark.parametrize("loss", ["decoupled_ppo", "truncated_is"])
def test_behaviour_logprobs_that_differ_from_the_proximal_ones_weight_the_update(tiny_codebook_model, loss):
    """With mu below pi_prox by d on every generated token, the behaviour weight is e^d (under the
    cap) on every token, so the gradient is exactly e^d times the on-policy one. A trainer that
    handed the proximal log-probs to the loss in place of the behaviour ones would give 1x."""
    examples = _on_policy_examples(load_causal_lm(tiny_codebook_model))
    config = LearnerConfig(loss=loss, behaviour_weight_cap=2.0, grad_clip=1e9, learning_rate=1e-2)
    on_policy = _gradient(tiny_codebook_model, config, examples)
    assert any(grad.abs().max() > 0 for grad in on_policy), "no gradient at all"
    for shift in (0.3, -1.0):
        off_policy = [
            dataclasses.replace(e, behaviour_logprobs=(e.behaviour_logprobs - shift * e.loss_mask).astype(np.float32))
            for e in examples
        ]
        update = _gradient(tiny_codebook_model, config, off_policy)
        for delta, reference in zip(update, on_policy):
            torch.testing.assert_close(delta, reference * float(np.exp(shift)), rtol=1e-3, atol=_noise(on_policy))


@pytest.mark.parametrize("algorithm", ["grpo", "gspo", "dr_grpo"], ids=["token", "sequence", "sum"])
def test_flat_groups_left_out_count_as_if_trained_on_with_zero_advantage(tiny_codebook_model, algorithm):
    """Flat groups never reach the model, but their share of the denominator does: the gradient
    equals that of the whole batch with the flat members at advantage 0: the signal examples' own
    gradient scaled by their share of the tokens (token level) or sequences (the others)."""
    signal = _on_policy_examples(load_causal_lm(tiny_codebook_model))
    flat = [dataclasses.replace(e, advantage=0.0) for e in _on_policy_examples(load_causal_lm(tiny_codebook_model), seed=1)]
    flat += flat[:6]
    share = FlatShare(tokens=float(sum(e.loss_mask.sum() for e in flat)), sequences=len(flat))
    if algorithm == "grpo":
        signal_tokens = float(sum(e.loss_mask.sum() for e in signal))
        signal_share = signal_tokens / (signal_tokens + share.tokens)
    else:
        signal_share = 1 / 3  # 6 sequences of 18
    config = LearnerConfig(algorithm=algorithm, grad_clip=1e9)
    whole = _gradient(tiny_codebook_model, config, signal + flat)
    alone = _gradient(tiny_codebook_model, config, signal)
    left_out = _gradient(tiny_codebook_model, config, signal, share)
    assert any(grad.abs().max() > 0 for grad in whole), "no gradient at all"
    for with_flat, reference, without in zip(left_out, whole, alone):
        torch.testing.assert_close(with_flat, reference, rtol=1e-4, atol=_noise(whole))
        torch.testing.assert_close(with_flat, without * signal_share, rtol=1e-3, atol=_noise(whole))
    # The logged figures stay means over the examples trained on; the fraction is logged beside them.
    logged_alone = Trainer(load_causal_lm(tiny_codebook_model), config).step(signal)
    logged = Trainer(load_causal_lm(tiny_codebook_model), config).step(signal, share)
    for name in ("loss", "entropy_estimate", "ratio_mean"):
        assert logged[name] == pytest.approx(logged_alone[name], rel=1e-5), name
    assert logged["signal_fraction"] == pytest.approx(signal_share) and logged_alone["signal_fraction"] == 1.0


def _groups_with_flat_ones(model) -> list:
    """Six groups of three on-policy members: two with signal, four flat (all 1 or all 0)."""
    from types import SimpleNamespace

    members = [e for seed in (2, 3, 4) for e in _on_policy_examples(model, seed=seed)]
    rewards = [[1.0, 0.0, 1.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [0.0, 1.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]
    groups = []
    for index, group_rewards in enumerate(rewards):
        trajectories = [
            SimpleNamespace(reward=reward, error="", token_ids=e.token_ids, loss_mask=e.loss_mask,
                            behaviour_logprobs=e.behaviour_logprobs)
            for reward, e in zip(group_rewards, members[3 * index:3 * index + 3])
        ]
        groups.append(SimpleNamespace(trajectories=trajectories))
    return groups


def _reference_model(model_folder):
    """The model with its weights moved a little: a KL anchor whose gradient is not 0."""
    reference = load_causal_lm(model_folder)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for parameter in reference.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    return reference.eval().requires_grad_(False)


@pytest.mark.parametrize("algorithm", ["grpo", "gspo", "dr_grpo"], ids=["token", "sequence", "sum"])
@pytest.mark.parametrize("kl_coef", [0.0, 1.0], ids=["kl-off", "kl-on"])
def test_the_update_is_the_whole_batch_gradient_with_flat_members_at_advantage_zero(tiny_codebook_model, algorithm,
                                                                                   kl_coef):
    """Scored and stepped as a run does (the algorithm scores the groups, the trainer steps on
    several micro-batches), the gradient equals one pass over every member, the flat groups' at
    advantage 0, with the KL penalty over all of them. With the KL off the flat groups are left
    out (counted in the denominator only); with it on they go through the model, since their KL
    is not 0: leaving them out dropped their KL anchor (45% off at kl_coef = 1)."""
    from longhorizon.learner.advantages import group_has_signal
    from longhorizon.learner.losses import kl_penalty

    model = load_causal_lm(tiny_codebook_model)
    groups = _groups_with_flat_ones(model)
    config = LearnerConfig(algorithm=algorithm, kl_coef=kl_coef, grad_clip=1e9, micro_batch_size=4,
                           max_tokens_per_micro_batch=10_000)
    reference = _reference_model(tiny_codebook_model)
    trainer = Trainer(model, config, reference_model=reference)
    scored = trainer.algorithm.score(groups)
    if kl_coef == 0:
        assert len(scored.examples) == 6 and scored.flat.sequences == 12  # the skip saves the compute
    else:
        assert len(scored.examples) == 18 and scored.flat.sequences == 0
    assert scored.groups_skipped_zero_variance == 4
    trainer.step(scored.examples, scored.flat)
    stepped = [p.grad.detach().clone() for p in model.parameters()]

    # The whole batch in one pass: the signal groups' advantages, 0 for the flat members.
    whole_model = load_causal_lm(tiny_codebook_model)
    algorithm_object = Trainer(whole_model, config, reference_model=reference).algorithm
    examples = []
    for group in groups:
        rewards = np.array([t.reward for t in group.trajectories])
        advantages = (algorithm_object.group_advantages(rewards) if group_has_signal(rewards)
                      else np.zeros(len(rewards)))
        examples += [Example(np.asarray(t.token_ids), t.loss_mask, t.behaviour_logprobs, float(a))
                     for t, a in zip(group.trajectories, advantages)]
    batch = pad_examples(examples, pad_token_id=0)
    logprobs = token_logprobs(whole_model, batch)
    loss = algorithm_object.loss(logprobs, logprobs.detach(), batch.behaviour_logprobs, batch.advantages,
                                 batch.loss_mask).loss
    if kl_coef:
        with torch.no_grad():
            anchor = token_logprobs(reference, batch)
        level = "token" if algorithm == "grpo" else "sequence"
        loss = loss + kl_coef * kl_penalty(logprobs, anchor, batch.loss_mask, aggregation=level).loss
    loss.backward()
    whole = [p.grad.detach().clone() for p in whole_model.parameters()]
    assert any(grad.abs().max() > 0 for grad in whole), "no gradient at all"
    largest = max(float(grad.abs().max()) for grad in whole)
    for got, expected in zip(stepped, whole):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6 * largest)


def test_flat_groups_left_out_under_a_kl_penalty_are_refused(tiny_codebook_model):
    """A scorer that left flat groups out while the KL is on would lose their KL: the step says so."""
    model = load_causal_lm(tiny_codebook_model)
    trainer = Trainer(model, LearnerConfig(kl_coef=0.1), reference_model=_reference_model(tiny_codebook_model))
    with pytest.raises(ValueError, match="flat groups were left out.*kl_coef"):
        trainer.step(_on_policy_examples(model), FlatShare(tokens=10.0, sequences=3))


def test_the_behaviour_weight_is_truncated_at_the_cap(tiny_codebook_model):
    examples = _on_policy_examples(load_causal_lm(tiny_codebook_model))
    config = LearnerConfig(loss="decoupled_ppo", behaviour_weight_cap=2.0, grad_clip=1e9)
    on_policy = _gradient(tiny_codebook_model, config, examples)
    far_behind = [
        dataclasses.replace(e, behaviour_logprobs=(e.behaviour_logprobs - 3.0 * e.loss_mask).astype(np.float32))
        for e in examples
    ]
    for delta, reference in zip(_gradient(tiny_codebook_model, config, far_behind), on_policy):
        torch.testing.assert_close(delta, reference * 2.0, rtol=1e-3, atol=_noise(on_policy))


def test_the_proximal_pass_runs_without_dropout(tiny_codebook_model, monkeypatch):
    model = load_causal_lm(tiny_codebook_model)
    model.extra_dropout = torch.nn.Dropout(0.5)
    # Dropout on the embeddings: active in train mode only, like a model trained with dropout.
    model.get_input_embeddings().register_forward_hook(lambda module, inputs, output: model.extra_dropout(output))
    assert has_dropout(model)
    examples = _on_policy_examples(model.eval())
    # The trainer's micro-batch holds the examples sorted by length.
    examples.sort(key=lambda e: len(e.token_ids))
    expected = token_logprobs(model.eval(), pad_examples(examples, 0)).detach()
    seen = []
    trainer = Trainer(model, LearnerConfig(micro_batch_size=64, max_tokens_per_micro_batch=10_000))
    real_loss = trainer.algorithm.loss

    def recording_loss(logprobs, proximal, *args, **kwargs):
        seen.append(proximal.detach().clone())
        return real_loss(logprobs, proximal, *args, **kwargs)

    monkeypatch.setattr(trainer.algorithm, "loss", recording_loss)
    trainer.step(examples)
    [proximal] = seen
    mask = pad_examples(examples, 0).loss_mask.bool()
    torch.testing.assert_close(proximal[mask], expected[mask])
    assert not has_dropout(load_causal_lm(tiny_codebook_model))


def test_sync_mode_and_async_at_zero_staleness_build_the_same_update(tiny_codebook_model):
    """The two modes as a run builds them (buffer and trainer from the config), fed the same
    on-policy batch: identical parameters, and equal to plain on-policy PPO."""
    from tests.test_sync_equivalence import _fixed_batch

    version = 5
    trajectories = _fixed_batch(load_causal_lm(tiny_codebook_model), version)
    learner = LearnerConfig(learning_rate=1e-2, micro_batch_size=3, max_staleness=4)
    results = {}
    for name, config in {
        "sync": Config(run=RunConfig(mode="sync"), learner=learner),
        "async": Config(run=RunConfig(mode="async"), learner=learner.replace(max_staleness=0)),
        "on-policy ppo": Config(run=RunConfig(mode="sync"), learner=learner.replace(loss="none")),
    }.items():
        buffer = build_buffer(config, vocab_size=None)
        for trajectory in trajectories:
            buffer.add(trajectory, learner_version=version)
        groups = buffer.pop_ready(3, learner_version=version)
        assert len(groups) == 3
        torch.manual_seed(0)
        model = load_causal_lm(tiny_codebook_model)
        build_trainer(config, model, pad_token_id=0).step(score_groups(groups).examples)
        results[name] = [p.detach().clone() for p in model.parameters()]
    assert config.learner.algorithm_options["loss"] == "none" and not Config().learner.algorithm_options
    for a, b, c in zip(results["sync"], results["async"], results["on-policy ppo"]):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, c, rtol=0, atol=1e-6)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logprobs_equal_whole_ones_in_value_and_gradient(tiny_codebook_model, temperature):
    model = load_causal_lm(tiny_codebook_model)
    assert chunked_logprobs_match(model)
    batch = pad_examples(_on_policy_examples(model), pad_token_id=0)
    results = []
    for chunk_tokens in (0, 5, 1024):
        model.zero_grad(set_to_none=True)
        logprobs = token_logprobs(model, batch, temperature, chunk_tokens=chunk_tokens)
        (logprobs * batch.loss_mask).sum().backward()
        results.append((logprobs.detach(), [p.grad.clone() for p in model.parameters()]))
    (whole, whole_grads), *chunked = results
    for values, grads in chunked:
        torch.testing.assert_close(values, whole, atol=1e-5, rtol=0)
        for grad, reference in zip(grads, whole_grads):
            torch.testing.assert_close(grad, reference, atol=1e-5, rtol=1e-4)


def test_the_entropy_of_each_position_by_hand():
    # Probabilities 1/4 and 3/4: H = -(1/4 ln 1/4 + 3/4 ln 3/4); four equal logits: ln 4.
    logits = torch.tensor([[[0.0, float(np.log(3.0))], [5.0, 5.0]]])
    targets = torch.tensor([[1, 0]])
    logprobs, entropy = logprobs_from_logits(logits, targets, 1.0, with_entropy=True)
    torch.testing.assert_close(logprobs, torch.tensor([[np.log(0.75), np.log(0.5)]], dtype=torch.float32))
    torch.testing.assert_close(entropy, torch.tensor([[-(0.25 * np.log(0.25) + 0.75 * np.log(0.75)), np.log(2)]],
                                                     dtype=torch.float32))
    # At temperature 2 the logits are halved before anything else: probabilities 1/(1+sqrt 3), ...
    _, tempered = logprobs_from_logits(logits, targets, 2.0, with_entropy=True)
    p = 1 / (1 + np.sqrt(3.0))
    assert float(tempered[0, 0]) == pytest.approx(-(p * np.log(p) + (1 - p) * np.log(1 - p)), rel=1e-5)


def test_chunked_entropy_equals_whole_in_value_and_gradient(tiny_codebook_model):
    model = load_causal_lm(tiny_codebook_model)
    batch = pad_examples(_on_policy_examples(model), pad_token_id=0)
    results = []
    for chunk_tokens in (0, 5):
        model.zero_grad(set_to_none=True)
        logprobs, entropy = token_logprobs(model, batch, 0.7, chunk_tokens=chunk_tokens, with_entropy=True)
        (entropy * batch.loss_mask).sum().backward()
        results.append((logprobs.detach(), entropy.detach(), [p.grad.clone() for p in model.parameters()]))
    (logprobs, whole, grads), (chunked_logprobs, chunked, chunked_grads) = results
    torch.testing.assert_close(chunked_logprobs, logprobs, atol=1e-5, rtol=0)
    torch.testing.assert_close(chunked, whole, atol=1e-5, rtol=0)
    assert float(whole.max()) <= np.log(model.config.vocab_size) + 1e-4 and float(whole.min()) > 0
    for grad, reference in zip(chunked_grads, grads):
        torch.testing.assert_close(grad, reference, atol=1e-5, rtol=1e-4)


def test_the_entropy_bonus_alone_makes_the_policy_less_certain(tiny_codebook_model):
    """Zero advantages everywhere: without the bonus nothing moves; with it, each step raises the
    entropy at the generated positions, and the step logs it."""
    examples = [dataclasses.replace(e, advantage=0.0) for e in _on_policy_examples(load_causal_lm(tiny_codebook_model))]
    batch = pad_examples(examples, pad_token_id=0)

    def mean_entropy(model):
        with torch.no_grad():
            _, entropy = token_logprobs(model, batch, with_entropy=True)
        return float((entropy * batch.loss_mask).sum() / batch.loss_mask.sum())

    still = load_causal_lm(tiny_codebook_model)
    before = mean_entropy(still)
    Trainer(still, LearnerConfig(learning_rate=1e-2)).step(examples)
    assert mean_entropy(still) == pytest.approx(before, abs=1e-6)
    model = load_causal_lm(tiny_codebook_model)
    trainer = Trainer(model, LearnerConfig(learning_rate=1e-3, entropy_coef=0.1))
    logged = trainer.step(examples)["entropy"]
    assert logged == pytest.approx(before, rel=1e-4)  # measured before the step
    after = mean_entropy(model)
    trainer.step(examples)
    assert before < after < mean_entropy(model)


def test_flat_groups_are_trained_on_at_advantage_zero_under_an_entropy_bonus():
    from types import SimpleNamespace

    def member(reward):
        return SimpleNamespace(reward=reward, error="", token_ids=np.arange(5), loss_mask=np.r_[0, 0, 1, 1, 1],
                               behaviour_logprobs=np.zeros(5, np.float32))

    groups = [SimpleNamespace(trajectories=[member(1.0), member(1.0)]),
              SimpleNamespace(trajectories=[member(0.0), member(1.0)])]
    plain = score_groups(groups, LearnerConfig())
    assert len(plain.examples) == 2 and plain.flat.sequences == 2
    bonus = score_groups(groups, LearnerConfig(entropy_coef=0.01))
    assert len(bonus.examples) == 4 and bonus.flat.sequences == 0
    assert [e.advantage for e in bonus.examples[:2]] == [0.0, 0.0]
    assert (bonus.groups_used, bonus.groups_skipped_zero_variance) == (1, 1)  # still counted as flat


def test_a_model_that_does_not_split_falls_back_to_whole_logits(tiny_codebook_model):
    model = load_causal_lm(tiny_codebook_model)
    real_forward = model.forward

    def scaled_forward(*args, **kwargs):  # logits the decoder + output layer alone do not give
        output = real_forward(*args, **kwargs)
        output.logits = output.logits * 0.5
        return output

    model.forward = scaled_forward
    assert not chunked_logprobs_match(model)
    assert Trainer(model, LearnerConfig(logprob_chunk_tokens=512)).chunk_tokens == 0


def test_the_learning_rate_warms_up_over_optimiser_steps_and_resumes_where_it_was(tiny_codebook_model):
    """Two optimiser steps per batch: the warm-up counts optimiser steps, and a trainer given the
    saved optimiser state (as a resumed run is) carries on from the count in it."""
    examples = _on_policy_examples(load_causal_lm(tiny_codebook_model))
    config = LearnerConfig(learning_rate=1e-2, warmup_steps=6, optimizer_steps_per_batch=2)
    first = Trainer(load_causal_lm(tiny_codebook_model), config)
    assert first.step(examples)["learning_rate"] == pytest.approx(1e-2 * 2 / 6)  # steps 1 and 2: the last one's
    assert first.step(examples)["learning_rate"] == pytest.approx(1e-2 * 4 / 6)
    assert first.optimizer_steps_taken() == 4
    resumed = Trainer(load_causal_lm(tiny_codebook_model), config)
    resumed.optimizer.load_state_dict(first.optimizer.state_dict())
    assert resumed.step(examples)["learning_rate"] == pytest.approx(1e-2)
    assert resumed.step(examples)["learning_rate"] == pytest.approx(1e-2)  # flat after the warm-up
    assert Trainer(load_causal_lm(tiny_codebook_model), LearnerConfig(learning_rate=3e-4)).step(examples)["learning_rate"] == 3e-4


def test_the_warm_up_sets_the_size_of_the_first_adam_step(tiny_codebook_model):
    """Adam's first step moves each parameter that has a gradient by the learning rate itself
    (its update is the gradient's sign): with a warm-up of 5 steps, by a fifth of it."""
    examples = _on_policy_examples(load_causal_lm(tiny_codebook_model))
    model = load_causal_lm(tiny_codebook_model)
    before = [p.detach().clone() for p in model.parameters()]
    Trainer(model, LearnerConfig(learning_rate=1e-2, warmup_steps=5)).step(examples)
    largest = max(float((p.detach() - b).abs().max()) for p, b in zip(model.parameters(), before))
    assert largest == pytest.approx(1e-2 / 5, rel=1e-3)
