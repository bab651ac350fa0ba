"""Message transports: ZeroMQ sockets polled from trio, and an in-process twin with the same interfaces.

Three channels connect the learner and its actors:

- trajectories, actor PUSH (connect) -> learner PULL (bind). When the high-water marks are
  reached the sender waits: nothing is dropped.
- broadcasts (weights, horizon cap), learner PUB (bind) -> actor SUB (connect). Each broadcast
  supersedes the previous one, so losing one is tolerable; a subscriber only sees messages
  published after it connected, and once its queue and the publisher's are full (the high-water
  marks) newer messages are dropped until it catches up.
- control (hello, heartbeat, stop, statistics), actor DEALER (connect) <-> learner ROUTER (bind).
  Each dealer's routing identity is its actor id plus a random token of its own, so two
  connections never share an identity: a second connection speaking for an actor id another live
  connection holds is refused (the first keeps it; see ``ZmqRouter``).

Every receiving socket has ``zmq.MAXMSGSIZE`` set from its ``WireLimits``: libzmq drops a frame
larger than that before buffering it and disconnects the peer that sent it (a connecting peer
then reconnects by itself); such a message never reaches the decoder and is not counted. The
decoder's own limits (total size, frame count, strings, tokens) catch everything else, and each
message they reject is counted in ``rejected`` and logged at WARNING, at most once per
``REJECTION_LOG_INTERVAL_S`` per socket.

Addresses are ZeroMQ endpoints such as ``"tcp://127.0.0.1:5555"``; a bound socket accepts port 0 or
``*`` and exposes the port it got in ``.address``. Sockets bind on 127.0.0.1 by default. Given a
run's keys (``curve=``), the endpoints use CurveZMQ: the learner's sockets admit only peers that
hold the run's client key, and all traffic is encrypted (common/curve.py). Given the run's secret
(``secret=``, for loopback), they use ZeroMQ PLAIN: the learner's sockets admit only peers that
present it, nothing is encrypted (common/auth.py). Either way refusals are counted in
``LearnerEndpoints.auth_refused``. Without either nothing authenticates peers, and binding beyond
loopback logs a warning.

Arrays in a sent message are handed to ZeroMQ without copying: do not modify them after ``send``.
"""

import logging
import math
import secrets
import time
from collections import OrderedDict, deque
from contextlib import ExitStack
from dataclasses import dataclass
from ipaddress import ip_address
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import trio
import zmq

from longhorizon.common.codec import (
    CONTROL_LIMITS,
    DEFAULT_LIMITS,
    WEIGHTS_LIMITS,
    WireError,
    WireLimits,
    decode,
    encode,
)
from longhorizon.common.wire import Message, Stop

if TYPE_CHECKING:
    from longhorizon.common.auth import RunSecret
    from longhorizon.common.curve import CurveKeys, ZapGate

    Credentials = CurveKeys | RunSecret

logger = logging.getLogger(__name__)

REJECTION_LOG_INTERVAL_S = 10.0
"""At most one warning per socket in this many seconds; the others are summed into the next."""

DEFAULT_TRAJECTORY_HWM = 32
"""Trajectories queued per connection on each side before a sender waits (often ~1 MiB each)."""

DEFAULT_BROADCAST_HWM = 8
"""Broadcasts queued per subscriber on each side; whole models can be in each."""

DEFAULT_CONTROL_HWM = 256
"""Control messages queued per connection on each side; they are small."""

COPY_THRESHOLD_BYTES = 512 * 1024
"""Frames smaller than this are copied on send; larger ones (token arrays, weight tensors) are
sent without a copy (pyzmq's own default is 64 KiB)."""

DEFAULT_TAKEOVER_AFTER_S = 30.0
"""How long the connection holding an actor id may stay silent before another connection may
take the id over (the learner passes its ``learner.peer_timeout_s``)."""

CONNECTION_MARK = "#"
"""Separates the actor id from the dealer's own token in its routing identity."""

CONNECTION_PROPERTY = "X-Connection"
"""The handshake property under which an actor's trajectory socket names its control connection
(the dealer's routing identity), so that the learner can tell which admitted process sent each
trajectory."""

_KNOWN_CONNECTIONS = 4096
"""How many admitted control connections the router remembers after they are gone: trajectories
an actor sent just before it died or restarted are still vouched for."""


def new_connection_id(actor_id: str) -> str:
    """A fresh identity for one process's connection speaking for ``actor_id``: the id, the
    mark, and a random token no other process knows."""
    return f"{actor_id}{CONNECTION_MARK}{secrets.token_hex(8)}"


def actor_id_of_connection(connection: str) -> str:
    """The actor id a connection identity speaks for."""
    return connection.rpartition(CONNECTION_MARK)[0] or connection


def is_loopback_host(host: str) -> bool:
    """127.0.0.0/8, ::1 and localhost; anything else (a name, 0.0.0.0, *) may be reachable from
    other machines."""
    if host == "localhost":
        return True
    try:
        return ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class UnknownPeer(LookupError):
    """A router was asked to send to a peer that is not connected (or never was)."""


# ---------------------------------------------------------------------------------------------
# Interfaces
# ---------------------------------------------------------------------------------------------


@runtime_checkable
class Sender(Protocol):
    """Sends messages to one channel; ``send`` waits while the channel is full."""

    async def send(self, message: Message) -> None: ...

    def close(self) -> None: ...


@runtime_checkable
class Receiver(Protocol):
    """Receives valid messages; invalid ones are skipped, logged and counted in ``rejected``."""

    rejected: int

    async def receive(self) -> Message: ...

    def close(self) -> None: ...


@runtime_checkable
class TrajectoryReceiver(Receiver, Protocol):
    """The learner's end of the trajectory channel: a Receiver that also says which control
    connection each message's sender named (see ``Router.vouches_for``)."""

    async def receive_with_sender(self) -> tuple[str | None, Message]: ...


@runtime_checkable
class Router(Protocol):
    """The learner's end of the control channel: talks to many peers by id."""

    rejected: int

    async def receive(self) -> tuple[str, Message]: ...

    def vouches_for(self, connection: str | None, actor_id: str) -> bool | None: ...

    async def send(self, peer_id: str, message: Message) -> None: ...

    def close(self) -> None: ...


@runtime_checkable
class Dealer(Protocol):
    """An actor's end of the control channel."""

    rejected: int

    async def send(self, message: Message) -> None: ...

    async def receive(self) -> Message: ...

    def refusal(self) -> str | None:
        """Why the learner refused this process's connection (its secret or keys), or None."""
        ...

    def close(self) -> None: ...


@dataclass
class LearnerEndpoints:
    """Everything the learner process talks through."""

    trajectories: TrajectoryReceiver
    broadcast: Sender
    control: Router
    owned_context: Any = None
    """A ZeroMQ context made for these sockets alone, terminated by ``close``."""
    gate: "ZapGate | None" = None
    """With CurveZMQ or the run's secret: admits the run's actors and counts refusals; closed by
    ``close``."""

    @property
    def auth_refused(self) -> int:
        """Connections refused: for want of the run's keys or secret (by the gate), or speaking
        for an actor id that another live connection holds (by the control router)."""
        refused = self.gate.refused if self.gate is not None else 0
        return refused + int(getattr(self.control, "takeovers_refused", 0))

    def close(self) -> None:
        _close_in_order(self, self.gate)


@dataclass
class ActorEndpoints:
    """Everything an actor process talks through."""

    trajectories: Sender
    broadcast: Receiver
    control: Dealer
    owned_context: Any = None
    """A ZeroMQ context made for these sockets alone, terminated by ``close``."""

    def close(self) -> None:
        _close_in_order(self)


def _close_in_order(endpoints: "LearnerEndpoints | ActorEndpoints", gate: "ZapGate | None" = None) -> None:
    """Close the three sockets, then the authentication gate (its sockets live in the same context),
    then terminate their own context. Terminating waits for ZeroMQ's I/O threads to let go of
    every message (LINGER 0 drops what was not sent), so no buffer lent to them is freed while
    they still read it, as could happen when a process exits with its context alive."""
    endpoints.trajectories.close()
    endpoints.broadcast.close()
    endpoints.control.close()
    if gate is not None:
        gate.close()
    if endpoints.owned_context is not None:
        endpoints.owned_context.term()
        endpoints.owned_context = None


class RateLimitedLog:
    """Counts events and logs them at WARNING without letting a flood spam the log: at most one
    line per ``interval_s``, the events in between summed into the next line."""

    def __init__(self, what: str, *, log: logging.Logger | None = None,
                 interval_s: float = REJECTION_LOG_INTERVAL_S) -> None:
        self.what = what
        self.interval_s = interval_s
        self.count = 0
        self._log = log or logger
        self._unreported = 0
        self._next_report_time = 0.0

    def record(self, reason: str) -> None:
        self.count += 1
        now = time.monotonic()
        if now < self._next_report_time:
            self._unreported += 1
            return
        also = f" ({self._unreported} more since the last report)" if self._unreported else ""
        self._log.warning("%s: %s%s", self.what, reason[:300], also)
        self._unreported = 0
        self._next_report_time = now + self.interval_s


class _Decoding:
    """Decodes received frames; counts and logs the messages it has to reject."""

    _limits: WireLimits
    _rejections: RateLimitedLog

    @property
    def rejected(self) -> int:
        """Messages received and dropped as invalid since this endpoint was made."""
        return self._rejections.count

    def _decode_or_count(self, frames: Any) -> Message | None:
        try:
            return decode(frames, limits=self._limits)
        except WireError as error:
            self._rejections.record(error.reason)
            return None


# ---------------------------------------------------------------------------------------------
# ZeroMQ under trio
# ---------------------------------------------------------------------------------------------


class _TrioSocket:
    """A ZeroMQ socket whose sends and receives wait in trio instead of blocking the thread.

    ZeroMQ exposes one file descriptor per socket that becomes readable whenever the socket's
    state *may* have changed, in either direction (so it is waited on for readability even when
    waiting to send). It is edge-triggered, and any call into the socket (send, receive, even
    reading ZMQ_EVENTS) can consume the edge. So: always read ZMQ_EVENTS before waiting; let
    only one task wait on the descriptor at a time (trio allows no more); and whenever a call
    finds the socket ready in a direction some other task is waiting for, wake that task,
    because the edge it was waiting for may just have been consumed.
    """

    def __init__(self, socket: zmq.Socket, name: str) -> None:
        self.socket = socket
        self.name = name
        self.closed = False
        self._fd = socket.getsockopt(zmq.FD)
        self._waiting = {zmq.POLLIN: 0, zmq.POLLOUT: 0}
        self._fd_watch: trio.CancelScope | None = None
        self._bystanders = 0
        self._state_changed = trio.Event()

    def _raise_if_closed(self) -> None:
        if self.closed:
            raise trio.ClosedResourceError(f"{self.name} is closed")

    def _wake_others(self) -> None:
        if self._fd_watch is not None:
            self._fd_watch.cancel()
        if self._bystanders:
            self._state_changed.set()
            self._state_changed = trio.Event()

    def _read_events(self) -> int:
        events = self.socket.getsockopt(zmq.EVENTS)
        if (events & zmq.POLLIN and self._waiting[zmq.POLLIN]) or (
            events & zmq.POLLOUT and self._waiting[zmq.POLLOUT]
        ):
            self._wake_others()
        return events

    async def _wait_for(self, flag: int) -> None:
        self._waiting[flag] += 1
        try:
            while True:
                self._raise_if_closed()
                if self._read_events() & flag:
                    return
                if self._fd_watch is None:
                    with trio.CancelScope() as scope:
                        self._fd_watch = scope
                        try:
                            await trio.lowlevel.wait_readable(self._fd)
                        finally:
                            self._fd_watch = None
                            # Someone else may need to take over watching the descriptor.
                            if self._bystanders:
                                self._state_changed.set()
                                self._state_changed = trio.Event()
                else:
                    self._bystanders += 1
                    try:
                        await self._state_changed.wait()
                    finally:
                        self._bystanders -= 1
        finally:
            self._waiting[flag] -= 1

    def _after_operation(self) -> None:
        if self._waiting[zmq.POLLIN] or self._waiting[zmq.POLLOUT]:
            self._read_events()

    async def send_frames(self, frames: list[Any], *, full_retry_s: float | None = None) -> None:
        """Send one multipart message, waiting while the socket cannot take it.

        ``full_retry_s``: for a ROUTER, where ZMQ_EVENTS says "writable" as long as *any* peer
        has room, a full peer is retried after this many seconds instead of waiting on events.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        while True:
            self._raise_if_closed()
            try:
                # Multipart messages are atomic in ZeroMQ: if the first frame is accepted, so are
                # the rest, so a NOBLOCK send never leaves half a message behind.
                self.socket.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                if full_retry_s is None:
                    await self._wait_for(zmq.POLLOUT)
                else:
                    await trio.sleep(full_retry_s)
                continue
            self._after_operation()
            # Let other tasks run even when the socket never makes us wait.
            await trio.lowlevel.cancel_shielded_checkpoint()
            return

    def send_now(self, frames: list[Any]) -> None:
        """Send one multipart message if the socket takes it at once; zmq.Again if it cannot,
        and ZMQError for anything else (a ROUTER's EHOSTUNREACH: no such peer)."""
        self._raise_if_closed()
        self.socket.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
        self._after_operation()

    async def receive_frames(self) -> list[zmq.Frame]:
        await trio.lowlevel.checkpoint_if_cancelled()
        while True:
            self._raise_if_closed()
            try:
                frames = self.socket.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                await self._wait_for(zmq.POLLIN)
                continue
            self._after_operation()
            await trio.lowlevel.cancel_shielded_checkpoint()
            return frames

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._fd_watch is not None:
            # Wakes the task parked on the descriptor with ClosedResourceError before the
            # descriptor disappears (only possible inside trio, where such a task can exist).
            trio.lowlevel.notify_closing(self._fd)
        if self._bystanders:
            self._state_changed.set()
        self.socket.close(linger=0)


def _warn_if_exposed(address: str, name: str) -> None:
    """Called for a socket bound without CurveZMQ (nothing, or only the run's secret, which is
    meant for loopback: it travels unencrypted)."""
    if address.startswith("tcp://"):
        host = address[len("tcp://") :].rsplit(":", 1)[0]
        if not is_loopback_host(host):
            logger.warning(
                "%s binds to %s beyond loopback WITHOUT authentication or encryption "
                "(transport.insecure = true): any host that can reach it can connect, send it "
                "messages and read what it sends",
                name,
                address,
            )


def _open_socket(
    *,
    context: zmq.Context | None,
    socket_type: int,
    name: str,
    address: str,
    bind: bool,
    send_hwm: int,
    receive_hwm: int,
    limits: WireLimits | None,
    identity: str | None = None,
    options: dict[int, int | bytes] | None = None,
    gate: "ZapGate | None" = None,
    credentials: "Credentials | None" = None,
    before_connect: Callable[[zmq.Socket], None] | None = None,
) -> tuple[_TrioSocket, str]:
    """A configured, bound or connected socket, and its address (with the real port if bound).

    A bound socket with ``gate`` is a server guarded by that gate (CurveZMQ, or PLAIN with the
    run's secret); a connecting one with ``credentials`` (the run's client keys, or its secret)
    is the matching client. ``before_connect(socket)`` runs just before the bind or connect (a
    monitor attached later could miss the first handshake's events).
    """
    if not isinstance(address, str) or "://" not in address:
        raise ValueError(f"{name}: {address!r} is not a ZeroMQ address like 'tcp://127.0.0.1:5555'")
    if send_hwm < 0 or receive_hwm < 0:
        raise ValueError(f"{name}: high-water marks must be >= 0 (0 means unlimited)")
    if (gate is not None and not bind) or (credentials is not None and bind):
        raise ValueError(f"{name}: a bound socket takes a gate, a connecting one the credentials")
    socket = (context or zmq.Context.instance()).socket(socket_type)
    # Frames under this size are copied into ZeroMQ rather than lent to it: a lent frame is
    # released later through pyzmq's garbage-collector thread, which must take the GIL back from
    # the sender, and that costs more than copying a message header of a few hundred KiB.
    socket.copy_threshold = COPY_THRESHOLD_BYTES
    try:
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SNDHWM, send_hwm)
        socket.setsockopt(zmq.RCVHWM, receive_hwm)
        if limits is not None:
            # What the mechanism adds to each frame on the wire, which libzmq counts: the same
            # frames pass with it as without.
            overhead = (gate or credentials).FRAME_OVERHEAD_BYTES if (gate or credentials) else 0
            socket.setsockopt(zmq.MAXMSGSIZE, limits.max_message_bytes + overhead)
        if identity is not None:
            socket.setsockopt(zmq.IDENTITY, identity.encode("utf-8"))
        for option, value in (options or {}).items():
            socket.setsockopt(option, value)
        # Security options must be in place before the first connection; the gate also starts
        # watching the socket's handshakes here, before any peer can reach it.
        if gate is not None:
            gate.protect(socket, name)
        for option, key in (credentials.client_options() if credentials is not None else {}).items():
            socket.setsockopt(option, key)
        if before_connect is not None:
            before_connect(socket)
        if bind:
            if gate is None or not gate.ENCRYPTS:
                _warn_if_exposed(address, name)
            socket.bind(address)
            address = socket.getsockopt_string(zmq.LAST_ENDPOINT)
        else:
            socket.connect(address)
    except zmq.ZMQError as error:
        socket.close(linger=0)
        verb = "bind" if bind else "connect"
        raise OSError(error.errno, f"{name}: cannot {verb} to {address!r}: {error.strerror}") from error
    return _TrioSocket(socket, name), address


class _ZmqEndpoint:
    """Shared by the ZeroMQ endpoints: the socket, its address, and closing."""

    _socket: _TrioSocket
    address: str

    def close(self) -> None:
        """Close the socket at once (LINGER 0): messages not yet sent are dropped."""
        self._socket.close()

    def __enter__(self) -> "_ZmqEndpoint":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class _ZmqReceiving(_Decoding, _ZmqEndpoint):
    """A ZeroMQ endpoint that decodes what it receives."""


class ZmqPushSender(_ZmqEndpoint):
    """Sends trajectories to the learner (PUSH, connects); waits when the queues are full."""

    def __init__(
        self,
        address: str,
        *,
        send_hwm: int = DEFAULT_TRAJECTORY_HWM,
        context: zmq.Context | None = None,
        credentials: "Credentials | None" = None,
        connection: str | None = None,
    ) -> None:
        # ``connection``: the identity of this process's control connection, which the socket's
        # handshake carries (encrypted with CurveZMQ) and the learner reads off every message.
        options = {zmq.METADATA: f"{CONNECTION_PROPERTY}:{connection}".encode("utf-8")} if connection else None
        self._socket, self.address = _open_socket(
            context=context, socket_type=zmq.PUSH, name="trajectory sender", address=address,
            bind=False, send_hwm=send_hwm, receive_hwm=0, limits=None, credentials=credentials,
            options=options,
        )

    async def send(self, message: Message) -> None:
        await self._socket.send_frames(encode(message))


class ZmqPullReceiver(_ZmqReceiving):
    """Receives trajectories from all actors (PULL, binds)."""

    def __init__(
        self,
        address: str = "tcp://127.0.0.1:*",
        *,
        limits: WireLimits = DEFAULT_LIMITS,
        receive_hwm: int = DEFAULT_TRAJECTORY_HWM,
        context: zmq.Context | None = None,
        gate: "ZapGate | None" = None,
    ) -> None:
        self._limits = limits
        self._rejections = RateLimitedLog("trajectory receiver rejected a message")
        self._socket, self.address = _open_socket(
            context=context, socket_type=zmq.PULL, name="trajectory receiver", address=address,
            bind=True, send_hwm=0, receive_hwm=receive_hwm, limits=limits, gate=gate,
        )

    async def receive(self) -> Message:
        return (await self.receive_with_sender())[1]

    async def receive_with_sender(self) -> tuple[str | None, Message]:
        """The next message, and the control connection its sender's handshake named (None for
        a socket that named none: not one of our actors)."""
        while True:
            frames = await self._socket.receive_frames()
            message = self._decode_or_count(frames)
            if message is not None:
                return _connection_property(frames[0]), message


def _connection_property(frame: zmq.Frame) -> str | None:
    try:
        return frame.get(CONNECTION_PROPERTY)
    except zmq.ZMQError:  # the peer's handshake did not carry it
        return None


class ZmqPublisher(_ZmqEndpoint):
    """Broadcasts weights and horizon updates to every subscribed actor (PUB, binds).

    Never waits: a subscriber that is more than the high-water marks behind misses messages.
    """

    def __init__(
        self,
        address: str = "tcp://127.0.0.1:*",
        *,
        send_hwm: int = DEFAULT_BROADCAST_HWM,
        context: zmq.Context | None = None,
        gate: "ZapGate | None" = None,
    ) -> None:
        self._socket, self.address = _open_socket(
            context=context, socket_type=zmq.PUB, name="broadcast publisher", address=address,
            bind=True, send_hwm=send_hwm, receive_hwm=0, limits=None, gate=gate,
        )

    async def send(self, message: Message) -> None:
        await self._socket.send_frames(encode(message))


class ZmqSubscriber(_ZmqReceiving):
    """Receives every broadcast published after it connected (SUB, connects)."""

    def __init__(
        self,
        address: str,
        *,
        limits: WireLimits = WEIGHTS_LIMITS,
        receive_hwm: int = DEFAULT_BROADCAST_HWM,
        context: zmq.Context | None = None,
        credentials: "Credentials | None" = None,
    ) -> None:
        self._limits = limits
        self._rejections = RateLimitedLog("broadcast subscriber rejected a message")
        self._socket, self.address = _open_socket(
            context=context, socket_type=zmq.SUB, name="broadcast subscriber", address=address,
            bind=False, send_hwm=0, receive_hwm=receive_hwm, limits=limits, credentials=credentials,
        )
        self._socket.socket.setsockopt(zmq.SUBSCRIBE, b"")

    async def receive(self) -> Message:
        while True:
            message = self._decode_or_count(await self._socket.receive_frames())
            if message is not None:
                return message


class ZmqRouter(_ZmqReceiving):
    """The learner's control socket (ROUTER, binds): messages arrive tagged with the actor id.

    Each dealer's routing identity is its actor id plus a token of its own (``ZmqDealer``), so
    every connection is told apart, and one connection at a time speaks for an actor id: the
    first the router hears from. Another connection under the same actor id (a duplicate actor,
    or a stray process of the run) is refused while that one is live: its messages are dropped,
    it is counted in ``takeovers_refused``, logged, and sent a Stop saying why. It takes the id
    over only once the holder is gone (its connection closed: a restarted actor rejoins at once)
    or silent longer than ``takeover_after_s`` (a hung one). ZeroMQ's own identity handover would
    give the id to the newest connection and leave the holder's connection unread for good.

    A dealer that reconnects under its own identity (a broken connection) takes over its old
    connection (ROUTER_HANDOVER). Sending to an id whose connection is gone raises
    ``UnknownPeer`` instead of dropping the message silently (ROUTER_MANDATORY). Sending to a
    peer whose queue is full waits (retrying every ``full_peer_retry_s``) until it has room: a
    peer that hangs without disconnecting makes ``send`` wait, so callers that must not stall
    wrap it in a timeout.
    """

    def __init__(
        self,
        address: str = "tcp://127.0.0.1:*",
        *,
        limits: WireLimits = CONTROL_LIMITS,
        hwm: int = DEFAULT_CONTROL_HWM,
        full_peer_retry_s: float = 0.01,
        takeover_after_s: float = DEFAULT_TAKEOVER_AFTER_S,
        context: zmq.Context | None = None,
        gate: "ZapGate | None" = None,
    ) -> None:
        self._limits = limits
        self._rejections = RateLimitedLog("control router rejected a message")
        self._takeovers = RateLimitedLog("control router refused a connection")
        self._full_peer_retry_s = full_peer_retry_s
        self.takeover_after_s = takeover_after_s
        # actor id -> routing identity of the connection that speaks for it, and when each such
        # connection was last heard from (monotonic seconds).
        self._holders: dict[str, bytes] = {}
        self._last_heard: dict[bytes, float] = {}
        self._refused: set[bytes] = set()
        # Every connection admitted to speak for an actor id, the latest last (bounded).
        self._admitted: OrderedDict[bytes, None] = OrderedDict()
        self._socket, self.address = _open_socket(
            context=context, socket_type=zmq.ROUTER, name="control router", address=address,
            bind=True, send_hwm=hwm, receive_hwm=hwm, limits=limits,
            options={zmq.ROUTER_MANDATORY: 1, zmq.ROUTER_HANDOVER: 1}, gate=gate,
        )

    @property
    def takeovers_refused(self) -> int:
        """Connections refused for speaking for an actor id that a live connection holds."""
        return self._takeovers.count

    async def receive(self) -> tuple[str, Message]:
        while True:
            frames = await self._socket.receive_frames()
            connection = frames[0].bytes
            try:
                identity = connection.decode("utf-8")
            except UnicodeDecodeError:
                self._rejections.record("peer identity is not UTF-8 (not one of our actors)")
                continue
            peer_id = actor_id_of_connection(identity)
            if not self._speaks_for(peer_id, connection):
                continue
            message = self._decode_or_count(frames[1:])
            if message is not None:
                return peer_id, message

    def _speaks_for(self, peer_id: str, connection: bytes) -> bool:
        """Whether ``connection`` may speak for ``peer_id`` (see the class's docstring)."""
        now = time.monotonic()
        holder = self._holders.get(peer_id)
        if holder is not None and holder != connection:
            silent_s = now - self._last_heard.get(holder, -math.inf)
            if silent_s <= self.takeover_after_s and self._connected(holder):
                self._refuse(peer_id, connection)
                return False
            logger.info(
                "control router: a new connection speaks for %s; the one before is %s", peer_id,
                f"silent for {silent_s:.0f}s" if silent_s > self.takeover_after_s else "gone",
            )
            self._last_heard.pop(holder, None)
        self._holders[peer_id] = connection
        self._last_heard[connection] = now
        self._refused.discard(connection)
        self._admitted[connection] = None
        self._admitted.move_to_end(connection)
        if len(self._admitted) > _KNOWN_CONNECTIONS:
            self._admitted.popitem(last=False)
        return True

    def vouches_for(self, connection: str | None, actor_id: str) -> bool | None:
        """Whether a message from the process behind ``connection`` may speak for ``actor_id``:
        True when this router admitted that connection for that id (now or before: an actor's
        last trajectories may arrive after it restarted), False when it names another id, none,
        or a connection refused the id; None when this router has not heard from it yet (its
        Hello may still be on the way)."""
        if connection is None or actor_id_of_connection(connection) != actor_id:
            return False
        raw = connection.encode("utf-8")
        if raw in self._admitted:
            return True
        return False if raw in self._refused else None

    def _connected(self, connection: bytes) -> bool:
        """Whether that connection is still there. An empty message probes it: the router fails
        at once for a connection that is gone (ROUTER_MANDATORY), and a dealer skips it."""
        try:
            self._socket.send_now([connection, b""])
        except zmq.Again:
            return True  # there, with a full queue
        except zmq.ZMQError as error:
            if error.errno == zmq.EHOSTUNREACH:
                return False
            raise
        return True

    def _refuse(self, peer_id: str, connection: bytes) -> None:
        """Drop a message of a connection refused the id; count, log and stop that connection
        once (our actors exit on Stop)."""
        if connection in self._refused:
            return
        self._refused.add(connection)
        self._takeovers.record(
            f"it speaks for {peer_id}, which another live connection holds (a second actor with "
            "the same index?); it is sent Stop"
        )
        reason = f"refused: {peer_id} is already live in another process of this run"
        try:
            self._socket.send_now([connection, *encode(Stop(reason=reason))])
        except zmq.ZMQError:
            pass  # gone already, or not reading: it was refused all the same

    async def send(self, peer_id: str, message: Message) -> None:
        connection = self._holders.get(peer_id)
        if connection is None:
            raise UnknownPeer(f"control router: no connected peer {peer_id!r}")
        frames = [connection, *encode(message)]
        try:
            await self._socket.send_frames(frames, full_retry_s=self._full_peer_retry_s)
        except zmq.ZMQError as error:
            if error.errno == zmq.EHOSTUNREACH:
                raise UnknownPeer(f"control router: no connected peer {peer_id!r}") from None
            raise


class ZmqDealer(_ZmqReceiving):
    """An actor's control socket (DEALER, connects). Its routing identity is the actor id, a
    ``CONNECTION_MARK`` and a random token, made once per socket: the learner tells this process
    apart from any other speaking for the same actor id, and the socket's own reconnections keep
    the identity."""

    def __init__(
        self,
        actor_id: str,
        address: str,
        *,
        limits: WireLimits = CONTROL_LIMITS,
        hwm: int = DEFAULT_CONTROL_HWM,
        context: zmq.Context | None = None,
        credentials: "Credentials | None" = None,
        connection: str | None = None,
    ) -> None:
        if not actor_id:
            raise ValueError("a dealer needs a non-empty actor id (it begins its routing identity)")
        if connection is not None and actor_id_of_connection(connection) != actor_id:
            raise ValueError(f"connection {connection!r} does not speak for {actor_id!r}")
        self.actor_id = actor_id
        self.connection = connection or new_connection_id(actor_id)
        self._limits = limits
        self._rejections = RateLimitedLog(f"control dealer {actor_id} rejected a message")
        # A refused socket has no connection to queue on: every send would wait for ever. A
        # monitor, attached before the first connection, tells us why (``refusal``).
        monitors: list[zmq.Socket] = []
        try:
            self._socket, self.address = _open_socket(
                context=context, socket_type=zmq.DEALER, name=f"control dealer {actor_id}",
                address=address, bind=False, send_hwm=hwm, receive_hwm=hwm, limits=limits,
                identity=self.connection, credentials=credentials,
                before_connect=lambda raw: monitors.append(raw.get_monitor_socket(_HANDSHAKE_EVENTS)),
            )
        except Exception:
            for monitor in monitors:
                monitor.close(linger=0)
            raise
        self._handshakes = monitors[0]
        self._refusal: str | None = None
        self._hang_ups_in_a_row = 0

    async def send(self, message: Message) -> None:
        await self._socket.send_frames(encode(message))

    async def receive(self) -> Message:
        while True:
            frames = await self._socket.receive_frames()
            if len(frames) == 1 and len(frames[0]) == 0:
                continue  # the router checking that this connection is still there
            message = self._decode_or_count(frames)
            if message is not None:
                return message

    def refusal(self) -> str | None:
        """Why the learner refused this socket's last handshake, or None (not refused, or a later
        handshake succeeded). Never waits."""
        from zmq.utils.monitor import parse_monitor_message

        while not self._socket.closed:
            try:
                event = parse_monitor_message(self._handshakes.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                break
            if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
                # The learner closed the connection before this side read why. A learner refusing
                # our mechanism usually hangs up first (seen in 17 of 20 tries on loopback), so
                # only some refusals arrive as a protocol failure; one hang-up alone may be a
                # learner that went away mid-handshake, several in a row are a refusal.
                self._hang_ups_in_a_row += 1
                if self._hang_ups_in_a_row >= HANG_UPS_THAT_MEAN_REFUSED:
                    self._refusal = handshake_hang_up_refusal(self._hang_ups_in_a_row)
                continue
            self._hang_ups_in_a_row = 0
            self._refusal = handshake_refusal(event["event"], event["value"])
        return self._refusal

    def close(self) -> None:
        if not self._socket.closed:
            self._socket.socket.disable_monitor()
            self._handshakes.close(linger=0)
        super().close()


_HANDSHAKE_EVENTS = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                     | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)

HANG_UPS_THAT_MEAN_REFUSED = 3
"""Handshakes the learner cut short in a row, with none admitted between, that an actor takes as
a refusal of its credentials."""


def handshake_refusal(event: int, value: int) -> str | None:
    """What a client socket's handshake event says about its admission: None for a success, else
    why the peer refused it, in words an operator can act on."""
    if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
        return None
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return (f"the learner refused this process's credentials (ZAP status {value}): it does not hold "
                "this run's secret or CurveZMQ keys")
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        return ("the learner speaks another security mechanism: one side has the run's secret or "
                "CurveZMQ keys and the other not (or other kinds)")
    return f"the handshake failed (ZeroMQ event {event}, value {value})"


def handshake_hang_up_refusal(hang_ups: int) -> str:
    """Why an actor whose handshakes the learner keeps cutting short is taken as refused."""
    return (f"the learner hung up during the handshake {hang_ups} times in a row: it speaks another "
            "security mechanism (one side has the run's secret or CurveZMQ keys and the other not, or "
            "other kinds)")


def zmq_learner_endpoints(
    *,
    trajectory_address: str,
    broadcast_address: str,
    control_address: str,
    trajectory_limits: WireLimits = DEFAULT_LIMITS,
    control_limits: WireLimits = CONTROL_LIMITS,
    trajectory_hwm: int = DEFAULT_TRAJECTORY_HWM,
    broadcast_hwm: int = DEFAULT_BROADCAST_HWM,
    control_hwm: int = DEFAULT_CONTROL_HWM,
    control_takeover_after_s: float = DEFAULT_TAKEOVER_AFTER_S,
    context: zmq.Context | None = None,
    curve: "CurveKeys | None" = None,
    secret: "RunSecret | None" = None,
) -> LearnerEndpoints:
    """The learner's three sockets, bound (port 0 picks free ports; see each ``.address``).

    Without ``context`` they get a context of their own, which ``close()`` terminates. With
    ``curve`` (the learner's keys) all three are CurveZMQ servers behind one gate, with ``secret``
    (the run's, on loopback) PLAIN servers behind one gate; a gate serves the context's ZAP
    requests, so a context holds at most one learner's sockets with either.
    ``control_takeover_after_s``: see ``ZmqRouter``'s ``takeover_after_s``.
    """
    if curve is not None and secret is not None:
        raise ValueError("the learner's sockets take CurveZMQ keys or the run's secret, not both")
    owned = None
    if context is None:
        context = owned = zmq.Context()
    with ExitStack() as opened:
        if owned is not None:
            opened.callback(owned.term)
        # The credentials make the gate that checks every peer: a CurveZMQ or a run-secret one.
        credentials = curve if curve is not None else secret
        gate = None if credentials is None else credentials.server_gate(context)
        if gate is not None:
            opened.callback(gate.close)
        trajectories = ZmqPullReceiver(
            trajectory_address, limits=trajectory_limits, receive_hwm=trajectory_hwm, context=context, gate=gate,
        )
        opened.callback(trajectories.close)
        broadcast = ZmqPublisher(broadcast_address, send_hwm=broadcast_hwm, context=context, gate=gate)
        opened.callback(broadcast.close)
        control = ZmqRouter(
            control_address, limits=control_limits, hwm=control_hwm, takeover_after_s=control_takeover_after_s,
            context=context, gate=gate,
        )
        opened.pop_all()
    return LearnerEndpoints(
        trajectories=trajectories, broadcast=broadcast, control=control, owned_context=owned, gate=gate
    )


def zmq_actor_endpoints(
    actor_id: str,
    *,
    trajectory_address: str,
    broadcast_address: str,
    control_address: str,
    broadcast_limits: WireLimits = WEIGHTS_LIMITS,
    control_limits: WireLimits = CONTROL_LIMITS,
    trajectory_hwm: int = DEFAULT_TRAJECTORY_HWM,
    broadcast_hwm: int = DEFAULT_BROADCAST_HWM,
    control_hwm: int = DEFAULT_CONTROL_HWM,
    context: zmq.Context | None = None,
    curve: "CurveKeys | None" = None,
    secret: "RunSecret | None" = None,
) -> ActorEndpoints:
    """An actor's three sockets, connected to the learner's addresses.

    Connecting succeeds even while the learner is not up yet: ZeroMQ keeps retrying. Without
    ``context`` the sockets get a context of their own, which ``close()`` terminates. With
    ``curve`` (an actor's keys) they are CurveZMQ clients, with ``secret`` (the run's) PLAIN
    clients presenting it.
    """
    if curve is not None and secret is not None:
        raise ValueError("an actor's sockets take CurveZMQ keys or the run's secret, not both")
    if curve is not None:
        curve.check("actor")
    credentials = curve if curve is not None else secret
    owned = None
    if context is None:
        context = owned = zmq.Context()
    # One identity for this process's control connection, named by its trajectory socket too:
    # the learner takes a trajectory only from the process admitted for its actor id.
    connection = new_connection_id(actor_id)
    with ExitStack() as opened:
        if owned is not None:
            opened.callback(owned.term)
        trajectories = ZmqPushSender(
            trajectory_address, send_hwm=trajectory_hwm, context=context, credentials=credentials,
            connection=connection,
        )
        opened.callback(trajectories.close)
        broadcast = ZmqSubscriber(
            broadcast_address, limits=broadcast_limits, receive_hwm=broadcast_hwm, context=context,
            credentials=credentials,
        )
        opened.callback(broadcast.close)
        control = ZmqDealer(
            actor_id, control_address, limits=control_limits, hwm=control_hwm, context=context,
            credentials=credentials, connection=connection,
        )
        opened.pop_all()
    return ActorEndpoints(trajectories=trajectories, broadcast=broadcast, control=control, owned_context=owned)


# ---------------------------------------------------------------------------------------------
# The in-process twin
# ---------------------------------------------------------------------------------------------


def _detached(frames: list[Any]) -> list[bytes]:
    """A private copy of the frames, as a real socket would deliver: neither side sees the other's
    later changes to its arrays. (One copy per message; cheap next to the work around it.)"""
    return [bytes(frame) for frame in frames]


class InProcessPushSender:
    """Twin of ZmqPushSender: waits when the network's bounded trajectory buffer is full."""

    def __init__(self, channel: trio.MemorySendChannel) -> None:
        self._channel = channel

    async def send(self, message: Message) -> None:
        await self.send_frames(encode(message))

    async def send_frames(self, frames: list[Any]) -> None:
        """Put raw frames on the channel, as a faulty or hostile peer could (for tests)."""
        await self._channel.send(_detached(frames))

    def close(self) -> None:
        self._channel.close()


class InProcessPullReceiver(_Decoding):
    """Twin of ZmqPullReceiver."""

    def __init__(self, channel: trio.MemoryReceiveChannel, limits: WireLimits) -> None:
        self._channel = channel
        self._limits = limits
        self._rejections = RateLimitedLog("in-process trajectory receiver rejected a message")

    async def receive(self) -> Message:
        while True:
            message = self._decode_or_count(await self._channel.receive())
            if message is not None:
                return message

    async def receive_with_sender(self) -> tuple[str | None, Message]:
        """As ZmqPullReceiver's; one process has no connections to name (None)."""
        return None, await self.receive()

    def close(self) -> None:
        self._channel.close()


class InProcessPublisher:
    """Twin of ZmqPublisher: never waits; each subscriber keeps what it has not read yet."""

    def __init__(self, network: "InProcessNetwork") -> None:
        self._network = network
        self._closed = False

    async def send(self, message: Message) -> None:
        if self._closed:
            raise trio.ClosedResourceError("in-process publisher is closed")
        frames = _detached(encode(message))
        for subscriber in list(self._network._subscribers):
            subscriber._deliver(frames)
        await trio.lowlevel.checkpoint()

    def close(self) -> None:
        self._closed = True


class InProcessSubscriber(_Decoding):
    """Twin of ZmqSubscriber: gets every message published after it subscribed, except that when
    it falls behind it keeps only the latest ``keep_latest`` (older ones are superseded anyway)."""

    def __init__(self, network: "InProcessNetwork", keep_latest: int, limits: WireLimits) -> None:
        self._network = network
        self._pending: deque[list[bytes]] = deque(maxlen=keep_latest)
        self._arrived = trio.lowlevel.ParkingLot()
        self._closed = False
        self._limits = limits
        self._rejections = RateLimitedLog("in-process broadcast subscriber rejected a message")

    def _deliver(self, frames: list[bytes]) -> None:
        self._pending.append(frames)
        self._arrived.unpark_all()

    async def receive(self) -> Message:
        await trio.lowlevel.checkpoint()
        while True:
            if self._closed:
                raise trio.ClosedResourceError("in-process subscriber is closed")
            if not self._pending:
                await self._arrived.park()
                continue
            message = self._decode_or_count(self._pending.popleft())
            if message is not None:
                return message

    def close(self) -> None:
        self._closed = True
        self._network._subscribers.discard(self)
        self._arrived.unpark_all()


class InProcessRouter(_Decoding):
    """Twin of ZmqRouter."""

    def __init__(self, network: "InProcessNetwork", limits: WireLimits) -> None:
        self._network = network
        self._inbox = network._control_inbox_receive.clone()
        self._closed = False
        self._limits = limits
        self._rejections = RateLimitedLog("in-process control router rejected a message")

    async def receive(self) -> tuple[str, Message]:
        while True:
            peer_id, frames = await self._inbox.receive()
            message = self._decode_or_count(frames)
            if message is not None:
                return peer_id, message

    def vouches_for(self, connection: str | None, actor_id: str) -> bool | None:
        """As ZmqRouter's; every party of one process is the run's own (True)."""
        return True

    async def send(self, peer_id: str, message: Message) -> None:
        if self._closed:
            raise trio.ClosedResourceError("in-process router is closed")
        frames = _detached(encode(message))
        dealer = self._network._dealers.get(peer_id)
        if dealer is None:
            raise UnknownPeer(f"in-process router: no connected peer {peer_id!r}")
        try:
            await dealer._inbox_send.send(frames)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            raise UnknownPeer(f"in-process router: peer {peer_id!r} has closed") from None

    def close(self) -> None:
        self._closed = True
        self._inbox.close()


class InProcessDealer(_Decoding):
    """Twin of ZmqDealer. A second dealer with the same id takes over from the first, like a
    restarted actor reconnecting to a ROUTER with handover."""

    def __init__(
        self, network: "InProcessNetwork", peer_id: str, buffer: int, limits: WireLimits
    ) -> None:
        self.actor_id = peer_id
        self._network = network
        self._to_router = network._control_inbox_send.clone()
        self._inbox_send, self._inbox_receive = trio.open_memory_channel(buffer)
        self._limits = limits
        self._rejections = RateLimitedLog(f"in-process control dealer {peer_id} rejected a message")

    async def send(self, message: Message) -> None:
        await self._to_router.send((self.actor_id, _detached(encode(message))))

    def refusal(self) -> str | None:
        return None  # one process, no handshake

    async def receive(self) -> Message:
        while True:
            message = self._decode_or_count(await self._inbox_receive.receive())
            if message is not None:
                return message

    def close(self) -> None:
        if self._network._dealers.get(self.actor_id) is self:
            del self._network._dealers[self.actor_id]
        self._to_router.close()
        self._inbox_receive.close()
        self._inbox_send.close()


class InProcessNetwork:
    """The three channels on trio memory channels, for tests and single-process runs.

    Messages still go through ``encode`` and ``decode`` (with a copy of the frames), so
    everything that crosses this network has crossed the real codec. Like everything trio, it
    is meant for tasks of one thread.
    """

    def __init__(
        self,
        *,
        trajectory_buffer: int = DEFAULT_TRAJECTORY_HWM,
        broadcast_keep_latest: int = DEFAULT_BROADCAST_HWM,
        control_buffer: int = DEFAULT_CONTROL_HWM,
        trajectory_limits: WireLimits = DEFAULT_LIMITS,
        broadcast_limits: WireLimits = WEIGHTS_LIMITS,
        control_limits: WireLimits = CONTROL_LIMITS,
    ) -> None:
        if trajectory_buffer < 0 or control_buffer < 0 or broadcast_keep_latest < 1:
            raise ValueError("buffers must be >= 0 and broadcast_keep_latest >= 1")
        self._trajectory_send, self._trajectory_receive = trio.open_memory_channel(trajectory_buffer)
        self._control_inbox_send, self._control_inbox_receive = trio.open_memory_channel(control_buffer)
        self._subscribers: set[InProcessSubscriber] = set()
        self._dealers: dict[str, InProcessDealer] = {}
        self._broadcast_keep_latest = broadcast_keep_latest
        self._control_buffer = control_buffer
        self._trajectory_limits = trajectory_limits
        self._broadcast_limits = broadcast_limits
        self._control_limits = control_limits

    def push_sender(self) -> InProcessPushSender:
        return InProcessPushSender(self._trajectory_send.clone())

    def pull_receiver(self) -> InProcessPullReceiver:
        return InProcessPullReceiver(self._trajectory_receive.clone(), self._trajectory_limits)

    def publisher(self) -> InProcessPublisher:
        return InProcessPublisher(self)

    def subscriber(self) -> InProcessSubscriber:
        subscriber = InProcessSubscriber(self, self._broadcast_keep_latest, self._broadcast_limits)
        self._subscribers.add(subscriber)
        return subscriber

    def router(self) -> InProcessRouter:
        return InProcessRouter(self, self._control_limits)

    def dealer(self, peer_id: str) -> InProcessDealer:
        if not peer_id:
            raise ValueError("a dealer needs a non-empty actor id (it is its routing identity)")
        dealer = InProcessDealer(self, peer_id, self._control_buffer, self._control_limits)
        self._dealers[peer_id] = dealer
        return dealer

    def learner_endpoints(self) -> LearnerEndpoints:
        return LearnerEndpoints(
            trajectories=self.pull_receiver(), broadcast=self.publisher(), control=self.router()
        )

    def actor_endpoints(self, actor_id: str) -> ActorEndpoints:
        return ActorEndpoints(
            trajectories=self.push_sender(), broadcast=self.subscriber(), control=self.dealer(actor_id)
        )
