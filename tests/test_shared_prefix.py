"""A group's common prefix encoded once gives the plain forward pass's log-probs and gradients."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from longhorizon.common.config import LearnerConfig
from longhorizon.learner.logprobs import Example, pad_examples, token_logprobs
from longhorizon.learner.shared_prefix import (
    _cut_under,
    balanced_cut,
    common_prefix_length,
    computed_tokens,
    plan_group_micro_batches,
    shareable_prefix_length,
    sharing_units,
)
from longhorizon.learner.trainer import Trainer, score_groups

VOCABULARY = 40
RTOL, ATOL = 1e-5, 1e-7


def _assert_same_gradient(actual: torch.Tensor, expected: torch.Tensor, name: str) -> None:
    """Equal to 1e-5 of the gradient's own scale. The models' RMSNorm computes in float32 even in
    a float64 model, so a gradient summed over rows (each member's copy of the prompt) and one
    summed inside the single prefix round differently, at about 1e-7 of the largest entry."""
    scale = float(expected.abs().max())
    difference = float((actual - expected).abs().max())
    assert difference <= RTOL * scale + 1e-12, f"{name}: differs by {difference:.3g} at a scale of {scale:.3g}"


def test_common_prefix_length_by_hand():
    assert common_prefix_length([[1, 2, 3, 4], [1, 2, 5], [1, 2, 3]]) == 2
    assert common_prefix_length([[1, 2, 3], [1, 2, 3]]) == 3
    assert common_prefix_length([[1, 2, 3], [1, 2]]) == 2
    assert common_prefix_length([[7, 2], [1, 2]]) == 0
    assert common_prefix_length([[4, 5, 6]]) == 3
    assert common_prefix_length([]) == 0
    assert common_prefix_length([np.array([1, 2, 3]), np.array([1, 2, 9, 9])]) == 2


def test_the_shared_prefix_leaves_every_member_a_token_and_needs_two_members():
    assert shareable_prefix_length([[1, 2, 3], [1, 2, 3]]) == 2  # identical: the last token stays
    assert shareable_prefix_length([[1, 2], [1, 2, 3, 4]]) == 1
    assert shareable_prefix_length([[1, 2, 3, 4], [1, 2, 5]]) == 2
    assert shareable_prefix_length([[1, 2, 3]]) == 0
    assert computed_tokens(torch.zeros(3, 10), 4) == 4 + 3 * 6
    assert computed_tokens(torch.zeros(3, 10), 0) == 30


def _example(tokens, group=None, advantage=1.0, prompt=0) -> Example:
    tokens = np.asarray(tokens, dtype=np.int64)
    mask = np.zeros(len(tokens), np.float32)
    mask[prompt:] = 1.0
    return Example(tokens, mask, np.zeros(len(tokens), np.float32), advantage, group=group)


def test_micro_batches_hold_one_group_each_within_the_computed_token_budget():
    prompt = [5, 6, 7, 8, 9, 10]
    group_a = [_example(prompt + [1] * n, group=0) for n in (2, 3, 4, 5)]
    group_b = [_example([3, 3] + [2] * n, group=1) for n in (1, 2)]
    loose = [_example([1, 2, 3]), _example([1, 2, 4])]
    plan = plan_group_micro_batches(group_a + group_b + loose, max_sequences=8, max_tokens=18, min_prefix=1)
    by_group = {}
    for chunk, prefix in plan:
        groups = {e.group for e in chunk}
        assert len(groups) == 1
        by_group.setdefault(groups.pop(), []).append((len(chunk), prefix))
    # Group a shares the prompt and [1, 1], cut to 7 tokens so that its shortest member (8 tokens)
    # keeps one. All four members would compute 7 + 4 x 4 = 23 > 18 tokens, so two micro-batches:
    # 3 + 1 costs 7 + 3 x 3 = 16 and 11 (the last member alone shares nothing), 2 + 2 costs
    # 7 + 2 x 2 = 11 and 7 + 2 x 4 = 15, the cheaper costliest one. The second pair shares its own
    # longest common prefix, the prompt and [1, 1, 1] (9 tokens).
    assert by_group[0] == [(2, 7), (2, 9)]
    assert by_group[1] == [(2, 2)]
    assert by_group[None] == [(2, 0)]  # without a group, nothing is shared
    # A group whose common prefix is short is cut with the examples without a group.
    plan = plan_group_micro_batches(group_a + group_b, max_sequences=8, max_tokens=18, min_prefix=3)
    assert [(sorted({e.group for e in chunk}), prefix) for chunk, prefix in plan] == [
        ([0], 7), ([0], 9), ([1], 0)]


def test_a_group_is_cut_into_the_fewest_micro_batches_then_evened_out():
    # Eight members of 20 tokens sharing 10, at most seven per micro-batch: two micro-batches,
    # 4 + 4 (10 + 4 x 10 = 50 tokens each) rather than 7 + 1 (80, then 20).
    assert _cut_under([20] * 8, 10, 7, 1000) == [7, 1]
    assert balanced_cut([20] * 8, 10, 7, 1000) == [4, 4]
    # The TextCraft-shaped group of the learner bench: a 542-token prompt, members of 783 to 1,024
    # tokens, four per micro-batch and 2,048 tokens computed at most. Front to back the budget
    # cuts 4 + 3 + 1 (542 + 4 x 344 = 1,918, 542 + 3 x 448 = 1,886, then 1,024 alone: 4,828
    # tokens). Three micro-batches are the fewest; 3 + 3 + 2 computes 542 + 3 x 310 = 1,472,
    # 542 + 3 x 413 = 1,781 and 542 + 2 x 482 = 1,506 (4,759 tokens), and no cut into three has a
    # cheaper costliest micro-batch (4 + 2 + 2: 1,918; 2 + 3 + 3 and 3 + 2 + 3: 1,988).
    textcraft = [783, 817, 852, 886, 921, 955, 990, 1024]
    assert _cut_under(textcraft, 542, 4, 2048) == [4, 3, 1]
    assert balanced_cut(textcraft, 542, 4, 2048) == [3, 3, 2]
    # Evened out by tokens, not by members: five short members and a long one cost 10 + 5 x 10 = 60
    # and 40; 4 + 2 would cost 50 and 10 + 2 x 30 = 70.
    assert balanced_cut([20, 20, 20, 20, 20, 40], 10, 8, 100) == [5, 1]
    # A member over the budget is alone; one that fits needs no cut; none, no micro-batch.
    assert balanced_cut([10, 12, 100], 8, 4, 30) == [2, 1]
    assert balanced_cut([10, 12], 8, 4, 30) == [2]
    assert balanced_cut([], 8, 4, 30) == []
    assert balanced_cut([20, 20, 20], 10, 2, 1000) == [2, 1]  # three members, two at most


def test_examples_are_dealt_to_ranks_in_pieces_that_keep_a_shared_prefix():
    prompt = [5, 6, 7, 8, 9, 10]
    examples = ([_example(prompt + [1] * n, group=0) for n in (2, 3, 4, 5)]  # indices 0-3
                + [_example([3, 3] + [2] * n, group=1) for n in (1, 2)]  # 4-5: shares 2 < 3 tokens
                + [_example([1, 2, 3])])  # 6: no group
    units = sharing_units(examples, max_sequences=8, max_tokens=18, min_prefix=3)
    # Group 0 in its two micro-batches (7 + 2 x 2 = 11 and 9 + 2 x (11 - 9) = 13 tokens computed),
    # every other example alone at its length (those without a group first).
    assert units == [([0, 1], 11), ([2, 3], 13), ([6], 3), ([4], 3), ([5], 4)]


def test_a_prefix_the_examples_do_not_share_is_refused():
    with pytest.raises(ValueError, match="not shared"):
        pad_examples([_example([1, 2, 3]), _example([1, 4, 3])], 0, prefix_length=2)
    with pytest.raises(ValueError, match="at least one token after"):
        pad_examples([_example([1, 2, 3]), _example([1, 2, 3, 4])], 0, prefix_length=3)


def _tiny_model(kind: str = "qwen2", seed: int = 0):
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    torch.manual_seed(seed)
    settings = {"vocab_size": VOCABULARY, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128}
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**settings, tie_word_embeddings=True))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**settings, tie_word_embeddings=False))
    return model.double().train()


def _group(case: str, seed: int = 0) -> tuple[list[Example], int]:
    """A group's members and the prefix they share: a common prompt, members that share more
    than the prompt, or members of very different lengths."""
    rng = np.random.default_rng(seed)
    prompt = list(rng.integers(0, VOCABULARY, 9))
    if case == "prompt":
        tails = [[1, 5, 7], [2, 8, 8, 3], [3, 4, 1, 1, 2]]
    elif case == "beyond_prompt":  # the same first reply, then different
        tails = [[11, 12, 13, 1, 5], [11, 12, 13, 2], [11, 12, 13, 3, 3, 3]]
    else:
        tails = [[1], [2] + list(rng.integers(0, VOCABULARY, 14)), [3, 4]]
    examples = [_example(prompt + tail, group=0, advantage=advantage, prompt=len(prompt))
                for tail, advantage in zip(tails, (1.0, -0.5, 0.25))]
    return examples, shareable_prefix_length([e.token_ids for e in examples])


def _loss_and_gradients(model, batch, chunk_tokens: int, with_entropy: bool, entropy_top_k: int = 0):
    model.zero_grad(set_to_none=True)
    if with_entropy:
        logprobs, entropy = token_logprobs(model, batch, 0.7, chunk_tokens, with_entropy=True,
                                           entropy_top_k=entropy_top_k)
    else:
        logprobs, entropy = token_logprobs(model, batch, 0.7, chunk_tokens), None
    loss = (logprobs * batch.loss_mask * batch.advantages[:, None]).sum()
    if entropy is not None:
        loss = loss + 0.1 * (entropy * batch.loss_mask).sum()
    loss.backward()
    gradients = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    valid = batch.attention_mask[:, 1:].bool()  # positions whose target is a real token
    return logprobs.detach()[valid], None if entropy is None else entropy.detach()[valid], gradients


def _assert_same_as_plain(model, examples, prefix, chunk_tokens=0, with_entropy=False, entropy_top_k=0):
    plain = _loss_and_gradients(model, pad_examples(examples, 0), chunk_tokens, with_entropy, entropy_top_k)
    shared = _loss_and_gradients(model, pad_examples(examples, 0, prefix), chunk_tokens, with_entropy, entropy_top_k)
    torch.testing.assert_close(shared[0], plain[0], rtol=RTOL, atol=ATOL)
    if with_entropy:
        torch.testing.assert_close(shared[1], plain[1], rtol=RTOL, atol=ATOL)
    assert shared[2].keys() == plain[2].keys() and plain[2]
    for name in plain[2]:
        _assert_same_gradient(shared[2][name], plain[2][name], name)
    # The prompt's own gradient is there: a member-only pass would miss most of it.
    assert any(float(g.abs().max()) > 1e-4 for g in shared[2].values())


@pytest.mark.parametrize("case,expected_prefix", [("prompt", 9), ("beyond_prompt", 12), ("lengths", 9)])
@pytest.mark.parametrize("kind", ["qwen2", "llama"])
@pytest.mark.parametrize("chunk_tokens", [0, 4])
def test_log_probs_and_gradients_equal_the_plain_pass(case, expected_prefix, kind, chunk_tokens):
    examples, prefix = _group(case)
    assert prefix == expected_prefix
    _assert_same_as_plain(_tiny_model(kind), examples, prefix, chunk_tokens)


@pytest.mark.parametrize("chunk_tokens", [0, 4])
@pytest.mark.parametrize("entropy_top_k", [0, 3])
def test_entropy_and_its_gradient_equal_the_plain_pass(chunk_tokens, entropy_top_k):
    examples, prefix = _group("lengths")
    _assert_same_as_plain(_tiny_model(), examples, prefix, chunk_tokens, with_entropy=True,
                          entropy_top_k=entropy_top_k)


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_equal_under_gradient_checkpointing(kind):
    examples, prefix = _group("beyond_prompt")
    model = _tiny_model(kind)
    reference = _loss_and_gradients(model, pad_examples(examples, 0), 4, False)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    _assert_same_as_plain(model, examples, prefix, chunk_tokens=4, with_entropy=True)
    shared = _loss_and_gradients(model, pad_examples(examples, 0, prefix), 4, False)
    for name in reference[2]:  # and the same as without checkpointing
        _assert_same_gradient(shared[2][name], reference[2][name], name)
    # The layers were only let keep the cache for the shared pass.
    assert not any(getattr(m, "_can_checkpoint_with_cache", False) for m in model.modules())


def test_equal_with_lora_adapters():
    from longhorizon.common.lora import apply_lora, lora_settings

    model = apply_lora(_tiny_model(), lora_settings({"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}))
    with torch.no_grad():  # adapters away from their zero start, so every adapter has a gradient
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.1)
    examples, prefix = _group("prompt")
    _assert_same_as_plain(model, examples, prefix, chunk_tokens=4)
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in name for name in trained)


def test_the_no_gradient_pass_equals_the_plain_one():
    examples, prefix = _group("lengths")
    model = _tiny_model().eval()
    with torch.no_grad():
        plain = token_logprobs(model, pad_examples(examples, 0), 1.0, 4)
        shared = token_logprobs(model, pad_examples(examples, 0, prefix), 1.0, 4)
    valid = pad_examples(examples, 0).attention_mask[:, 1:].bool()
    torch.testing.assert_close(shared[valid], plain[valid], rtol=RTOL, atol=ATOL)


def _scored_groups():
    """Three groups of four members: each group's prompt, then replies of different lengths
    (two members of the first group share their first reply)."""
    rng = np.random.default_rng(3)
    groups = []
    for index in range(3):
        prompt = list(rng.integers(0, VOCABULARY, 16 + index))
        trajectories = []
        for member in range(4):
            reply = list(rng.integers(0, VOCABULARY, 3 + 2 * member))
            if index == 0 and member < 2:
                reply = [7, 7, 7] + reply
            tokens = np.array(prompt + reply, dtype=np.int64)
            mask = np.r_[np.zeros(len(prompt)), np.ones(len(reply))].astype(np.float32)
            trajectories.append(SimpleNamespace(
                reward=float((member + index) % 2), turn_rewards=[float((member + index) % 2)], error="",
                token_ids=tokens, loss_mask=mask,
                behaviour_logprobs=(-rng.random(len(tokens)) * mask).astype(np.float32),
            ))
        groups.append(SimpleNamespace(trajectories=trajectories))
    return groups


@pytest.mark.parametrize("settings", [
    {},
    {"optimizer_steps_per_batch": 2, "entropy_coef": 0.01},  # a separate proximal pass, the entropy term
    {"gradient_checkpointing": True, "algorithm": "rloo", "kl_coef": 0.05},  # a reference model's pass
    {"step_credit": "anchor_states", "step_discount": 0.5},  # an advantage per token
])
def test_a_whole_step_on_scored_groups_updates_the_same(settings):
    base = dict(learning_rate=1e-3, micro_batch_size=8, max_tokens_per_micro_batch=256, logprob_chunk_tokens=8,
                **settings)
    scored = score_groups(_scored_groups(), LearnerConfig(**base))
    assert {e.group for e in scored.examples} == {0, 1, 2}
    assert all((e.token_advantages is not None) == ("step_credit" in settings) for e in scored.examples)
    model = _tiny_model()
    results = []
    for shared in (False, True):
        config = LearnerConfig(**base, shared_prefix=shared)
        reference = copy.deepcopy(model).eval() if config.kl_coef > 0 else None
        trainer = Trainer(copy.deepcopy(model), config, reference_model=reference)
        micro = trainer._micro_batches(scored.examples)
        assert all(m.prefix_length > 0 for m in micro) == shared
        metrics = trainer.step(scored.examples, scored.flat)
        results.append((metrics, dict(trainer.model.named_parameters())))
    (plain_metrics, plain), (shared_metrics, shared) = results
    for key in ("loss", "grad_norm", "train_tokens", "entropy_estimate", *(["kl"] if "kl_coef" in settings else [])):
        assert shared_metrics[key] == pytest.approx(plain_metrics[key], rel=1e-5, abs=1e-9), key
    for name, parameter in plain.items():
        _assert_same_gradient(shared[name].grad, parameter.grad, name)
        torch.testing.assert_close(shared[name].detach(), parameter.detach(), rtol=RTOL, atol=1e-6, msg=name)
    moved = max(float((p.detach() - q.detach()).abs().max()) for p, q in zip(plain.values(), model.parameters()))
    assert moved > 1e-4  # the step did update the parameters


def _updates_alike(plain: Trainer, shared: Trainer, start: dict, metrics: tuple[dict, dict], names) -> None:
    """The same metrics `names` (to 1e-5), every trained parameter's gradient (to 1e-5 of its
    scale) and update (to 1e-5 of the whole update's size: Adam divides each entry's gradient by
    its own magnitude, so an entry whose gradient is near 0 turns the 1e-7 rounding of RMSNorm's
    float32 into a larger difference of its own update)."""
    plain_metrics, shared_metrics = metrics
    for key in names:
        assert shared_metrics[key] == pytest.approx(plain_metrics[key], rel=1e-5, abs=1e-9), key
    shared_parameters = dict(shared.policy.named_parameters())
    trained = [(name, p) for name, p in plain.policy.named_parameters() if p.requires_grad]
    assert trained
    for name, parameter in trained:
        _assert_same_gradient(shared_parameters[name].grad, parameter.grad, name)
    plain_update = torch.cat([(p.detach() - start[name]).flatten() for name, p in trained])
    shared_update = torch.cat([(shared_parameters[name].detach() - start[name]).flatten() for name, p in trained])
    assert float(plain_update.norm()) > 1e-4  # the step did update the parameters
    assert float((shared_update - plain_update).norm()) <= 1e-5 * float(plain_update.norm())


LORA = {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("algorithm", ["grpo", "dapo", "gspo", "cispo", "ppo"])
def test_every_algorithm_updates_the_same_with_the_shared_prefix(algorithm, lora):
    """Two optimiser steps (a separate proximal pass), micro-batches of at most three members (each
    group of four cut 2 + 2); ppo's examples keep their groups too, its critic on the policy's
    backbone (a plain pass beside the shared one). With LoRA the adapters start away from 0, as
    they are after some training, so that every adapter has a gradient."""
    base = dict(algorithm=algorithm, learning_rate=1e-3, micro_batch_size=3, max_tokens_per_micro_batch=256,
                logprob_chunk_tokens=8, optimizer_steps_per_batch=2, **({"lora": LORA} if lora else {}))
    scored = score_groups(_scored_groups(), LearnerConfig(**base))
    assert {e.group for e in scored.examples} == {0, 1, 2}
    model = _tiny_model()
    trainers, metrics = [], []
    for shared in (False, True):
        torch.manual_seed(0)  # the adapters' and the critic's start
        trainer = Trainer(copy.deepcopy(model), LearnerConfig(**base, shared_prefix=shared))
        if lora:
            generator = torch.Generator().manual_seed(1)
            with torch.no_grad():
                for name, parameter in trainer.model.named_parameters():
                    if "lora_B" in name:
                        parameter.copy_(torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype) * 0.1)
        if not trainers:
            start = {name: p.detach().clone() for name, p in trainer.policy.named_parameters()}
        assert [(len(m), m.prefix_length > 0) for m in trainer._micro_batches(scored.examples)] == (
            [(2, True)] * 6 if shared else [(3, False)] * 4)
        metrics.append(trainer.step(scored.examples, scored.flat))
        trainers.append(trainer)
    names = ["loss", "grad_norm", "train_tokens", "entropy_estimate"] + (["value_loss"] if algorithm == "ppo" else [])
    _updates_alike(*trainers, start, tuple(metrics), names)


def test_a_model_whose_forward_takes_no_cache_keeps_the_plain_pass(monkeypatch, caplog):
    from longhorizon.learner import prefix_probe, shared_prefix

    assert prefix_probe.probe_shared_prefix(_tiny_model("llama")).usable
    assert Trainer(_tiny_model(), LearnerConfig(shared_prefix=True)).shared_prefix

    def broken(run, *args, **kwargs):
        raise TypeError("this model takes no past_key_values")

    monkeypatch.setattr(shared_prefix, "shared_prefix_forward", broken)
    probe = prefix_probe.probe_shared_prefix(_tiny_model())
    assert not probe.usable and "takes no past_key_values" in probe.reason
    with caplog.at_level("WARNING"):
        trainer = Trainer(_tiny_model(), LearnerConfig(shared_prefix=True))
    assert not trainer.shared_prefix and "is not used" in caplog.text and "takes no past_key_values" in caplog.text
    examples, _ = _group("prompt")
    assert all(m.prefix_length == 0 for m in trainer._micro_batches(examples))


def test_a_float32_difference_is_judged_in_float64_on_the_architecture(monkeypatch):
    """A difference above the negligible one sends the probe to a float64 twin of the model: there
    the passes agree to rounding of float64, so the float32 difference is rounding and is named."""
    from longhorizon.learner import prefix_probe

    monkeypatch.setattr(prefix_probe, "NEGLIGIBLE_DIFFERENCE", -1.0)
    model = _tiny_model("llama").float()
    state = torch.random.get_rng_state()
    probe = prefix_probe.probe_shared_prefix(model)
    assert torch.equal(torch.random.get_rng_state(), state)  # the twin's weights do not move the run's seed
    assert probe.usable and probe.exact_difference is not None and probe.exact_difference < 1e-12
    assert probe.difference < 1e-4 and "float32" in probe.reason and "rounding" in probe.reason
    twin = prefix_probe._float64_twin(model)
    assert type(twin) is type(model) and next(twin.parameters()).dtype == torch.float64
    assert twin.config.num_hidden_layers == 2 and twin.config.hidden_size == model.config.hidden_size


def test_a_pass_that_computes_otherwise_is_refused_with_both_differences(monkeypatch):
    """Suffix tokens that see zeros for the prefix's values differ in float64 as much as in
    float32: refused, and the reason names both measured differences."""
    from longhorizon.learner import prefix_probe, shared_prefix

    def without_prefix_values(self, keys, values, *args, **kwargs):
        return torch.cat([self.keys, keys], dim=-2), torch.cat([torch.zeros_like(self.values), values], dim=-2)

    monkeypatch.setattr(shared_prefix._PrefixLayer, "update", without_prefix_values)
    probe = prefix_probe.probe_shared_prefix(_tiny_model("qwen2").float())
    assert not probe.usable
    assert probe.exact_difference > 1e-3 and probe.difference > 1e-3
    assert f"{probe.difference:.1e} in float32" in probe.reason and f"{probe.exact_difference:.1e} in float64" in probe.reason


def test_a_difference_beyond_the_precision_rounding_is_refused(monkeypatch):
    """Exact in float64 on the CPU but far off on the model's own device and precision (a kernel
    that computes otherwise there): refused, naming the allowance."""
    from longhorizon.learner import prefix_probe

    monkeypatch.setattr(prefix_probe, "NEGLIGIBLE_DIFFERENCE", -1.0)
    monkeypatch.setattr(prefix_probe, "ROUNDING_ALLOWANCE", {torch.float32: -1.0})
    probe = prefix_probe.probe_shared_prefix(_tiny_model("qwen2").float())
    assert not probe.usable and "more than that precision's rounding" in probe.reason


def test_a_model_with_sliding_window_layers_is_refused():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=VOCABULARY, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, use_sliding_window=True, sliding_window=4, max_window_layers=1,
    ))
    examples, prefix = _group("prompt")
    with pytest.raises(ValueError, match="full attention in every layer"):
        token_logprobs(model, pad_examples(examples, 0, prefix))


def test_the_learner_bench_builds_groups_that_share_the_recorded_prompt():
    from longhorizon.launch.bench.learner import PROMPT_TOKENS, _examples, build_parser, main

    args = build_parser().parse_args(["--shape", "textcraft", "--tokens", "1024", "--sequences", "12",
                                      "--group-size", "8"])
    examples = _examples(args, 1000)
    assert [e.group for e in examples] == [0] * 8 + [1] * 4
    prompt = PROMPT_TOKENS["textcraft"]
    first, second = examples[:8], examples[8:]
    assert common_prefix_length([e.token_ids for e in first]) >= prompt
    assert common_prefix_length([e.token_ids for e in second]) >= prompt
    assert max(len(e.token_ids) for e in first) == 1024
    assert min(len(e.token_ids) for e in first) == prompt + round((1024 - prompt) / 2)
    assert all(e.loss_mask[:prompt].sum() == 0 and e.loss_mask[prompt:].all() for e in examples)
    # Its group of eight (783 to 1,024 tokens) in micro-batches of four and 2,048 tokens computed:
    # 3 + 3 + 2 (test_a_group_is_cut_into_the_fewest_micro_batches_then_evened_out).
    assert sorted(len(e.token_ids) for e in first) == [783, 817, 852, 886, 921, 955, 990, 1024]
    plan = plan_group_micro_batches(first, 4, 2048)
    assert [len(chunk) for chunk, _ in plan] == [3, 3, 2] and all(prefix >= prompt for _, prefix in plan)
    assert main(["--shape", "random", "--shared-prefix", "on"]) == 2  # sharing needs groups
    assert main(["--shape", "codebook", "--tokens", "20"]) == 2  # shorter than the prompt


def test_a_16_bit_model_is_judged_against_its_own_plain_rounding(monkeypatch):
    """In bfloat16 the plain pass itself is far from the exact values: the shared pass may differ
    from it by twice the plain pass's distance from float32, and the model is left in bfloat16."""
    from longhorizon.learner import prefix_probe

    monkeypatch.setattr(prefix_probe, "NEGLIGIBLE_DIFFERENCE", -1.0)
    model = _tiny_model("llama").to(torch.bfloat16)
    before = {name: p.clone() for name, p in model.state_dict().items()}
    probe = prefix_probe.probe_shared_prefix(model)
    assert probe.usable and "bfloat16" in probe.reason and probe.exact_difference < 1e-12
    assert all(p.dtype == torch.bfloat16 and torch.equal(p, before[name]) for name, p in model.state_dict().items())
    monkeypatch.setattr(prefix_probe, "PLAIN_ROUNDING_FACTOR", -1.0)
    assert not prefix_probe.probe_shared_prefix(model).usable


@pytest.mark.slow
def test_the_default_model_trains_with_the_shared_prefix_to_float32_rounding(default_model_path):
    """SmolLM2 in float32: the probe reads its difference as rounding, the trainer takes the
    shared prefix, and a group sharing a chat-template prompt gets the plain pass's log-probs,
    entropies and gradients to float32 rounding (measured 1.5e-5 nats, 3e-5 of each gradient's
    scale; a wrong pass is off by nats)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from longhorizon.learner.prefix_probe import EXACT_TOLERANCE, NEGLIGIBLE_DIFFERENCE, probe_shared_prefix

    tokenizer = AutoTokenizer.from_pretrained(default_model_path)
    model = AutoModelForCausalLM.from_pretrained(default_model_path).float().train()
    probe = probe_shared_prefix(model)
    # Either float32 rounding (float64 shows the two passes exact: measured 2.7e-5 in float32 with
    # torch's default threads), or no difference at all (0.0 with one thread, as in the suite's
    # workers), where no float64 check is made.
    assert probe.usable, probe.reason
    assert (probe.difference <= NEGLIGIBLE_DIFFERENCE and probe.exact_difference is None
            or probe.exact_difference is not None and probe.exact_difference <= EXACT_TOLERANCE), probe.reason
    assert Trainer(model, LearnerConfig(shared_prefix=True)).shared_prefix
    prompt = tokenizer(tokenizer.apply_chat_template([
        {"role": "system", "content": "Crafting commands: get, craft, inventory. Recipes: craft 4 oak planks "
                                      "using 1 oak logs; craft 4 stick using 2 oak planks."},
        {"role": "user", "content": "Goal: craft stick."},
    ], add_generation_prompt=True, tokenize=False))["input_ids"]
    replies = ["Thought: I need planks first.\nAction: get 1 oak logs", "Action: craft 4 oak planks using 1 oak logs",
               "Action: inventory"]
    examples = [_example(prompt + tokenizer(reply)["input_ids"], group=0, advantage=advantage, prompt=len(prompt))
                for reply, advantage in zip(replies, (1.0, -0.5, 0.25))]
    prefix = shareable_prefix_length([e.token_ids for e in examples])
    assert prefix >= len(prompt) > 40
    # At the learner's log-prob chunking (1,024 tokens) only: the unchunked pass and chunks that
    # split a sequence are held to the plain pass on the tiny Qwen2 and Llama (SmolLM2's
    # architecture) above, entropy and gradient checkpointing included. This test is for the real
    # model's rounding, which the chunking does not change.
    chunk_tokens = LearnerConfig().logprob_chunk_tokens
    plain = _loss_and_gradients(model, pad_examples(examples, 0), chunk_tokens, with_entropy=True)
    shared = _loss_and_gradients(model, pad_examples(examples, 0, prefix), chunk_tokens, with_entropy=True)
    torch.testing.assert_close(shared[0], plain[0], rtol=0, atol=1e-3)
    torch.testing.assert_close(shared[1], plain[1], rtol=0, atol=1e-3)
    assert shared[2].keys() == plain[2].keys() and len(plain[2]) > 100
    for name in plain[2]:
        scale = float(plain[2][name].abs().max())
        difference = float((shared[2][name] - plain[2][name]).abs().max())
        assert difference <= 1e-3 * scale + 1e-12, f"{name}: differs by {difference:.3g} at {scale:.3g}"
