"""The validating MessagePack codec for the messages of `common/wire.py` (no pickle).

A message travels as a list of frames. Frame 0 is a MessagePack map
``{"type": tag, "schema": version, "fields": {...}}`` holding the scalar fields and one descriptor
per array: ``{"dtype": "<i4", "shape": [T], "data": bytes}`` for small arrays (inline), or
``{"dtype": ..., "shape": ..., "frame": k}`` for arrays larger than ``INLINE_ARRAY_BYTES``, whose
raw bytes are frame ``k`` (frames 1, 2, ... in the order the header names them). The tensors of a
weights update are never copied on the way out: each frame is a ``memoryview`` of the tensor. The
per-token arrays of a trajectory, when several are large, are copied into one frame instead
(``"offset"`` says where each starts): one frame costs ZeroMQ less than several.

``decode`` trusts nothing: whatever the bytes, it returns a message or raises ``WireError``.
"""

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Callable

import msgpack
import numpy as np

from longhorizon.common.wire import (
    CHAT_ROLES,
    MESSAGE_TYPES,
    TENSOR_DTYPE_BYTES,
    ActorStats,
    Backlog,
    CollectiveWeights,
    Heartbeat,
    Hello,
    HorizonUpdate,
    Message,
    Stop,
    Trajectory,
    WeightsUpdate,
)

INLINE_ARRAY_BYTES = 64 * 1024
"""Arrays up to this many bytes ride inside the header; larger ones get a frame."""

MAX_LOGPROB = 1e-3
"""Largest behaviour log-probability a receiver accepts: 0 plus room for engines' rounding."""

_PACK_ALIGNMENT = 8
"""Offsets of arrays packed into one frame are multiples of this (any allowed item size divides it)."""

_MIB = 1 << 20
_INT64_MIN = -(1 << 63)
_INT64_MAX = (1 << 63) - 1

# Little-endian on the wire whatever the sender's byte order. bool is left out on purpose: numpy
# gives undefined results for bool arrays whose bytes are not 0/1, so booleans travel as uint8.
_ALLOWED_DTYPES: dict[str, np.dtype] = {
    np.dtype(name).newbyteorder("<").str: np.dtype(name).newbyteorder("<")
    for name in (
        "float16", "float32", "float64",
        "int8", "int16", "int32", "int64",
        "uint8", "uint16", "uint32", "uint64",
    )
}


class WireError(ValueError):
    """A message that cannot be encoded or decoded; ``reason`` says what is wrong with it."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class WireLimits:
    """Bounds a receiver enforces on every incoming message (each socket chooses its own)."""

    max_message_bytes: int = 64 * _MIB
    """Total bytes over all frames; also set as the socket's ZMQ_MAXMSGSIZE (a per-frame bound)."""
    max_frames: int = 64
    """Frames in one message: the header plus one per large array."""
    max_string_chars: int = 1024
    """Identifiers and names: ids, hostnames, env names, tensor names."""
    max_text_chars: int = 4 * _MIB
    """Long free text: the episode text, error descriptions, stop reasons."""
    max_tokens: int = 1 << 20
    """Tokens in one trajectory."""
    max_list_items: int = 65536
    """Items in a list field such as per-turn rewards."""
    max_tensors: int = 65536
    """Named tensors in one weights update."""
    max_array_dims: int = 8
    """Dimensions of any array."""


DEFAULT_LIMITS = WireLimits()
"""For trajectories (the learner's PULL socket)."""

WEIGHTS_LIMITS = WireLimits(max_message_bytes=32 * 1024 * _MIB, max_frames=65537)
"""For the broadcast channel, where whole models travel as one message (one frame per tensor)."""

CONTROL_LIMITS = WireLimits(max_message_bytes=1 * _MIB, max_frames=1)
"""For hello / heartbeat / stop / statistics: small, single-frame messages only."""


# ---------------------------------------------------------------------------------------------
# Schemas derived from the declarations
# ---------------------------------------------------------------------------------------------

_KIND_BY_ANNOTATION: dict[Any, str] = {
    str: "str",
    int: "int",
    float: "float",
    bool: "bool",
    list[float]: "float_list",
    list[int]: "int_list",
    list[str]: "str_list",
    list[bytes]: "bytes_list",
    np.ndarray: "array",
    dict[str, np.ndarray] | None: "tensors",
    str | None: "optional_str",
    list[dict[str, str]] | None: "optional_chat",
}


@dataclass(frozen=True)
class _FieldSpec:
    name: str
    kind: str
    dtype: np.dtype | None
    where: str
    """"Owner.field", for error messages (built once, not per message)."""
    normalise: Callable[["_FieldSpec", Any], Any]
    """Checks and converts the field's value for sending (chosen by kind, once)."""
    decode: Callable[["_FieldSpec", Any, "_FrameCursor", "WireLimits"], Any]
    """Checks and converts the field's received value (chosen by kind, once)."""


@dataclass(frozen=True)
class _MessageSpec:
    cls: type
    tag: str
    version: int
    fields: tuple[_FieldSpec, ...]
    names: frozenset[str]
    check: Callable[[dict[str, Any], "WireLimits | None"], None]
    check_contents: Callable[[dict[str, Any]], None] | None


def _field_specs(cls: type) -> tuple[_FieldSpec, ...]:
    specs = []
    for declared in dataclasses.fields(cls):
        kind = _KIND_BY_ANNOTATION[declared.type]
        if kind == "str" and declared.metadata.get("long_text"):
            kind = "text"
        specs.append(
            _FieldSpec(
                name=declared.name,
                kind=kind,
                dtype=declared.metadata.get("dtype"),
                where=f"{cls.__name__}.{declared.name}",
                normalise=_NORMALISERS[kind],
                decode=_DECODERS[kind],
            )
        )
    return tuple(specs)


def _fail(reason: str) -> None:
    raise WireError(reason)


def _short(value: Any, limit: int = 60) -> str:
    """repr of an untrusted value, bounded so a hostile message cannot flood the logs."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---------------------------------------------------------------------------------------------
# Per-message semantic checks (shared by encode and decode)
# ---------------------------------------------------------------------------------------------


def _require_nonempty(values: dict[str, Any], owner: str, *names: str) -> None:
    for name in names:
        if values[name] == "":
            _fail(f"{owner}.{name} must not be empty")


def _require_at_least(values: dict[str, Any], owner: str, minimum: int, *names: str) -> None:
    for name in names:
        if values[name] < minimum:
            _fail(f"{owner}.{name} must be >= {minimum}, got {values[name]}")


_TOKEN_ARRAYS = ("token_ids", "loss_mask", "behaviour_logprobs", "policy_versions")


def _check_trajectory(values: dict[str, Any], limits: WireLimits | None) -> None:
    _require_nonempty(values, "Trajectory", "trajectory_id", "actor_id", "group_id")
    _require_at_least(values, "Trajectory", 1, "group_size")
    _require_at_least(values, "Trajectory", 0, "num_turns", "horizon_cap", "invalid_actions")
    if values["invalid_actions"] > values["num_turns"]:
        _fail(f"Trajectory.invalid_actions {values['invalid_actions']} is more than its {values['num_turns']} turns")
    for name in _TOKEN_ARRAYS:
        if values[name].ndim != 1:
            _fail(f"Trajectory.{name} must be 1-D, got shape {values[name].shape}")
    length = len(values["token_ids"])
    lengths = {name: len(values[name]) for name in _TOKEN_ARRAYS}
    if len(set(lengths.values())) != 1:
        _fail(f"Trajectory token arrays differ in length: {lengths}")
    if limits is not None and length > limits.max_tokens:
        _fail(f"Trajectory has {length} tokens, more than the limit {limits.max_tokens}")
    if not 0 <= values["prompt_length"] <= length:
        _fail(f"Trajectory.prompt_length {values['prompt_length']} is outside 0..{length}")
    offsets = values["image_offsets"]
    if len(offsets) != len(values["images"]):
        _fail(f"Trajectory has {len(values['images'])} images but {len(offsets)} image_offsets")
    if any(not 0 <= offset < length for offset in offsets) or any(a > b for a, b in zip(offsets, offsets[1:])):
        _fail(f"Trajectory.image_offsets must be in order and within its {length} tokens")


def _check_token_contents(values: dict[str, Any]) -> None:
    """The values inside the token arrays, which a learner would otherwise trip over later."""
    if len(values["token_ids"]) == 0:
        return
    # Whole-array reductions (a pass each, no temporaries), and one boolean temporary at the end.
    token_ids, loss_mask = values["token_ids"], values["loss_mask"]
    if token_ids.min() < 0:
        _fail("Trajectory.token_ids holds negative token ids")
    if loss_mask.max() > 1:
        _fail("Trajectory.loss_mask must hold only 0 and 1")
    # The smallest and largest values: NaN propagates into both, and an infinity is one of them.
    # (Cheaper than a sum, which numpy adds pairwise.) A log-probability is at most 0; anything
    # above rounding error is a broken engine.
    behaviour_logprobs = values["behaviour_logprobs"]
    lowest, highest = behaviour_logprobs.min(), behaviour_logprobs.max()
    if not (math.isfinite(lowest) and math.isfinite(highest)):
        _fail("Trajectory.behaviour_logprobs holds NaN or infinity")
    if highest > MAX_LOGPROB:
        _fail(f"Trajectory.behaviour_logprobs holds {float(highest):.6g}, but log-probabilities are at most 0")
    policy_versions = values["policy_versions"]
    if policy_versions.min() < -1:
        _fail("Trajectory.policy_versions must be >= -1")
    # Staleness is computed from generated tokens' versions: exactly the non-generated tokens
    # carry -1. The mask holds only 0 and 1 (checked above), so it reads as booleans without a
    # copy, and "negative version != generated" must hold everywhere (computed in place).
    not_generated = np.less(policy_versions, 0)
    if not np.not_equal(not_generated, loss_mask.view(np.bool_), out=not_generated).all():
        _fail("Trajectory.policy_versions must be >= 0 on generated tokens and -1 elsewhere")


def _check_weights_update(values: dict[str, Any], limits: WireLimits | None) -> None:
    _require_at_least(values, "WeightsUpdate", 0, "version")
    has_tensors, has_path = values["tensors"] is not None, values["path"] is not None
    if has_tensors == has_path:
        _fail("WeightsUpdate needs exactly one of tensors and path")
    if has_path and values["path"] == "":
        _fail("WeightsUpdate.path must not be empty")
    if has_tensors and any(name == "" for name in values["tensors"]):
        _fail("WeightsUpdate.tensors has an empty tensor name")
    for name in values["bfloat16_tensors"]:
        array = values["tensors"].get(name) if has_tensors else None
        if array is None or array.dtype != np.uint16:
            _fail(f"WeightsUpdate.bfloat16_tensors names {_short(name, 80)}, which is not a uint16 tensor of the update")


def _check_collective_weights(values: dict[str, Any], limits: WireLimits | None) -> None:
    """The announced layout must describe buckets the receiver can fill and cut without reading
    past their ends, so a receiver can trust it."""
    owner = "CollectiveWeights"
    _require_at_least(values, owner, 0, "version")
    _require_nonempty(values, owner, "store_host", "group_name")
    if not 1 <= values["store_port"] <= 65535:
        _fail(f"{owner}.store_port {values['store_port']} is not a TCP port")
    if values["backend"] not in ("gloo", "nccl"):
        _fail(f"{owner}.backend must be gloo or nccl, got {_short(values['backend'])}")
    if not values["timeout_s"] > 0:
        _fail(f"{owner}.timeout_s must be positive")
    names = values["tensor_names"]
    per_tensor = ("tensor_dtypes", "tensor_ndims", "tensor_buckets", "tensor_offsets")
    lengths = {name: len(values[name]) for name in ("tensor_names", *per_tensor)}
    if len(set(lengths.values())) != 1:
        _fail(f"{owner} per-tensor lists differ in length: {lengths}")
    if "" in names or len(set(names)) != len(names):
        _fail(f"{owner}.tensor_names must be distinct and not empty")
    ndims, dims, sizes = values["tensor_ndims"], values["tensor_dims"], values["bucket_sizes"]
    if any(n < 0 for n in ndims) or sum(ndims) != len(dims) or any(d < 0 for d in dims):
        _fail(f"{owner}: tensor_ndims and tensor_dims do not describe shapes")
    if any(size < 0 for size in sizes):
        _fail(f"{owner}.bucket_sizes must not be negative")
    crc = values["bucket_crc32"]
    if crc and (len(crc) != len(sizes) or any(not 0 <= c < 1 << 32 for c in crc)):
        _fail(f"{owner}.bucket_crc32 must be empty or one 32-bit value per bucket")
    start = 0
    places = zip(names, values["tensor_dtypes"], ndims, values["tensor_buckets"], values["tensor_offsets"])
    for name, dtype, ndim, bucket, offset in places:
        itemsize = TENSOR_DTYPE_BYTES.get(dtype)
        if itemsize is None:
            _fail(f"{owner}: tensor {_short(name)} has dtype {_short(dtype)}, not one of {', '.join(TENSOR_DTYPE_BYTES)}")
        nbytes = math.prod(dims[start:start + ndim]) * itemsize
        start += ndim
        # Aligned to the item size, so the receiver can view the bytes as the dtype in place.
        if not 0 <= bucket < len(sizes) or offset < 0 or offset % itemsize or offset + nbytes > sizes[bucket]:
            _fail(f"{owner}: tensor {_short(name)} does not fit in bucket {bucket} at offset {offset}")


def _check_horizon_update(values: dict[str, Any], limits: WireLimits | None) -> None:
    _require_at_least(values, "HorizonUpdate", 1, "horizon_cap")
    _require_at_least(values, "HorizonUpdate", 0, "stage", "learner_step")


def _check_backlog(values: dict[str, Any], limits: WireLimits | None) -> None:
    _require_at_least(values, "Backlog", 0, "learner_version", "waiting_trajectories")
    _require_at_least(values, "Backlog", 1, "live_actors")


def _check_hello(values: dict[str, Any], limits: WireLimits | None) -> None:
    _require_nonempty(values, "Hello", "actor_id")
    _require_at_least(values, "Hello", 0, "pid")


def _check_heartbeat(values: dict[str, Any], limits: WireLimits | None) -> None:
    _require_nonempty(values, "Heartbeat", "actor_id")
    _require_at_least(values, "Heartbeat", 0, "episodes_done")
    _require_at_least(values, "Heartbeat", -1, "refused_version")


def _check_nothing(values: dict[str, Any], limits: WireLimits | None) -> None:
    return None


def _check_actor_stats(values: dict[str, Any], limits: WireLimits | None) -> None:
    _require_nonempty(values, "ActorStats", "actor_id")
    _require_at_least(values, "ActorStats", 0, "episodes_done", "errors", "weights_refused", "history_breaks",
                      "paced_s")


_CHECKS: dict[type, Callable[[dict[str, Any], WireLimits | None], None]] = {
    Trajectory: _check_trajectory,
    WeightsUpdate: _check_weights_update,
    CollectiveWeights: _check_collective_weights,
    HorizonUpdate: _check_horizon_update,
    Backlog: _check_backlog,
    Hello: _check_hello,
    Heartbeat: _check_heartbeat,
    Stop: _check_nothing,
    ActorStats: _check_actor_stats,
}


# Checks that read every element of an array run only when decoding: the receiver is where
# input is not trusted, and a bad value there is dropped, counted and logged like any bad
# message, instead of raising inside the sender's loop (encode still checks types, dtypes,
# shapes and lengths, which are programming errors).
_CONTENT_CHECKS: dict[type, Callable[[dict[str, Any]], None]] = {
    Trajectory: _check_token_contents,
}


# ---------------------------------------------------------------------------------------------
# Encoding
# ---------------------------------------------------------------------------------------------


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(
        value, (bool, np.bool_)
    )


def _normalise_int(where: str, value: Any) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        _fail(f"{where} must be an int, got {type(value).__name__}")
    value = int(value)
    if not _INT64_MIN <= value <= _INT64_MAX:
        _fail(f"{where} does not fit in 64 bits")
    return value


def _normalise_float(where: str, value: Any) -> float:
    if not _is_number(value):
        _fail(f"{where} must be a number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        _fail(f"{where} must be finite, got {value}")
    return value


def _wire_array(where: str, value: Any, dtype: np.dtype | None) -> np.ndarray:
    """The value as a C-contiguous little-endian array of an allowed dtype (``dtype`` if given)."""
    array = np.asarray(value)
    if dtype is None:
        if array.dtype == np.bool_:
            _fail(f"{where}: send booleans as uint8")
        dtype = array.dtype.newbyteorder("<")
        if dtype.str not in _ALLOWED_DTYPES:
            _fail(f"{where} has dtype {array.dtype}, which cannot travel")
    elif array.dtype != dtype:
        if not np.can_cast(array.dtype, dtype, casting="same_kind"):
            _fail(f"{where} must be {dtype.name}, got {array.dtype}")
        converted = array.astype(dtype)
        if dtype.kind in "iu" and not np.array_equal(converted, array):
            _fail(f"{where} holds values outside the range of {dtype.name}")
        array = converted
    if array.dtype != dtype:
        array = array.astype(dtype)
    if not array.flags.c_contiguous:
        array = np.ascontiguousarray(array)
    return array


def _normalise_str(spec: _FieldSpec, value: Any) -> str:
    if not isinstance(value, str):
        _fail(f"{spec.where} must be a str, got {type(value).__name__}")
    return value


def _normalise_optional_str(spec: _FieldSpec, value: Any) -> str | None:
    if value is not None and not isinstance(value, str):
        _fail(f"{spec.where} must be a str or None, got {type(value).__name__}")
    return value


def _normalise_int_field(spec: _FieldSpec, value: Any) -> int:
    return _normalise_int(spec.where, value)


def _normalise_float_field(spec: _FieldSpec, value: Any) -> float:
    return _normalise_float(spec.where, value)


def _normalise_bool(spec: _FieldSpec, value: Any) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        _fail(f"{spec.where} must be a bool, got {type(value).__name__}")
    return bool(value)


def _normalise_float_list(spec: _FieldSpec, value: Any) -> list[float]:
    if isinstance(value, (str, bytes)) or not isinstance(value, (Sequence, np.ndarray)):
        _fail(f"{spec.where} must be a list of numbers, got {type(value).__name__}")
    if all(type(item) is float for item in value) and math.isfinite(sum(value)):
        return list(value)
    return [_normalise_float(f"{spec.where}[{index}]", item) for index, item in enumerate(value)]


def _normalise_int_list(spec: _FieldSpec, value: Any) -> list[int]:
    if isinstance(value, (str, bytes)) or not isinstance(value, (Sequence, np.ndarray)):
        _fail(f"{spec.where} must be a list of ints, got {type(value).__name__}")
    return [_normalise_int(f"{spec.where}[{index}]", item) for index, item in enumerate(value)]


def _normalise_str_list(spec: _FieldSpec, value: Any) -> list[str]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        _fail(f"{spec.where} must be a list of str, got {type(value).__name__}")
    for index, item in enumerate(value):
        if not isinstance(item, str):
            _fail(f"{spec.where}[{index}] must be a str, got {type(item).__name__}")
    return list(value)


def _normalise_bytes_list(spec: _FieldSpec, value: Any) -> list[bytes]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        _fail(f"{spec.where} must be a list of bytes, got {type(value).__name__}")
    items = []
    for index, item in enumerate(value):
        if not isinstance(item, (bytes, bytearray, memoryview)):
            _fail(f"{spec.where}[{index}] must be bytes, got {type(item).__name__}")
        items.append(bytes(item))
    return items


def _chat_messages(where: str, value: Any, limits: WireLimits | None) -> list[dict[str, str]] | None:
    """None, or chat messages checked (the same rules both ways; sizes only against `limits`):
    a list of maps with exactly the keys role (one of CHAT_ROLES) and content (a string)."""
    if value is None:
        return None
    if not isinstance(value, (list, tuple)):
        _fail(f"{where} must be a list of chat messages or None, got {type(value).__name__}")
    if limits is not None and len(value) > limits.max_list_items:
        _fail(f"{where} has {len(value)} items, more than the limit {limits.max_list_items}")
    messages = []
    for index, message in enumerate(value):
        if not isinstance(message, Mapping) or set(message) != {"role", "content"}:
            _fail(f"{where}[{index}] must be a map with exactly the keys role and content, got {_short(message)}")
        role, content = message["role"], message["content"]
        if not isinstance(role, str) or role not in CHAT_ROLES:
            _fail(f"{where}[{index}].role must be one of {', '.join(CHAT_ROLES)}, got {_short(role)}")
        if not isinstance(content, str):
            _fail(f"{where}[{index}].content must be a str, got {type(content).__name__}")
        if limits is not None and len(content) > limits.max_text_chars:
            _fail(f"{where}[{index}].content has {len(content)} characters, "
                  f"more than the limit {limits.max_text_chars}")
        messages.append({"role": role, "content": content})
    return messages


def _normalise_chat(spec: _FieldSpec, value: Any) -> list[dict[str, str]] | None:
    return _chat_messages(spec.where, value, None)


def _normalise_array(spec: _FieldSpec, value: Any) -> np.ndarray:
    return _wire_array(spec.where, value, spec.dtype)


def _normalise_tensors(spec: _FieldSpec, value: Any) -> dict[str, np.ndarray] | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        _fail(f"{spec.where} must be a dict of name -> array, got {type(value).__name__}")
    tensors = {}
    for name, tensor in value.items():
        if not isinstance(name, str):
            _fail(f"{spec.where} keys must be str, got {type(name).__name__}")
        tensors[name] = _wire_array(f"{spec.where}[{name!r}]", tensor, None)
    return tensors


_NORMALISERS: dict[str, Callable[[_FieldSpec, Any], Any]] = {
    "str": _normalise_str,
    "text": _normalise_str,
    "optional_str": _normalise_optional_str,
    "optional_chat": _normalise_chat,
    "int": _normalise_int_field,
    "float": _normalise_float_field,
    "bool": _normalise_bool,
    "float_list": _normalise_float_list,
    "int_list": _normalise_int_list,
    "str_list": _normalise_str_list,
    "bytes_list": _normalise_bytes_list,
    "array": _normalise_array,
    "tensors": _normalise_tensors,
}


def _array_descriptor(array: np.ndarray, frames: list[bytes | memoryview], inline_limit: int) -> dict:
    raw = memoryview(array.reshape(-1).view(np.uint8))
    descriptor: dict[str, Any] = {"dtype": array.dtype.str, "shape": list(array.shape)}
    if raw.nbytes > inline_limit:
        descriptor["frame"] = len(frames)
        frames.append(raw)
    else:
        descriptor["data"] = raw.tobytes()
    return descriptor


def _aligned_offsets(sizes: Sequence[int]) -> tuple[list[int], int]:
    offsets, total = [], 0
    for size in sizes:
        total = -(-total // _PACK_ALIGNMENT) * _PACK_ALIGNMENT
        offsets.append(total)
        total += size
    return offsets, total


def pack_arrays(arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Copies of `arrays` laid out in one shared buffer (aligned), which `encode` sends as one
    frame without copying. Producers of large messages (the actor building a trajectory) call
    this once when they create the arrays."""
    contiguous = {name: np.ascontiguousarray(array) for name, array in arrays.items()}
    offsets, total = _aligned_offsets([array.nbytes for array in contiguous.values()])
    storage = np.empty(total, dtype=np.uint8)
    packed = {}
    for (name, array), start in zip(contiguous.items(), offsets):
        view = storage[start:start + array.nbytes].view(array.dtype).reshape(array.shape)
        view[...] = array
        packed[name] = view
    return packed


def _shared_storage(arrays: Mapping[str, np.ndarray]) -> tuple[np.ndarray, dict[str, int]] | None:
    """The one buffer all `arrays` are views of (as `pack_arrays` makes them), with offsets."""
    bases = {id(array.base): array.base for array in arrays.values()}
    if len(bases) != 1:
        return None
    storage = next(iter(bases.values()))
    if not isinstance(storage, np.ndarray) or storage.dtype != np.uint8 or storage.ndim != 1:
        return None
    start = storage.__array_interface__["data"][0]
    offsets = {}
    for name, array in arrays.items():
        offset = array.__array_interface__["data"][0] - start
        if not array.flags.c_contiguous or offset % _PACK_ALIGNMENT or offset + array.nbytes > storage.nbytes:
            return None
        offsets[name] = offset
    return storage, offsets


def _pack_descriptors(arrays: dict[str, np.ndarray], frames: list[bytes | memoryview], inline_limit: int) -> dict[str, dict]:
    """Descriptors for a message's per-token arrays, the large ones sharing ONE frame.

    ZeroMQ pays per frame (each large frame costs about as much as copying it again), so the
    large arrays travel together, each at an aligned offset. Arrays made by `pack_arrays` already
    share one buffer and go out without a copy; others are copied into one. Tensors of a weights
    update are not packed: each keeps its own zero-copy frame.
    """
    large = {name: array for name, array in arrays.items() if array.nbytes > inline_limit}
    if len(large) < 2:
        return {name: _array_descriptor(array, frames, inline_limit) for name, array in arrays.items()}
    shared = _shared_storage(large)
    if shared is None:
        copies = pack_arrays(large)
        shared = _shared_storage(copies)
        large = copies
    storage, offsets = shared
    frame_index = len(frames)
    frames.append(memoryview(storage))
    descriptors = {}
    for name, array in arrays.items():
        if name in large:
            descriptors[name] = {
                "dtype": array.dtype.str, "shape": list(array.shape), "frame": frame_index, "offset": offsets[name],
            }
        else:
            descriptors[name] = _array_descriptor(array, frames, inline_limit)
    return descriptors


def encode(message: Message, *, inline_limit: int = INLINE_ARRAY_BYTES) -> list[bytes | memoryview]:
    """Frames for ``message``: a MessagePack header, then one zero-copy frame per large array.

    The frames of large arrays share memory with the message's arrays: do not modify those
    arrays until the frames have been sent. Raises ``WireError`` if the message is not valid.
    """
    spec = _SPEC_BY_CLASS.get(type(message))
    if spec is None:
        raise WireError(f"cannot encode {type(message).__name__}: not a wire message type")
    values = {field.name: field.normalise(field, getattr(message, field.name)) for field in spec.fields}
    spec.check(values, None)
    frames: list[bytes | memoryview] = [b""]
    packed_fields: dict[str, Any] = {}
    array_fields = _pack_descriptors(
        {f.name: values[f.name] for f in spec.fields if f.kind == "array"}, frames, inline_limit
    )
    for field_spec in spec.fields:
        value = values[field_spec.name]
        if field_spec.kind == "array":
            value = array_fields[field_spec.name]
        elif field_spec.kind == "tensors" and value is not None:
            value = {name: _array_descriptor(array, frames, inline_limit) for name, array in value.items()}
        packed_fields[field_spec.name] = value
    header = {"type": spec.tag, "schema": spec.version, "fields": packed_fields}
    frames[0] = msgpack.packb(header, use_bin_type=True)
    return frames


# ---------------------------------------------------------------------------------------------
# Decoding
# ---------------------------------------------------------------------------------------------


class _FrameCursor:
    """Hands out the array frames in order, so each is used exactly once."""

    def __init__(self, buffers: list[memoryview]) -> None:
        self.buffers = buffers
        self.next_index = 1

    def take(self, where: str, index: Any, *, shared: bool = False) -> memoryview:
        """The frame `index`: the next unused one, or (for packed arrays) the one just taken."""
        if shared and type(index) is int and index == self.next_index - 1 and index >= 1:
            return self.buffers[index]
        if type(index) is not int or index != self.next_index:
            _fail(f"{where} refers to frame {_short(index)}, expected frame {self.next_index}")
        if index >= len(self.buffers):
            _fail(f"{where} refers to frame {index}, but the message has {len(self.buffers)} frames")
        self.next_index += 1
        return self.buffers[index]


def _byte_view(frame: Any, index: int) -> memoryview:
    try:
        view = memoryview(frame)
    except TypeError:
        _fail(f"frame {index} is not a buffer ({type(frame).__name__})")
    if view.ndim != 1 or view.format != "B":
        try:
            view = view.cast("B")
        except (TypeError, ValueError):
            _fail(f"frame {index} is not a contiguous buffer")
    return view


def _decode_str(where: str, raw: Any, max_chars: int) -> str:
    if not isinstance(raw, str):
        _fail(f"{where} must be a str, got {type(raw).__name__}")
    if len(raw) > max_chars:
        _fail(f"{where} has {len(raw)} characters, more than the limit {max_chars}")
    return raw


def _decode_int(where: str, raw: Any) -> int:
    if type(raw) is not int:
        _fail(f"{where} must be an int, got {type(raw).__name__}")
    if not _INT64_MIN <= raw <= _INT64_MAX:
        _fail(f"{where} does not fit in 64 bits")
    return raw


def _decode_float(where: str, raw: Any) -> float:
    if type(raw) not in (float, int):
        _fail(f"{where} must be a number, got {type(raw).__name__}")
    value = float(raw)
    if not math.isfinite(value):
        _fail(f"{where} must be finite, got {value}")
    return value


def _decode_array(
    where: str, raw: Any, dtype: np.dtype | None, cursor: _FrameCursor, limits: WireLimits
) -> np.ndarray:
    if not isinstance(raw, dict):
        _fail(f"{where} must be an array descriptor, got {type(raw).__name__}")
    keys = set(raw)
    if keys == {"dtype", "shape", "data"}:
        buffer = raw["data"]
        if not isinstance(buffer, bytes):
            _fail(f"{where} inline data must be bytes, got {type(buffer).__name__}")
        byte_length = len(buffer)
    elif keys == {"dtype", "shape", "frame"}:
        buffer = cursor.take(where, raw["frame"])
        byte_length = buffer.nbytes
    elif keys == {"dtype", "shape", "frame", "offset"}:
        buffer = cursor.take(where, raw["frame"], shared=True)
        offset = raw["offset"]
        if type(offset) is not int or offset < 0 or offset % _PACK_ALIGNMENT or offset > buffer.nbytes:
            _fail(f"{where} has offset {_short(offset)}, not an aligned position in its frame")
        byte_length = None  # the array takes what its shape needs from the offset on
    else:
        _fail(f"{where} descriptor has keys {_short(sorted(map(str, keys)))}")
    dtype_name = raw["dtype"]
    if not isinstance(dtype_name, str) or dtype_name not in _ALLOWED_DTYPES:
        _fail(f"{where} has dtype {_short(dtype_name)}, which is not allowed")
    wire_dtype = _ALLOWED_DTYPES[dtype_name]
    if dtype is not None and wire_dtype != dtype:
        _fail(f"{where} must be {dtype.name}, got {wire_dtype.name}")
    shape = raw["shape"]
    if not isinstance(shape, list) or len(shape) > limits.max_array_dims:
        _fail(f"{where} shape must be a list of at most {limits.max_array_dims} sizes")
    for size in shape:
        if type(size) is not int or size < 0:
            _fail(f"{where} shape {_short(shape)} is not a list of non-negative ints")
    count = math.prod(shape)
    if byte_length is None:
        available = buffer.nbytes - offset
        if count * wire_dtype.itemsize > available:
            _fail(f"{where} needs {count * wire_dtype.itemsize} bytes past its offset, the frame has {available}")
    else:
        offset = 0
        if count * wire_dtype.itemsize != byte_length:
            _fail(
                f"{where} has {byte_length} bytes, but shape {shape} of {wire_dtype.name} "
                f"needs {count * wire_dtype.itemsize}"
            )
    array = np.frombuffer(buffer, dtype=wire_dtype, count=count, offset=offset)
    return array if len(shape) == 1 else array.reshape(shape)


def _decode_str_field(spec: _FieldSpec, raw: Any, cursor: _FrameCursor, limits: WireLimits) -> str:
    return _decode_str(spec.where, raw, limits.max_string_chars)


def _decode_text_field(spec: _FieldSpec, raw: Any, cursor: _FrameCursor, limits: WireLimits) -> str:
    return _decode_str(spec.where, raw, limits.max_text_chars)


def _decode_optional_str(spec: _FieldSpec, raw: Any, cursor: _FrameCursor, limits: WireLimits) -> str | None:
    return None if raw is None else _decode_str(spec.where, raw, limits.max_text_chars)


def _decode_int_field(spec: _FieldSpec, raw: Any, cursor: _FrameCursor, limits: WireLimits) -> int:
    return _decode_int(spec.where, raw)


def _decode_float_field(spec: _FieldSpec, raw: Any, cursor: _FrameCursor, limits: WireLimits) -> float:
    return _decode_float(spec.where, raw)


def _decode_bool(spec: _FieldSpec, raw: Any, cursor: _FrameCursor, limits: WireLimits) -> bool:
    if type(raw) is not bool:
        _fail(f"{spec.where} must be a bool, got {type(raw).__name__}")
    return raw


def _decode_float_list(spec: _FieldSpec, raw: Any, cursor: _FrameCursor, limits: WireLimits) -> list[float]:
    if not isinstance(raw, list):
        _fail(f"{spec.where} must be a list, got {type(raw).__name__}")
    if len(raw) > limits.max_list_items:
        _fail(f"{spec.where} has {len(raw)} items, more than the limit {limits.max_list_items}")
    # One pass over the common case (all floats, finite sum); item by item only to say which
    # item is wrong, or when ints need converting.
    if all(type(item) is float for item in raw) and math.isfinite(sum(raw)):
        return raw
    return [_decode_float(f"{spec.where}[{index}]", item) for index, item in enumerate(raw)]


def _decode_list(spec: _FieldSpec, raw: Any, limits: WireLimits) -> list:
    if not isinstance(raw, list):
        _fail(f"{spec.where} must be a list, got {type(raw).__name__}")
    if len(raw) > limits.max_list_items:
        _fail(f"{spec.where} has {len(raw)} items, more than the limit {limits.max_list_items}")
    return raw


def _decode_int_list(spec: _FieldSpec, raw: Any, cursor: _FrameCursor, limits: WireLimits) -> list[int]:
    return [_decode_int(f"{spec.where}[{index}]", item) for index, item in enumerate(_decode_list(spec, raw, limits))]


def _decode_str_list(spec: _FieldSpec, raw: Any, cursor: _FrameCursor, limits: WireLimits) -> list[str]:
    items = _decode_list(spec, raw, limits)
    return [_decode_str(f"{spec.where}[{index}]", item, limits.max_string_chars) for index, item in enumerate(items)]


def _decode_bytes_list(spec: _FieldSpec, raw: Any, cursor: _FrameCursor, limits: WireLimits) -> list[bytes]:
    items = _decode_list(spec, raw, limits)
    for index, item in enumerate(items):
        if not isinstance(item, bytes):
            _fail(f"{spec.where}[{index}] must be bytes, got {type(item).__name__}")
    return items


def _decode_chat(spec: _FieldSpec, raw: Any, cursor: _FrameCursor, limits: WireLimits) -> list[dict[str, str]] | None:
    return _chat_messages(spec.where, raw, limits)


def _decode_array_field(spec: _FieldSpec, raw: Any, cursor: _FrameCursor, limits: WireLimits) -> np.ndarray:
    return _decode_array(spec.where, raw, spec.dtype, cursor, limits)


def _decode_tensors(
    spec: _FieldSpec, raw: Any, cursor: _FrameCursor, limits: WireLimits
) -> dict[str, np.ndarray] | None:
    if raw is None:
        return None
    where = spec.where
    if not isinstance(raw, dict):
        _fail(f"{where} must be a map of name -> array, got {type(raw).__name__}")
    if len(raw) > limits.max_tensors:
        _fail(f"{where} has {len(raw)} tensors, more than the limit {limits.max_tensors}")
    tensors = {}
    for name, descriptor in raw.items():
        name = _decode_str(f"{where} name", name, limits.max_string_chars)
        tensors[name] = _decode_array(f"{where}[{name!r}]", descriptor, None, cursor, limits)
    return tensors


_DECODERS: dict[str, Callable[[_FieldSpec, Any, _FrameCursor, WireLimits], Any]] = {
    "str": _decode_str_field,
    "text": _decode_text_field,
    "optional_str": _decode_optional_str,
    "optional_chat": _decode_chat,
    "int": _decode_int_field,
    "float": _decode_float_field,
    "bool": _decode_bool,
    "float_list": _decode_float_list,
    "int_list": _decode_int_list,
    "str_list": _decode_str_list,
    "bytes_list": _decode_bytes_list,
    "array": _decode_array_field,
    "tensors": _decode_tensors,
}


# The schemas, built once the field codecs above exist.


def _build_spec(cls: type) -> _MessageSpec:
    fields = _field_specs(cls)
    return _MessageSpec(
        cls=cls,
        tag=cls.TYPE_TAG,
        version=cls.SCHEMA_VERSION,
        fields=fields,
        names=frozenset(spec.name for spec in fields),
        check=_CHECKS[cls],
        check_contents=_CONTENT_CHECKS.get(cls),
    )


_SPEC_BY_CLASS: dict[type, _MessageSpec] = {cls: _build_spec(cls) for cls in MESSAGE_TYPES}
_SPEC_BY_TAG: dict[str, _MessageSpec] = {spec.tag: spec for spec in _SPEC_BY_CLASS.values()}


def _decode(frames: Sequence[Any], limits: WireLimits) -> Message:
    if isinstance(frames, (bytes, bytearray, memoryview, str)):
        _fail("expected a sequence of frames, got a single buffer")
    if not isinstance(frames, Sequence):
        _fail(f"expected a sequence of frames, got {type(frames).__name__}")
    frame_count = len(frames)
    if frame_count == 0:
        _fail("message has no frames")
    if frame_count > limits.max_frames:
        _fail(f"message has {frame_count} frames, more than the limit {limits.max_frames}")
    buffers = [_byte_view(frame, index) for index, frame in enumerate(frames)]
    total_bytes = sum(buffer.nbytes for buffer in buffers)
    if total_bytes > limits.max_message_bytes:
        _fail(f"message has {total_bytes} bytes, more than the limit {limits.max_message_bytes}")
    try:
        header = msgpack.unpackb(buffers[0], raw=False, strict_map_key=True, use_list=True)
    except Exception as error:  # msgpack raises many types; all mean a malformed header
        raise WireError(f"header is not valid MessagePack ({type(error).__name__})") from error
    if not isinstance(header, dict) or set(header) != {"type", "schema", "fields"}:
        _fail("header must be a map with exactly the keys type, schema, fields")
    spec = _SPEC_BY_TAG.get(header["type"]) if isinstance(header["type"], str) else None
    if spec is None:
        _fail(f"unknown message type {_short(header['type'])}")
    schema = header["schema"]
    if type(schema) is not int or schema != spec.version:
        _fail(f"{spec.tag} schema version {_short(schema)} is not supported (expected {spec.version})")
    raw_fields = header["fields"]
    if not isinstance(raw_fields, dict):
        _fail(f"{spec.tag} fields must be a map")
    given = set(raw_fields)
    if given != spec.names:
        missing = sorted(spec.names - given)
        unknown = sorted(_short(name, 40) for name in given - spec.names)
        _fail(f"{spec.tag} fields do not match the schema (missing {missing}, unknown {unknown[:5]})")
    cursor = _FrameCursor(buffers)
    values = {field.name: field.decode(field, raw_fields[field.name], cursor, limits) for field in spec.fields}
    if cursor.next_index != frame_count:
        _fail(f"message has {frame_count} frames, but its header uses {cursor.next_index}")
    spec.check(values, limits)
    if spec.check_contents is not None:
        spec.check_contents(values)
    return spec.cls(**values)


def decode(frames: Sequence[Any], *, limits: WireLimits = DEFAULT_LIMITS) -> Message:
    """The message in ``frames`` (bytes, memoryviews or zmq.Frame objects), fully validated.

    Arrays are numpy views on the frames' buffers (no copy). Raises ``WireError``, and nothing
    else, for any input that is not a valid message within ``limits``.
    """
    try:
        return _decode(frames, limits)
    except WireError:
        raise
    except Exception as error:  # a safety net: no byte pattern may escape as another exception
        raise WireError(f"malformed message ({type(error).__name__}: {_short(str(error))})") from error
