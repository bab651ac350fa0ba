"""The learner's peer table on its own: who joined, which version each holds, who went silent."""

from collections import Counter

from longhorizon.common.wire import ActorStats, Heartbeat, Hello
from longhorizon.learner.peers import PeerTable


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _hello(actor_id: str, pid: int, version: int) -> Hello:
    return Hello(actor_id=actor_id, pid=pid, hostname="host", policy_version=version, engine="scripted")


def _heartbeat(actor_id: str, version: int, episodes: int) -> Heartbeat:
    return Heartbeat(actor_id=actor_id, policy_version=version, episodes_done=episodes, time=0.0)


def test_versions_follow_hello_then_heartbeats():
    peers = PeerTable(timeout_s=30.0, counters=Counter(), clock=FakeClock())
    peers.heard_from("a", _hello("a", pid=1, version=0))
    assert peers.version_of("a") == 0
    peers.heard_from("a", _heartbeat("a", version=3, episodes=5))
    assert peers.version_of("a") == 3
    stats = ActorStats(actor_id="a", episodes_done=5, episodes_per_s=1.0, generated_tokens_per_s=2.0,
                       mean_generation_seconds=0.1, mean_env_seconds=0.2, errors=0)
    peers.heard_from("a", stats)
    assert peers.version_of("a") == 3 and peers.known["a"]["stats"] is stats
    assert list(peers) == ["a"] and len(peers) == 1


def test_a_silent_actor_is_counted_lost_once_and_back_when_it_speaks():
    clock, counters = FakeClock(), Counter()
    peers = PeerTable(timeout_s=30.0, counters=counters, clock=clock)
    peers.heard_from("a", _hello("a", pid=1, version=0))
    peers.heard_from("b", _hello("b", pid=2, version=0))
    clock.now += 20.0
    peers.heard_from("a", _heartbeat("a", version=0, episodes=1))
    clock.now += 15.0  # b last heard 35 s ago, a 15 s ago
    assert peers.live() == ["a"]
    assert peers.live() == ["a"]
    assert counters["actors_lost"] == 1
    assert peers.last_seen("b") == 100.0
    peers.heard_from("b", _heartbeat("b", version=0, episodes=2))
    assert peers.live() == ["a", "b"] and "lost" not in peers.known["b"]
    clock.now += 31.0
    assert peers.live() == [] and counters["actors_lost"] == 3


def test_episodes_reported_are_kept_per_actor_process():
    peers = PeerTable(timeout_s=30.0, counters=Counter(), clock=FakeClock())
    peers.heard_from("a", _hello("a", pid=1, version=0))
    peers.heard_from("a", _heartbeat("a", version=0, episodes=7))
    # The actor restarts under the same identity: its count starts again, the old one is kept.
    peers.heard_from("a", _hello("a", pid=2, version=0))
    peers.heard_from("a", _heartbeat("a", version=0, episodes=2))
    peers.heard_from("a", _heartbeat("a", version=0, episodes=4))
    assert peers.episodes_reported_total() == 11


def test_the_waiting_note_says_why_no_actor_is_live():
    clock = FakeClock()
    peers = PeerTable(timeout_s=30.0, counters=Counter(), clock=clock)
    assert peers.describe_live().startswith("none has connected yet (an actor connects once its engine has started")
    peers.heard_from("b", _hello("b", pid=2, version=0))
    peers.heard_from("a", _hello("a", pid=1, version=0))
    assert peers.describe_live() == "a, b"
    clock.now += 31.0
    assert peers.describe_live() == "none (2 gone silent; see logs/actor-*.log)"


def test_a_restarted_learner_counts_a_live_actors_episodes_once():
    """A learner restored from a checkpoint holds each actor process's last report; a live actor
    says no Hello to the new learner, and its heartbeats (which name its process) replace its
    entry rather than adding a second one."""
    peers = PeerTable(timeout_s=30.0, counters=Counter(), clock=FakeClock())
    peers.episodes_reported.update({("a", ("host", 1)): 40, ("a", ("host", 0)): 5})  # the old process before it
    peers.heard_from("a", Heartbeat(actor_id="a", policy_version=0, episodes_done=52, time=0.0, pid=1, hostname="host"))
    assert peers.episodes_reported_total() == 57
