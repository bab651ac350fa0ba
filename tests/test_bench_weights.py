"""`longhorizon bench weights`: synthetic shapes, the bit-for-bit check, and a real run over every transport."""

import json
import math

import pytest
import torch

from longhorizon.actor.weights import WeightsReceiver
from longhorizon.launch.bench.weights import (
    StateDictSource,
    TensorsTarget,
    main,
    make_synthetic_state,
    state_digest,
    synthetic_shapes,
)
from longhorizon.learner.broadcast import make_weights_update
from longhorizon.learner.weights import TRANSPORTS


def test_synthetic_shapes_are_a_real_1_5b_decoder_and_scale_down():
    shapes = synthetic_shapes(1.5e9)
    # Qwen2.5-1.5B: vocabulary 151,936, hidden 1,536, MLP 8,960, two key/value heads of 128, 28 layers.
    assert shapes["model.embed_tokens.weight"] == (151936, 1536)
    assert shapes["model.layers.27.mlp.down_proj.weight"] == (1536, 8960)
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (256, 1536)
    assert "model.layers.28.mlp.up_proj.weight" not in shapes
    assert sum(math.prod(shape) for shape in shapes.values()) == 1_543_714_304
    small = synthetic_shapes(3e6)
    assert small["model.embed_tokens.weight"][1] == 64
    assert set(small) == set(shapes)


def test_the_digest_sees_a_single_changed_value():
    state = make_synthetic_state(synthetic_shapes(3e6))
    assert all(tensor.dtype == torch.bfloat16 for tensor in state.values())
    assert all(bool(tensor.abs().sum() > 0) for tensor in state.values())
    copy = {name: tensor.clone() for name, tensor in state.items()}
    assert state_digest(copy) == state_digest(state)
    name = "model.layers.3.mlp.up_proj.weight"
    copy[name].view(-1)[12345] = copy[name].view(-1)[12345] + 1
    assert state_digest(copy) != state_digest(state)


def test_inline_bfloat16_comes_back_bit_identical_and_mismatches_are_refused():
    state = make_synthetic_state(synthetic_shapes(3e6))
    target = TensorsTarget(3e6)
    update = make_weights_update(StateDictSource(state), 1, "inline")
    assert all(array.dtype.name == "uint16" for array in update.tensors.values())  # numpy has no bfloat16
    assert set(update.bfloat16_tensors) == set(state)
    target.load(update, WeightsReceiver())
    assert state_digest(target.state()) == state_digest(state)
    assert update.tensors == {}  # every received tensor was let go of once loaded

    partial = make_weights_update(StateDictSource(state), 2, "inline")
    del partial.tensors["model.norm.weight"]
    with pytest.raises(ValueError, match="model.norm.weight"):
        target.load(partial, WeightsReceiver())
    assert set(WeightsReceiver().receive(make_weights_update(StateDictSource(state), 3, "inline"))) == set(state)


def test_a_real_run_moves_both_payloads_over_every_transport(tiny_codebook_model):
    # A process of its own: the benchmark keeps freed message buffers for reuse, as the learner
    # does, which is process-wide and cannot be undone (other tests measure glibc's defaults).
    import subprocess
    import sys

    completed = subprocess.run([
        sys.executable, "-m", "longhorizon.launch.bench.weights",
        "--model", str(tiny_codebook_model), "--synthetic-params", "3e6", "--repeats", "2", "--warmup", "2",
        "--loopback-frame-mib", "1", "--loopback-mib", "4", "--memcpy-mib", "8", "--timeout-s", "120",
    ], capture_output=True, text=True, timeout=600)
    code, output = completed.returncode, completed.stdout
    assert code == 0, output + completed.stderr[-3000:]
    result = json.loads(output.strip().splitlines()[-1])
    assert result["benchmark"] == "weights"
    assert result["memcpy_gb_per_s"] > 0 and result["loopback_gb_per_s"] > 0
    runs = {(run["payload"], run["transport"]): run for run in result["runs"]}
    builtins = set(TRANSPORTS.builtin_names())  # the production classes, every one
    assert {transport for _, transport in runs} == builtins
    assert len(runs) == 2 * len(builtins)
    for (payload, transport), run in runs.items():
        assert run["identical"], (payload, transport)
        assert len(run["seconds_each"]) == 2
        assert run["seconds"] > 0 and run["gb_per_s"] > 0 and run["load_s"] >= 0 and run["first_s"] > 0
        low, high = result["loopback_range_gb_per_s"]
        assert low <= run["loopback_gb_per_s"] <= high  # measured around this run
        assert run["share_of_loopback"] == pytest.approx(run["gb_per_s"] / run["loopback_gb_per_s"])
        synthetic = payload.startswith("synthetic")
        assert run["dtype"] == ("bfloat16" if synthetic else "float32")
        assert run["state_bytes"] == run["params"] * (2 if synthetic else 4)
        if transport == "inline":
            assert run["moved_bytes"] == run["state_bytes"]  # bfloat16 travels as 2 bytes a value
        else:
            assert run["state_bytes"] <= run["moved_bytes"] < run["state_bytes"] + 100_000  # a file's header
    assert result["all_identical"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--transports", "pigeon"], "inline, path"),
        (["--no-model", "--synthetic-params", "0"], "nothing to measure"),
        (["--no-model", "--weights-dir", "/no/such/folder"], "create it"),
    ],
)
def test_bad_options_are_refused_with_the_fix(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_a_payload_that_would_not_fit_is_refused_before_it_starts(monkeypatch):
    from longhorizon.launch.bench import weights as bench_weights

    bf16_1_5b = 3_087_428_608
    # The receiver's copy, the update in flight and the spare copy kept between updates: 3 x 3.1
    # GB plus a margin of 1 GiB.
    monkeypatch.setattr(bench_weights, "available_memory_bytes", lambda: 10 * 10**9)
    with pytest.raises(RuntimeError, match="lower --synthetic-params"):
        bench_weights.check_memory_for("synthetic", bf16_1_5b)
    monkeypatch.setattr(bench_weights, "available_memory_bytes", lambda: 11 * 10**9)
    bench_weights.check_memory_for("synthetic", bf16_1_5b)  # 10.3 GB fits in 11
