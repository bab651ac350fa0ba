"""The learner's record of the actors it hears from on the control socket: who joined, which
weights each holds, when each was last heard from, and which have gone silent (lost).

Pure bookkeeping, no sockets: the learner feeds it every control message and asks it who is live
before sending anything to the actors.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator

from longhorizon.common.wire import ActorStats, Heartbeat, Hello

log = logging.getLogger(__name__)


class PeerTable:
    """What the learner knows of each actor, keyed by its identity on the control socket.

    Each entry is a dict: "last_seen" (monotonic seconds), "version" (the weights it last said it
    holds), "incarnation" ((hostname, pid) from its latest Hello), "stats" (its latest
    ActorStats), and "lost" once it has been counted lost.
    """

    def __init__(self, timeout_s: float, counters: Counter, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout_s = timeout_s
        # The learner's counters, which its checkpoints save: "actors_lost" must survive a resume.
        self.counters = counters
        self.clock = clock
        self.known: dict[str, dict] = {}
        # Episodes each actor process says it sent, kept per process: a restarted actor counts
        # from zero again.
        self.episodes_reported: dict[tuple, int] = {}

    def __len__(self) -> int:
        return len(self.known)

    def __iter__(self) -> Iterator[str]:
        return iter(self.known)

    def heard_from(self, peer: str, message: object) -> None:
        """Record one control message from `peer` (any message counts as a sign of life)."""
        info = self.known.setdefault(peer, {})
        info["last_seen"] = self.clock()
        if isinstance(message, Hello):
            info["version"] = message.policy_version
            info["incarnation"] = (message.hostname, message.pid)
            info.pop("lost", None)
            info.pop("refused_version", None)  # a new process has refused nothing yet
        elif isinstance(message, Heartbeat):
            info["version"] = message.policy_version
            info["refused_version"] = message.refused_version
            if message.pid:  # a learner restarted after the actor's Hello learns it here
                info["incarnation"] = (message.hostname, message.pid)
            self.episodes_reported[(peer, info.get("incarnation"))] = message.episodes_done
            info.pop("lost", None)
        elif isinstance(message, ActorStats):
            info["stats"] = message

    def live(self) -> list[str]:
        """Actors heard from within `timeout_s`; the others are reported (and counted) lost once."""
        now = self.clock()
        live = []
        for peer, info in self.known.items():
            if now - info.get("last_seen", 0.0) <= self.timeout_s:
                live.append(peer)
            elif not info.get("lost"):
                info["lost"] = True
                self.counters["actors_lost"] += 1
                log.warning(
                    "actor %s silent for %.0fs: counted as lost (a restarted actor rejoins with Hello)",
                    peer, now - info.get("last_seen", 0.0),
                )
        return live

    def describe_live(self) -> str:
        """The live actors for a progress note, or why there are none: none has connected yet
        (an actor connects once its engine has started, which for vLLM takes a minute or more),
        or those that had are silent."""
        live = self.live()
        if live:
            return ", ".join(sorted(live))
        if not self.known:
            return "none has connected yet (an actor connects once its engine has started; see logs/actor-*.log)"
        return f"none ({len(self.known)} gone silent; see logs/actor-*.log)"

    def version_of(self, peer: str) -> int | None:
        """The weights version `peer` last said it holds (None before it said)."""
        return self.known[peer].get("version")

    def refused_version_of(self, peer: str) -> int:
        """The newest weights version `peer`'s engine refused (-1: none, or not said yet)."""
        return self.known[peer].get("refused_version", -1)

    def stats_total(self, field: str) -> float:
        """An ActorStats field summed over the actors' latest stats (an actor restarted since
        counts from zero again)."""
        return sum(getattr(info["stats"], field) for info in self.known.values() if "stats" in info)

    def last_seen(self, peer: str) -> float:
        return self.known[peer].get("last_seen", 0.0)

    def episodes_reported_total(self) -> int:
        """Episodes the actors said they sent, summed over every actor process seen."""
        return sum(self.episodes_reported.values())
