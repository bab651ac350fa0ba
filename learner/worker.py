"""The learner: collects groups from the actors, updates the policy, broadcasts weights and horizon.

One learner owns the parameters, the optimiser, the group buffer, the horizon schedule and the
checkpoints. Its socket loops (trajectories in, control in) run beside the training loop under
trio, and the update itself runs in a worker thread, so sockets keep draining while it trains.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections import Counter, deque
from pathlib import Path

import numpy as np
import trio

from longhorizon.common.config import Config
from longhorizon.common.metrics import MetricsWriter, truncate_metrics
from longhorizon.common.resources import MIB, LowMemoryWarning, memory_figures
from longhorizon.common.transport import RateLimitedLog, UnknownPeer
from longhorizon.common.wire import Backlog, Heartbeat, Hello, Stop
from longhorizon.learner.broadcast import horizon_update
from longhorizon.learner.buffer import GroupBuffer, staleness
from longhorizon.learner.checkpoint import checkpoint_dir, latest_checkpoint, load_checkpoint, save_checkpoint
from longhorizon.learner.curriculum import AdaptiveState, make_schedule
from longhorizon.learner.distributed import (
    Ranks,
    destroy_process_group,
    init_process_group,
    rank_device,
    receive_command,
    scatter_objects,
    send_command,
)
from longhorizon.learner.episode_log import open_episode_log
from longhorizon.learner.peers import PeerTable
from longhorizon.learner.samples import sample_lengths
from longhorizon.learner.scoring import ScoredBatch
from longhorizon.learner.trainer import Trainer
from longhorizon.learner.weights import PublisherContext, build_publisher
from longhorizon.common.models import resolve_model_path, load_causal_lm, load_tokenizer, resolve_device

log = logging.getLogger(__name__)

# An actor reporting an older version than this many seconds after a broadcast probably missed
# it (PUB drops messages for slow subscribers); the learner then publishes the latest again. The
# same interval bounds how often a joining actor can make the learner re-send whole weights.
_REPUBLISH_AFTER_S = 5.0
# A trajectory whose sender's control connection has not been heard from yet (its Hello may still
# be queued) waits this long, at most this many of them, before it is refused.
_UNVOUCHED_WAIT_S = 30.0
_UNVOUCHED_LIMIT = 1024
_NOT_ADMITTED = "its sender is not the process admitted for that actor id"
_HORIZON_REPEAT_S = 2.0
_WAITING_REPORT_S = 30.0
# A Stop that an actor cannot take within this long (a hung peer with a full queue) is given up.
_STOP_SEND_TIMEOUT_S = 2.0
# While rank 0 waits for groups, the other ranks wait for its next command inside a collective
# that times out after `learner.rank_timeout_s`: rank 0 sends an empty command this often.
_RANK_KEEPALIVE_S = 30.0


class NonfiniteUpdatesError(RuntimeError):
    """Too many update steps in a row were skipped for a non-finite loss or gradient norm."""


class NonfiniteSteps:
    """Update steps skipped for a non-finite loss or gradient norm (`Trainer.step`), in a row.

    One such step now and then is skipped and survived; `limit` of them in a row mean something
    upstream is broken (rewards, log-probs, a diverged policy), and a run that only skips updates
    trains on nothing while looking alive, so it must stop and say why.
    """

    def __init__(self, limit: int) -> None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"learner.max_nonfinite_steps must be an integer >= 1, got {limit!r}")
        self.limit = limit
        self.in_a_row = 0

    def record(self, skipped: bool) -> bool:
        """Note one update step (skipped or applied); True once `limit` were skipped in a row."""
        self.in_a_row = self.in_a_row + 1 if skipped else 0
        return self.in_a_row >= self.limit

    def error(self) -> NonfiniteUpdatesError:
        return NonfiniteUpdatesError(
            f"{self.in_a_row} update steps in a row had a non-finite loss or gradient norm "
            f"(learner.max_nonfinite_steps = {self.limit}); each was skipped, so the weights are "
            "still those of the last finite step, but the run is training on nothing. Look at what "
            "feeds the update: the env's rewards (learner.max_abs_reward bounds them), the actors' "
            "behaviour log-probs, bf16-mixed precision (try fp32), a learning rate too high for the "
            "model. The WARNING lines of the skipped steps name their groups; their records in "
            "metrics.jsonl carry nonfinite_step = 1."
        )


def check_sampling_for_training(config: Config) -> None:
    """Refuse sampling settings whose behaviour log-probs the learner cannot reproduce."""
    top_p = config.actor.sampling.top_p
    if top_p < 1.0:
        raise ValueError(
            f"actor.sampling.top_p = {top_p} cannot be used for training: the engines record "
            "log-probs of the nucleus-truncated distribution, while the learner's policy is the "
            "full one, so every ratio pi/mu would be biased (about -0.2 nats per token at top_p 0.8). "
            "Train with top_p = 1 (the reference does); top_p < 1 is fine for eval."
        )


def build_buffer(config: Config, *, vocab_size: int | None) -> GroupBuffer:
    """The group buffer a run's mode asks for: sync mode consumes only groups generated by the
    current version (staleness 0), async mode those within `learner.max_staleness`."""
    if config.run.mode not in ("sync", "async"):
        raise ValueError(f"run.mode must be 'async' or 'sync', got {config.run.mode!r}")
    learner = config.learner
    return GroupBuffer(
        max_staleness=0 if config.run.mode == "sync" else learner.max_staleness,
        group_timeout_s=learner.group_timeout_s,
        partial_groups=learner.partial_groups,
        vocab_size=vocab_size,
        max_tokens=config.actor.max_context_tokens,
        max_abs_reward=learner.max_abs_reward,
        staleness_unit=learner.staleness_unit,
    )


def build_trainer(
    config: Config, model, *, pad_token_id: int, reference_model=None, ranks: Ranks | None = None,
) -> Trainer:
    """The update step of a run, the same in both modes (sync mode is decoupled PPO at staleness 0)."""
    return Trainer(
        model, config.learner, temperature=config.actor.sampling.temperature,
        pad_token_id=pad_token_id, reference_model=reference_model, ranks=ranks,
    )


class Learner:
    """One learner rank. Rank 0 (the only one with one rank) owns the sockets, the buffer, the
    metrics and the training loop; the other ranks hold shards of the model and optimiser and run
    `follow_main_rank`."""

    def __init__(
        self, config: Config, endpoints, run_dir: Path, model_path: str, ranks: Ranks | None = None,
    ) -> None:
        import torch


        check_sampling_for_training(config)
        torch.set_num_threads(max(1, config.learner.torch_threads))
        torch.manual_seed(config.run.seed)
        self.config = config
        self.endpoints = endpoints
        self.run_dir = Path(run_dir)
        self.model_path = Path(model_path)
        self.ranks = ranks or Ranks.single()
        self.device = rank_device(resolve_device(config.learner.device), self.ranks)
        init_process_group(self.ranks, self.device, config.learner.rank_timeout_s)
        self.model = load_causal_lm(model_path, config.model.dtype).to(self.device).eval()
        tokenizer = load_tokenizer(model_path)
        pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        reference = None
        if config.learner.kl_coef > 0:
            reference = load_causal_lm(model_path, config.model.dtype).to(self.device).eval()
            reference.requires_grad_(False)
        self.trainer = build_trainer(
            config, self.model, pad_token_id=pad_token_id, reference_model=reference, ranks=self.ranks,
        )
        log.info(
            "learner rank %d of %d on %s, %s, gradient checkpointing %s, log-prob chunks of %s tokens",
            self.ranks.rank, self.ranks.world_size, self.device, config.learner.precision,
            "on" if self.trainer.gradient_checkpointing else "off", self.trainer.chunk_tokens or "all",
        )
        self.sync = config.run.mode == "sync"
        self.buffer = build_buffer(config, vocab_size=self.model.get_input_embeddings().num_embeddings)
        horizon = config.horizon
        self.schedule = make_schedule(horizon)
        self.step = 0
        self.version = 0
        self.gathered = 0  # trajectories of the batch being gathered (reported in the backlog)
        self.counters: Counter = Counter()
        self.nonfinite = NonfiniteSteps(config.learner.max_nonfinite_steps)
        # Seconds trained before this process started (a resumed run's clock continues).
        self.elapsed_before = 0.0
        self._reports_at_checkpoint: dict[tuple, int] = {}
        if config.run.resume:
            checkpoint = latest_checkpoint(self.run_dir)
            if checkpoint is not None:
                restored = load_checkpoint(checkpoint, trainer=self.trainer)
                self.step, self.version = restored["step"], restored["version"]
                self._restore_counters(restored["counters"])
            # Steps after the checkpoint are trained again: their old records would repeat.
            dropped = truncate_metrics(self.run_dir, last_step=self.step) if self.ranks.is_main else 0
            log.info(
                "resumed from %s at step %d (version %d); %d later metrics records removed",
                checkpoint or "the start (no checkpoint yet)", self.step, self.version, dropped,
            )
        self.last_checkpoint_step = self.step
        self.horizon = self.schedule.at(self.step)
        self.metrics = MetricsWriter(self.run_dir, config=config) if self.ranks.is_main else None
        # run.save_episodes: every episode trained on, as conversation files (None when off).
        self.episode_log = (open_episode_log(config, self.run_dir, tokenizer, self.model_path, start_step=self.step)
                            if self.ranks.is_main else None)
        self.weights_bytes = 0
        self.low_memory = LowMemoryWarning()
        self._refusals_logged: dict[str, int] = {}  # actor -> the refused version last warned about
        # (arrival time, sender connection, trajectory) for senders not yet heard on control.
        self._unvouched: deque[tuple[float, str | None, object]] = deque()
        self._wrong_senders = RateLimitedLog("learner refused a trajectory", log=log)
        self.last_rank_command = time.monotonic()
        self.peers = PeerTable(config.learner.peer_timeout_s, self.counters)
        self.peers.episodes_reported.update(self._reports_at_checkpoint)
        self.latest_weights = None
        self.last_weights_broadcast = -math.inf
        self._publish_lock = trio.Lock()
        self.arrived = trio.Event()
        self.last_arrival = time.monotonic()
        self.received_since_step = 0
        self.generated_tokens_since_step = 0
        self.started = time.monotonic()
        # learner.weights_transport: how each version reaches the actors (learner/weights/).
        self.publisher = build_publisher(config.learner.weights_transport, PublisherContext(
            weights_dir=self.run_dir / "weights", host=config.transport.host, device=self.device,
            options=config.learner.weights_options, announce=self._announce_from_thread,
        ))
        self._trio_token = None  # set when run() starts: the publisher's threads call into the loop

    def _restore_counters(self, saved: dict) -> None:
        if isinstance(saved.get("learner"), dict):
            self.counters.update(saved["learner"])
            # What the old process's buffer held at the checkpoint is not in this one: lost.
            lost = self.buffer.restore_counters(saved.get("buffer", {}))
            if lost:
                log.info("%d trajectories held at the checkpoint are lost (trajectories_lost_on_restart)", lost)
            self.buffer.refused_fields.update(saved.get("buffer_refused_fields", {}))
            self.elapsed_before = float(saved.get("elapsed_s", 0.0))
            # Each actor process's last report of episodes sent, so the total a restarted learner
            # reports keeps what actors told its predecessor (a live actor's next report replaces
            # its own entry).
            self._reports_at_checkpoint = {
                (peer, tuple(incarnation) if incarnation else None): int(count)
                for peer, incarnation, count in saved.get("episodes_reported", [])}
            if saved.get("horizon_schedule") and self.schedule.kind == "adaptive":
                # The same stage, with the same window of figures, as when the checkpoint was taken.
                state = dict(saved["horizon_schedule"])
                state["success"], state["truncated"] = tuple(state["success"]), tuple(state["truncated"])
                self.schedule.state = AdaptiveState(**state)
        else:  # checkpoints written before the buffer's counters were saved
            self.counters.update(saved)

    def _saved_counters(self) -> dict:
        learner = dict(self.counters)
        # Socket-level rejections restart from zero in a new process: carried as offsets.
        learner["rejected_messages"] = self._rejected("trajectories")
        learner["control_rejected_messages"] = self._rejected("control")
        learner["auth_refused"] = int(self.counters.get("auth_refused", 0)) + int(getattr(self.endpoints, "auth_refused", 0))
        saved = {"learner": learner, "buffer": dict(self.buffer.counters),
                 "buffer_refused_fields": dict(self.buffer.refused_fields), "elapsed_s": self._elapsed(),
                 "episodes_reported": [[peer, list(incarnation) if incarnation else None, count]
                                       for (peer, incarnation), count in self.peers.episodes_reported.items()]}
        if self.schedule.kind == "adaptive":
            saved["horizon_schedule"] = dataclasses.asdict(self.schedule.state)
        return saved

    def _rejected(self, channel: str) -> int:
        key = "rejected_messages" if channel == "trajectories" else "control_rejected_messages"
        endpoint = getattr(self.endpoints, channel)
        return int(self.counters.get(key, 0)) + int(getattr(endpoint, "rejected", 0))

    def _elapsed(self) -> float:
        return self.elapsed_before + time.monotonic() - self.started

    # -- sockets ---------------------------------------------------------------------------

    async def _receive_trajectories(self) -> None:
        while True:
            sender, trajectory = await self.endpoints.trajectories.receive_with_sender()
            if not hasattr(trajectory, "group_id"):
                self.counters["unexpected_messages"] += 1
                continue
            # Each trajectory must come from the process the control socket admitted for its
            # actor id: another process holding the run's credentials cannot train under an
            # actor's name. (Those held for want of a Hello go first.)
            self._settle_unvouched()
            verdict = self.endpoints.control.vouches_for(sender, trajectory.actor_id)
            if verdict is None:
                self._unvouched.append((time.monotonic(), sender, trajectory))
                if len(self._unvouched) > _UNVOUCHED_LIMIT:
                    _, oldest_sender, oldest = self._unvouched.popleft()
                    self._refuse_sender(oldest_sender, oldest, "its sender never said Hello")
            elif verdict:
                self._accept(trajectory)
            else:
                self._refuse_sender(sender, trajectory, _NOT_ADMITTED)

    def _settle_unvouched(self) -> None:
        """Take or refuse the held trajectories whose senders the control socket has now heard
        from (or that waited too long)."""
        if not self._unvouched:
            return
        now = time.monotonic()
        waiting: deque = deque()
        for arrived, sender, trajectory in self._unvouched:
            verdict = self.endpoints.control.vouches_for(sender, trajectory.actor_id)
            if verdict:
                self._accept(trajectory)
            elif verdict is False:
                self._refuse_sender(sender, trajectory, _NOT_ADMITTED)
            elif now - arrived > _UNVOUCHED_WAIT_S:
                self._refuse_sender(sender, trajectory, f"its sender said no Hello within {_UNVOUCHED_WAIT_S:.0f}s")
            else:
                waiting.append((arrived, sender, trajectory))
        self._unvouched = waiting

    def _refuse_sender(self, sender: str | None, trajectory, reason: str) -> None:
        self.counters["trajectories_wrong_sender"] += 1
        self._wrong_senders.record(f"{trajectory.trajectory_id!r} for {trajectory.actor_id!r} from connection "
                                   f"{sender!r}: {reason}")

    def _accept(self, trajectory) -> None:
        self.counters["trajectories_received"] += 1
        self.last_arrival = time.monotonic()
        self.received_since_step += 1
        generated = int(np.sum(trajectory.loss_mask))
        self.generated_tokens_since_step += generated
        self.counters["generated_tokens_received"] += generated
        self.buffer.add(trajectory, learner_version=self.version)
        self.arrived.set()

    async def _control(self) -> None:
        while True:
            peer, message = await self.endpoints.control.receive()
            self.peers.heard_from(peer, message)
            self._settle_unvouched()  # a Hello vouches for the trajectories its sender sent first
            if isinstance(message, Hello):
                log.info("actor %s joined (pid %s on %s, engine %s)", peer, message.pid, message.hostname, message.engine)
                self.publisher.actor_joined(peer, message.policy_version)
                # A new or restarted actor needs the current horizon at once, and the weights if
                # it does not hold them; whole weights go out at most once per interval however
                # many actors join (each re-send reaches every subscriber).
                await self._publish_horizon()
                await self._republish_weights_if_behind(message.policy_version)
            elif isinstance(message, Heartbeat):
                await self._republish_weights_if_behind(message.policy_version, peer)

    def _refused_latest(self, peer: str) -> bool:
        """Whether `peer`'s engine refused the latest weights: sending them again would only be
        refused again."""
        return (self.latest_weights is not None and peer in self.peers.known
                and self.peers.refused_version_of(peer) >= self.latest_weights.version)

    def _skip_refused_latest(self, peer: str) -> bool:
        """`_refused_latest`, logged once per version and actor when it holds back a send."""
        if not self._refused_latest(peer):
            return False
        version = self.latest_weights.version
        if self._refusals_logged.get(peer) != version:
            self._refusals_logged[peer] = version
            log.warning("actor %s refused weights v%d (see its log) and serves v%s: not sending v%d to it again; "
                        "the next version goes out as usual", peer, version, self.peers.version_of(peer), version)
        return True

    async def _republish_weights_if_behind(self, actor_version: int, peer: str | None = None) -> None:
        if self.publisher.needs_control_channel:
            self._keep_actors_current()  # per actor, with its own bounds: nothing goes to all
            return
        if self.latest_weights is None or actor_version == self.latest_weights.version:
            return
        if peer is not None and self._skip_refused_latest(peer):
            return
        if time.monotonic() - self.last_weights_broadcast <= _REPUBLISH_AFTER_S:
            return
        await self._publish()
        self.counters["weights_republished"] += 1  # counted once sent, so a reader sees it out

    async def _publish_horizon(self) -> None:
        # The backlog first: an actor starting on its first horizon already knows what waits.
        await self._publish_backlog()
        await self.endpoints.broadcast.send(horizon_update(self.horizon))

    async def _publish_backlog(self) -> None:
        """What waits to be trained, for the actors' pacing (wire.Backlog)."""
        if not self.sync:
            await self.endpoints.broadcast.send(Backlog(
                learner_version=self.version, waiting_trajectories=self.gathered + len(self.buffer),
                live_actors=max(1, len(self.peers.live()))))

    async def _rebuild_weights(self) -> None:
        """The weights message of the current version. Called by the training loop only, between
        updates: the copy must never overlap an optimiser step changing the parameters."""
        self.latest_weights = await trio.to_thread.run_sync(
            lambda: self.publisher.build(self._weights_state_dict(), self.version)
        )
        self.weights_bytes = self.publisher.payload_bytes(self.latest_weights)

    async def _publish(self, *, weights: bool = True) -> None:
        # One broadcast at a time: a re-send for a latecomer must not interleave its horizon and
        # weights with the training loop's newer ones.
        async with self._publish_lock:
            # The horizon first: an actor that sees a new version already knows its cap.
            await self._publish_horizon()
            if self.latest_weights is None:
                return
            if self.publisher.needs_control_channel:
                # Per actor, in the background (training goes on meanwhile): every actor that
                # lacks this version gets it. The starting version too: actors that hold it are
                # sent nothing.
                if weights:
                    self.last_weights_broadcast = time.monotonic()
                await self.publisher.publish(self.latest_weights, self.endpoints.broadcast)
                self._keep_actors_current()
            elif weights:
                self.last_weights_broadcast = time.monotonic()
                await self.publisher.publish(self.latest_weights, self.endpoints.broadcast)

    def _announce_from_thread(self, peer: str, message, timeout_s: float) -> None:
        """For transports that serve each actor from threads of their own: send `message` on
        `peer`'s control socket through the trio loop, waiting at most `timeout_s`."""
        trio.from_thread.run(self._send_announcement, peer, message, timeout_s, trio_token=self._trio_token)

    async def _send_announcement(self, peer: str, message, timeout_s: float) -> None:
        """Send a transport's announcement to one actor, bounded as the transport asks (a hung
        peer with a full queue must not hold its delivery thread for ever)."""
        with trio.fail_after(timeout_s):
            await self.endpoints.control.send(peer, message)

    def _keep_actors_current(self) -> None:
        """Per-actor transports: every live actor that lacks the latest version gets it (the
        transport skips actors that failed and have not been heard from since)."""
        for peer in self.peers.live():
            if not self._skip_refused_latest(peer):
                self.publisher.keep_current(peer, self.peers.version_of(peer), self.peers.last_seen(peer))

    async def _repeat_horizon(self) -> None:
        """Publish the horizon every few seconds: a subscriber that joined after the last
        broadcast (ZeroMQ's slow-joiner gap) still learns the cap and the learner's version."""
        while True:
            await trio.sleep(_HORIZON_REPEAT_S)
            await self._publish_horizon()

    # -- training --------------------------------------------------------------------------

    async def _collect_batch(self) -> list:
        wanted = self.config.learner.groups_per_step
        groups: list = []
        waiting_since = last_report = time.monotonic()
        told_actors = False
        while len(groups) < wanted:
            if time.monotonic() - last_report > _WAITING_REPORT_S:
                # Say what the learner waits for rather than hanging silently.
                last_report = time.monotonic()
                log.warning(
                    "waiting %.0fs for groups: %d/%d ready, %d trajectories pending in %d groups, "
                    "actors live: %s",
                    last_report - waiting_since, len(groups), wanted, len(self.buffer), self.buffer.pending_groups,
                    self.peers.describe_live(),
                )
            give_up = self.sync and self._sync_batch_is_over(len(groups), wanted, waiting_since)
            ready = self.buffer.pop_ready(wanted - len(groups), learner_version=self.version, give_up_waiting=give_up)
            if self.trainer.algorithm.resamples_flat_groups:
                # Dynamic sampling (dapo): a group without signal is set aside and another
                # awaited in its place, so every step trains on a full batch of signal.
                kept = [group for group in ready if self.trainer.algorithm.carries_signal(group)]
                self.counters["groups_resampled"] += len(ready) - len(kept)
                ready = kept
            groups += ready
            self.gathered = sum(len(group.trajectories) for group in groups)
            if len(groups) >= wanted or give_up:
                if give_up and len(groups) < wanted:
                    self.counters["short_sync_batches"] += 1
                    log.warning(
                        "sync batch of version %d ends with %d of %d groups (%d dropped, see the "
                        "buffer counters in metrics)", self.version, len(groups), wanted,
                        self.buffer.dropped_groups_by_version[self.version],
                    )
                break
            if not told_actors:
                # Short of a batch: actors pacing themselves by the last step's backlog learn at
                # once that there is room (async mode; the horizon repeat says it again later).
                told_actors = True
                await self._publish_backlog()
            self.arrived = trio.Event()
            with trio.move_on_after(0.5):  # wake up now and then for group timeouts
                await self.arrived.wait()
            await self._keep_ranks_waiting()
        return groups

    def _advance_horizon(self, groups) -> str:
        """The horizon after this step; for the adaptive schedule, from this step's figures.
        Returns the reason when the stage changed (logged and recorded), else ""."""
        if self.schedule.kind != "adaptive":
            self.horizon = self.schedule.at(self.step)
            return ""
        trajectories = [t for g in groups for t in g.trajectories]
        success = float(np.mean([t.success for t in trajectories])) if trajectories else 0.0
        # Only the cap's cuts: a larger cap does nothing for episodes the env or the context ended.
        cut = float(np.mean([cut_by_cap(t) for t in trajectories])) if trajectories else 0.0
        stage_before = self.horizon.stage
        self.horizon = self.schedule.observe(self.step, success, cut)
        if self.horizon.stage == stage_before:
            return ""
        decision = self.schedule.state.last_decision
        log.info("horizon stage %d -> %d (cap %d): %s", stage_before, self.horizon.stage, self.horizon.cap, decision)
        return decision

    def _sync_batch_is_over(self, ready: int, wanted: int, batch_started: float) -> bool:
        """Sync mode: the actors generate exactly one batch per version, so a group lost on the way
        (dropped, or its trajectories rejected on the wire) would leave the learner waiting for
        ever. The batch is over once every group it expected is ready or dropped (groups of this
        version only: late members of older groups do not count), or when nothing has arrived
        for `learner.sync_batch_timeout_s`."""
        if ready + self.buffer.dropped_groups_by_version[self.version] >= wanted:
            return True
        quiet_since = max(self.last_arrival, batch_started)  # the last step may have been long
        return time.monotonic() - quiet_since > self.config.learner.sync_batch_timeout_s

    def _record(self, groups, scored, train_metrics: dict, elapsed: float, trained_version: int) -> dict:
        trajectories = [t for g in groups for t in g.trajectories]
        # Staleness is measured against the version that trained on the batch, as the buffer does.
        etas = [staleness(trained_version, t.policy_versions, t.loss_mask) for t in trajectories]
        rewards = [t.reward for t in trajectories]
        buffer_counters = self.buffer.counters
        live = self.peers.live()
        record = {
            "step": self.step,
            "version": self.version,
            "time": self._elapsed(),
            "reward_mean": float(np.mean(rewards)) if rewards else 0.0,
            "success_rate": float(np.mean([t.success for t in trajectories])) if trajectories else 0.0,
            "horizon_cap": self.horizon.cap,
            "horizon_stage": self.horizon.stage,
            "staleness_mean": float(np.mean(etas)) if etas else 0.0,
            "staleness_max": int(max(etas)) if etas else 0,
            "staleness_hist": {str(k): v for k, v in sorted(Counter(etas).items())},
            "episodes_per_s": self.received_since_step / max(elapsed, 1e-9),
            "tokens_per_s": self.generated_tokens_since_step / max(elapsed, 1e-9),
            "groups_used": scored.groups_used,
            "groups_skipped_zero_variance": scored.groups_skipped_zero_variance,
            "groups_skipped_too_small": scored.groups_skipped_too_small,
            "groups_resampled": int(self.counters["groups_resampled"]),
            # Update steps skipped for a non-finite loss or gradient norm, over the whole run (this
            # step's own verdict is `nonfinite_step`, from the trainer).
            "steps_nonfinite": int(self.counters["steps_nonfinite"]),
            "failed_episodes": scored.failed_trajectories,
            "episode_turns_mean": float(np.mean([t.num_turns for t in trajectories])) if trajectories else 0.0,
            "truncated_rate": float(np.mean([t.truncated for t in trajectories])) if trajectories else 0.0,
            "cut_by_cap_rate": float(np.mean([cut_by_cap(t) for t in trajectories])) if trajectories else 0.0,
            "cut_by_context_rate": float(np.mean([cut_by_context(t) for t in trajectories])) if trajectories else 0.0,
            # Training sequences the step's episodes became (turn samples: one per turn).
            "train_samples": sum(len(sample_lengths(t)) for t in trajectories),
            **outcome_figures(groups),
            # Where data went, counted over the whole run (a resumed run continues the counts of
            # its checkpoint): received = accepted + the refusals below; accepted = trained +
            # dropped with their group + held + lost on restart (held at the checkpoint a
            # restarted learner resumed from: they died with the old process). Episodes the
            # actors reported sending, minus those received, were in flight (or died with a
            # killed actor, or reached a learner after its last checkpoint).
            "actor_episodes_reported": self.peers.episodes_reported_total(),
            "trajectories_received": buffer_counters["received"],
            "generated_tokens_received": int(self.counters["generated_tokens_received"]),
            "trajectories_accepted": buffer_counters["accepted"],
            "trajectories_trained": buffer_counters["returned_trajectories"],
            "trajectories_dropped_with_group": buffer_counters["dropped_group_trajectories"],
            "trajectories_held": len(self.buffer),
            "trajectories_lost_on_restart": buffer_counters["lost_on_restart"],
            "groups_dropped_stale": buffer_counters["dropped_stale_groups"],
            "groups_dropped_partial": buffer_counters["dropped_partial_groups"] + buffer_counters["dropped_incomplete_groups"],
            "groups_dropped_overflow": buffer_counters["dropped_overflow_groups"],
            "groups_used_partial": buffer_counters["returned_partial_groups"],
            "trajectories_dropped_stale": buffer_counters["dropped_stale_trajectories"],
            # learner.staleness_unit = "token": generated tokens left out of the loss as too stale.
            "tokens_masked_stale": buffer_counters["stale_tokens_masked"],
            "trajectories_duplicate": buffer_counters["duplicates"],
            "trajectories_malformed": buffer_counters["dropped_malformed"],
            # The same refusals by the field at fault, e.g. {"reward": 2}.
            "trajectories_malformed_by_field": dict(sorted(self.buffer.refused_fields.items())),
            "trajectories_too_long": buffer_counters["dropped_too_long"],
            "trajectories_late": buffer_counters["dropped_late_trajectories"],
            "trajectories_future": buffer_counters["dropped_future_trajectories"],
            "trajectories_overfull": buffer_counters["dropped_overfull"],
            "rejected_messages": self._rejected("trajectories"),
            "control_rejected_messages": self._rejected("control"),
            # Connections refused for want of the run's CurveZMQ keys (common/curve.py).
            "auth_refused": int(self.counters.get("auth_refused", 0)) + int(getattr(self.endpoints, "auth_refused", 0)),
            # Trajectories refused before the buffer (not in trajectories_received) because the
            # process that sent them is not the one admitted for their actor id.
            "trajectories_wrong_sender": int(self.counters["trajectories_wrong_sender"]),
            "actors_seen": len(self.peers),
            "actors_live": len(live),
            "actors_lost": int(self.counters["actors_lost"]),
            # Weight updates the actors' engines refused (from their latest stats), and the live
            # actors that refused the latest version (it is not sent to them again).
            "weights_refused": self.peers.stats_total("weights_refused"),
            "actors_refusing_latest": sum(self._refused_latest(peer) for peer in live),
            # Gateway actors: calls whose messages were not their session's history (split or
            # refused as gateway.on_history_break says), from the actors' latest stats.
            "history_breaks": self.peers.stats_total("history_breaks"),
            # Async actors' time spent not starting groups the learner could not have trained
            # within max_staleness (actor.pace_to_learner), summed from their latest stats.
            "actors_paced_s": round(self.peers.stats_total("paced_s"), 3),
            # Bytes of tensors in the latest weights update (with LoRA: the adapters alone).
            "weights_bytes": self.weights_bytes,
            # This process's resident memory (now, and its peak so far) and what the machine (or
            # its cgroup) has left, in MiB.
            **memory_figures(),
        }
        record.update(train_metrics)
        self._warn_on_low_memory(record)
        return record

    def _warn_on_low_memory(self, record: dict) -> None:
        """A WARNING when the machine's memory runs low: the kernel's OOM killer gives no notice."""
        available, total = record.get("memory_available_mb"), record.get("memory_total_mb")
        if available is None or not total:
            return
        message = self.low_memory.check(int(available * MIB), int(total * MIB))
        if message is not None:
            log.warning("step %d: %s (this learner: %.0f MiB, its peak %.0f MiB)", self.step, message,
                        record.get("rss_mb", 0.0), record.get("rss_peak_mb", 0.0))

    def _write_sample(self, groups) -> None:
        trajectories = [t for g in groups for t in g.trajectories]
        if not trajectories:
            return
        best = max(trajectories, key=lambda t: t.reward)
        folder = self.run_dir / "episodes"
        folder.mkdir(parents=True, exist_ok=True)
        header = (
            f"step {self.step}  task {best.task_id}  reward {best.reward:.3f}  success {best.success}  "
            f"turns {best.num_turns}/{best.horizon_cap}  actor {best.actor_id}\n\n"
        )
        (folder / f"step_{self.step:06d}.txt").write_text(header + best.text + "\n")

    def _checkpoint(self) -> Path:
        self._command_ranks("checkpoint", {"step": self.step, "version": self.version})
        path = save_checkpoint(
            self.run_dir, trainer=self.trainer, step=self.step,
            version=self.version, horizon=self.horizon,
            counters=self._saved_counters() if self.ranks.is_main else {},
            model_folder=self.model_path, keep=self.config.run.keep_checkpoints,
        )
        self.last_checkpoint_step = self.step
        return path

    # -- the other ranks -------------------------------------------------------------------

    def _command_ranks(self, command: str, payload=None) -> None:
        """Rank 0: name the collective work that follows, so every rank enters it (a no-op with
        one rank)."""
        if self.ranks.distributed and self.ranks.is_main:
            send_command(command, payload)
            self.last_rank_command = time.monotonic()

    def _update(self, scored: ScoredBatch) -> dict:
        """One update step over every rank: rank 0 deals the examples out by tokens computed,
        keeping the members that share a prefix together (and every rank gets the flat groups'
        share of the denominator)."""
        if not self.ranks.distributed:
            return self.trainer.step(scored.examples, scored.flat)

        self._command_ranks("step")
        shares = self.trainer.deal_examples(scored.examples)
        mine, flat = scatter_objects([(share, scored.flat) for share in shares], self.ranks)
        return self.trainer.step(mine, flat)

    def _weights_state_dict(self) -> dict:
        """What the actors need: the whole model's parameters (gathered from the ranks), or with
        LoRA the adapters alone."""
        self._command_ranks("weights")
        return self.trainer.actor_weights()

    async def _keep_ranks_waiting(self) -> None:
        if self.ranks.distributed and time.monotonic() - self.last_rank_command > _RANK_KEEPALIVE_S:
            await trio.to_thread.run_sync(self._command_ranks, "wait")

    def stop_ranks(self) -> None:
        """Rank 0: release the other ranks at the end of the run."""
        self._command_ranks("stop")

    def follow_main_rank(self) -> None:
        """A rank other than 0: take part in the collective work rank 0 names, until it says stop."""
        while True:
            command, payload = receive_command()
            if command == "step":
                self.trainer.step(*scatter_objects(None, self.ranks))
            elif command == "weights":
                self.trainer.actor_weights()
            elif command == "checkpoint":
                self.step, self.version = payload["step"], payload["version"]
                self.horizon = self.schedule.at(self.step)
                self._checkpoint()
            elif command == "stop":
                return
            elif command != "wait":
                raise RuntimeError(f"unknown command {command!r} from rank 0")

    async def _train(self) -> None:
        learner = self.config.learner
        # Weights of the starting version are built at once, so an actor holding another version
        # (ahead of a learner restarted from an older checkpoint) can be sent them; they are
        # broadcast now only when the actors cannot have them yet (a resumed run).
        await self._rebuild_weights()
        await self._publish(weights=self.version > 0)
        last_step_time = time.monotonic()
        run = self.config.run
        recent_success: deque[float] = deque(maxlen=run.target_window)
        target_reached = False
        first_step_of_process = True
        while self.step < run.total_steps and not target_reached:
            groups = await self._collect_batch()
            scored = self.trainer.algorithm.score(groups)
            train_metrics: dict = {}
            if scored.examples:
                train_metrics = await trio.to_thread.run_sync(self._update, scored)
            skipped = bool(train_metrics.get("nonfinite_step", 0.0))
            stop_for_nonfinite = self.nonfinite.record(skipped) if scored.examples else False
            if skipped:
                self._report_nonfinite_step(groups, train_metrics)
            # A version names a set of weights. A step whose batch carried no signal (every group
            # flat), or whose update was skipped as non-finite, leaves the weights as they were,
            # so in async mode it keeps the version: the trajectories in flight stay as fresh as
            # they were, and nothing is rebuilt or sent. Sync-mode actors generate one batch per
            # version and wait for the next, so there every step makes a version.
            trained_version = self.version
            self.step += 1
            self.gathered = 0
            if (scored.examples and train_metrics.get("optimizer_steps_applied", 1.0) > 0) or self.sync:
                self.version += 1
            cap_before = self.horizon.cap, self.horizon.stage
            decision = self._advance_horizon(groups)
            now = time.monotonic()
            record = self._record(groups, scored, train_metrics, now - last_step_time, trained_version)
            if decision:
                record["horizon_decision"] = decision
            if first_step_of_process:
                # What queued while this process loaded (all of it, after a restart) arrives in
                # this step: its per-step rates are not the actors' (the progress line says so).
                record["learner_started"] = True
                first_step_of_process = False
            recent_success.append(record["success_rate"])
            target_reached = target_success_reached(list(recent_success), run.target_success, run.target_window)
            if target_reached:
                record["target_reached"] = True
            last_step = self.step == run.total_steps or target_reached
            last_step_time = now
            self.received_since_step = self.generated_tokens_since_step = 0
            # A stop request (SIGTERM) waits until the step's broadcast, checkpoint and record
            # are out, so the run directory never holds half a step.
            with trio.CancelScope(shield=True):
                if self.step % learner.sample_episodes_every == 0:
                    self._write_sample(groups)
                due = self.sync or self.step % learner.broadcast_every == 0 or last_step
                if due and self.version != self.latest_weights.version:
                    await self._rebuild_weights()
                    await self._publish()
                elif (self.horizon.cap, self.horizon.stage) != cap_before:
                    await self._publish(weights=False)  # a new stage goes out now, not at the next repeat
                # The record goes out before the checkpoint: a learner killed between the two
                # resumes from the older checkpoint, which cuts the record and trains the step
                # again. The other order would leave a checkpoint whose step has no record.
                checkpoint = self.step % learner.checkpoint_every == 0 or last_step
                if checkpoint:
                    record["checkpoint"] = str(checkpoint_dir(self.run_dir, self.step))
                if self.episode_log is not None:
                    await trio.to_thread.run_sync(
                        self.episode_log.write_step, self.step, trained_version, groups, scored, train_metrics)
                self.metrics.write(record)
                if checkpoint:
                    await trio.to_thread.run_sync(self._checkpoint)
            log.info(
                "step %d reward %.3f success %.2f horizon %d staleness %.2f",
                self.step, record["reward_mean"], record["success_rate"], record["horizon_cap"], record["staleness_mean"],
            )
            if stop_for_nonfinite:  # after the step's record is out, so metrics.jsonl shows it
                raise self.nonfinite.error()
            if target_reached:
                log.info(
                    "training success %.2f over the last %d steps reached run.target_success = %.2f: "
                    "the run ends at step %d of %d", float(np.mean(recent_success)), len(recent_success),
                    run.target_success, self.step, run.total_steps,
                )

    def _report_nonfinite_step(self, groups, train_metrics: dict) -> None:
        """Count and log one update skipped for a non-finite loss or gradient norm, naming the
        batch's groups (their trajectories are where a bad value would have come from)."""
        self.counters["steps_nonfinite"] += 1
        group_ids = [group.group_id for group in groups]
        shown = ", ".join(group_ids[:32]) + (f" and {len(group_ids) - 32} more" if len(group_ids) > 32 else "")
        log.warning(
            "step %d: the update's loss (%s) or gradient norm (%s) is not finite: skipped, the "
            "weights and optimiser state are unchanged (%d such steps in a row, %d this run; "
            "learner.max_nonfinite_steps = %d); the batch's groups: %s",
            self.step + 1, train_metrics.get("loss"), train_metrics.get("grad_norm"), self.nonfinite.in_a_row,
            self.counters["steps_nonfinite"], self.nonfinite.limit, shown,
        )

    async def run(self) -> None:
        """Train for run.total_steps learner steps, then stop the actors.

        Cancelled (SIGTERM, Ctrl-C), it first writes a checkpoint of the last finished step, so
        `run.resume=true` (or the launcher restarting it) continues from there.
        """
        self._trio_token = trio.lowlevel.current_trio_token()
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._receive_trajectories)
                nursery.start_soon(self._control)
                nursery.start_soon(self._repeat_horizon)
                await self._train()
                await self.stop_actors("training finished")
                nursery.cancel_scope.cancel()
            await trio.to_thread.run_sync(self.stop_ranks)
        except BaseException as error:
            if _only_cancellation(error):
                with trio.CancelScope(shield=True):
                    if self.step > self.last_checkpoint_step:
                        path = await trio.to_thread.run_sync(self._checkpoint)
                        log.info("stopped at step %d; checkpoint written to %s", self.step, path)
                    await trio.to_thread.run_sync(self.stop_ranks)
            # After a failure the other ranks are left waiting: they fail once this process is
            # gone (their collectives lose rank 0), and the launcher restarts them all.
            raise
        finally:
            self.publisher.close()
            self.metrics.close()

    async def stop_actors(self, reason: str) -> int:
        """Send Stop to every live actor; returns how many took it. One gone or hung peer is
        logged and skipped, never allowed to break the shutdown of the others."""
        stopped = 0
        for peer in self.peers.live():
            with trio.move_on_after(_STOP_SEND_TIMEOUT_S) as scope:
                try:
                    await self.endpoints.control.send(peer, Stop(reason=reason))
                    stopped += 1
                except (UnknownPeer, trio.ClosedResourceError) as error:
                    log.warning("could not stop actor %s: %s", peer, error)
            if scope.cancelled_caught:
                log.warning("could not stop actor %s: its queue stayed full for %.0fs", peer, _STOP_SEND_TIMEOUT_S)
        lost = len(self.peers) - stopped
        if lost:
            log.warning("%d of %d actors seen were gone or unreachable at the end", lost, len(self.peers))
        return stopped


def target_success_reached(recent: list[float], target: float, window: int) -> bool:
    """Whether a run with `run.target_success = target` ends now: the last `window` steps'
    training success rates (`recent`, oldest first) average at least `target`. Off at 0."""
    if target <= 0 or len(recent) < window:
        return False
    return sum(recent[-window:]) / window >= target


def cut_by_cap(trajectory) -> bool:
    """Whether the horizon cap ended the episode (the actor says so in `cut_by`; one that does not:
    truncated on the cap's turn). The env's own limit or the context budget may end it sooner
    (truncated_rate counts those too)."""
    if getattr(trajectory, "cut_by", ""):
        return trajectory.cut_by == "horizon"
    return bool(trajectory.truncated and not trajectory.terminated and trajectory.num_turns >= trajectory.horizon_cap)


def cut_by_context(trajectory) -> bool:
    """Whether the context budget ended the episode: its next turn would not have fit
    actor.max_context_tokens."""
    return getattr(trajectory, "cut_by", "") == "context"


def outcome_figures(groups) -> dict[str, float]:
    """A step's groups by outcome, whatever the algorithm made of them, and how often the policy
    garbled the action format. A group in which no episode (or every episode) succeeded teaches
    the task nothing, even where format penalties spread its rewards; many of them mean the
    tasks are out of the policy's reach (or mastered), not that the update is wrong."""
    trajectories = [t for g in groups for t in g.trajectories]
    turns = sum(t.num_turns for t in trajectories)
    return {
        "groups_none_succeeded": sum(not any(t.success for t in g.trajectories) for g in groups),
        "groups_all_succeeded": sum(all(t.success for t in g.trajectories) for g in groups),
        # Replies the env could not read as an action, per turn played.
        "invalid_action_rate": sum(t.invalid_actions for t in trajectories) / turns if turns else 0.0,
    }


def _only_cancellation(error: BaseException) -> bool:
    """Whether `error` is a cancellation (alone or grouped by nurseries), not a failure: only a
    stop request gets a final checkpoint; after a crash mid-step the parameters may be half
    updated."""
    if isinstance(error, BaseExceptionGroup):
        rest = error.split(trio.Cancelled)[1]
        return rest is None
    return isinstance(error, trio.Cancelled)


def _model_folder(config: Config, model_path: str | None) -> str:
    if model_path is not None:
        return model_path

    return str(resolve_model_path(config.model.path, config.model.cache_dir))


async def run_learner(
    config: Config, endpoints, *, model_path: str | None = None, ranks: Ranks | None = None,
) -> Learner:
    """Rank 0 (or the only rank): train with the actors over `endpoints`."""
    model_path = _model_folder(config, model_path)
    learner = await trio.to_thread.run_sync(Learner, config, endpoints, config.run_dir, model_path, ranks)
    try:
        await learner.run()
    finally:
        destroy_process_group()
    return learner


def run_learner_rank(config: Config, ranks: Ranks, *, model_path: str | None = None) -> None:
    """A rank other than 0: no sockets; hold a shard and follow rank 0 until it says stop."""
    learner = Learner(config, None, config.run_dir, _model_folder(config, model_path), ranks)
    try:
        learner.follow_main_rank()
    finally:
        destroy_process_group()
