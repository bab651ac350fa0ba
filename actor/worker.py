"""The actor: plays GRPO groups on its shard of tasks and streams trajectories to the learner.

It runs many episodes at once under trio, loads new weights as the learner broadcasts them
(tagging every generated turn with the version that wrote it), applies the horizon cap in force
when each episode starts, and answers control messages. In `async` mode it waits for the
learner only to start no group the learner could not train within `max_staleness` (pacing, from
the backlog the learner publishes); in `sync` mode it generates its share of one batch with the
current weights, then waits for the next version (the synchronous baseline).
"""

from __future__ import annotations

import logging
import math
import os
import random
import socket
import time
from dataclasses import dataclass
from typing import Any

import trio

from longhorizon.actor.engines.base import Engine
# engine_settings is re-exported: recipes and tests import it from here.
from longhorizon.actor.engines.factory import build_engine, engine_settings  # noqa: F401
from longhorizon.actor.rollout import AgentLoopSettings, EnvPool, run_group, run_group_member
from longhorizon.common.config import Config
from longhorizon.common.collective import CollectiveError
from longhorizon.common.models import WeightsRefused
from longhorizon.common.plugins import Registry
from longhorizon.common.wire import (
    ActorStats, Backlog, CollectiveWeights, Heartbeat, Hello, HorizonUpdate, Stop, Trajectory, WeightsUpdate,
)
from longhorizon.envs.base import list_tasks, make_env

log = logging.getLogger(__name__)

_ADMISSION_CHECK_S = 0.5


class ActorRefused(RuntimeError):
    """The learner refused this actor's connection (its run secret or CurveZMQ keys): a restart
    with the same credentials would be refused again."""


class SyncVersionRefused(RuntimeError):
    """Sync mode: the engine refused the weights of the version whose batch this actor must play,
    and no other version will come until that batch is trained: the actor cannot go on."""


def group_would_be_trainable(backlog: Backlog | None, *, held_version: int, unsent_members: int,
                             sent_since_backlog: int, group_size: int, groups_per_step: int,
                             max_staleness: int) -> bool:
    """Whether a group this actor starts now could still be trained within `max_staleness`.

    The learner trains `groups_per_step` groups a step, oldest first. Ahead of a new group wait
    the trajectories the learner reported (`backlog.waiting_trajectories`) and what every live
    actor has made or is making since that report, taken as this actor's share times the number
    of actors (its members sent since the report and those not yet sent). Counted in groups, the
    new one is trained after ahead // groups_per_step more steps, so its staleness then is those
    steps plus how far the weights it is played with already lag the learner's. No report yet:
    nothing to go by, so yes.
    """
    if backlog is None:
        return True
    lag = max(0, backlog.learner_version - held_version)
    own = max(0, unsent_members) + sent_since_backlog
    ahead_groups = (backlog.waiting_trajectories + backlog.live_actors * own) // group_size
    return lag + ahead_groups // groups_per_step <= max_staleness


def sync_share(groups_per_step: int, num_actors: int, actor_index: int) -> int:
    """Groups actor `actor_index` generates per learner step in sync mode (the batch split evenly)."""
    base, extra = divmod(groups_per_step, num_actors)
    return base + (1 if actor_index < extra else 0)


@dataclass
class _Counters:
    episodes: int = 0
    generated_tokens: int = 0
    generation_seconds: float = 0.0
    env_seconds: float = 0.0
    errors: int = 0
    weights_refused: int = 0
    """Weight updates the engine refused (they did not fit its model; it kept the version it had)."""
    newest_refused_version: int = -1
    """The newest version among them (-1: none), told to the learner in every heartbeat."""
    last_refusal: str = ""
    paced_seconds: float = 0.0
    """Time spent not starting groups the learner could not have trained in time (pacing)."""


class Actor:
    def __init__(self, config: Config, actor_index: int, endpoints, engine: Engine) -> None:
        self.config = config
        self.actor_index = actor_index
        self.actor_id = f"actor-{actor_index}"
        self.endpoints = endpoints
        self.engine = engine
        env_options = dict(config.env.options)
        tasks = list_tasks(config.env.name, config.env.train_split, **env_options)
        num_actors = max(1, config.actor.num_actors)
        self.tasks = tasks[actor_index::num_actors] or tasks
        self.env_pool = EnvPool(lambda: make_env(config.env.name, **env_options))
        self.rng = random.Random(f"{config.run.seed}-{actor_index}")
        self.horizon: HorizonUpdate | None = None
        self.changed = trio.Event()  # set (and replaced) whenever horizon or weights change
        self.counters = _Counters()
        self.started = time.monotonic()
        self.groups_started = 0
        self.last_sync_version = -1  # sync mode: the version whose share was generated last
        self.backlog: Backlog | None = None  # the learner's latest report of what waits to be trained
        self.sent_since_backlog = 0  # trajectories sent since that report
        self.slots_paced, self.paced_since = 0, 0.0  # rollout slots held back now, since when

    def _notify(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> str:
        """Run until the learner says stop (returns its reason) or the caller cancels."""
        stop_reason = ""
        # Collective weights are announced on the control socket and received by one task in
        # turn, so the control loop stays free for Stop while the bytes arrive.
        announced_weights, announcements = trio.open_memory_channel(math.inf)
        try:
            async with trio.open_nursery() as nursery:
                # Watching from before the first send: a refused connection makes that send wait
                # for ever.
                nursery.start_soon(self._watch_admission)
                await self.endpoints.control.send(
                    Hello(
                        actor_id=self.actor_id,
                        pid=os.getpid(),
                        hostname=socket.gethostname(),
                        policy_version=self.engine.policy_version,
                        engine=self.config.actor.engine,
                    )
                )
                nursery.start_soon(self._receive_broadcasts)
                nursery.start_soon(self._receive_collective_weights, announcements)
                nursery.start_soon(self._heartbeats)
                self._start_drivers(nursery)
                task_status.started()
                while True:
                    message = await self.endpoints.control.receive()
                    if isinstance(message, Stop):
                        stop_reason = message.reason
                        log.info("%s: stop requested (%s)", self.actor_id, message.reason)
                        nursery.cancel_scope.cancel()
                        break
                    if isinstance(message, CollectiveWeights):
                        announced_weights.send_nowait(message)
        finally:
            await self.env_pool.close()  # also when cancelled from outside (a signal)
        return stop_reason

    def _start_drivers(self, nursery: trio.Nursery) -> None:
        """Start what makes episodes: the rollout loops (a gateway actor serves calls instead)."""
        if self.config.run.mode == "sync":
            nursery.start_soon(self._sync_loop)
        elif self.config.actor.rollout_slots == "episode":
            nursery.start_soon(self._async_episode_slots)
        else:
            for _ in range(self.config.actor.concurrent_groups):
                nursery.start_soon(self._async_group_loop)

    async def _receive_broadcasts(self) -> None:
        while True:
            message = await self.endpoints.broadcast.receive()
            if isinstance(message, HorizonUpdate):
                self.horizon = message
                self._notify()
            elif isinstance(message, Backlog):
                self.backlog, self.sent_since_backlog = message, 0
                self._notify()
            elif isinstance(message, WeightsUpdate):
                # The learner re-sends its latest version to latecomers: equal means held.
                # A version the engine refused is not tried again when the learner re-sends it
                # for another actor (only that number: a learner resumed from a checkpoint counts up again).
                if message.version not in (self.engine.policy_version, self.counters.newest_refused_version):
                    await self._load_weights(message)

    async def _receive_collective_weights(self, announcements: trio.MemoryReceiveChannel) -> None:
        """Take collective updates in the order announced. Each is loaded even when its version
        is the one held: the learner is already sending its bytes, and waits for them to be taken.
        A failed transfer is logged; the learner sends the weights again on a new group once this
        actor's heartbeat shows it lacks them."""
        async for message in announcements:
            try:
                await self._load_weights(message)
            except CollectiveError as error:
                log.error("%s: weights v%d over the collective failed: %s", self.actor_id, message.version, error)

    async def _load_weights(self, message: WeightsUpdate | CollectiveWeights) -> None:
        """Load a version into the engine. The engine swaps weights between turns, so no turn
        mixes two versions. An update the engine refuses (it does not fit the model: a name, a
        shape or a dtype, or NaN/inf values; nothing of it was loaded) is counted and logged, and
        the actor goes on with the version it holds."""
        held = self.engine.policy_version
        started = time.perf_counter()
        try:
            await trio.to_thread.run_sync(self.engine.update_weights, message)
        except WeightsRefused as refused:
            self.counters.weights_refused += 1
            self.counters.newest_refused_version = max(self.counters.newest_refused_version, message.version)
            self.counters.last_refusal = str(refused)
            log.warning(
                "%s: refused weights v%d, still serving v%d (%d refused so far): %s",
                self.actor_id, message.version, self.engine.policy_version, self.counters.weights_refused, refused,
            )
            self._notify()  # a sync actor waiting for this version must learn it will not come
            return
        if message.version < held:
            # The learner restarted from an older checkpoint; its weights are the policy now, so
            # the actor follows it back rather than wait for ever.
            log.warning(
                "%s: the learner went back from v%d to v%d (resumed from a checkpoint)",
                self.actor_id, held, message.version,
            )
            self.last_sync_version = -1
        log.info("%s: loaded weights v%d in %.2fs", self.actor_id, message.version, time.perf_counter() - started)
        self._notify()

    async def _heartbeats(self) -> None:
        last_stats = time.monotonic()
        while True:
            await trio.sleep(self.config.actor.heartbeat_s)
            await self.endpoints.control.send(
                Heartbeat(
                    actor_id=self.actor_id,
                    policy_version=self.engine.policy_version,
                    episodes_done=self.counters.episodes,
                    time=time.time(),
                    refused_version=self.counters.newest_refused_version,
                    pid=os.getpid(),
                    hostname=socket.gethostname(),
                )
            )
            if time.monotonic() - last_stats >= 5 * self.config.actor.heartbeat_s:
                last_stats = time.monotonic()
                await self.endpoints.control.send(self.stats())

    def stats(self) -> ActorStats:
        elapsed = max(time.monotonic() - self.started, 1e-9)
        episodes = max(self.counters.episodes, 1)
        return ActorStats(
            actor_id=self.actor_id,
            episodes_done=self.counters.episodes,
            episodes_per_s=self.counters.episodes / elapsed,
            generated_tokens_per_s=self.counters.generated_tokens / elapsed,
            mean_generation_seconds=self.counters.generation_seconds / episodes,
            mean_env_seconds=self.counters.env_seconds / episodes,
            errors=self.counters.errors,
            weights_refused=self.counters.weights_refused,
            paced_s=self.counters.paced_seconds,
        )

    async def _send(self, trajectory: Trajectory) -> None:
        counters = self.counters
        counters.episodes += 1
        self.sent_since_backlog += 1
        counters.generated_tokens += int(trajectory.loss_mask.sum())
        counters.generation_seconds += trajectory.generation_seconds
        counters.env_seconds += trajectory.env_seconds
        counters.errors += bool(trajectory.error)
        # PUSH blocks past the high-water mark: backpressure instead of dropped trajectories. A
        # send abandoned by the timeout left nothing half sent, so it is simply tried again.
        report_s = self.config.actor.wait_report_s
        waited = 0.0
        while True:
            with trio.move_on_after(report_s):
                await self.endpoints.trajectories.send(trajectory)
                return
            waited += report_s
            log.warning(
                "%s: waiting %.0fs to send a trajectory: the learner is not taking them (busy, hung or gone)",
                self.actor_id, waited,
            )

    def _next_group(self) -> tuple[object, dict]:
        """A new group: its task (drawn from this actor's shard) and what all its members share,
        the horizon cap in force now among them."""
        task = self.rng.choice(self.tasks)
        self.groups_started += 1
        settings = dict(
            group_size=self.config.actor.group_size,
            group_id=f"{self.actor_id}-{os.getpid()}-{self.groups_started}",
            actor_id=self.actor_id,
            horizon_cap=self.horizon.horizon_cap,
            max_context_tokens=self.config.actor.max_context_tokens,
            max_new_tokens=self.config.actor.sampling.max_new_tokens,
            seed=self.rng.randrange(2**31),
            loop_settings=AgentLoopSettings.from_actor(self.config.actor),
            on_trajectory=self._send,
            invalid_reply_reward=self.config.actor.invalid_reply_reward,
            env_call_timeout_s=self.config.actor.env_call_timeout_s,
            # Only a run that saves its episodes sends their messages (the learner writes them).
            with_messages=self.config.run.save_episodes,
        )
        return task, settings

    async def _play_group(self) -> None:
        task, settings = self._next_group()
        await run_group(self.engine, self.env_pool, task, **settings)

    async def _watch_admission(self) -> None:
        """End the actor with a clear error once the learner has refused its connection: ZeroMQ
        does not retry a refused handshake, so every send would otherwise wait for ever."""
        refusal = getattr(self.endpoints.control, "refusal", lambda: None)
        while True:
            reason = refusal()
            if reason is not None:
                raise ActorRefused(f"{self.actor_id}: {reason}")
            await trio.sleep(_ADMISSION_CHECK_S)

    async def _wait_for(self, condition, what, *, level: int | None = logging.WARNING) -> None:
        """Wait until `condition()` holds, saying what it waits for now and then (a learner that
        never comes up, or never sends the next version, must not leave a silent actor). `what`
        is a text or a function giving one (for a reason that changes while waiting)."""
        started = trio.current_time()
        while not condition():
            with trio.move_on_after(self.config.actor.wait_report_s) as scope:
                await self.changed.wait()
            if scope.cancelled_caught and level is not None:
                log.log(
                    level, "%s: waiting %.0fs for %s (weights v%d held)",
                    self.actor_id, trio.current_time() - started, what() if callable(what) else what,
                    self.engine.policy_version,
                )

    def _group_would_be_trainable(self) -> bool:
        return group_would_be_trainable(
            self.backlog, held_version=self.engine.policy_version,
            unsent_members=self.groups_started * self.config.actor.group_size - self.counters.episodes,
            sent_since_backlog=self.sent_since_backlog, group_size=self.config.actor.group_size,
            groups_per_step=self.config.learner.groups_per_step, max_staleness=self.config.learner.max_staleness,
        )

    def _pacing_reason(self) -> str:
        backlog = self.backlog
        lag = backlog.learner_version - self.engine.policy_version
        if lag > self.config.learner.max_staleness:
            # Not pacing: these weights are too old for anything played with them to be trained
            # (an update this actor refused, or one still on its way).
            return (f"weights within learner.max_staleness = {self.config.learner.max_staleness} of the "
                    f"learner's v{backlog.learner_version}: anything played with the ones held would be dropped as stale")
        return (f"room in the learner's backlog ({backlog.waiting_trajectories} trajectories waiting at v{backlog.learner_version}, "
                f"{self.config.learner.groups_per_step} a step, max_staleness {self.config.learner.max_staleness}): "
                f"a group started now would be dropped as stale")

    async def _pace(self) -> None:
        """Async mode, `actor.pace_to_learner`: start a group only once it could be trained in time."""
        if not self.config.actor.pace_to_learner or self._group_would_be_trainable():
            return
        # Counted once however many slots wait: the actor's time held back, not its slots'.
        first = self.slots_paced == 0
        if first:
            self.paced_since = trio.current_time()
        self.slots_paced += 1
        try:
            # The first slot held back says why; the others wait with it in silence.
            await self._wait_for(self._group_would_be_trainable, self._pacing_reason,
                                 level=logging.INFO if first else None)
        finally:
            self.slots_paced -= 1
            if self.slots_paced == 0:
                self.counters.paced_seconds += trio.current_time() - self.paced_since

    async def _async_group_loop(self) -> None:
        """rollout_slots = "group": a slot plays one group, then the next; it waits for the
        group's longest member."""
        await self._wait_for(lambda: self.horizon is not None, "the learner's first horizon broadcast")
        while True:
            await self._pace()
            await self._play_group()

    async def _async_episode_slots(self) -> None:
        """rollout_slots = "episode": concurrent_groups x group_size episode slots, each starting
        the next episode as soon as its own ends. A group's members start as slots free up (the
        next group begins once the last one's members have all started), so a slot never idles
        behind a long member of its group. Every member keeps the task, seed and horizon cap its
        group drew when its first member started."""
        await self._wait_for(lambda: self.horizon is not None, "the learner's first horizon broadcast")
        group_size = self.config.actor.group_size
        slots = trio.Semaphore(max(1, self.config.actor.concurrent_groups) * group_size)

        async def play_member(task, member: int, settings: dict) -> None:
            try:
                await run_group_member(self.engine, self.env_pool, task, member, **settings)
            finally:
                slots.release()

        async with trio.open_nursery() as nursery:
            while True:
                await slots.acquire()
                await self._pace()
                task, settings = self._next_group()
                for member in range(group_size):
                    if member:
                        await slots.acquire()
                    nursery.start_soon(play_member, task, member, settings)

    async def _sync_loop(self) -> None:
        share = sync_share(self.config.learner.groups_per_step, max(1, self.config.actor.num_actors), self.actor_index)
        limit = trio.CapacityLimiter(max(1, self.config.actor.concurrent_groups))
        while True:
            # Generate only with the weights of the learner's current version, once per version.
            await self._wait_for(
                lambda: self.horizon is not None
                and ((self.engine.policy_version >= self.horizon.learner_step
                      and self.engine.policy_version > self.last_sync_version)
                     or self._refused_version_to_play()),
                f"the learner's next version after v{self.last_sync_version}",
            )
            if self._refused_version_to_play():
                raise SyncVersionRefused(
                    f"{self.actor_id}: sync mode needs the learner's v{self.horizon.learner_step} to play its batch, "
                    f"and the engine refused those weights ({self.counters.last_refusal}); the learner trains "
                    f"nothing until that batch arrives, so this actor stops (it serves v{self.engine.policy_version})")
            self.last_sync_version = self.engine.policy_version

            async def limited_group() -> None:
                async with limit:
                    await self._play_group()

            async with trio.open_nursery() as nursery:
                for _ in range(share):
                    nursery.start_soon(limited_group)

    def _refused_version_to_play(self) -> bool:
        """Sync mode: whether the version the learner waits for is one the engine refused."""
        wanted = self.horizon.learner_step if self.horizon is not None else -1
        return self.engine.policy_version < wanted <= self.counters.newest_refused_version


def _check_driver(name: str, part: Any) -> None:
    if not (isinstance(part, type) and issubclass(part, Actor)):
        raise TypeError(f"actor driver {name!r} must be a subclass of longhorizon.actor.worker.Actor, got {part!r}")


ACTOR_DRIVERS: Registry = Registry(
    "actor driver",
    "longhorizon.actor_drivers",
    # The gateway's module (Starlette, Hypercorn) is imported only where a gateway runs.
    {"rollout": "longhorizon.actor.worker:Actor", "gateway": "longhorizon.actor.gateway_server:GatewayActor"},
    check=_check_driver,
)


def actor_driver(name: str) -> type[Actor]:
    """The actor class `actor.driver` names: what makes the actor's episodes."""
    return ACTOR_DRIVERS.get(name)


async def run_actor(config: Config, actor_index: int, endpoints, *, engine: Engine | None = None) -> str:
    """Build the engine (unless given) and run an actor until the learner stops it."""
    if engine is None:
        engine = await trio.to_thread.run_sync(lambda: build_engine(config, "train", actor_index=actor_index))
    actor = actor_driver(config.actor.driver)(config, actor_index, endpoints, engine)
    try:
        return await actor.run()
    finally:
        await engine.close()
