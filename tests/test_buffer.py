"""Group buffer: staleness off-by-one, completion and timeouts, de-duplication, memory bound."""

import dataclasses
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import pytest

from longhorizon.learner.buffer import Group, GroupBuffer, staleness


@dataclass
class StandInTrajectory:
    """The fields of the wire Trajectory that the buffer reads; the per-token arrays left out are
    made to match the loss mask (token ids 0, behaviour log-probs 0)."""

    trajectory_id: str
    group_id: str
    group_size: int
    reward: float
    loss_mask: np.ndarray
    policy_versions: np.ndarray
    token_ids: np.ndarray | None = None
    behaviour_logprobs: np.ndarray | None = None
    prompt_length: int = 0
    turn_rewards: list = field(default_factory=list)
    num_turns: int = 1
    invalid_actions: int = 0
    generation_seconds: float = 0.0
    env_seconds: float = 0.0

    def __post_init__(self) -> None:
        length = len(np.atleast_1d(self.loss_mask))
        if self.token_ids is None:
            self.token_ids = np.zeros(length, np.int32)
        if self.behaviour_logprobs is None:
            self.behaviour_logprobs = np.zeros(length, np.float32)


def trajectory(
    trajectory_id: str,
    group_id: str,
    *,
    versions: list[int],
    group_size: int = 2,
    reward: float = 0.0,
) -> StandInTrajectory:
    """A trajectory whose tokens have the given policy versions; -1 marks a non-generated token."""
    policy_versions = np.array(versions, dtype=np.int32)
    return StandInTrajectory(
        trajectory_id=trajectory_id,
        group_id=group_id,
        group_size=group_size,
        reward=reward,
        loss_mask=(policy_versions >= 0).astype(np.uint8),
        policy_versions=policy_versions,
    )


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_buffer(max_staleness: int = 0, **options) -> tuple[GroupBuffer, FakeClock]:
    clock = FakeClock()
    options.setdefault("group_timeout_s", 30.0)
    return GroupBuffer(max_staleness, clock=clock, **options), clock


# ---------------------------------------------------------------------------------------------
# staleness()


def test_staleness_counts_from_the_oldest_generated_token():
    # Prompt (-1), a segment by version 3, an observation (-1), a segment by version 5.
    versions = np.array([-1, 3, 3, -1, 5, 5], dtype=np.int32)
    mask = (versions >= 0).astype(np.uint8)
    assert staleness(5, versions, mask) == 2
    assert staleness(3, versions, mask) == 0
    # Made by weights newer than the learner's: reported as negative, not hidden.
    assert staleness(2, versions, mask) == -1


def test_staleness_ignores_tokens_outside_the_loss_mask():
    versions = np.array([1, 4, 4], dtype=np.int32)
    # Token 0 has a version but is not counted (e.g. a masked-out retry).
    assert staleness(4, versions, np.array([0, 1, 1], dtype=np.uint8)) == 0


def test_staleness_without_generated_tokens_is_zero():
    versions = np.array([-1, -1], dtype=np.int32)
    assert staleness(7, versions, np.zeros(2, dtype=np.uint8)) == 0


def test_staleness_refuses_bad_arrays():
    with pytest.raises(ValueError, match="no policy version"):
        staleness(3, np.array([-1, 2]), np.array([1, 1]))
    with pytest.raises(ValueError, match="same length"):
        staleness(3, np.array([1, 2, 3]), np.array([1, 1]))


# ---------------------------------------------------------------------------------------------
# The staleness bound, off-by-one


def test_max_staleness_zero_uses_version_v_only_at_learner_version_v():
    buffer, _ = make_buffer(max_staleness=0)
    for member in ("a", "b"):
        buffer.add(trajectory(member, "g", versions=[-1, 4, 4]), learner_version=4)
    assert buffer.pop_ready(8, learner_version=5) == []
    assert buffer.counters["dropped_stale_groups"] == 1
    assert len(buffer) == 0

    buffer.add(trajectory("c", "h", versions=[4]), learner_version=5)
    assert buffer.counters["dropped_stale_trajectories"] == 1

    for member in ("d", "e"):
        buffer.add(trajectory(member, "k", versions=[4]), learner_version=4)
    groups = buffer.pop_ready(8, learner_version=4)
    assert [group.group_id for group in groups] == ["k"]
    assert buffer.staleness_histogram == {0: 2}


def test_max_staleness_two_allows_exactly_two_versions_of_lag():
    buffer, _ = make_buffer(max_staleness=2)
    buffer.add(trajectory("a", "g", versions=[4]), learner_version=6)
    buffer.add(trajectory("b", "g", versions=[5]), learner_version=6)
    buffer.add(trajectory("c", "h", versions=[4]), learner_version=7)
    assert buffer.counters["accepted"] == 2
    assert buffer.counters["dropped_stale_trajectories"] == 1
    [group] = buffer.pop_ready(8, learner_version=6)
    assert group.member_staleness(6) == [2, 1]
    assert group.staleness(6) == 2
    assert buffer.staleness_histogram == {2: 1, 1: 1}


def test_group_staleness_is_that_of_its_stalest_member():
    buffer, _ = make_buffer(max_staleness=1)
    buffer.add(trajectory("old", "g", versions=[3, 4]), learner_version=4)
    buffer.add(trajectory("new", "g", versions=[4, 4]), learner_version=4)
    # At version 5 the member that started with version 3 is 2 behind: the whole group goes.
    assert buffer.pop_ready(8, learner_version=5) == []
    assert buffer.counters["dropped_stale_groups"] == 1


def test_trajectory_from_newer_weights_is_dropped():
    buffer, _ = make_buffer(max_staleness=4)
    buffer.add(trajectory("a", "g", versions=[9]), learner_version=8)
    assert buffer.counters["dropped_future_trajectories"] == 1
    assert len(buffer) == 0


# ---------------------------------------------------------------------------------------------
# Completion, timeouts, order


def test_complete_groups_come_out_oldest_first():
    buffer, clock = make_buffer(max_staleness=1)
    buffer.add(trajectory("a1", "first", versions=[0], reward=1.0), learner_version=0)
    clock.now += 1
    buffer.add(trajectory("b1", "second", versions=[0], reward=0.5), learner_version=0)
    buffer.add(trajectory("b2", "second", versions=[0], reward=0.0), learner_version=0)
    # "second" is complete but "first" is not: only "second" is ready.
    assert [group.group_id for group in buffer.pop_ready(8, learner_version=0)] == ["second"]

    buffer.add(trajectory("c1", "third", versions=[0]), learner_version=0)
    buffer.add(trajectory("c2", "third", versions=[0]), learner_version=0)
    buffer.add(trajectory("a2", "first", versions=[0], reward=0.0), learner_version=0)
    # Both complete now; "first" arrived first, and max_groups=1 leaves "third" for later.
    [group] = buffer.pop_ready(1, learner_version=0)
    assert group.group_id == "first"
    np.testing.assert_array_equal(group.rewards, [1.0, 0.0])
    assert len(buffer) == 2
    assert [group.group_id for group in buffer.pop_ready(1, learner_version=1)] == ["third"]
    assert buffer.counters["returned_groups"] == 3
    assert buffer.counters["returned_trajectories"] == 6


def test_incomplete_group_waits_for_the_timeout_then_comes_out_partial_when_kept():
    buffer, clock = make_buffer(group_timeout_s=30.0, partial_groups="keep")
    buffer.add(trajectory("a", "g", versions=[0], group_size=4), learner_version=0)
    buffer.add(trajectory("b", "g", versions=[0], group_size=4), learner_version=0)
    clock.now += 29.9
    assert buffer.pop_ready(8, learner_version=0) == []
    clock.now += 0.1
    [group] = buffer.pop_ready(8, learner_version=0)
    assert len(group.trajectories) == 2 and not group.is_complete
    assert buffer.counters["returned_partial_groups"] == 1


def test_timed_out_group_with_too_few_members_is_dropped():
    buffer, clock = make_buffer(group_timeout_s=10.0, min_group_size_on_timeout=2, partial_groups="keep")
    buffer.add(trajectory("a", "g", versions=[0], group_size=4), learner_version=0)
    clock.now += 10.0
    assert buffer.pop_ready(8, learner_version=0) == []
    assert buffer.counters["dropped_incomplete_groups"] == 1
    assert buffer.pending_groups == 0


def test_members_refused_as_stale_are_not_waited_for_when_partial_groups_are_kept():
    buffer, _ = make_buffer(max_staleness=1, partial_groups="keep")
    buffer.add(trajectory("stale", "g", versions=[0], group_size=3), learner_version=2)
    buffer.add(trajectory("a", "g", versions=[2], group_size=3), learner_version=2)
    buffer.add(trajectory("b", "g", versions=[2], group_size=3), learner_version=2)
    # All three accounted for, two usable: ready at once, no timeout needed.
    [group] = buffer.pop_ready(8, learner_version=2)
    assert [member.trajectory_id for member in group.trajectories] == ["a", "b"]

    buffer.add(trajectory("stale1", "h", versions=[0], group_size=2), learner_version=2)
    buffer.add(trajectory("fresh", "h", versions=[2], group_size=2), learner_version=2)
    # One usable member is below the minimum of 2.
    assert buffer.pop_ready(8, learner_version=2) == []
    assert buffer.counters["dropped_incomplete_groups"] == 1


def test_partial_groups_are_dropped_by_default_and_counted():
    buffer, clock = make_buffer(group_timeout_s=30.0)
    assert buffer.partial_groups == "drop"
    # Timed out with two of four members: dropped, not released with a biased baseline.
    buffer.add(trajectory("a", "g", versions=[0], group_size=4), learner_version=0)
    buffer.add(trajectory("b", "g", versions=[0], group_size=4), learner_version=0)
    clock.now += 30.0
    assert buffer.pop_ready(8, learner_version=0) == []
    assert buffer.counters["dropped_partial_groups"] == 1
    assert buffer.counters["returned_partial_groups"] == 0
    assert buffer.pending_groups == 0
    # The missing members arriving afterwards are late, not a new group.
    buffer.add(trajectory("c", "g", versions=[0], group_size=4), learner_version=0)
    assert buffer.counters["dropped_late_trajectories"] == 1 and buffer.pending_groups == 0


def test_a_member_refused_as_stale_drops_its_group_at_once_by_default():
    buffer, _ = make_buffer(max_staleness=1)
    buffer.add(trajectory("a", "g", versions=[2], group_size=3), learner_version=2)
    buffer.add(trajectory("b", "g", versions=[2], group_size=3), learner_version=2)
    buffer.add(trajectory("stale", "g", versions=[0], group_size=3), learner_version=2)
    # The long, late episode was refused: the group can never be whole, so it goes, no timeout.
    assert buffer.pop_ready(8, learner_version=2) == []
    assert buffer.counters["dropped_stale_trajectories"] == 1
    assert buffer.counters["dropped_partial_groups"] == 1


def test_trajectories_longer_than_the_budget_are_refused_and_their_group_is_partial():
    buffer, _ = make_buffer(max_tokens=4)
    buffer.add(trajectory("short", "g", versions=[-1, 0, 0, 0]), learner_version=0)
    buffer.add(trajectory("long", "g", versions=[-1, 0, 0, 0, 0]), learner_version=0)
    assert buffer.counters["dropped_too_long"] == 1
    assert buffer.counters["accepted"] == 1
    assert buffer.pop_ready(8, learner_version=0) == []
    assert buffer.counters["dropped_partial_groups"] == 1
    with pytest.raises(ValueError, match="max_tokens"):
        make_buffer(max_tokens=0)


def test_give_up_waiting_treats_incomplete_groups_as_timed_out():
    for policy, released in (("drop", 0), ("keep", 1)):
        buffer, _ = make_buffer(group_timeout_s=600.0, partial_groups=policy)
        buffer.add(trajectory("a", "g", versions=[0], group_size=3), learner_version=0)
        buffer.add(trajectory("b", "g", versions=[0], group_size=3), learner_version=0)
        assert buffer.pop_ready(8, learner_version=0) == []
        assert len(buffer.pop_ready(8, learner_version=0, give_up_waiting=True)) == released
        assert buffer.pending_groups == 0


def test_zero_variance_groups_are_not_filtered():
    buffer, _ = make_buffer()
    buffer.add(trajectory("a", "g", versions=[0], reward=1.0), learner_version=0)
    buffer.add(trajectory("b", "g", versions=[0], reward=1.0), learner_version=0)
    [group] = buffer.pop_ready(8, learner_version=0)
    np.testing.assert_array_equal(group.rewards, [1.0, 1.0])


# ---------------------------------------------------------------------------------------------
# Refusals


def test_duplicates_and_late_arrivals_are_counted_not_kept():
    buffer, _ = make_buffer()
    buffer.add(trajectory("a", "g", versions=[0]), learner_version=0)
    buffer.add(trajectory("a", "g", versions=[0]), learner_version=0)
    assert buffer.counters["duplicates"] == 1
    assert len(buffer) == 1
    buffer.add(trajectory("b", "g", versions=[0]), learner_version=0)
    assert len(buffer.pop_ready(8, learner_version=0)) == 1
    # Re-sent after its group left: still a duplicate. A new member of that group: late.
    buffer.add(trajectory("b", "g", versions=[0]), learner_version=0)
    buffer.add(trajectory("c", "g", versions=[0]), learner_version=0)
    assert buffer.counters["duplicates"] == 2
    assert buffer.counters["dropped_late_trajectories"] == 1
    assert len(buffer) == 0 and buffer.pending_groups == 0


def test_more_members_than_the_group_size_are_refused():
    buffer, _ = make_buffer()
    for member in ("a", "b"):
        buffer.add(trajectory(member, "g", versions=[0], group_size=2), learner_version=0)
    buffer.add(trajectory("c", "g", versions=[0], group_size=2), learner_version=0)
    assert buffer.counters["dropped_overfull"] == 1
    assert len(buffer) == 2


@pytest.mark.parametrize(
    "bad, field",
    [
        (object(), "trajectory_id"),
        (StandInTrajectory("x", "g", 2, float("nan"), np.ones(1, np.uint8), np.zeros(1, np.int32)), "reward"),
        (StandInTrajectory("x", "g", 0, 1.0, np.ones(1, np.uint8), np.zeros(1, np.int32)), "group_size"),
        (StandInTrajectory("", "g", 2, 1.0, np.ones(1, np.uint8), np.zeros(1, np.int32)), "trajectory_id"),
        (StandInTrajectory("x", "g", 2, 1.0, np.ones(2, np.uint8), np.zeros(1, np.int32)), "policy_versions"),
        (StandInTrajectory("x", "g", 2, 1.0, np.ones(1, np.uint8), np.full(1, -1, np.int32)), "policy_versions"),
        (StandInTrajectory("x", "g", 2, 1.0, np.ones(1, np.uint8), np.zeros(1, np.float32)), "policy_versions"),
    ],
    ids=[
        "no-fields", "nan-reward", "empty-group", "no-id", "ragged", "unversioned", "float-versions"
    ],
)
def test_malformed_trajectories_are_counted_not_raised(bad, field):
    buffer, _ = make_buffer()
    buffer.add(bad, learner_version=0)
    assert buffer.counters["dropped_malformed"] == 1
    assert buffer.refused_fields == {field: 1}
    assert len(buffer) == 0


def test_a_flood_of_refusals_logs_one_line_with_the_count(caplog):
    buffer, _ = make_buffer(vocab_size=10)
    with caplog.at_level("WARNING", logger="longhorizon.learner.buffer"):
        for index in range(200):
            bad = trajectory(f"t{index}", f"g{index}", versions=[-1, 0])
            bad.token_ids = np.array([3, 99])  # outside the vocabulary of 10
            buffer.add(bad, learner_version=0)
    assert buffer.counters["dropped_malformed"] == 200
    warnings = [record for record in caplog.records if record.levelname == "WARNING"]
    assert len(warnings) == 1
    assert "outside the model's vocabulary" in warnings[0].getMessage()


def test_group_size_disagreement_is_malformed():
    buffer, _ = make_buffer()
    buffer.add(trajectory("a", "g", versions=[0], group_size=4), learner_version=0)
    buffer.add(trajectory("b", "g", versions=[0], group_size=2), learner_version=0)
    assert buffer.counters["dropped_malformed"] == 1
    assert buffer.refused_fields == {"group_size": 1}
    assert len(buffer) == 1


# ---------------------------------------------------------------------------------------------
# Memory bound and construction


def test_pending_groups_are_bounded_by_dropping_the_oldest_incomplete():
    buffer, _ = make_buffer(max_pending_groups=2)
    buffer.add(trajectory("a1", "complete", versions=[0]), learner_version=0)
    buffer.add(trajectory("a2", "complete", versions=[0]), learner_version=0)
    buffer.add(trajectory("b1", "waiting", versions=[0]), learner_version=0)
    buffer.add(trajectory("c1", "newest", versions=[0]), learner_version=0)
    assert buffer.counters["dropped_overflow_groups"] == 1
    assert buffer.pending_groups == 2
    # "waiting" was the oldest incomplete group; its straggler is now late.
    buffer.add(trajectory("b2", "waiting", versions=[0]), learner_version=0)
    assert buffer.counters["dropped_late_trajectories"] == 1
    assert [group.group_id for group in buffer.pop_ready(8, learner_version=0)] == ["complete"]


def test_pop_ready_zero_and_negative():
    buffer, _ = make_buffer()
    buffer.add(trajectory("a", "g", versions=[0]), learner_version=0)
    buffer.add(trajectory("b", "g", versions=[0]), learner_version=0)
    assert buffer.pop_ready(0, learner_version=0) == []
    assert len(buffer) == 2
    with pytest.raises(ValueError, match="max_groups"):
        buffer.pop_ready(-1, learner_version=0)


@pytest.mark.parametrize(
    "arguments, message",
    [
        ({"max_staleness": -1, "group_timeout_s": 1.0}, "max_staleness"),
        ({"max_staleness": 0, "group_timeout_s": 0.0}, "group_timeout_s"),
        ({"max_staleness": 0, "group_timeout_s": 1.0, "min_group_size_on_timeout": 0}, "min_group"),
        ({"max_staleness": 0, "group_timeout_s": 1.0, "max_pending_groups": 0}, "max_pending"),
        ({"max_staleness": 0, "group_timeout_s": 1.0, "partial_groups": "some"}, "partial_groups"),
        ({"max_staleness": 0, "group_timeout_s": 1.0, "max_abs_reward": 0.0}, "max_abs_reward"),
        ({"max_staleness": 0, "group_timeout_s": 1.0, "max_abs_reward": float("inf")}, "max_abs_reward"),
        ({"max_staleness": 0, "group_timeout_s": 1.0, "max_abs_reward": 1e13}, "max_abs_reward"),
    ],
)
def test_constructor_validation(arguments, message):
    with pytest.raises(ValueError, match=message):
        GroupBuffer(**arguments)


def test_group_rewards_property():
    members = [
        trajectory("a", "g", versions=[1], reward=0.25),
        trajectory("b", "g", versions=[-1, 3], reward=1.0),
    ]
    group = Group("g", members, group_size=3)
    np.testing.assert_array_equal(group.rewards, [0.25, 1.0])
    assert group.rewards.dtype == np.float64
    assert not group.is_complete
    assert group.member_staleness(3) == [2, 0]
    assert group.staleness(3) == 2


def test_token_ids_outside_the_vocabulary_are_refused_as_malformed():
    buffer, _ = make_buffer(vocab_size=100)
    inside = trajectory("t0", "g", versions=[-1, 0, 0])
    buffer.add(dataclasses.replace(inside, token_ids=np.array([5, 99, 0])), learner_version=0)
    assert buffer.counters["accepted"] == 1
    for ids in ([5, 100, 0], [5, -3, 0]):
        bad = trajectory(f"t{ids[1]}", "g", versions=[-1, 0, 0])
        buffer.add(dataclasses.replace(bad, token_ids=np.array(ids)), learner_version=0)
    assert buffer.counters["dropped_malformed"] == 2
    assert buffer.counters["accepted"] == 1
    # A trajectory without token ids cannot be checked: malformed, not an exception.
    fields = vars(trajectory("t9", "g", versions=[-1, 0]))
    buffer.add(SimpleNamespace(**{k: v for k, v in fields.items() if k != "token_ids"}), learner_version=0)
    assert buffer.counters["dropped_malformed"] == 3
    assert buffer.refused_fields == {"token_ids": 3}


def test_vocab_size_must_be_positive():
    with pytest.raises(ValueError, match="vocab_size"):
        make_buffer(vocab_size=0)


def test_every_trajectory_is_counted_once_under_random_traffic():
    """Duplicates, stale, over-long, late and malformed arrivals, timeouts and overflow, in a
    random order: what came in is always accepted or refused for one counted reason, and what
    was accepted is returned, dropped with its group, or still held."""
    refusals = (
        "duplicates", "dropped_malformed", "dropped_too_long", "dropped_stale_trajectories",
        "dropped_future_trajectories", "dropped_late_trajectories", "dropped_overfull",
    )
    rng = np.random.default_rng(0)
    for policy in ("drop", "keep"):
        buffer, clock = make_buffer(
            max_staleness=2, group_timeout_s=5.0, partial_groups=policy, max_pending_groups=6, max_tokens=6,
        )
        version, sent_ids = 0, []
        for _ in range(3000):
            choice = rng.random()
            if choice < 0.1 and sent_ids:
                buffer.add(trajectory(sent_ids[rng.integers(len(sent_ids))], "g0", versions=[version]),
                           learner_version=version)  # a re-sent duplicate
            elif choice < 0.15:
                buffer.add(StandInTrajectory("", "g", 2, 0.0, np.ones(1), np.zeros(1)), learner_version=version)
            else:
                group = f"g{len(sent_ids) // 3 + int(rng.integers(0, 4))}"  # a sliding window of groups
                length = int(rng.integers(1, 9))  # some longer than max_tokens
                born = version - int(rng.integers(0, 5)) + int(rng.random() < 0.02)  # stale, or from the future
                identity = f"t{len(sent_ids)}"
                sent_ids.append(identity)
                buffer.add(trajectory(identity, group, versions=[-1] + [born] * length, group_size=3),
                           learner_version=version)
            if rng.random() < 0.05:
                clock.now += float(rng.uniform(0, 4))
            if rng.random() < 0.05:
                buffer.pop_ready(int(rng.integers(0, 3)), learner_version=version)
                version += int(rng.random() < 0.5)
            counters = buffer.counters
            assert counters["received"] == counters["accepted"] + sum(counters[name] for name in refusals)
            assert sum(buffer.refused_fields.values()) == counters["dropped_malformed"]
            assert counters["accepted"] == (
                counters["returned_trajectories"] + counters["dropped_group_trajectories"] + len(buffer)
            )
        assert [name for name in (*refusals, "returned_trajectories") if buffer.counters[name] == 0] == []


def test_dropped_groups_are_counted_by_the_version_that_made_them():
    buffer, clock = make_buffer(max_staleness=1, group_timeout_s=5.0)
    buffer.add(trajectory("a", "g2", versions=[-1, 2, 2], group_size=2), learner_version=3)
    buffer.add(trajectory("b", "g3", versions=[-1, 3], group_size=2), learner_version=3)
    buffer.add(trajectory("c", "g1", versions=[-1, 1], group_size=2), learner_version=3)  # stale: opens, refused
    clock.now += 5.0
    assert buffer.pop_ready(8, learner_version=3) == []
    assert dict(buffer.dropped_groups_by_version) == {1: 1, 2: 1, 3: 1}


# ---------------------------------------------------------------------------------------------
# staleness judged per token


def test_tokens_within_staleness_keeps_the_generated_tokens_inside_the_bound():
    from longhorizon.learner.buffer import tokens_within_staleness

    # Prompt, turn 1 by v2, an observation, turn 2 by v4, turn 3 by v6; the learner at v7, bound 3:
    # lags 5, 3, 1, so turn 1 leaves the loss and turns 2 and 3 stay.
    versions = np.array([-1, -1, 2, 2, -1, 4, 4, 6], np.int32)
    mask = (versions >= 0).astype(np.uint8)
    kept = tokens_within_staleness(7, versions, mask, 3)
    assert kept.tolist() == [0, 0, 0, 0, 0, 1, 1, 1] and kept.dtype == np.uint8
    assert tokens_within_staleness(7, versions, mask, 5).tolist() == mask.tolist()
    assert tokens_within_staleness(7, versions, mask, 0).tolist() == [0] * 8
    assert mask.tolist() == [0, 0, 1, 1, 0, 1, 1, 1]  # the input is left alone


def _two_turn_group(group_id: str = "g"):
    """Two members whose first turn was played by v0 and second by v3."""
    return [trajectory(f"{group_id}{i}", group_id, versions=[-1, 0, 0, -1, 3, 3]) for i in range(2)]


def test_per_token_staleness_trains_the_recent_turns_of_an_episode_per_episode_staleness_drops():
    # At v4 with a bound of 2: the first turn's lag is 4, the second's 1.
    for unit, expected_groups in (("episode", 0), ("token", 1)):
        buffer, _ = make_buffer(max_staleness=2, staleness_unit=unit)
        for member in _two_turn_group():
            buffer.add(member, learner_version=4)
        ready = buffer.pop_ready(4, learner_version=4)
        assert len(ready) == expected_groups, unit
        if unit == "episode":
            assert buffer.counters["dropped_stale_trajectories"] == 2
            continue
        for member in ready[0].trajectories:
            assert member.loss_mask.tolist() == [0, 0, 0, 0, 1, 1]
        assert buffer.counters["stale_tokens_masked"] == 4 and buffer.counters["returned_trajectories"] == 2
        assert buffer.staleness_histogram == {1: 2}  # the lag of what is trained
    # The trajectories as received keep their masks (a copy is trimmed).
    members = _two_turn_group("h")
    buffer, _ = make_buffer(max_staleness=2, staleness_unit="token")
    for member in members:
        buffer.add(member, learner_version=4)
    buffer.pop_ready(4, learner_version=4)
    assert all(member.loss_mask.tolist() == [0, 1, 1, 0, 1, 1] for member in members)


def test_per_token_staleness_still_refuses_an_episode_with_no_token_inside_the_bound():
    buffer, _ = make_buffer(max_staleness=2, staleness_unit="token")
    buffer.add(trajectory("a", "g", versions=[-1, 0, 3]), learner_version=4)
    buffer.add(trajectory("b", "g", versions=[-1, 0, 1]), learner_version=4)  # newest lag 3 > 2
    assert buffer.counters["dropped_stale_trajectories"] == 1 and buffer.counters["accepted"] == 1
    # A held member whose every token goes stale while it waits takes its group with it.
    buffer, _ = make_buffer(max_staleness=2, staleness_unit="token")
    for member in _two_turn_group():
        buffer.add(member, learner_version=4)
    assert buffer.pop_ready(4, learner_version=6) == []  # newest lag 3
    assert buffer.counters["dropped_stale_groups"] == 1 and buffer.counters["stale_tokens_masked"] == 0


def test_an_unknown_staleness_unit_is_refused():
    with pytest.raises(ValueError, match="staleness_unit must be one of episode, token"):
        make_buffer(staleness_unit="turn")


def test_the_launcher_refuses_per_token_staleness_with_a_score_that_reads_every_token():
    from longhorizon.common.config import ConfigError, load_config
    from longhorizon.launch.checks import validate_config

    base = ["env.name='codebook'", "actor.engine='scripted'", "learner.staleness_unit='token'"]
    validate_config(load_config(None, base))  # grpo scores by the final reward alone
    validate_config(load_config(None, [*base, "learner.algorithm='dapo'"]))
    for refused in (["learner.algorithm='ppo'"],
                    ["learner.algorithm='dapo'", "learner.overlong_max_tokens=64", "learner.overlong_buffer_tokens=16"],
                    ["learner.step_credit='anchor_states'"]):  # its turns are the runs of generated tokens
        with pytest.raises(ConfigError, match='staleness_unit = "token" takes an episode'):
            validate_config(load_config(None, [*base, *refused]))
    with pytest.raises(ConfigError, match="learner.staleness_unit must be one of episode, token, got 'turn'"):
        validate_config(load_config(None, ["env.name='codebook'", "learner.staleness_unit='turn'"]))
