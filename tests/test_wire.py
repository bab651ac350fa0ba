"""Tests for the message codec (common/codec.py): round trips, zero-copy framing, and rejection of every kind of bad input."""

import dataclasses
import math
import random

import msgpack
import numpy as np
import pytest
import zmq

from longhorizon.common.codec import (
    CONTROL_LIMITS,
    DEFAULT_LIMITS,
    INLINE_ARRAY_BYTES,
    WEIGHTS_LIMITS,
    WireError,
    WireLimits,
    decode,
    encode,
    pack_arrays,
)
from longhorizon.common.wire import (
    MESSAGE_TYPES,
    ActorStats,
    Backlog,
    Heartbeat,
    Hello,
    HorizonUpdate,
    Stop,
    Trajectory,
    WeightsUpdate,
)


def make_trajectory(tokens: int = 12, **overrides) -> Trajectory:
    """A small valid trajectory: a 4-token prompt, then generated and observation tokens."""
    loss_mask = np.zeros(tokens, dtype=np.uint8)
    loss_mask[4:] = 1
    fields = dict(
        trajectory_id="actor-0/episode-7",
        actor_id="actor-0",
        env_name="textcraft",
        task_id="craft/stick",
        group_id="actor-0/group-2",
        group_size=4,
        token_ids=np.arange(tokens, dtype=np.int32) + 100,
        loss_mask=loss_mask,
        behaviour_logprobs=np.where(loss_mask == 1, -0.5, 0.0).astype(np.float32),
        policy_versions=np.where(loss_mask == 1, 3, -1).astype(np.int32),
        prompt_length=4,
        reward=1.0,
        turn_rewards=[0.0, 1.0],
        num_turns=2,
        invalid_actions=1,
        horizon_cap=10,
        terminated=True,
        truncated=False,
        success=True,
        generation_seconds=1.25,
        env_seconds=0.5,
        text="Action: get 1 stick\nObservation: Got 1 stick",
        error="",
    )
    fields.update(overrides)
    return Trajectory(**fields)


def small_messages() -> list:
    return [
        HorizonUpdate(horizon_cap=20, stage=1, learner_step=100),
        Backlog(learner_version=7, waiting_trajectories=96, live_actors=3),
        Hello(actor_id="actor-3", pid=4242, hostname="node-7", policy_version=-1, engine="scripted"),
        Heartbeat(actor_id="actor-3", policy_version=5, episodes_done=12, time=1700000000.25),
        Stop(reason="training finished"),
        ActorStats(
            actor_id="actor-3", episodes_done=12, episodes_per_s=0.5, generated_tokens_per_s=310.0,
            mean_generation_seconds=1.5, mean_env_seconds=0.25, errors=1, paced_s=4.5,
        ),
        WeightsUpdate(version=9, path="/shared/run/weights/v9"),
    ]


def header_of(frames: list) -> dict:
    return msgpack.unpackb(bytes(frames[0]), raw=False)


def with_header(frames: list, header: dict) -> list:
    return [msgpack.packb(header, use_bin_type=True), *frames[1:]]


def assert_rejected(frames, expected_reason: str, limits: WireLimits = DEFAULT_LIMITS) -> None:
    with pytest.raises(WireError) as caught:
        decode(frames, limits=limits)
    assert expected_reason in caught.value.reason


# --------------------------------------------------------------------------------------------
# Round trips
# --------------------------------------------------------------------------------------------


def test_trajectory_round_trip_keeps_every_field() -> None:
    original = make_trajectory()
    decoded = decode(encode(original))
    assert isinstance(decoded, Trajectory)
    for name in ("token_ids", "loss_mask", "behaviour_logprobs", "policy_versions"):
        np.testing.assert_array_equal(getattr(decoded, name), getattr(original, name))
        assert getattr(decoded, name).dtype == getattr(original, name).dtype
    assert decoded.token_ids.tolist() == list(range(100, 112))
    assert decoded.policy_versions.tolist() == [-1] * 4 + [3] * 8
    for name in ("trajectory_id", "actor_id", "env_name", "task_id", "group_id", "group_size",
                 "prompt_length", "reward", "turn_rewards", "num_turns", "invalid_actions", "horizon_cap",
                 "terminated", "truncated", "success", "generation_seconds", "env_seconds",
                 "text", "error"):
        assert getattr(decoded, name) == getattr(original, name), name


@pytest.mark.parametrize("message", small_messages(), ids=lambda message: type(message).__name__)
def test_small_messages_round_trip_as_one_frame(message) -> None:
    frames = encode(message)
    assert len(frames) == 1
    decoded = decode(frames, limits=CONTROL_LIMITS)
    assert type(decoded) is type(message)
    assert vars(decoded) == vars(message)


def test_every_message_type_has_a_distinct_tag_and_a_schema_version() -> None:
    tags = [cls.TYPE_TAG for cls in MESSAGE_TYPES]
    assert len(set(tags)) == len(MESSAGE_TYPES) == 9
    assert all(type(cls.SCHEMA_VERSION) is int and cls.SCHEMA_VERSION >= 1 for cls in MESSAGE_TYPES)


def test_large_token_arrays_share_one_frame_and_small_ones_ride_inline() -> None:
    # 20,000 tokens: int32 and float32 arrays are 80,000 bytes (> 64 KiB), packed into one frame
    # at aligned offsets; the uint8 loss mask is 20,000 bytes (inline).
    trajectory = make_trajectory(tokens=20_000)
    frames = encode(trajectory)
    assert len(frames) == 2
    fields = header_of(frames)["fields"]
    assert fields["token_ids"] == {"dtype": "<i4", "shape": [20_000], "frame": 1, "offset": 0}
    assert fields["behaviour_logprobs"] == {"dtype": "<f4", "shape": [20_000], "frame": 1, "offset": 80_000}
    assert fields["policy_versions"]["offset"] == 160_000
    assert memoryview(frames[1]).nbytes == 240_000
    assert len(fields["loss_mask"]["data"]) == 20_000
    decoded = decode(frames)
    np.testing.assert_array_equal(decoded.policy_versions, trajectory.policy_versions)


def test_arrays_made_by_pack_arrays_go_out_without_a_copy() -> None:
    trajectory = make_trajectory(tokens=20_000)
    names = ("token_ids", "loss_mask", "behaviour_logprobs", "policy_versions")
    packed = pack_arrays({name: getattr(trajectory, name) for name in names})
    assert all(array.base is packed["token_ids"].base for array in packed.values())
    frames = encode(dataclasses.replace(trajectory, **packed))
    assert len(frames) == 2
    assert np.shares_memory(np.frombuffer(frames[1], dtype=np.uint8), packed["token_ids"])
    np.testing.assert_array_equal(decode(frames).behaviour_logprobs, trajectory.behaviour_logprobs)


def test_inline_limit_is_a_parameter() -> None:
    frames = encode(make_trajectory(tokens=12), inline_limit=16)
    # token ids, log-probs and versions are 48 bytes each (> 16): one packed frame; the mask is 12 bytes.
    assert len(frames) == 2
    assert len(encode(make_trajectory(tokens=12))) == 1
    assert INLINE_ARRAY_BYTES == 64 * 1024


def test_decoded_arrays_are_views_on_the_received_buffers() -> None:
    frames = [bytearray(frame) for frame in encode(make_trajectory(tokens=20_000))]
    decoded = decode(frames)
    frames[1][0:4] = (7).to_bytes(4, "little")
    assert decoded.token_ids[0] == 7


def test_decodes_zmq_frames() -> None:
    original = make_trajectory(tokens=20_000)
    frames = [zmq.Frame(bytes(frame)) for frame in encode(original)]
    decoded = decode(frames)
    np.testing.assert_array_equal(decoded.token_ids, original.token_ids)


def test_weights_update_with_tensors_of_many_dtypes() -> None:
    tensors = {
        "embed.weight": np.arange(40_000, dtype=np.float32).reshape(200, 200),
        "norm.weight": np.ones(8, dtype=np.float16),
        "bf16.weight": np.array([0x3F80, 0x4000], dtype=np.uint16),  # bfloat16 1.0, 2.0
        "step": np.array(12, dtype=np.int64),  # 0-d
        "empty": np.zeros((0, 3), dtype=np.float32),
    }
    update = WeightsUpdate(version=4, tensors=tensors, bfloat16_tensors=["bf16.weight"])
    frames = encode(update)
    assert len(frames) == 2  # only the 160,000-byte embedding is large
    decoded = decode(frames, limits=WEIGHTS_LIMITS)
    assert decoded.version == 4 and decoded.path is None
    assert list(decoded.tensors) == list(tensors)
    for name, tensor in tensors.items():
        assert decoded.tensors[name].dtype == tensor.dtype
        assert decoded.tensors[name].shape == tensor.shape
        np.testing.assert_array_equal(decoded.tensors[name], tensor)
    assert decoded.bfloat16_tensors == ["bf16.weight"]


def test_encode_converts_lists_bools_and_numpy_scalars() -> None:
    trajectory = make_trajectory(
        token_ids=list(range(100, 112)),
        loss_mask=np.array([False] * 4 + [True] * 8),
        behaviour_logprobs=np.full(12, -0.25, dtype=np.float64),
        reward=np.float32(0.5),
        num_turns=np.int64(2),
        success=np.bool_(True),
        turn_rewards=(0, 0.5),
    )
    decoded = decode(encode(trajectory))
    assert decoded.token_ids.dtype == np.int32 and decoded.token_ids[-1] == 111
    assert decoded.loss_mask.tolist() == [0] * 4 + [1] * 8
    assert decoded.behaviour_logprobs.dtype == np.float32
    assert decoded.reward == 0.5 and type(decoded.reward) is float
    assert decoded.num_turns == 2 and decoded.success is True
    assert decoded.turn_rewards == [0.0, 0.5]


def test_non_contiguous_and_big_endian_arrays_are_sent_correctly() -> None:
    tensor = np.arange(24, dtype=">f4").reshape(4, 6)[:, ::2]
    decoded = decode(encode(WeightsUpdate(version=1, tensors={"w": tensor})), limits=WEIGHTS_LIMITS)
    assert decoded.tensors["w"].dtype == np.dtype("<f4")
    np.testing.assert_array_equal(decoded.tensors["w"], [[0, 2, 4], [6, 8, 10], [12, 14, 16], [18, 20, 22]])


# --------------------------------------------------------------------------------------------
# What encode refuses
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "message, reason",
    [
        (make_trajectory(token_ids=np.arange(12, dtype=np.int64) + 2**40), "outside the range of int32"),
        (make_trajectory(token_ids=np.arange(12, dtype=np.float32)), "must be int32"),
        (make_trajectory(loss_mask=np.zeros(11, dtype=np.uint8)), "differ in length"),
        (make_trajectory(reward=math.nan), "must be finite"),
        (make_trajectory(group_size=True), "must be an int"),
        (make_trajectory(text=b"bytes"), "must be a str"),
        (make_trajectory(turn_rewards=[0.0, "1"]), "turn_rewards[1] must be a number"),
        (make_trajectory(trajectory_id=""), "trajectory_id must not be empty"),
        (make_trajectory(prompt_length=13), "prompt_length 13 is outside 0..12"),
        (make_trajectory(invalid_actions=-1), "invalid_actions must be >= 0"),
        (make_trajectory(invalid_actions=3), "invalid_actions 3 is more than its 2 turns"),
        (WeightsUpdate(version=1), "exactly one of tensors and path"),
        (WeightsUpdate(version=1, path="/x", tensors={"w": np.ones(2, np.float32)}), "exactly one"),
        (WeightsUpdate(version=1, tensors={"mask": np.ones(2, dtype=bool)}), "booleans as uint8"),
        (WeightsUpdate(version=1, tensors={"names": np.array(["a", "b"])}), "cannot travel"),
        (WeightsUpdate(version=1, tensors={"w": np.ones(2, np.float32)}, bfloat16_tensors=["w"]), "not a uint16 tensor"),
        (WeightsUpdate(version=1, path="/x", bfloat16_tensors=["w"]), "not a uint16 tensor"),
        (HorizonUpdate(horizon_cap=0, stage=0, learner_step=0), "horizon_cap must be >= 1"),
    ],
)
def test_encode_refuses_invalid_messages(message, reason: str) -> None:
    with pytest.raises(WireError) as caught:
        encode(message)
    assert reason in caught.value.reason


def test_array_contents_are_checked_by_the_receiver_only() -> None:
    # The sender checks structure; the receiver, where input is untrusted, also checks values.
    frames = encode(make_trajectory(loss_mask=np.full(12, 2, dtype=np.uint8)))
    assert_rejected(frames, "only 0 and 1")
    frames = encode(make_trajectory(policy_versions=np.full(12, -1, dtype=np.int32)))
    assert_rejected(frames, ">= 0 on generated tokens")


def test_encode_refuses_objects_that_are_not_messages() -> None:
    with pytest.raises(WireError, match="not a wire message type"):
        encode({"type": "stop"})


# --------------------------------------------------------------------------------------------
# What decode rejects
# --------------------------------------------------------------------------------------------


def valid_frames() -> list:
    return encode(make_trajectory(tokens=20_000))


def test_rejects_garbage_and_empty_input() -> None:
    assert_rejected([b"\xc1garbage"], "not valid MessagePack")
    assert_rejected([], "no frames")
    assert_rejected(b"a single buffer", "sequence of frames")
    assert_rejected(["a str frame"], "not a buffer")
    assert_rejected([msgpack.packb([1, 2, 3])], "exactly the keys type, schema, fields")
    assert_rejected([msgpack.packb({"type": "stop", "schema": 1})], "exactly the keys")


def test_rejects_unknown_type_and_wrong_schema_version() -> None:
    frames = valid_frames()
    header = header_of(frames)
    assert_rejected(with_header(frames, {**header, "type": "trajectorie"}), "unknown message type")
    assert_rejected(with_header(frames, {**header, "type": 7}), "unknown message type")
    assert_rejected(with_header(frames, {**header, "schema": 1}), "schema version 1 is not supported")
    assert_rejected(with_header(frames, {**header, "schema": True}), "schema version True")


def test_rejects_missing_unknown_and_mistyped_fields() -> None:
    frames = valid_frames()
    header = header_of(frames)
    fields = header["fields"]
    missing = {key: value for key, value in fields.items() if key != "reward"}
    assert_rejected(with_header(frames, {**header, "fields": missing}), "missing ['reward']")
    extra = {**fields, "bonus": 1}
    assert_rejected(with_header(frames, {**header, "fields": extra}), "unknown [\"'bonus'\"]")
    for name, bad_value, reason in [
        ("group_size", "4", "group_size must be an int"),
        ("group_size", True, "group_size must be an int"),
        ("group_size", 2**64 - 1, "does not fit in 64 bits"),
        ("terminated", 1, "terminated must be a bool"),
        ("reward", None, "reward must be a number"),
        ("turn_rewards", [0.0, math.inf], "turn_rewards[1] must be finite"),
        ("turn_rewards", "0,1", "turn_rewards must be a list"),
        ("text", b"raw bytes", "text must be a str"),
        ("token_ids", [1, 2, 3], "must be an array descriptor"),
    ]:
        bad = {**fields, name: bad_value}
        assert_rejected(with_header(frames, {**header, "fields": bad}), reason)


def test_rejects_bad_array_descriptors() -> None:
    frames = valid_frames()
    header = header_of(frames)
    fields = header["fields"]

    def with_field(name: str, descriptor: dict) -> list:
        return with_header(frames, {**header, "fields": {**fields, name: descriptor}})

    token_ids = fields["token_ids"]
    assert_rejected(with_field("token_ids", {**token_ids, "dtype": "<f4"}), "must be int32")
    for dtype in ("|b1", ">i4", "<U4", "|O", 5):
        assert_rejected(with_field("token_ids", {**token_ids, "dtype": dtype}), "not allowed")
    assert_rejected(with_field("token_ids", {**token_ids, "shape": [-1]}), "non-negative ints")
    assert_rejected(with_field("token_ids", {**token_ids, "shape": [1] * 9}), "at most 8 sizes")
    assert_rejected(with_field("token_ids", {**token_ids, "frame": 2}), "expected frame 1")
    assert_rejected(with_field("token_ids", {**token_ids, "data": b""}), "descriptor has keys")
    assert_rejected(with_field("token_ids", {**token_ids, "offset": 3}), "not an aligned position")
    assert_rejected(with_field("token_ids", {**token_ids, "offset": -8}), "not an aligned position")
    assert_rejected(with_field("token_ids", {**token_ids, "offset": 10**9}), "not an aligned position")
    versions = fields["policy_versions"]
    assert_rejected(with_field("policy_versions", {**versions, "shape": [20_001]}), "bytes past its offset")
    mask = fields["loss_mask"]
    assert_rejected(with_field("loss_mask", {**mask, "data": "text"}), "inline data must be bytes")
    assert_rejected(with_field("loss_mask", {**mask, "data": mask["data"][:-1]}), "has 19999 bytes")


def test_rejects_truncated_missing_and_extra_frames() -> None:
    frames = valid_frames()
    truncated = [frames[0], bytes(frames[1])[:-4]]
    assert_rejected(truncated, "policy_versions needs 80000 bytes past its offset")
    assert_rejected(frames[:1], "refers to frame 1, but the message has 1 frames")
    assert_rejected([*frames, b"extra"], "has 3 frames, but its header uses 2")


def test_rejects_misaligned_token_arrays() -> None:
    frames = encode(make_trajectory(tokens=12))
    header = header_of(frames)
    fields = header["fields"]
    shorter = {**fields, "loss_mask": {"dtype": "|u1", "shape": [11], "data": bytes(11)}}
    assert_rejected([msgpack.packb({**header, "fields": shorter})], "differ in length")


def test_rejects_bad_token_contents() -> None:
    frames = encode(make_trajectory(tokens=12))
    header = header_of(frames)
    fields = header["fields"]

    def with_array(name: str, array: np.ndarray) -> list:
        descriptor = {"dtype": array.dtype.str, "shape": list(array.shape), "data": array.tobytes()}
        return [msgpack.packb({**header, "fields": {**fields, name: descriptor}})]

    assert_rejected(with_array("token_ids", np.full(12, -5, dtype=np.int32)), "negative token ids")
    assert_rejected(with_array("loss_mask", np.full(12, 3, dtype=np.uint8)), "only 0 and 1")
    logprobs = np.zeros(12, dtype=np.float32)
    logprobs[6] = np.nan
    assert_rejected(with_array("behaviour_logprobs", logprobs), "NaN")
    assert_rejected(with_array("behaviour_logprobs", np.full(12, 3e38, dtype=np.float32)), "at most 0")
    assert_rejected(with_array("behaviour_logprobs", np.full(12, 0.5, dtype=np.float32)), "at most 0")
    # Rounding above 0 is not an error.
    assert decode(with_array("behaviour_logprobs", np.full(12, 1e-6, dtype=np.float32))) is not None
    assert_rejected(with_array("policy_versions", np.full(12, -2, dtype=np.int32)), ">= -1")
    assert_rejected(with_array("policy_versions", np.full(12, -1, dtype=np.int32)), "on generated tokens")


def test_rejects_weights_update_with_both_or_neither_source() -> None:
    frames = encode(WeightsUpdate(version=3, path="/shared/v3"))
    header = header_of(frames)
    descriptor = {"dtype": "<f4", "shape": [1], "data": bytes(4)}
    both = {**header["fields"], "tensors": {"w": descriptor}}
    assert_rejected([msgpack.packb({**header, "fields": both})], "exactly one", WEIGHTS_LIMITS)
    neither = {**header["fields"], "path": None}
    assert_rejected([msgpack.packb({**header, "fields": neither})], "exactly one", WEIGHTS_LIMITS)
    bad_name = {**header["fields"], "path": None, "tensors": {3: descriptor}}
    assert_rejected([msgpack.packb({**header, "fields": bad_name})], "not valid MessagePack", WEIGHTS_LIMITS)


def test_limits_are_enforced() -> None:
    frames = valid_frames()
    total = sum(memoryview(frame).nbytes for frame in frames)
    assert_rejected(frames, f"has {total} bytes, more than", WireLimits(max_message_bytes=total - 1))
    assert_rejected(frames, "more than the limit 1", WireLimits(max_frames=1))
    assert_rejected(frames, "20000 tokens, more than the limit 19999", WireLimits(max_tokens=19_999))
    long_id = encode(make_trajectory(actor_id="a" * 1025))
    assert_rejected(long_id, "actor_id has 1025 characters", DEFAULT_LIMITS)
    long_text = encode(make_trajectory(text="x" * 101))
    assert_rejected(long_text, "text has 101 characters", WireLimits(max_text_chars=100))
    many_turns = encode(make_trajectory(turn_rewards=[0.0] * 11))
    assert_rejected(many_turns, "11 items, more than the limit 10", WireLimits(max_list_items=10))
    tensors = {f"w{index}": np.zeros(1, np.float32) for index in range(5)}
    many_tensors = encode(WeightsUpdate(version=1, tensors=tensors))
    assert_rejected(many_tensors, "5 tensors, more than the limit 4", WireLimits(max_tensors=4))
    # A trajectory does not fit the control channel's limits.
    assert_rejected(frames, "more than the limit", CONTROL_LIMITS)


def test_wire_error_is_a_value_error_with_a_reason() -> None:
    with pytest.raises(ValueError) as caught:
        decode([b"\x00"])
    assert isinstance(caught.value, WireError)
    assert caught.value.reason == str(caught.value)


# --------------------------------------------------------------------------------------------
# Fuzzing: whatever the bytes, decode returns a message or raises WireError
# --------------------------------------------------------------------------------------------


def decode_or_wire_error(frames) -> None:
    try:
        decode(frames)
    except WireError:
        pass


def random_msgpack_value(rng: random.Random, depth: int = 0):
    choices = [None, True, -1, 2**63, 1.5, math.nan, "x" * rng.randint(0, 3), b"\x00\x01", [], {}]
    if depth < 3:
        choices += [
            [random_msgpack_value(rng, depth + 1) for _ in range(rng.randint(0, 3))],
            {"dtype": "<i4", "shape": [rng.randint(-1, 3)], "frame": rng.randint(0, 4)},
            {"dtype": rng.choice(["<i4", "<f4", "|u1"]), "shape": [2], "data": bytes(rng.randint(0, 9))},
        ]
    return rng.choice(choices)


def test_fuzz_random_truncated_and_mutated_frames() -> None:
    rng = random.Random(1234)
    bases = [encode(make_trajectory(tokens=20_000)), encode(make_trajectory(tokens=9))]
    bases += [encode(message) for message in small_messages()]
    bases.append(encode(WeightsUpdate(version=2, tensors={"w": np.ones((300, 100), np.float32)})))
    accepted = 0
    for _ in range(1500):
        frames = [bytes(frame) for frame in rng.choice(bases)]
        mutation = rng.randrange(6)
        if mutation == 0:  # random bytes
            frames = [rng.randbytes(rng.randint(0, 64)) for _ in range(rng.randint(1, 4))]
        elif mutation == 1:  # truncate a frame
            index = rng.randrange(len(frames))
            frames[index] = frames[index][: rng.randint(0, len(frames[index]))]
        elif mutation == 2:  # flip bytes of the header
            header = bytearray(frames[0])
            for _ in range(rng.randint(1, 4)):
                header[rng.randrange(len(header))] = rng.randrange(256)
            frames[0] = bytes(header)
        elif mutation == 3:  # drop, duplicate or add frames
            if rng.random() < 0.5 and len(frames) > 1:
                del frames[rng.randrange(1, len(frames))]
            else:
                frames.insert(rng.randint(1, len(frames)), rng.randbytes(rng.randint(0, 16)))
        elif mutation == 4:  # replace one field's value with a random MessagePack value
            header = msgpack.unpackb(frames[0], raw=False)
            name = rng.choice(sorted(header["fields"]))
            header["fields"][name] = random_msgpack_value(rng)
            frames[0] = msgpack.packb(header, use_bin_type=True)
        else:  # replace a top-level header entry
            header = msgpack.unpackb(frames[0], raw=False)
            header[rng.choice(["type", "schema", "fields"])] = random_msgpack_value(rng)
            frames[0] = msgpack.packb(header, use_bin_type=True)
        try:
            decode(frames)
            accepted += 1
        except WireError:
            pass
    # Some mutations are harmless (flipping a byte inside the text); most are not.
    assert accepted < 500


def test_fuzz_frames_that_are_not_bytes() -> None:
    for frames in ([None], [1, 2], [np.zeros((2, 2), dtype=np.float32)], [memoryview(b"ab")[::2]], None, 5):
        decode_or_wire_error(frames)
        with pytest.raises(WireError):
            decode(frames)
