"""Whether a model may train with the shared-prefix pass (learner/shared_prefix.py) instead of
the plain one: decided by whether their difference is rounding, not by a fixed tolerance.

A short probe runs both passes on the model's own device and precision. A difference that is not
negligible is judged on a float64 model of the same architecture: exact there, the model's own
difference is its precision's rounding; not exact, the pass computes something else and the
plain pass is kept. The trainer and the SFT recipe ask `probe_shared_prefix` once per model.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from longhorizon.learner.logprobs import Example, pad_examples, token_logprobs


@dataclass(frozen=True)
class PrefixProbe:
    """What `probe_shared_prefix` found: whether the shared-prefix pass may replace the plain one,
    the two passes' largest log-prob difference at the model's own precision and, where that was
    not already negligible, in float64 on a copy of the architecture, and a line saying so."""

    usable: bool
    difference: float
    exact_difference: float | None
    reason: str


NEGLIGIBLE_DIFFERENCE = 1e-6
"""A log-prob difference at the model's precision below which no float64 check is made."""

EXACT_TOLERANCE = 1e-9
"""In float64 the two passes compute the same sums in a different order: they agree to about
1e-15; a wrong mask, position or cache differs by far more than this."""

ROUNDING_ALLOWANCE = {torch.float64: EXACT_TOLERANCE, torch.float32: 1e-2}
"""The most a difference at the model's precision may be, once float64 showed the computation
exact, for it still to be read as rounding (the device's kernels at that precision may differ
from the check's). SmolLM2 differs by 2.7e-5 on the probe in float32 (2.7e-4 on longer
sequences); a wrong attention differs by whole nats. A 16-bit model has no fixed allowance:
its own plain pass is measured against float32 (`_plain_rounding`)."""

PLAIN_ROUNDING_FACTOR = 2.0
"""At a 16-bit precision the shared pass may differ from the plain one by up to this many times
the plain pass's own distance from float32: rounding makes both about that far from the exact
values, in directions of their own. SmolLM2 in bfloat16: the plain pass is 5.9 nats from
float64 at its worst position, the shared one 6.1, and they differ by 3.3."""


def _probe_rows(vocabulary: int) -> list[np.ndarray]:
    """Two sequences of different lengths sharing their first four tokens."""
    ids = np.arange(11, dtype=np.int64) % vocabulary
    return [ids[:9], np.concatenate([ids[:4], ids[6:]])]


def _probe_logprobs(model, prefix_length: int) -> torch.Tensor:
    """The probe's next-token log-probs at its real positions, on the model's device and at its
    precision: plain, or with its first `prefix_length` tokens shared."""
    examples = [_probe_example(row) for row in _probe_rows(model.get_input_embeddings().num_embeddings)]
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            logprobs = token_logprobs(model, pad_examples(examples, 0, prefix_length=prefix_length).to(device))
    finally:
        model.train(was_training)
    valid = pad_examples(examples, 0).attention_mask[:, 1:].bool().to(device)
    return logprobs[valid].double()


def _probe_difference(model) -> float:
    """The largest |shared - plain| log-prob over the probe."""
    return float((_probe_logprobs(model, 0) - _probe_logprobs(model, 4)).abs().max())


def _plain_rounding(model) -> float:
    """How far the plain pass of a 16-bit `model` is from the same pass in float32: the model is
    cast to float32 in place and back (16-bit to float32 and back is exact), so no copy is held."""
    dtype = next(model.parameters()).dtype
    narrow = _probe_logprobs(model, 0)
    try:
        wide = _probe_logprobs(model.float(), 0)
    finally:
        model.to(dtype)
    return float((wide - narrow).abs().max())


CHECK_LAYERS = 2
"""Decoder layers of the float64 check model: every layer computes alike, and a second one
checks that each layer's cache is its own."""


CHECK_VOCABULARY = 64
"""Vocabulary of the float64 check model (more where a special token's id is higher)."""


def _float64_twin(model):
    """A float64 model of `model`'s architecture and configuration (its attention implementation
    included, where the CPU has it) with `CHECK_LAYERS` layers, a small vocabulary and random weights, on the CPU:
    whether the shared-prefix pass computes what the plain pass does is a property of the code,
    which runs the same at any size, and float64 leaves rounding out of the comparison."""
    import copy

    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # a LoRA wrapper's model
    config = copy.deepcopy(base.config)
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    layers = min(CHECK_LAYERS, int(text.num_hidden_layers))
    text.num_hidden_layers = layers
    if getattr(text, "layer_types", None):
        text.layer_types = list(text.layer_types)[:layers]
    # The probe's token ids are below 11; a vocabulary that still holds the special tokens' ids
    # keeps the embedding (and a tied output layer) small.
    special = [getattr(text, name, None) for name in ("pad_token_id", "bos_token_id", "eos_token_id")]
    special = [i for item in special for i in (item if isinstance(item, (list, tuple)) else [item]) if i is not None]
    text.vocab_size = min(int(text.vocab_size), max([CHECK_VOCABULARY - 1, *special]) + 1)
    implementation = getattr(base.config, "_attn_implementation", None)
    if implementation not in (None, "eager", "sdpa"):  # flash kernels run on GPUs in 16 bits only
        config._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]):  # the run's own random state stays as it was
        torch.manual_seed(0)
        twin = type(base)(config)
    return twin.to(torch.float64)


def probe_shared_prefix(model) -> PrefixProbe:
    """Whether the shared-prefix pass may stand in for the plain one on `model`, decided by
    whether their difference is rounding.

    On a short probe (`_probe_rows`) the two passes run on the model's own device, precision and
    attention implementation. A negligible difference settles it. Otherwise a float64 model of the
    same architecture (`_float64_twin`) runs the probe: if the passes agree there to
    `EXACT_TOLERANCE`, the computation is the same and the model's own difference is its
    precision's rounding (up to `ROUNDING_ALLOWANCE`, or for a 16-bit model twice its own plain
    pass's distance from float32); if not, the pass computes something else
    (a mask, a position, a cache this code does not reproduce) and the plain pass is kept. A model
    whose forward does not take these caches at all keeps it too.
    """
    name = type(model).__name__
    try:
        difference = _probe_difference(model)
    except Exception as error:  # noqa: BLE001 - a model with another calling convention or cache
        return PrefixProbe(False, float("nan"), None, f"{name} does not run the shared-prefix pass ({error})")
    dtype = next(model.parameters()).dtype
    precision = str(dtype).removeprefix("torch.")
    if difference <= NEGLIGIBLE_DIFFERENCE:
        return PrefixProbe(True, difference, None, f"{name}: shared and plain log-probs differ by {difference:.1e} "
                                                   f"in {precision}")
    try:
        exact = _probe_difference(_float64_twin(model))
    except Exception as error:  # noqa: BLE001 - an architecture that cannot be rebuilt from its config
        return PrefixProbe(False, difference, None,
                           f"{name}'s shared-prefix log-probs differ from its plain ones by {difference:.1e} in "
                           f"{precision}, and no float64 copy of its architecture could be built to tell whether "
                           f"that is rounding ({error})")
    if exact > EXACT_TOLERANCE:
        return PrefixProbe(False, difference, exact,
                           f"{name}'s shared-prefix log-probs differ from its plain ones by {difference:.1e} in "
                           f"{precision} and by {exact:.1e} in float64: the pass computes something else")
    if dtype in ROUNDING_ALLOWANCE:
        allowance = ROUNDING_ALLOWANCE[dtype]
    else:
        allowance = PLAIN_ROUNDING_FACTOR * _plain_rounding(model)
    if difference > allowance:
        return PrefixProbe(False, difference, exact,
                           f"{name}'s shared-prefix log-probs differ from its plain ones by {difference:.1e} in "
                           f"{precision} on its device, more than that precision's rounding ({allowance:.1e}), "
                           f"though by {exact:.1e} in float64 on the CPU")
    return PrefixProbe(True, difference, exact,
                       f"{name}: shared and plain log-probs differ by {difference:.1e} in {precision} and by "
                       f"{exact:.1e} in float64: rounding")


def _probe_example(tokens: np.ndarray) -> Example:
    return Example(token_ids=tokens, loss_mask=np.ones(len(tokens), np.float32),
                   behaviour_logprobs=np.zeros(len(tokens), np.float32), advantage=0.0)
