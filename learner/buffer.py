"""The learner's group buffer: collects trajectories into GRPO groups and bounds their staleness.

Trajectories arrive one at a time, from many actors, as soon as each episode ends. The buffer
gathers them by group id and hands out groups once they are complete (or have waited long enough
with enough members), never handing out a group whose oldest token is more than ``max_staleness``
policy versions behind the learner; or, with ``staleness_unit = "token"``, handing a group out
with its members' too-old tokens taken out of their loss masks, so that a long episode whose
weights changed between turns trains on its recent turns instead of being dropped. Everything
it refuses is counted, so a run's metrics show
where data went.
"""

from __future__ import annotations

import collections
import copy
import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from longhorizon.common.codec import MAX_LOGPROB
from longhorizon.common.config import PARTIAL_GROUP_POLICIES, STALENESS_UNITS
from longhorizon.common.transport import RateLimitedLog
from longhorizon.learner.samples import sample_lengths, window_problem, windows_of

__all__ = ["DEFAULT_MAX_ABS_REWARD", "Group", "GroupBuffer", "staleness", "tokens_within_staleness"]

_VERSIONS_REMEMBERED = 1024
DEFAULT_MAX_ABS_REWARD = 1e6
# The largest reward bound allowed: advantages reach twice the bound (rloo, dr_grpo), a critic's
# returns sum turn rewards and its loss squares them, all in float32 (largest 3.4e38); at 1e12
# every one of them stays far inside it.
MAX_ABS_REWARD_LIMIT = 1e12

logger = logging.getLogger(__name__)


def staleness(learner_version: int, policy_versions: np.ndarray, loss_mask: np.ndarray) -> int:
    """Policy lag eta = learner_version - the oldest policy version among the generated tokens.

    eta = 0 means every generated token was sampled with the weights the learner holds now; with
    ``max_staleness = 0`` only such trajectories are used, which is the synchronous algorithm.
    The oldest version counts because weights can change mid-episode and the oldest segment is the
    most off-policy one. A trajectory with no generated tokens has eta = 0. A negative eta (a
    trajectory from weights newer than the learner's, e.g. after the learner resumed from an older
    checkpoint) is returned as is.
    """
    policy_versions = np.asarray(policy_versions)
    loss_mask = np.asarray(loss_mask)
    if policy_versions.ndim != 1 or policy_versions.shape != loss_mask.shape:
        raise ValueError(
            f"policy_versions {policy_versions.shape} and loss_mask {loss_mask.shape} must be "
            f"1-D arrays of the same length"
        )
    generated_versions = policy_versions[loss_mask.astype(bool)]
    if generated_versions.size == 0:
        return 0
    oldest_version = int(generated_versions.min())
    if oldest_version < 0:
        raise ValueError("a generated token (loss_mask == 1) has no policy version (-1)")
    return int(learner_version) - oldest_version




def tokens_within_staleness(learner_version: int, policy_versions: np.ndarray, loss_mask: np.ndarray,
                            max_staleness: int) -> np.ndarray:
    """`loss_mask` without the generated tokens whose policy lag (learner_version minus the version
    that sampled them) is above `max_staleness`: what the learner trains on when staleness is
    judged per token. An episode whose weights changed between turns keeps its recent turns; its
    older ones stay in the sequence as context, out of the loss."""
    loss_mask = np.asarray(loss_mask)
    recent = np.asarray(policy_versions) >= int(learner_version) - int(max_staleness)
    return (loss_mask.astype(bool) & recent).astype(loss_mask.dtype)


def _newest_staleness(learner_version: int, trajectory: Any) -> int:
    """Policy lag of a trajectory's newest generated token (0 with none)."""
    versions = np.asarray(trajectory.policy_versions)[np.asarray(trajectory.loss_mask).astype(bool)]
    return int(learner_version) - int(versions.max()) if versions.size else 0


@dataclass
class Group:
    """Trajectories of one task instance, sampled together for a group-relative baseline."""

    group_id: str
    trajectories: list[Any]
    """Members held, in arrival order."""
    group_size: int
    """How many trajectories the actor started for this group."""
    first_arrival: float = 0.0
    """Clock time when the first member (or the first news of one) reached the buffer."""
    refused_members: int = 0
    """Members that arrived but were refused (too stale or too long): they will not come again."""
    policy_version: int = 0
    """The oldest policy version in the member that opened the group (in sync mode, the version
    that generated the whole group)."""

    @property
    def rewards(self) -> np.ndarray:
        """The members' final rewards, in arrival order."""
        return np.array([trajectory.reward for trajectory in self.trajectories], dtype=np.float64)

    @property
    def is_complete(self) -> bool:
        """Every member has arrived."""
        return len(self.trajectories) >= self.group_size

    def member_staleness(self, learner_version: int) -> list[int]:
        """eta of each member at ``learner_version``, in arrival order."""
        return [
            staleness(learner_version, trajectory.policy_versions, trajectory.loss_mask)
            for trajectory in self.trajectories
        ]

    def staleness(self, learner_version: int) -> int:
        """The group's eta: that of its stalest member (0 for an empty group)."""
        return max(self.member_staleness(learner_version), default=0)

    def newest_member_staleness(self, learner_version: int) -> list[int]:
        """Each member's lag by its newest generated token: above the bound, nothing of it can be
        trained even with staleness judged per token."""
        return [_newest_staleness(learner_version, trajectory) for trajectory in self.trajectories]


class _RecentKeys:
    """Remembers the most recent keys up to a fixed number, so memory stays bounded."""

    def __init__(self, capacity: int) -> None:
        self._keys: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._capacity = capacity

    def add(self, key: str) -> None:
        self._keys[key] = None
        self._keys.move_to_end(key)
        while len(self._keys) > self._capacity:
            self._keys.popitem(last=False)

    def __contains__(self, key: object) -> bool:
        return key in self._keys


_COUNTER_NAMES = (
    "received",
    "accepted",
    "duplicates",
    "dropped_malformed",
    "dropped_too_long",
    "dropped_stale_trajectories",
    "dropped_future_trajectories",
    "dropped_late_trajectories",
    "dropped_overfull",
    "dropped_stale_groups",
    "dropped_incomplete_groups",
    "dropped_partial_groups",
    "dropped_overflow_groups",
    "dropped_group_trajectories",
    "returned_groups",
    "returned_partial_groups",
    "returned_trajectories",
    "lost_on_restart",
    "stale_tokens_masked",
)


class GroupBuffer:
    """Collects trajectories by group id and releases ready, fresh-enough groups, oldest first.

    A group is ready when all ``group_size`` members have arrived. A group that lost members
    (refused as stale or too long) or is still incomplete ``group_timeout_s`` after its first
    arrival is *partial*: with ``partial_groups="drop"`` (the default) it is dropped, because
    the members that go missing are not a random sample (the late ones are the long, often
    failing episodes, so the survivors' mean and std lean towards short successes); with
    ``"keep"`` it is released with the members it has if there are at least
    ``min_group_size_on_timeout`` of them, else dropped. Groups with zero reward variance are
    not filtered here: the trainer counts and skips them.

    Every number a trajectory carries is checked for what it may be, not only its type (see
    `_describe_malformation`): a reward or turn reward beyond ``max_abs_reward`` in absolute
    value, a positive or non-finite behaviour log-prob, per-token arrays of different lengths, a
    prompt longer than the trajectory, negative counts or durations are refused as malformed. With
    ``vocab_size``, trajectories holding token ids outside the model's vocabulary are refused as
    malformed; with ``max_tokens``, trajectories longer than that are refused (the run's context
    budget: one over-long trajectory could take the learner's memory). Each malformed refusal is
    also counted under the field at fault (``refused_fields``, e.g. ``{"reward": 2}``), and the
    rate-limited log line names the field and its value.

    Counters (``counters``): received, accepted, duplicates, dropped_malformed,
    dropped_too_long, dropped_stale_trajectories, dropped_future_trajectories (made by weights
    newer than the learner's), dropped_late_trajectories (for a group already returned or
    dropped), dropped_overfull (more members than group_size), dropped_stale_groups,
    dropped_incomplete_groups (partial, kept policy, too few members), dropped_partial_groups
    (partial, drop policy), dropped_overflow_groups (beyond ``max_pending_groups``),
    dropped_group_trajectories (accepted members of the groups dropped), returned_groups,
    returned_partial_groups, returned_trajectories, lost_on_restart (held by a learner that was
    restarted: see `restore_counters`). Every trajectory received is counted once: received =
    accepted + each refusal counter, and accepted = returned_trajectories +
    dropped_group_trajectories + lost_on_restart + the trajectories still held. Beside them, in
    tokens: stale_tokens_masked (generated tokens of returned members left out of the loss as too
    stale, staleness_unit "token").
    """

    def __init__(
        self,
        max_staleness: int,
        group_timeout_s: float,
        min_group_size_on_timeout: int = 2,
        clock: Callable[[], float] = time.monotonic,
        *,
        partial_groups: str = "drop",
        max_pending_groups: int = 1024,
        remembered_ids: int = 65536,
        vocab_size: int | None = None,
        max_tokens: int | None = None,
        max_abs_reward: float = DEFAULT_MAX_ABS_REWARD,
        staleness_unit: str = "episode",
    ) -> None:
        if not isinstance(max_staleness, int) or max_staleness < 0:
            raise ValueError(f"max_staleness must be an integer >= 0, got {max_staleness!r}")
        if staleness_unit not in STALENESS_UNITS:
            raise ValueError(f"staleness_unit must be one of {', '.join(STALENESS_UNITS)}, got {staleness_unit!r}")
        if not group_timeout_s > 0:
            raise ValueError(f"group_timeout_s must be > 0, got {group_timeout_s!r}")
        if min_group_size_on_timeout < 1:
            raise ValueError(
                f"min_group_size_on_timeout must be >= 1, got {min_group_size_on_timeout!r}"
            )
        if partial_groups not in PARTIAL_GROUP_POLICIES:
            raise ValueError(
                f"partial_groups must be one of {', '.join(PARTIAL_GROUP_POLICIES)}, got {partial_groups!r}"
            )
        if max_pending_groups < 1:
            raise ValueError(f"max_pending_groups must be >= 1, got {max_pending_groups!r}")
        if remembered_ids < 1:
            raise ValueError(f"remembered_ids must be >= 1, got {remembered_ids!r}")
        if vocab_size is not None and vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1 or None, got {vocab_size!r}")
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1 or None, got {max_tokens!r}")
        if (isinstance(max_abs_reward, bool) or not isinstance(max_abs_reward, (int, float))
                or not 0 < max_abs_reward <= MAX_ABS_REWARD_LIMIT):
            raise ValueError(
                f"learner.max_abs_reward must be a number in (0, {MAX_ABS_REWARD_LIMIT:g}], got "
                f"{max_abs_reward!r} (larger rewards would overflow advantages and losses)"
            )
        self.max_abs_reward = float(max_abs_reward)
        # Token ids at or beyond the model's vocabulary would fail in its embedding (on CUDA a
        # device-side assert that ends the process): refused on arrival instead.
        self.vocab_size = vocab_size
        self.max_tokens = max_tokens
        self.max_staleness = max_staleness
        self.staleness_unit = staleness_unit
        self.group_timeout_s = float(group_timeout_s)
        self.min_group_size_on_timeout = min_group_size_on_timeout
        self.partial_groups = partial_groups
        self.max_pending_groups = max_pending_groups
        self._clock = clock
        # Insertion order is first-arrival order, which is the order groups are handed out in.
        self._pending: dict[str, Group] = {}
        # Bounded memories of what has been seen, so re-sent or late trajectories are recognised
        # without the buffer growing for ever.
        self._seen_trajectory_ids = _RecentKeys(remembered_ids)
        self._closed_group_ids = _RecentKeys(remembered_ids)
        self.counters: dict[str, int] = dict.fromkeys(_COUNTER_NAMES, 0)
        # dropped_malformed by the field at fault: their sum is dropped_malformed.
        self.refused_fields: collections.Counter[str] = collections.Counter()
        self.staleness_histogram: collections.Counter[int] = collections.Counter()
        # Groups dropped, by the version that made them (see Group.policy_version): a synchronous
        # learner counts the losses of its own version's batch only.
        self.dropped_groups_by_version: collections.Counter[int] = collections.Counter()
        # A sender with a bug can send thousands of bad trajectories: one log line per interval.
        self._refusals = RateLimitedLog("group buffer refused a trajectory", log=logger)
        self._overflows = RateLimitedLog("group buffer full", log=logger)

    def __len__(self) -> int:
        """Trajectories held."""
        return sum(len(group.trajectories) for group in self._pending.values())

    def restore_counters(self, saved: dict[str, int]) -> int:
        """Continue a checkpoint's counts in this new, empty buffer; returns how many trajectories
        the checkpointed buffer held, now counted as ``lost_on_restart``.

        A restarted (or resumed) learner starts with an empty buffer: the trajectories held when
        the checkpoint was written died with the old process. (What the old process accepted
        after its checkpoint is counted nowhere: the counts are the checkpoint's, as the steps
        after it are trained again.) How many were held is derived from the saved counts
        (accepted less trained, dropped with their group and lost before), not saved apart, so
        the sum closes exactly even when trajectories arrived while the checkpoint was written.
        """
        if len(self) or any(self.counters.values()):
            raise RuntimeError("counters can only be restored into a new, empty buffer")
        for name, value in saved.items():
            if name in self.counters:  # a checkpoint may predate a counter, or hold a retired one
                self.counters[name] = int(value)
        counters = self.counters
        held = (counters["accepted"] - counters["returned_trajectories"]
                - counters["dropped_group_trajectories"] - counters["lost_on_restart"])
        if held < 0:
            raise ValueError(
                f"the checkpoint's buffer counters do not add up: accepted {counters['accepted']} < trained "
                f"{counters['returned_trajectories']} + dropped with their group "
                f"{counters['dropped_group_trajectories']} + lost on restart {counters['lost_on_restart']}"
            )
        counters["lost_on_restart"] += held
        return held

    @property
    def pending_groups(self) -> int:
        """Groups held, complete or not."""
        return len(self._pending)

    # -----------------------------------------------------------------------------------------
    # Arrivals

    def add(self, trajectory: Any, *, learner_version: int) -> None:
        """Take one trajectory; refuse (and count) duplicates, malformed, stale and late ones.

        Never raises on a bad trajectory: a long-running learner must not die of one bad message.
        """
        self.counters["received"] += 1
        problem = _describe_malformation(trajectory, self.max_abs_reward)
        if problem is None and self.vocab_size is not None:
            problem = _describe_out_of_vocabulary(trajectory, self.vocab_size)
        if problem is None:
            try:
                trajectory_staleness = staleness(
                    learner_version, trajectory.policy_versions, trajectory.loss_mask
                )
            except ValueError as error:
                problem = ("policy_versions", str(error))
        if problem is not None:
            self._refuse_malformed(trajectory, *problem)
            return

        trajectory_id, group_id = trajectory.trajectory_id, trajectory.group_id
        if trajectory_id in self._seen_trajectory_ids:
            self.counters["duplicates"] += 1
            return
        self._seen_trajectory_ids.add(trajectory_id)
        if group_id in self._closed_group_ids:
            self.counters["dropped_late_trajectories"] += 1
            return

        group = self._pending.get(group_id)
        if group is not None and group.group_size != trajectory.group_size:
            self._refuse_malformed(
                trajectory, "group_size",
                f"group {group_id} has size {group.group_size} but it says {trajectory.group_size}",
            )
            return
        if trajectory_staleness < 0:
            self.counters["dropped_future_trajectories"] += 1
            return
        if group is None:
            group = self._open_group(group_id, trajectory.group_size, learner_version - trajectory_staleness)
        # What the learner will encode at once: the whole trajectory, or its longest turn sample.
        length = max(sample_lengths(trajectory))
        if self.max_tokens is not None and length > self.max_tokens:
            self.counters["dropped_too_long"] += 1
            group.refused_members += 1
            self._refusals.record(
                f"trajectory {trajectory_id} has {length} tokens{' in a turn sample' if windows_of(trajectory) else ''}, "
                f"more than the run's budget of {self.max_tokens} (actor.max_context_tokens)"
            )
            return
        if self.staleness_unit == "token":
            trajectory_staleness = _newest_staleness(learner_version, trajectory)
        if trajectory_staleness > self.max_staleness:
            self.counters["dropped_stale_trajectories"] += 1
            group.refused_members += 1
            return
        if len(group.trajectories) + group.refused_members >= group.group_size:
            self.counters["dropped_overfull"] += 1
            return
        group.trajectories.append(trajectory)
        self.counters["accepted"] += 1

    def _refuse_malformed(self, trajectory: Any, field: str, problem: str) -> None:
        self.counters["dropped_malformed"] += 1
        self.refused_fields[field] += 1
        # Who sent it, where that can be read: the field and value alone do not find the sender.
        sender = ", ".join(
            f"{name} {getattr(trajectory, name)!r}" for name in ("trajectory_id", "actor_id", "env_name")
            if isinstance(getattr(trajectory, name, None), str)
        )
        self._refusals.record(f"malformed {field}: {problem}" + (f" ({sender})" if sender else ""))

    def _open_group(self, group_id: str, group_size: int, policy_version: int) -> Group:
        if len(self._pending) >= self.max_pending_groups:
            self._drop_for_room()
        group = Group(
            group_id=group_id, trajectories=[], group_size=group_size, first_arrival=self._clock(),
            policy_version=policy_version,
        )
        self._pending[group_id] = group
        return group

    def _drop_for_room(self) -> None:
        # The oldest incomplete group is the one least likely to be finished soon; complete groups
        # are only dropped when nothing else is left to drop.
        victim_id = next(
            (group_id for group_id, group in self._pending.items() if not group.is_complete),
            next(iter(self._pending)),
        )
        self._drop(victim_id, "dropped_overflow_groups")
        self._overflows.record(f"{self.max_pending_groups} groups pending: dropped group {victim_id}")

    def _drop(self, group_id: str, reason: str) -> None:
        group = self._close(group_id)
        self.counters[reason] += 1
        self.counters["dropped_group_trajectories"] += len(group.trajectories)
        self.dropped_groups_by_version[group.policy_version] += 1
        if len(self.dropped_groups_by_version) > _VERSIONS_REMEMBERED:
            del self.dropped_groups_by_version[min(self.dropped_groups_by_version)]

    def _close(self, group_id: str) -> Group:
        self._closed_group_ids.add(group_id)
        return self._pending.pop(group_id)

    # -----------------------------------------------------------------------------------------
    # Departures

    def pop_ready(self, max_groups: int, *, learner_version: int, give_up_waiting: bool = False) -> list[Group]:
        """Up to ``max_groups`` ready groups, oldest first, each within ``max_staleness`` now.

        Every pending group is also swept: groups that became too stale are dropped, and partial
        groups (members refused or timed out) are dropped or released as ``partial_groups``
        says. ``give_up_waiting`` treats every incomplete group as timed out (the caller knows
        no more members will come, e.g. a synchronous batch whose actors are done).
        """
        if max_groups < 0:
            raise ValueError(f"max_groups must be >= 0, got {max_groups!r}")
        now = self._clock()
        ready: list[Group] = []
        for group_id, group in list(self._pending.items()):
            member_staleness = (group.newest_member_staleness(learner_version) if self.staleness_unit == "token"
                                else group.member_staleness(learner_version))
            if max(member_staleness, default=0) > self.max_staleness:
                self._drop(group_id, "dropped_stale_groups")
                continue
            if not group.is_complete:
                lost_members = group.refused_members > 0
                timed_out = give_up_waiting or now - group.first_arrival >= self.group_timeout_s
                if self.partial_groups == "drop":
                    if lost_members or timed_out:
                        self._drop(group_id, "dropped_partial_groups")
                    continue
                all_accounted_for = (
                    len(group.trajectories) + group.refused_members >= group.group_size
                )
                if not (all_accounted_for or timed_out):
                    continue
                if len(group.trajectories) < self.min_group_size_on_timeout:
                    self._drop(group_id, "dropped_incomplete_groups")
                    continue
            # Ready groups beyond max_groups stay, in order, for the next call.
            if len(ready) < max_groups:
                self._close(group_id)
                if self.staleness_unit == "token":
                    self._mask_stale_tokens(group, learner_version)
                ready.append(group)
                self._count_returned(group, group.member_staleness(learner_version))
        return ready

    def _mask_stale_tokens(self, group: Group, learner_version: int) -> None:
        """Each member's generated tokens beyond the bound taken out of its loss mask (a copy:
        the trajectory as received is left alone)."""
        for index, trajectory in enumerate(group.trajectories):
            mask = tokens_within_staleness(learner_version, trajectory.policy_versions, trajectory.loss_mask,
                                           self.max_staleness)
            masked = int(np.asarray(trajectory.loss_mask).astype(bool).sum() - mask.astype(bool).sum())
            if masked:
                trimmed = copy.copy(trajectory)
                trimmed.loss_mask = mask
                group.trajectories[index] = trimmed
                self.counters["stale_tokens_masked"] += masked

    def _count_returned(self, group: Group, member_staleness: Iterable[int]) -> None:
        self.counters["returned_groups"] += 1
        self.counters["returned_trajectories"] += len(group.trajectories)
        if not group.is_complete:
            self.counters["returned_partial_groups"] += 1
        self.staleness_histogram.update(member_staleness)


def _describe_out_of_vocabulary(trajectory: Any, vocab_size: int) -> tuple[str, str] | None:
    """(field, what is wrong) with a trajectory's token ids for a model of ``vocab_size``, or None."""
    try:
        token_ids = np.asarray(trajectory.token_ids)
    except AttributeError:
        return "token_ids", "missing field"
    if token_ids.ndim != 1 or not np.issubdtype(token_ids.dtype, np.integer):
        return "token_ids", f"must be a 1-D integer array, got shape {token_ids.shape} of {token_ids.dtype}"
    if token_ids.size == 0:
        return None
    # One pass: read as unsigned, a negative id is larger than any vocabulary.
    unsigned = token_ids.view(np.dtype(f"u{token_ids.itemsize}")) if token_ids.dtype.kind == "i" else token_ids
    if int(unsigned.max()) < vocab_size:
        return None
    lowest, highest = int(token_ids.min()), int(token_ids.max())
    return "token_ids", f"token ids {lowest}..{highest} are outside the model's vocabulary of {vocab_size}"


# Every field of the wire Trajectory (common/wire.py) that the learner reads a number from.
_CHECKED_FIELDS = (
    "trajectory_id", "group_id", "group_size", "reward", "turn_rewards", "token_ids", "loss_mask",
    "behaviour_logprobs", "policy_versions", "prompt_length", "num_turns", "invalid_actions",
    "generation_seconds", "env_seconds",
)


def _is_integer(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))


def _describe_malformation(trajectory: Any, max_abs_reward: float = DEFAULT_MAX_ABS_REWARD) -> tuple[str, str] | None:
    """(field, what is wrong) for the first field of a trajectory that the learner cannot use, or
    None if every field is usable.

    The wire decoder (common/codec.py) checks types, dtypes and the token arrays' contents; this
    checks every value the learner reads, whatever carried it, for what it may be, so that
    nothing downstream (advantages, losses, metrics) can overflow or turn NaN on an accepted
    trajectory: rewards and turn rewards finite and within
    ``max_abs_reward``; behaviour log-probs finite and <= 0 (with the wire's room for rounding,
    ``MAX_LOGPROB``); token ids, loss mask, behaviour log-probs and policy versions 1-D arrays of
    one length, the mask 0 or 1; the prompt within the trajectory; counts and durations finite
    and >= 0, no more invalid actions than turns.
    """
    values: dict[str, Any] = {}
    for name in _CHECKED_FIELDS:
        try:
            values[name] = getattr(trajectory, name)
        except AttributeError:
            return name, "missing field"
    trajectory_id, group_id, group_size = values["trajectory_id"], values["group_id"], values["group_size"]
    if not isinstance(trajectory_id, str) or not trajectory_id:
        return "trajectory_id", f"must be a non-empty string, got {trajectory_id!r}"
    if not isinstance(group_id, str) or not group_id:
        return "group_id", f"must be a non-empty string, got {group_id!r}"
    if not _is_integer(group_size):
        return "group_size", f"must be an integer, got {group_size!r}"
    if group_size < 1:
        return "group_size", f"must be >= 1, got {group_size}"

    reward = values["reward"]
    if not _is_number(reward):
        return "reward", f"must be a number, got {reward!r}"
    if not math.isfinite(float(reward)):
        return "reward", f"must be finite, got {reward!r}"
    if abs(float(reward)) > max_abs_reward:
        return "reward", f"{float(reward)!r} is beyond +-{max_abs_reward:g} (learner.max_abs_reward)"
    turn_rewards = values["turn_rewards"]
    if not isinstance(turn_rewards, (list, tuple, np.ndarray)):
        return "turn_rewards", f"must be a list of numbers, got {type(turn_rewards).__name__}"
    for turn, turn_reward in enumerate(turn_rewards):
        if not _is_number(turn_reward) or not math.isfinite(float(turn_reward)):
            return "turn_rewards", f"turn {turn}: must be a finite number, got {turn_reward!r}"
        # ppo's critic learns from turn rewards: the same bound as the reward's.
        if abs(float(turn_reward)) > max_abs_reward:
            return "turn_rewards", (
                f"turn {turn}: {float(turn_reward)!r} is beyond +-{max_abs_reward:g} (learner.max_abs_reward)"
            )

    arrays: dict[str, np.ndarray] = {}
    for name in ("token_ids", "loss_mask", "behaviour_logprobs", "policy_versions"):
        try:
            arrays[name] = np.asarray(values[name])
        except (TypeError, ValueError) as error:  # e.g. a ragged list
            return name, f"is not an array: {error}"
    for name, array in arrays.items():
        if array.ndim != 1:
            return name, f"must be a 1-D array, got shape {array.shape}"
    length = arrays["token_ids"].shape[0]
    for name, array in arrays.items():
        if array.shape[0] != length:
            return name, f"has {array.shape[0]} entries but token_ids has {length}"
    if not np.issubdtype(arrays["token_ids"].dtype, np.integer):
        return "token_ids", f"must be integers, got dtype {arrays['token_ids'].dtype}"
    if not np.issubdtype(arrays["policy_versions"].dtype, np.integer):
        return "policy_versions", f"must be integers, got dtype {arrays['policy_versions'].dtype}"
    loss_mask = arrays["loss_mask"]
    if loss_mask.dtype.kind not in "biuf" or (length and not np.all((loss_mask == 0) | (loss_mask == 1))):
        return "loss_mask", f"must hold only 0 and 1, got {np.unique(loss_mask)[:5].tolist()} of dtype {loss_mask.dtype}"
    logprobs = arrays["behaviour_logprobs"]
    if not np.issubdtype(logprobs.dtype, np.floating):
        return "behaviour_logprobs", f"must be floats, got dtype {logprobs.dtype}"
    # The smallest and largest: NaN propagates into both and an infinity is one of them.
    lowest, highest = (float(logprobs.min()), float(logprobs.max())) if length else (0.0, 0.0)
    if not (math.isfinite(lowest) and math.isfinite(highest)):
        position = int(np.flatnonzero(~np.isfinite(logprobs))[0])
        return "behaviour_logprobs", f"must be finite, got {float(logprobs[position])!r} at token {position}"
    # At most 0, with the wire's room for engines' rounding (common/codec.py).
    if highest > MAX_LOGPROB:
        position = int(np.argmax(logprobs))
        return "behaviour_logprobs", f"must be <= 0 (log-probabilities), got {highest!r} at token {position}"

    prompt_length = values["prompt_length"]
    if not _is_integer(prompt_length) or not 0 <= prompt_length <= length:
        return "prompt_length", f"must be an integer in 0..{length} (the trajectory's tokens), got {prompt_length!r}"
    windows = getattr(trajectory, "sample_windows", None) or []
    if not isinstance(windows, (list, tuple)):
        return "sample_windows", f"must be a list of integers, got {type(windows).__name__}"
    problem = window_problem(list(windows), loss_mask, prompt_length)
    if problem is not None:
        return "sample_windows", problem
    for name in ("num_turns", "invalid_actions"):
        if not _is_integer(values[name]) or values[name] < 0:
            return name, f"must be an integer >= 0, got {values[name]!r}"
    if values["invalid_actions"] > values["num_turns"]:
        return "invalid_actions", f"{values['invalid_actions']} is more than the {values['num_turns']} turns taken"
    for name in ("generation_seconds", "env_seconds"):
        seconds = values[name]
        if not _is_number(seconds) or not math.isfinite(float(seconds)) or seconds < 0:
            return name, f"must be a finite number >= 0, got {seconds!r}"
    return None
