"""Every message that crosses a process boundary: the message types, their fields, type tags and
schema versions.

Each message is a dataclass; its fields' annotations (and, for arrays, the dtype in the field's
metadata) are its schema, which `common/codec.py` reads to turn messages into frames and back.
A change to a message's fields raises its ``SCHEMA_VERSION``.
"""

from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np


# ---------------------------------------------------------------------------------------------
# Field declarations
# ---------------------------------------------------------------------------------------------


def _array_field(dtype: str) -> Any:
    """A field holding a numpy array of exactly this dtype."""
    return field(metadata={"dtype": np.dtype(dtype).newbyteorder("<")})


def _long_text_field(default: str | None = None) -> Any:
    """A string field bounded by ``max_text_chars`` rather than ``max_string_chars``."""
    if default is None:
        return field(metadata={"long_text": True})
    return field(default=default, metadata={"long_text": True})


CHAT_ROLES = ("system", "user", "assistant")
"""The roles a chat message of a trajectory may have."""


@dataclass(kw_only=True, eq=False)
class Trajectory:
    """One finished episode: everything the learner needs to use it in an update."""

    TYPE_TAG: ClassVar[str] = "trajectory"
    # 2: invalid_actions added. 3: messages added. 4: sample_windows, cut_by added. 5: images,
    # image_offsets added.
    SCHEMA_VERSION: ClassVar[int] = 5

    # Unique per episode, so the learner can drop a trajectory that arrives twice.
    trajectory_id: str
    # Which actor produced it: statistics, debugging, and error attribution.
    actor_id: str
    # The environment, so one learner can train on several at once and report them apart.
    env_name: str
    # The task instance played; episodes of one group share it.
    task_id: str
    # GRPO compares the members of a group; the learner collects them under this key.
    group_id: str
    # How many members the group will have, so the learner knows when it is complete.
    group_size: int
    # The whole conversation as token ids, exactly as generated (never re-tokenised).
    token_ids: np.ndarray = _array_field("int32")
    # 1 on tokens the model generated (they carry loss), 0 on prompt and environment tokens.
    loss_mask: np.ndarray = _array_field("uint8")
    # Log-probability the actor sampled each generated token with (0 elsewhere): the behaviour
    # policy in the off-policy correction.
    behaviour_logprobs: np.ndarray = _array_field("float32")
    # Policy version that generated each token (-1 on tokens not generated); weights can change
    # mid-episode, and staleness is measured against the oldest generated token.
    policy_versions: np.ndarray = _array_field("int32")
    # Tokens before the first generated token, so the learner can skip the shared prompt.
    prompt_length: int
    # The final outcome: the reward the update optimises.
    reward: float
    # Per-turn rewards, kept for inspection and for reward-shaping experiments.
    turn_rewards: list[float]
    # Turns taken; compared with the horizon cap to see how often episodes hit it.
    num_turns: int
    # Turns whose reply the env could not read as an action (a garbled format), so the learner can
    # tell a policy that fails the task from one that fails the format.
    invalid_actions: int = 0
    # Horizon cap in force when the episode ran; the learner's curriculum watches it.
    horizon_cap: int
    # The environment ended the episode (success or failure).
    terminated: bool
    # The episode was cut off (horizon cap, token budget), not ended by the environment.
    truncated: bool
    # Whether the task was solved, which is not always reward > 0.
    success: bool
    # Seconds spent generating and in the environment: throughput accounting on the learner.
    generation_seconds: float
    env_seconds: float
    # The episode as readable text, for sample logs.
    text: str = _long_text_field(default="")
    # "" normally; otherwise what failed (environment or engine), so failures are visible.
    error: str = _long_text_field(default="")
    # The conversation as chat messages ({"role": ..., "content": ...}, roles in CHAT_ROLES), for
    # a run that saves the episodes it trains on (`run.save_episodes`); None otherwise, so the
    # text of every turn does not travel twice for nothing.
    messages: list[dict[str, str]] | None = None
    # Where the model was shown less than the whole history (actor.history_turns), each turn's
    # context as it was sampled, three indices into token_ids per turn: window_start, reply_start,
    # reply_end. The turn's training sample is token_ids[:prompt_length] +
    # token_ids[window_start:reply_end], its reply [reply_start, reply_end) the only tokens with
    # loss. Empty: the whole trajectory is one sample, every reply in the context it was sampled in.
    sample_windows: list[int] = field(default_factory=list)
    # Why a truncated episode stopped: "env" (its own limit), "horizon" (the turn cap) or "context"
    # (the next turn would not have fit actor.max_context_tokens); "" when it was not cut.
    cut_by: str = ""
    # A vision-language policy's images (PNG or JPEG bytes: the screenshots its observations showed),
    # in the order of their tokens in token_ids; the learner gives them to the model again to score
    # the tokens as they were sampled. Empty for text.
    images: list[bytes] = field(default_factory=list)
    # Where the piece of token_ids that shows each image begins (0: the first prompt; else the
    # observation after a reply), so a turn's sample (sample_windows) takes the images it shows.
    image_offsets: list[int] = field(default_factory=list)


@dataclass(kw_only=True, eq=False)
class WeightsUpdate:
    """New policy weights: either the tensors themselves or where to read them."""

    TYPE_TAG: ClassVar[str] = "weights_update"
    SCHEMA_VERSION: ClassVar[int] = 2

    # The policy version these weights are; actors tag generated tokens with it.
    version: int
    # Parameter name -> array; each large tensor travels as its own zero-copy frame.
    tensors: dict[str, np.ndarray] | None = None
    # A safetensors directory on a filesystem the actors share with the learner, instead.
    path: str | None = None
    # Tensors whose uint16 arrays hold bfloat16 bit patterns. numpy has no bfloat16: naming them
    # lets a bf16 model travel at 2 bytes a value (not widened to float32) and come back exact.
    bfloat16_tensors: list[str] = field(default_factory=list)


@dataclass(kw_only=True, eq=False)
class CollectiveWeights:
    """New policy weights whose bytes follow over a torch.distributed group (the `collective`
    transport). Sent to one actor on its control socket; right after, the learner broadcasts the
    buckets, in order, over that actor's pair group (learner rank 0, actor rank 1)."""

    TYPE_TAG: ClassVar[str] = "collective_weights"
    SCHEMA_VERSION: ClassVar[int] = 1

    # The policy version these weights are; actors tag generated tokens with it.
    version: int
    # Where the learner's rendezvous store (a torch TCPStore) listens, to form the group.
    store_host: str
    store_port: int
    # The group's key prefix in the store, new for every group the learner forms: a name the
    # actor does not hold a group for means "form this one" (the old group broke, or the learner
    # restarted).
    group_name: str
    # gloo (buffers in CPU memory) or nccl (buffers on the GPU).
    backend: str
    # Every wait of the receiver (forming the group, each bucket) gives up after this long.
    timeout_s: float
    # The tensors: name, torch dtype name ("bfloat16", ...), shape (the number of dimensions per
    # tensor, then all dimensions in one flat list), and where the bytes sit: bucket, byte offset.
    tensor_names: list[str]
    tensor_dtypes: list[str]
    tensor_ndims: list[int]
    tensor_dims: list[int]
    tensor_buckets: list[int]
    tensor_offsets: list[int]
    # Size in bytes of each bucket, in the order they are broadcast.
    bucket_sizes: list[int]
    # CRC32 of each bucket, checked on arrival (a transfer that is not bit-identical is refused);
    # empty when the buckets live on a GPU, where computing it would cost a copy to the host.
    bucket_crc32: list[int]


@dataclass
class HorizonUpdate:
    """The horizon cap (most turns an episode may take) the actors must apply from now on."""

    TYPE_TAG: ClassVar[str] = "horizon_update"
    SCHEMA_VERSION: ClassVar[int] = 1

    # The new cap on turns per episode.
    horizon_cap: int
    # Stage of the horizon schedule, for logs and for resuming.
    stage: int
    # Learner step at which the cap took effect.
    learner_step: int


@dataclass
class Backlog:
    """What the learner has waiting to train, published after every step, whenever it starts to
    wait for groups and with every horizon repeat. Async actors pace themselves by it: a group
    that would wait behind more than `max_staleness` steps of groups would be dropped as stale, so
    it is not started (see `actor.worker.group_would_be_trainable`)."""

    TYPE_TAG: ClassVar[str] = "backlog"
    SCHEMA_VERSION: ClassVar[int] = 1

    # The learner's version now: the version the next step trains against.
    learner_version: int
    # Trajectories received and not yet trained or dropped (the batch being gathered, the whole
    # groups after it and the members of groups still arriving).
    waiting_trajectories: int
    # Actors the learner hears from (at least 1): each actor takes its play as one share of all.
    live_actors: int


@dataclass
class Hello:
    """An actor announcing itself to the learner when it starts or reconnects."""

    TYPE_TAG: ClassVar[str] = "hello"
    SCHEMA_VERSION: ClassVar[int] = 1

    # The actor's identity; its ZeroMQ routing identity starts with it.
    actor_id: str
    # Process id and host, so a person can find (and stop) the process.
    pid: int
    hostname: str
    # The weights the actor holds, so the learner can tell whether it needs an update.
    policy_version: int
    # Engine type (hf, vllm, openai, scripted), for the run's records.
    engine: str


@dataclass
class Heartbeat:
    """Periodic sign of life from an actor; silence means it hangs or died."""

    TYPE_TAG: ClassVar[str] = "heartbeat"
    # 3: pid and hostname added.
    SCHEMA_VERSION: ClassVar[int] = 3

    actor_id: str
    # Weights the actor currently samples with: shows how far behind it runs.
    policy_version: int
    # Progress since start: a heartbeat with no progress for long means a stuck actor.
    episodes_done: int
    # The actor's wall clock (time.time()); hosts' clocks differ, so only for display.
    time: float
    # The newest weights version the actor's engine refused (-1: none): the learner does not send
    # that version again, since it would be refused again.
    refused_version: int = -1
    # The actor process (as in its Hello): a learner restarted since that Hello still knows whose
    # count of episodes this is.
    pid: int = 0
    hostname: str = ""


@dataclass
class Stop:
    """Asks an actor (or all actors) to finish and exit."""

    TYPE_TAG: ClassVar[str] = "stop"
    SCHEMA_VERSION: ClassVar[int] = 1

    # Why, for the actor's log.
    reason: str = _long_text_field()


@dataclass
class ActorStats:
    """Throughput figures an actor reports now and then, for the learner's metrics."""

    TYPE_TAG: ClassVar[str] = "actor_stats"
    # 3: history_breaks added. 4: paced_s added.
    SCHEMA_VERSION: ClassVar[int] = 4

    actor_id: str
    episodes_done: int
    episodes_per_s: float
    generated_tokens_per_s: float
    mean_generation_seconds: float
    mean_env_seconds: float
    # Episodes that ended with an env or engine failure.
    errors: int
    # Weight updates the actor's engine refused (it kept the version it had).
    weights_refused: int = 0
    # A gateway actor: calls whose messages were not their session's history plus new messages
    # (the agent's framework re-rendered or edited it), so the learner can tell how often an
    # outside agent's sessions could not stay one sequence.
    history_breaks: int = 0
    # Seconds the actor held back from starting groups the learner could not have trained within
    # max_staleness (actor.pace_to_learner): time the learner, not the actor, set the pace.
    paced_s: float = 0.0


Message = (Trajectory | WeightsUpdate | CollectiveWeights | HorizonUpdate | Backlog | Hello | Heartbeat | Stop
           | ActorStats)

MESSAGE_TYPES: tuple[type, ...] = (
    Trajectory, WeightsUpdate, CollectiveWeights, HorizonUpdate, Backlog, Hello, Heartbeat, Stop, ActorStats,
)

TENSOR_DTYPE_BYTES: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
}
"""Tensor dtypes a collective weights update may announce (torch's names), with their sizes."""
