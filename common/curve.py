"""CurveZMQ for a run: its keys, how they reach each process, and the learner's gate that admits
only the run's actors and counts the peers it refuses. (Runs on loopback authenticate with a
secret instead, through a gate of the same kind: common/auth.py, which also picks between them.)

A run's secret is two CurveZMQ keypairs made for that run alone: the learner's (the server: it
binds all three sockets) and one client keypair shared by the actors. A connection to any of the
learner's sockets completes only when both ends prove what they hold: the actor that it knows the
learner's secret key is behind the learner's public key, the learner (through its ZAP handler,
which admits one client public key and nothing else) that the actor holds the run's client
secret key. Everything after the handshake is encrypted. So a peer without the run's keys can
neither push a trajectory, nor talk on the control socket, nor read a broadcast.

Keys travel as one environment variable, ``LONGHORIZON_CURVE_KEYS``, holding a small JSON object
with what the process's role needs: the learner gets no client secret, an actor no server
secret. Launchers make fresh keys per run (``curve_environments``) and set the variable for each
process they start; a person who starts the processes by hand makes them once with
``longhorizon keys DIR`` (``learner.keys`` and ``actor.keys``, readable by their owner only) and
sets ``LONGHORIZON_CURVE_KEYS="$(cat DIR/actor.keys)"`` for each. A worker takes the variable
out of its environment when it starts, so nothing it starts (env helpers, sandboxes) inherits it.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import queue
import struct
import threading
from collections.abc import MutableMapping
from dataclasses import dataclass, replace
from pathlib import Path

import zmq
from zmq.utils import z85

from longhorizon.common.config import ConfigError, TransportConfig
from longhorizon.common.transport import RateLimitedLog, is_loopback_host

logger = logging.getLogger(__name__)

CURVE_KEYS_VARIABLE = "LONGHORIZON_CURVE_KEYS"
"""The environment variable that hands a process its role's keys (JSON; see ``CurveKeys``)."""

CURVE_MODES = ("auto", "on", "off")
ROLES = ("learner", "actor")

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
"""Where libzmq asks a context's authentication handler about each new connection (RFC 27)."""
ZAP_DOMAIN = b"longhorizon"

REFUSAL_EVENTS = (
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)
"""Every way a handshake can fail. The last one is a peer that closed the connection or said
nothing during it: a peer without CurveZMQ often sees the mismatch first and hangs up (which of
the two ends notices first is a race), and a port scanner does the same. An actor stopping in
the milliseconds of its handshake would be counted too."""

CURVE_FRAME_OVERHEAD_BYTES = 33
"""What CurveZMQ adds to each frame on the wire (command name, nonce, MAC, flags). libzmq checks
``zmq.MAXMSGSIZE`` against the wire size, so with CurveZMQ the limit is raised by this much: the
same frames pass with it as without."""

_GATE_POLL_MS = 100
"""How often the gate's thread looks for newly watched sockets and for its stop request."""


class CurveKeyError(ValueError):
    """CurveZMQ keys that are missing, malformed, or not the ones a role needs."""


@dataclass(frozen=True)
class CurveKeys:
    """A run's CurveZMQ keys, Z85 text (40 characters each). A role's copy leaves out the secret
    it does not need ("")."""

    server_public: str
    client_public: str
    server_secret: str = ""
    """The learner's alone."""
    client_secret: str = ""
    """The actors'."""

    @classmethod
    def make(cls) -> CurveKeys:
        """Fresh keys (one run's)."""
        server_public, server_secret = zmq.curve_keypair()
        client_public, client_secret = zmq.curve_keypair()
        return cls(
            server_public=server_public.decode(), client_public=client_public.decode(),
            server_secret=server_secret.decode(), client_secret=client_secret.decode(),
        )

    def server_gate(self, context: zmq.Context) -> CurveGate:
        """The learner's gate with these keys: it admits only peers holding the run's client keys."""
        return CurveGate(context, self)

    def for_role(self, role: str) -> CurveKeys:
        """The keys one role needs: the learner never holds the actors' secret, nor an actor the
        learner's (an actor that leaks its keys cannot pose as the learner)."""
        if role == "learner":
            copy = replace(self, client_secret="")
        elif role == "actor":
            copy = replace(self, server_secret="")
        else:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
        copy.check(role)
        return copy

    def check(self, role: str, *, source: str = "the keys") -> None:
        """Raise CurveKeyError unless these are well-formed keys with everything ``role`` needs."""
        needed = {"server_public", "client_public", "server_secret" if role == "learner" else "client_secret"}
        for name in sorted(needed):
            if not getattr(self, name):
                raise CurveKeyError(f"{source}: no {name}, which the {role} needs (give it the {role}.keys file)")
        for name, text in vars(self).items():
            if text and (len(text) != 40 or _z85_or_none(text) is None):
                raise CurveKeyError(f"{source}: {name} is not a CurveZMQ key (40 characters of Z85)")
        for public, secret in (("server_public", "server_secret"), ("client_public", "client_secret")):
            secret_key = getattr(self, secret)
            if secret_key and zmq.curve_public(secret_key.encode()).decode() != getattr(self, public):
                raise CurveKeyError(f"{source}: {public} does not belong to {secret} (keys of two runs mixed?)")

    def to_json(self) -> str:
        fields = {name: value for name, value in vars(self).items() if value}
        return json.dumps(fields, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, *, role: str, source: str) -> CurveKeys:
        """Parse and check a role's keys; ``source`` names where they came from in errors."""
        try:
            fields = json.loads(text)
        except json.JSONDecodeError:
            fields = None
        names = {"server_public", "client_public", "server_secret", "client_secret"}
        if not (isinstance(fields, dict) and set(fields) <= names and all(isinstance(v, str) for v in fields.values())):
            raise CurveKeyError(f"{source}: expected the contents of the {role}.keys file made by `longhorizon keys`")
        keys = cls(**{"server_public": "", "client_public": "", **fields})
        keys.check(role, source=source)
        return keys

    FRAME_OVERHEAD_BYTES = CURVE_FRAME_OVERHEAD_BYTES
    """What CurveZMQ adds to each frame on the wire (``zmq.MAXMSGSIZE`` counts it)."""

    def client_options(self) -> dict[int, bytes]:
        """Socket options of an actor's socket (a CurveZMQ client)."""
        return {
            zmq.CURVE_SERVERKEY: self.server_public.encode(),
            zmq.CURVE_PUBLICKEY: self.client_public.encode(),
            zmq.CURVE_SECRETKEY: self.client_secret.encode(),
        }


def _z85_or_none(text: str) -> bytes | None:
    try:
        return z85.decode(text)
    except (KeyError, ValueError, TypeError):
        return None


# ---------------------------------------------------------------------------------------------
# When a run uses CurveZMQ, and handing the keys over
# ---------------------------------------------------------------------------------------------


def uses_curve(transport: TransportConfig) -> bool:
    """Whether the run's sockets use CurveZMQ; ConfigError for settings that contradict each other
    or would leave sockets open beyond loopback without ``transport.insecure = true``."""
    if transport.curve not in CURVE_MODES:
        raise ConfigError(f"transport.curve must be one of {', '.join(CURVE_MODES)}, got {transport.curve!r}")
    off_box = not is_loopback_host(transport.host)
    if transport.curve == "on" and transport.insecure:
        raise ConfigError(
            "transport.curve = 'on' and transport.insecure = true contradict each other: keep one"
        )
    if transport.curve == "off" and off_box and not transport.insecure:
        raise ConfigError(
            f"transport.host {transport.host!r} is not loopback and transport.curve = 'off': any host "
            "that reaches the ports could send trajectories and read the weights. Use CurveZMQ "
            "(transport.curve = 'auto'), or set transport.insecure = true to run without authentication"
        )
    used = transport.curve == "on" or (transport.curve == "auto" and off_box and not transport.insecure)
    if used and not zmq.has("curve"):
        raise ConfigError(
            "transport: this pyzmq/libzmq is built without CurveZMQ (libsodium); install the pyzmq "
            "wheel from PyPI, which has it, or keep transport.host on loopback"
        )
    return used


def curve_environments(transport: TransportConfig) -> dict[str, dict[str, str]]:
    """Fresh keys for one run as the environment variables of each role ("learner", "actor"):
    empty dicts when the run does not use CurveZMQ. A launcher calls this once per run (so a
    restarted process gets the same keys) and adds its role's variables to each process it starts."""
    if not uses_curve(transport):
        return {role: {} for role in ROLES}
    keys = CurveKeys.make()
    return {role: {CURVE_KEYS_VARIABLE: keys.for_role(role).to_json()} for role in ROLES}


def curve_keys_for_process(
    role: str, transport: TransportConfig, environ: MutableMapping[str, str] = os.environ
) -> CurveKeys | None:
    """The keys this process's sockets use (None without CurveZMQ), taken out of ``environ`` so
    that processes started from here do not inherit them. A missing or wrong variable is a
    CurveKeyError that says how to provide it."""
    text = environ.pop(CURVE_KEYS_VARIABLE, None)
    if not uses_curve(transport):
        return None
    if text is None:
        why = (
            f"transport.host {transport.host!r} is not loopback" if transport.curve == "auto"
            else "transport.curve = 'on'"
        )
        raise CurveKeyError(
            f"{why}, so the sockets use CurveZMQ, but this {role} has no keys: set {CURVE_KEYS_VARIABLE} "
            f"to the contents of the {role}.keys file made by `longhorizon keys DIR` (the local launcher "
            "sets it itself), or set transport.insecure = true to run without authentication"
        )
    return CurveKeys.from_json(text, role=role, source=CURVE_KEYS_VARIABLE)


def write_key_files(folder: str | Path) -> list[Path]:
    """Make a run's keys and write ``learner.keys`` and ``actor.keys`` into ``folder``, each
    created readable by its owner only (never world-readable, not even for a moment). Refuses to
    replace existing files: processes may be using those keys."""
    folder = Path(folder)
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    keys = CurveKeys.make()
    written = []
    for role in ROLES:
        path = folder / f"{role}.keys"
        try:
            descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            raise CurveKeyError(f"{path} exists; keys are not replaced (remove it to make new ones)") from None
        with os.fdopen(descriptor, "w") as key_file:
            key_file.write(keys.for_role(role).to_json() + "\n")
        written.append(path)
    return written


def print_new_key_files(folder: str) -> int:
    """`longhorizon keys DIR`: write the files and say how to use them."""
    learner_file, actor_file = write_key_files(folder)
    print(f"wrote {learner_file} and {actor_file} (readable by you only); give each process its role's keys:")
    worker = "python -m longhorizon.launch.worker"
    print(f'  {CURVE_KEYS_VARIABLE}="$(cat {learner_file})" {worker} learner --config F')
    print(f'  {CURVE_KEYS_VARIABLE}="$(cat {actor_file})" {worker} actor --config F --index N')
    return 0


# ---------------------------------------------------------------------------------------------
# The learner's gate
# ---------------------------------------------------------------------------------------------


class ZapGate:
    """The server side of authentication in one ZeroMQ context (the learner's), on a thread of
    its own: it answers the context's ZAP requests, admitting only peers that prove they belong
    to the run, and counts (and logs, rate-limited) every connection to a watched socket that did
    not complete the handshake. A peer that keeps retrying is counted at each attempt.

    Subclasses say which mechanism they serve: ``CurveGate`` here (CurveZMQ: the run's keys,
    traffic encrypted), ``SecretGate`` in common/auth.py (ZeroMQ PLAIN: the run's secret, for
    loopback, nothing encrypted).

    One gate per context (libzmq has one ZAP endpoint per context). Make it before the sockets it
    protects, and close it after closing them and before terminating the context (its sockets
    belong to the context). If its thread ever stopped answering, handshakes would wait and then
    fail: the gate fails closed as long as its ZAP socket stays bound, which it does until ``close``.
    """

    MECHANISM = b""
    """The ZMTP security mechanism this gate admits (the ZAP request names it)."""
    FRAME_OVERHEAD_BYTES = 0
    """What the mechanism adds to each frame on the wire (``zmq.MAXMSGSIZE`` counts it)."""
    ENCRYPTS = False
    """Whether traffic through the gate's sockets is encrypted (safe beyond loopback)."""

    def __init__(self, context: zmq.Context, *, what: str) -> None:
        self._context = context
        self._refusals = RateLimitedLog(f"refused a connection ({what})")
        self._zap = context.socket(zmq.REP)
        self._zap.setsockopt(zmq.LINGER, 0)
        try:
            self._zap.bind(ZAP_ENDPOINT)
        except zmq.ZMQError as error:
            self._zap.close()
            raise OSError(error.errno, f"{what}: cannot serve ZAP in this context ({error.strerror}); "
                                       "is another gate bound to it?") from error
        self._new_monitors: queue.SimpleQueue = queue.SimpleQueue()
        self._monitors: dict[zmq.Socket, str] = {}
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = threading.Thread(target=self._serve, name="zap gate", daemon=True)
        self._thread.start()

    @property
    def refused(self) -> int:
        """Connections refused since the gate was made."""
        return self._refusals.count

    def protect(self, socket: zmq.Socket, name: str) -> None:
        """Make ``socket`` a server of this gate's mechanism, guarded by it. Call before it binds."""
        if socket.context is not self._context:
            # libzmq admits everyone when a context has no ZAP handler: the gate must be there.
            raise ValueError("a ZAP gate protects only sockets of its own ZeroMQ context")
        self._make_server(socket)
        socket.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
        # The monitor's pair socket is made here and then used only by the gate's thread (the
        # queue hands it over); events wait in it until that thread reads them.
        self._new_monitors.put((socket.get_monitor_socket(REFUSAL_EVENTS), name))

    def _make_server(self, socket: zmq.Socket) -> None:
        raise NotImplementedError

    def _admits(self, credentials: list[bytes]) -> bool:
        """Whether the credentials of a ZAP request of this gate's mechanism are the run's."""
        raise NotImplementedError

    def _refusal_reason(self, kind: int, value: int) -> str:
        """Why a handshake failed, for the log (``kind``: the monitor event, ``value``: its value)."""
        if kind == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
            return "it hung up or went silent during the handshake"
        return f"handshake error {value:#x}"

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._zap, zmq.POLLIN)
        while not self._stopping.is_set():
            while not self._new_monitors.empty():
                monitor, name = self._new_monitors.get()
                self._monitors[monitor] = name
                poller.register(monitor, zmq.POLLIN)
            for socket, _ in poller.poll(_GATE_POLL_MS):
                if socket is self._zap:
                    self._answer(socket.recv_multipart())
                else:
                    self._count(self._monitors[socket], socket.recv_multipart())

    def _answer(self, request: list[bytes]) -> None:
        # ZAP 1.0: version, request id, domain, peer address, identity, mechanism, then the
        # mechanism's credentials (CURVE: the client's public key; PLAIN: username, password).
        admitted = (
            len(request) >= 7 and request[0] == b"1.0" and request[5] == self.MECHANISM
            and self._admits(request[6:])
        )
        request_id = request[1] if len(request) > 1 else b""
        status, text = (b"200", b"OK") if admitted else (b"400", b"not this run's credentials")
        self._zap.send_multipart([b"1.0", request_id, status, text, b"actor" if admitted else b"", b""])

    def _count(self, name: str, event: list[bytes]) -> None:
        kind, value = struct.unpack("=HI", event[0][:6])
        self._refusals.record(f"{name}: {self._refusal_reason(kind, value)}")

    def close(self) -> None:
        """Stop the thread and close the gate's sockets (the protected sockets first, please)."""
        if self._thread is None:
            return
        self._stopping.set()
        self._thread.join()
        self._thread = None
        while not self._new_monitors.empty():
            self._monitors[self._new_monitors.get()[0]] = ""
        for monitor in self._monitors:
            monitor.close(linger=0)
        self._zap.close(linger=0)


class CurveGate(ZapGate):
    """CurveZMQ's gate: admits only the run's client public key. Refused: a peer without
    CurveZMQ, with another server key, with a client key that is not the run's, or one that hung
    up during the handshake."""

    MECHANISM = b"CURVE"
    FRAME_OVERHEAD_BYTES = CURVE_FRAME_OVERHEAD_BYTES
    ENCRYPTS = True

    def __init__(self, context: zmq.Context, keys: CurveKeys) -> None:
        keys.check("learner")
        self._server_secret = keys.server_secret.encode()
        self._client_public = z85.decode(keys.client_public)
        super().__init__(context, what="CurveZMQ")
        logger.info("CurveZMQ on: the learner's sockets admit only peers holding this run's keys")

    def _make_server(self, socket: zmq.Socket) -> None:
        socket.setsockopt(zmq.CURVE_SERVER, 1)
        socket.setsockopt(zmq.CURVE_SECRETKEY, self._server_secret)

    def _admits(self, credentials: list[bytes]) -> bool:
        return len(credentials) == 1 and hmac.compare_digest(credentials[0], self._client_public)

    def _refusal_reason(self, kind: int, value: int) -> str:
        if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            return "its client key is not this run's"
        if kind == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
            return "it hung up or went silent during the handshake (a peer without CurveZMQ?)"
        if value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            return "it does not use CurveZMQ (do transport.curve and transport.insecure differ between processes?)"
        if value == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
            return "it does not have this run's server key (another run's keys?)"
        return f"CurveZMQ handshake error {value:#x}"
