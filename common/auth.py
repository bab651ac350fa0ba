"""How a run's peers prove they belong to it: the mechanism each run uses, the per-run secret of
loopback runs and its gate, and how each process gets its credentials.

Every run authenticates the peers of the learner's three sockets; only processes of the run can
push a trajectory, speak on the control socket or read a broadcast:

- beyond loopback, CurveZMQ (common/curve.py): keys made per run, every frame encrypted;
- on loopback, ZeroMQ's PLAIN mechanism with a secret made per run: a peer presents it once when
  it connects and the learner's ZAP handler (``SecretGate``) refuses any other. Nothing is
  encrypted: loopback traffic never leaves the machine and reading it takes root. So it costs
  nothing per frame, where CurveZMQ would slow every weights broadcast (docs/design.md,
  "Processes and sockets", has the figures);
- nothing with ``transport.insecure = true`` (processes started by hand without a secret).

The secret travels like the CurveZMQ keys: one environment variable, ``LONGHORIZON_RUN_SECRET``,
the same for every process of the run. Launchers make it per run (``auth_environments``) and set
it for each process they start; a worker takes it out of its environment when it starts, so
nothing it starts inherits it, and it is never written to the run directory or logged.
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
from collections.abc import MutableMapping
from dataclasses import dataclass, field

import zmq

from longhorizon.common.config import TransportConfig
from longhorizon.common.curve import (
    ROLES,
    CurveKeys,
    ZapGate,
    curve_environments,
    curve_keys_for_process,
    uses_curve,
)
from longhorizon.common.transport import is_loopback_host

logger = logging.getLogger(__name__)

RUN_SECRET_VARIABLE = "LONGHORIZON_RUN_SECRET"
"""The environment variable that hands every process of a loopback run the run's secret."""

MECHANISMS = ("curve", "secret", "none")

_PLAIN_USERNAME = b"longhorizon"
"""PLAIN sends a user name with the password; only the password is checked."""

_MIN_SECRET_CHARACTERS = 16
_MAX_SECRET_BYTES = 255  # ZeroMQ PLAIN's limit on a password


class RunSecretError(ValueError):
    """A run secret that is missing or not usable."""


def auth_mechanism(transport: TransportConfig) -> str:
    """How the run's peers authenticate: "curve" (CurveZMQ: beyond loopback, or
    ``transport.curve = "on"``), "secret" (loopback, the default there) or "none"
    (``transport.insecure = true``). ConfigError for settings that contradict each other."""
    if uses_curve(transport):
        return "curve"
    if transport.insecure or not is_loopback_host(transport.host):
        # Beyond loopback without CurveZMQ, uses_curve has already refused unless insecure is set.
        return "none"
    return "secret"


@dataclass(frozen=True)
class RunSecret:
    """The run's shared secret (text). Never printed: its repr hides it."""

    value: str = field(repr=False)

    FRAME_OVERHEAD_BYTES = 0
    """PLAIN adds nothing to the frames after the handshake."""

    @classmethod
    def make(cls) -> RunSecret:
        """A fresh secret (one run's): 256 random bits."""
        return cls(secrets.token_hex(32))

    @classmethod
    def from_text(cls, text: str, *, source: str) -> RunSecret:
        """Check a secret handed over as text; ``source`` names where it came from in errors."""
        text = text.strip()
        if len(text) < _MIN_SECRET_CHARACTERS or len(text.encode("utf-8")) > _MAX_SECRET_BYTES:
            raise RunSecretError(
                f"{source}: the run's secret must have {_MIN_SECRET_CHARACTERS} to {_MAX_SECRET_BYTES} characters "
                f"(it has {len(text)}); make one with `python -c 'import secrets; print(secrets.token_hex(32))'`"
            )
        return cls(text)

    def client_options(self) -> dict[int, bytes]:
        """Socket options of an actor's socket (a PLAIN client presenting the secret)."""
        return {zmq.PLAIN_USERNAME: _PLAIN_USERNAME, zmq.PLAIN_PASSWORD: self.value.encode("utf-8")}

    def server_gate(self, context: zmq.Context) -> SecretGate:
        """The learner's gate with this secret: it admits only peers that present it."""
        return SecretGate(context, self)


class SecretGate(ZapGate):
    """The learner's gate on loopback: admits a connection only if it presents the run's secret
    (ZeroMQ PLAIN, checked by the context's ZAP handler). Refused, counted and logged: a peer
    without PLAIN (no secret), with another secret, or one that hung up during the handshake."""

    MECHANISM = b"PLAIN"

    def __init__(self, context: zmq.Context, secret: RunSecret) -> None:
        self._password = secret.value.encode("utf-8")
        super().__init__(context, what="run secret")
        logger.info("run secret on: the learner's sockets admit only peers holding this run's secret")

    def _make_server(self, socket: zmq.Socket) -> None:
        socket.setsockopt(zmq.PLAIN_SERVER, 1)

    def _admits(self, credentials: list[bytes]) -> bool:
        return len(credentials) == 2 and hmac.compare_digest(credentials[1], self._password)

    def _refusal_reason(self, kind: int, value: int) -> str:
        if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            return "it does not have this run's secret"
        if kind == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
            return "it hung up or went silent during the handshake (a peer without the run's secret?)"
        if value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            return (f"it presents no run secret (a process started without {RUN_SECRET_VARIABLE}, or "
                    "with another transport.insecure or transport.curve?)")
        return f"handshake error {value:#x}"


def auth_environments(transport: TransportConfig) -> dict[str, dict[str, str]]:
    """The run's credentials as the environment variables of each role ("learner", "actor"):
    CurveZMQ keys, the run's secret, or nothing, per ``auth_mechanism``. A launcher calls this once
    per run (a restarted process gets the same credentials) and adds its role's variables to each
    process it starts."""
    mechanism = auth_mechanism(transport)
    if mechanism == "curve":
        return curve_environments(transport)
    if mechanism == "secret":
        secret = RunSecret.make()
        return {role: {RUN_SECRET_VARIABLE: secret.value} for role in ROLES}
    return {role: {} for role in ROLES}


def credentials_for_process(
    role: str, transport: TransportConfig, environ: MutableMapping[str, str] = os.environ
) -> CurveKeys | RunSecret | None:
    """What this process's sockets authenticate with (None with ``transport.insecure``), taken out
    of ``environ`` so that processes started from here do not inherit it. Missing or wrong where
    needed: an error (a ValueError) that says how to provide it."""
    secret_text = environ.pop(RUN_SECRET_VARIABLE, None)
    keys = curve_keys_for_process(role, transport, environ)
    mechanism = auth_mechanism(transport)
    if mechanism == "curve":
        return keys
    if mechanism == "none":
        return None
    if secret_text is None:
        raise RunSecretError(
            f"transport.host {transport.host!r} is loopback, so the run's processes prove they belong to it "
            f"with a secret, but this {role} has none: set {RUN_SECRET_VARIABLE} to the same secret in every "
            "process of the run (`export LONGHORIZON_RUN_SECRET=$(python -c 'import secrets; "
            "print(secrets.token_hex(32))')`; `longhorizon train` makes one itself), or set "
            "transport.insecure = true to run without authentication"
        )
    return RunSecret.from_text(secret_text, source=RUN_SECRET_VARIABLE)
