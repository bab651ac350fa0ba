"""Weight transports behind one interface: the publishers (learner/weights/), the one receiver
(actor/weights.py), bfloat16 at 2 bytes a value, and the registry's checks."""

from pathlib import Path

import numpy as np
import pytest
import torch

from longhorizon.actor.weights import WeightsReceiver
from longhorizon.common.models import load_causal_lm
from longhorizon.common.plugins import PluginError
from longhorizon.common.codec import WEIGHTS_LIMITS, decode, encode
from longhorizon.common.wire import WeightsUpdate
from longhorizon.learner.broadcast import make_weights_update, unique_state_dict
from longhorizon.learner.weights import TRANSPORTS, PublisherContext, WeightsPublisher, build_publisher


def _over_the_wire(update):
    return decode(encode(update), limits=WEIGHTS_LIMITS)


def test_inline_bfloat16_moves_half_the_bytes_of_float32_and_comes_back_exact(tiny_codebook_model):
    bf16 = unique_state_dict(load_causal_lm(tiny_codebook_model, "bfloat16"))
    fp32 = unique_state_dict(load_causal_lm(tiny_codebook_model, "float32"))
    publisher = build_publisher("inline", PublisherContext())
    bf16_update, fp32_update = publisher.build(bf16, 1), publisher.build(fp32, 1)
    assert publisher.payload_bytes(bf16_update) * 2 == publisher.payload_bytes(fp32_update)
    wire_bytes = [sum(len(frame) for frame in encode(update)) for update in (bf16_update, fp32_update)]
    assert wire_bytes[0] < 0.55 * wire_bytes[1]  # the header aside, half
    received = WeightsReceiver().receive(_over_the_wire(bf16_update))
    assert set(received) == set(bf16)
    for name, tensor in bf16.items():
        assert received[name].dtype == torch.bfloat16, name
        assert torch.equal(received[name].view(torch.int16), tensor.view(torch.int16)), name  # bit for bit


def test_an_inline_update_owns_its_bytes_and_the_receiver_reads_frames_in_place():
    state = {"w": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3), "b": torch.ones(4)}
    update = build_publisher("inline", PublisherContext()).build(state, 2)
    state["w"].add_(1)  # the learner's next step, in place
    assert update.tensors["w"].tolist() == [[0x0000, 0x3F80, 0x4000], [0x4040, 0x4080, 0x40A0]]
    decoded = _over_the_wire(update)
    received = WeightsReceiver().receive(decoded)
    # No copy on the actor's side: the tensor is a view of the received frame's buffer.
    assert np.shares_memory(received["b"].numpy(), decoded.tensors["b"])
    assert received["w"].tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]


def test_path_writes_a_folder_per_version_and_keeps_the_newest_three(tmp_path):
    publisher = build_publisher("path", PublisherContext(weights_dir=tmp_path))
    assert publisher.shared_filesystem and not publisher.needs_control_channel
    state = {"w": torch.randn(3, 2, dtype=torch.bfloat16)}
    for version in range(1, 6):
        update = publisher.build(state, version)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v000003", "v000004", "v000005"]
    assert publisher.payload_bytes(update) > state["w"].numel() * 2
    assert torch.equal(WeightsReceiver().receive(update)["w"], state["w"])


def test_the_classes_say_what_the_learner_and_launchers_ask():
    inline, path, collective = (TRANSPORTS.get(name) for name in ("inline", "path", "collective"))
    assert (inline.sends, path.sends, collective.sends) == ("inline", "path", "collective")
    assert [cls.needs_control_channel for cls in (inline, path, collective)] == [False, False, True]
    assert [cls.shared_filesystem for cls in (inline, path, collective)] == [False, True, False]


def test_the_registry_refuses_what_is_not_a_publisher_and_names_what_exists():
    class NotAPublisher:
        sends = "inline"

    class SendsPigeons(WeightsPublisher):
        sends = "pigeon"

    with pytest.raises(TypeError, match="must be a WeightsPublisher subclass"):
        TRANSPORTS.register("odd", NotAPublisher)
    with pytest.raises(TypeError, match="sends 'pigeon'"):
        TRANSPORTS.register("birds", SendsPigeons)
    with pytest.raises(PluginError, match="unknown weights transport 'carrier'; available: collective, inline, path"):
        TRANSPORTS.get("carrier")


def test_the_receiver_refuses_what_is_no_weights_message():
    with pytest.raises(TypeError, match="not a weights message"):
        WeightsReceiver().receive({"version": 1})


def test_make_weights_update_builds_through_the_named_transport(tmp_path):
    state = {"w": torch.ones(2)}
    assert isinstance(make_weights_update(state, 1, "inline"), WeightsUpdate)
    assert make_weights_update(state, 1, "path", tmp_path).path.endswith("v000001")


def _pointers(update) -> dict:
    return {name: array.__array_interface__["data"][0] for name, array in update.tensors.items()}


def _as_sent(tensor: torch.Tensor) -> np.ndarray:
    return tensor.view(torch.int16).numpy().view(np.uint16) if tensor.dtype == torch.bfloat16 else tensor.numpy()


@pytest.mark.parametrize("held", ["message", "all frames", "the bfloat16 frame"])
def test_inline_reuses_an_earlier_copy_only_once_nothing_refers_to_it(held):
    state = {"w": torch.randn(256, 128), "h": torch.randn(65536).to(torch.bfloat16)}  # 128 KiB each
    publisher = build_publisher("inline", PublisherContext())
    first = publisher.build(state, 1)
    first_memory = _pointers(first)
    frames = encode(first)
    assert len(frames) == 3  # both tensors travel as frames of their own (not in the header)
    kept = {"message": first, "all frames": frames, "the bfloat16 frame": frames[2]}[held]
    del first, frames
    second = publisher.build({name: t * 2 for name, t in state.items()}, 2)
    # Version 1's memory is still referred to (as ZeroMQ would while sending): new memory.
    assert not set(_pointers(second).values()) & set(first_memory.values())
    sent = kept.tensors["h"] if held == "message" else np.frombuffer(kept if held != "all frames" else kept[2], np.uint16)
    assert np.array_equal(sent, _as_sent(state["h"]))  # what is in flight was not touched
    del kept, sent, second
    third = publisher.build({name: t * 3 for name, t in state.items()}, 3)
    assert _pointers(third) == first_memory  # nothing refers to it now: written in place
    for name, tensor in state.items():
        assert np.array_equal(third.tensors[name], _as_sent(tensor * 3)), name


def test_path_removes_the_oldest_folder_before_writing_the_new_one(tmp_path, monkeypatch):
    from longhorizon.learner.weights import path as path_module

    publisher = build_publisher("path", PublisherContext(weights_dir=tmp_path))
    state = {"w": torch.randn(3, 2)}
    for version in range(1, 4):
        publisher.build(state, version)
    seen = []
    original = path_module.write_version

    def spy(weights_dir, tensors, version):
        seen.append(sorted(p.name for p in weights_dir.iterdir()))
        return original(weights_dir, tensors, version)

    monkeypatch.setattr(path_module, "write_version", spy)
    publisher.build(state, 4)
    assert seen == [["v000002", "v000003"]]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v000002", "v000003", "v000004"]


def test_a_version_folder_removed_while_it_is_written_is_written_again(tmp_path, monkeypatch):
    """Someone removes `v000001.partial` mid-write: the learner writes it again and goes on; removed
    every time, the error names the folder instead of a bare FileNotFoundError."""
    import shutil

    import safetensors.torch

    from longhorizon.learner.weights import path as path_module

    original = safetensors.torch.save_file
    removals = {"left": 1}

    def save_then_lose_the_folder(tensors, filename):
        original(tensors, filename)
        if removals["left"]:
            removals["left"] -= 1
            shutil.rmtree(Path(filename).parent)

    monkeypatch.setattr(safetensors.torch, "save_file", save_then_lose_the_folder)
    state = {"w": torch.randn(3, 2)}
    folder = path_module.write_version(tmp_path, state, 1)
    assert folder.name == "v000001" and (folder / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v000001"]
    removals["left"] = path_module.WRITE_ATTEMPTS
    with pytest.raises(RuntimeError, match=r"weights v2: .*v000002.partial was removed while it was written, 2 times"):
        path_module.write_version(tmp_path, state, 2)
