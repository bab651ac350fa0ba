"""CurveZMQ: a peer without the run's keys can neither push a trajectory, nor join the control
socket, nor read a broadcast, and is counted; with the keys everything works; the settings and the
keys fail early with errors that name the fix; a real run through the launcher works with it on.

Every socket is on 127.0.0.1 with CurveZMQ forced on, which is what a non-loopback host gets.
"""

import json
import os
import stat
import subprocess
import sys
import threading
from dataclasses import replace
from pathlib import Path

import pytest
import trio
import zmq

from longhorizon.common.config import ConfigError, TransportConfig, dump_toml, load_config
from longhorizon.common.curve import (
    CURVE_KEYS_VARIABLE,
    CurveKeyError,
    CurveKeys,
    curve_environments,
    curve_keys_for_process,
    uses_curve,
    write_key_files,
)
from longhorizon.common.metrics import read_metrics
from longhorizon.common.transport import (
    ZmqDealer,
    ZmqPushSender,
    ZmqSubscriber,
    _warn_if_exposed,
    zmq_actor_endpoints,
    zmq_learner_endpoints,
)
from longhorizon.common.codec import DEFAULT_LIMITS
from longhorizon.common.wire import Hello, HorizonUpdate, Stop
from tests.test_transport import make_trajectory, publish_until_received

LOOPBACK = "tcp://127.0.0.1:0"
REPO_ROOT = Path(__file__).resolve().parent.parent


def _own_client_key(keys: CurveKeys) -> CurveKeys:
    public, secret = zmq.curve_keypair()
    return replace(keys.for_role("actor"), client_public=public.decode(), client_secret=secret.decode())


# Peers without the run's keys, and what the learner's log may say about each (a peer without
# CurveZMQ may notice the mismatch first and hang up).
STRANGERS = {
    "no CurveZMQ": (lambda keys: None, ("does not use CurveZMQ", "hung up or went silent")),
    "another run's keys": (lambda keys: CurveKeys.make().for_role("actor"), ("does not have this run's server key",)),
    "the server key with its own client key": (_own_client_key, ("client key is not this run's",)),
}


@pytest.fixture
def keys() -> CurveKeys:
    return CurveKeys.make()


@pytest.fixture
def learner(keys):
    endpoints = zmq_learner_endpoints(
        trajectory_address=LOOPBACK, broadcast_address=LOOPBACK, control_address=LOOPBACK,
        curve=keys.for_role("learner"),
    )
    yield endpoints
    endpoints.close()


async def intruder_sends(intruder, message) -> None:
    """Send as a peer the learner will refuse. Its socket queues the message while the handshake
    is under way, but once the learner has hung up on it there may be no connection left to queue
    on and the send would wait for ever (on a busy machine the refusal can come first). Either
    way the message must never arrive, which the callers check."""
    with trio.move_on_after(1):
        await intruder.send(message)


async def assert_push_refused(learner, intruder, member, caplog, reasons: tuple[str, ...]) -> None:
    """`intruder` pushes a trajectory and is refused (logged for one of `reasons`); `member`'s
    trajectory arrives, the intruder's never does. Closes both."""
    await intruder_sends(intruder, make_trajectory(5, episode=1))
    await refused_once(learner, caplog, reasons)
    await member.send(make_trajectory(5, episode=2))
    with trio.fail_after(10):
        assert (await learner.trajectories.receive()).trajectory_id == "actor-0/episode-2"
    with trio.move_on_after(0.5) as nothing_more:
        await learner.trajectories.receive()
    assert nothing_more.cancelled_caught, "the intruder's trajectory got through"
    intruder.close()
    member.close()


async def refused_once(learner, caplog, reasons: tuple[str, ...]) -> None:
    """Wait until the learner has refused a connection and logged why (its gate's thread counts,
    then logs)."""

    def said_why() -> bool:
        return any(reason in record.getMessage() for record in caplog.records for reason in reasons)

    with trio.move_on_after(10):
        while not said_why():
            await trio.sleep(0.01)
    assert said_why(), [record.getMessage() for record in caplog.records]
    assert learner.auth_refused >= 1


async def assert_broadcast_unheard(learner, intruder, member) -> None:
    """Broadcast until `member` hears it, then 25 times more: `intruder` must hear none. Closes both."""
    overheard = []

    async def eavesdrop() -> None:
        overheard.append(await intruder.receive())

    update = HorizonUpdate(horizon_cap=7, stage=1, learner_step=3)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(eavesdrop)
        await publish_until_received(learner.broadcast, [member], update)
        for _ in range(25):  # the intruder has every chance to hear one
            await learner.broadcast.send(update)
            await trio.sleep(0.02)
        nursery.cancel_scope.cancel()
    assert overheard == []
    intruder.close()
    member.close()


# --------------------------------------------------------------------------------------------
# Without the keys: refused and counted
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stranger", STRANGERS)
async def test_a_peer_without_the_keys_cannot_push_a_trajectory(keys, learner, client_context, caplog, stranger):
    stranger_keys, reason = STRANGERS[stranger]
    address = learner.trajectories.address
    intruder = ZmqPushSender(address, context=client_context, credentials=stranger_keys(keys))
    member = ZmqPushSender(address, context=client_context, credentials=keys.for_role("actor"))
    await assert_push_refused(learner, intruder, member, caplog, reason)


@pytest.mark.parametrize("stranger", STRANGERS)
async def test_a_peer_without_the_keys_cannot_join_the_control_socket(keys, learner, client_context, caplog, stranger):
    stranger_keys, reason = STRANGERS[stranger]
    address = learner.control.address
    intruder = ZmqDealer("actor-9", address, context=client_context, credentials=stranger_keys(keys))
    member = ZmqDealer("actor-1", address, context=client_context, credentials=keys.for_role("actor"))
    await intruder_sends(intruder, Hello(actor_id="actor-9", pid=9, hostname="elsewhere", policy_version=0,
                                         engine="scripted"))
    await refused_once(learner, caplog, reason)
    await member.send(Hello(actor_id="actor-1", pid=1, hostname="here", policy_version=0, engine="scripted"))
    with trio.fail_after(10):
        peer_id, message = await learner.control.receive()
    assert (peer_id, message.actor_id) == ("actor-1", "actor-1")
    with trio.move_on_after(0.5) as nothing_more:
        await learner.control.receive()
    assert nothing_more.cancelled_caught, "the learner heard from the intruder"
    intruder.close()
    member.close()


@pytest.mark.parametrize("stranger", STRANGERS)
async def test_a_peer_without_the_keys_cannot_read_a_broadcast(keys, learner, client_context, caplog, stranger):
    stranger_keys, reason = STRANGERS[stranger]
    address = learner.broadcast.address
    intruder = ZmqSubscriber(address, context=client_context, credentials=stranger_keys(keys))
    member = ZmqSubscriber(address, context=client_context, credentials=keys.for_role("actor"))
    await refused_once(learner, caplog, reason)
    await assert_broadcast_unheard(learner, intruder, member)


# --------------------------------------------------------------------------------------------
# With the keys: everything works
# --------------------------------------------------------------------------------------------


async def test_with_the_keys_all_three_channels_work(keys, learner):
    actor = zmq_actor_endpoints(
        "actor-0", trajectory_address=learner.trajectories.address,
        broadcast_address=learner.broadcast.address, control_address=learner.control.address,
        curve=keys.for_role("actor"),
    )
    try:
        with trio.fail_after(10):
            await actor.trajectories.send(make_trajectory(40_000, episode=4))
            assert (await learner.trajectories.receive()).trajectory_id == "actor-0/episode-4"
            await actor.control.send(Hello(actor_id="actor-0", pid=1, hostname="h", policy_version=0, engine="hf"))
            peer_id, _ = await learner.control.receive()
            await learner.control.send(peer_id, Stop(reason="done"))
            assert vars(await actor.control.receive()) == {"reason": "done"}
        update = HorizonUpdate(horizon_cap=5, stage=0, learner_step=0)
        [received] = await publish_until_received(learner.broadcast, [actor.broadcast], update)
        assert vars(received) == vars(update)
        assert learner.auth_refused == 0
    finally:
        actor.close()


@pytest.mark.parametrize("frame_bytes, reaches_the_decoder", [(4096, True), (4097, False)])
async def test_the_size_limit_is_the_same_with_curve(keys, client_context, frame_bytes, reaches_the_decoder):
    # CurveZMQ makes every frame on the wire 33 bytes larger; libzmq's limit must not count them.
    learner = zmq_learner_endpoints(
        trajectory_address=LOOPBACK, broadcast_address=LOOPBACK, control_address=LOOPBACK,
        trajectory_limits=replace(DEFAULT_LIMITS, max_message_bytes=4096), curve=keys.for_role("learner"),
    )
    sender = client_context.socket(zmq.PUSH)
    for option, value in keys.for_role("actor").client_options().items():
        sender.setsockopt(option, value)
    sender.connect(learner.trajectories.address)
    sender.send(b"\xc1" * frame_bytes)  # not a message: the decoder counts it if it gets that far
    async with trio.open_nursery() as nursery:
        nursery.start_soon(learner.trajectories.receive)  # decodes (and rejects) whatever arrives
        with trio.move_on_after(5 if reaches_the_decoder else 0.5):
            while learner.trajectories.rejected == 0:
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    assert learner.trajectories.rejected == int(reaches_the_decoder)
    sender.close(linger=0)
    learner.close()


def test_each_role_holds_only_its_own_secret(keys):
    with pytest.raises(CurveKeyError, match="no server_secret"):
        zmq_learner_endpoints(
            trajectory_address=LOOPBACK, broadcast_address=LOOPBACK, control_address=LOOPBACK,
            curve=keys.for_role("actor"),
        )
    with pytest.raises(CurveKeyError, match="no client_secret"):
        zmq_actor_endpoints(
            "actor-0", trajectory_address=LOOPBACK, broadcast_address=LOOPBACK, control_address=LOOPBACK,
            curve=keys.for_role("learner"),
        )


# --------------------------------------------------------------------------------------------
# Settings and key hand-off
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "settings, used",
    [
        ({}, False),
        ({"curve": "on"}, True),
        ({"host": "10.1.2.3"}, True),
        ({"host": "node7.cluster"}, True),
        ({"host": "0.0.0.0"}, True),
        ({"host": "127.0.0.5"}, False),
        ({"host": "10.1.2.3", "insecure": True}, False),
        ({"host": "10.1.2.3", "curve": "off", "insecure": True}, False),
    ],
)
def test_when_curve_is_used(settings, used):
    assert uses_curve(TransportConfig(**settings)) is used


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["transport.host='10.1.2.3'", "transport.curve='off'"], "set transport.insecure = true"),
        (["transport.curve='on'", "transport.insecure=true"], "contradict"),
        (["transport.curve='yes'"], "transport.curve must be one of auto, on, off"),
    ],
)
def test_unsafe_or_contradictory_settings_fail_before_any_process_starts(tmp_path, overrides, message):
    from longhorizon.launch.launchers.local import launch_local

    config = load_config(None, ["env.name=codebook", f"run.output_dir={str(tmp_path)!r}", *overrides])
    with pytest.raises(ConfigError, match=message):
        launch_local(config, progress=lambda line: None)
    assert not config.run_dir.exists()


def test_binding_beyond_loopback_without_curve_warns(caplog):
    # Only the check runs: no socket is opened on any address but loopback.
    _warn_if_exposed("tcp://10.1.2.3:5555", "trajectory receiver")
    _warn_if_exposed("tcp://127.0.0.1:5555", "broadcast publisher")
    [warning] = caplog.records
    assert "trajectory receiver" in warning.getMessage() and "transport.insecure = true" in warning.getMessage()


def test_the_launcher_hands_each_role_only_its_keys():
    assert curve_environments(TransportConfig()) == {"learner": {}, "actor": {}}
    environments = curve_environments(TransportConfig(curve="on"))
    learner = json.loads(environments["learner"][CURVE_KEYS_VARIABLE])
    actor = json.loads(environments["actor"][CURVE_KEYS_VARIABLE])
    assert set(learner) == {"server_public", "server_secret", "client_public"}
    assert set(actor) == {"server_public", "client_public", "client_secret"}
    assert (learner["server_public"], learner["client_public"]) == (actor["server_public"], actor["client_public"])
    assert curve_environments(TransportConfig(curve="on")) != environments, "keys are made per run"


def test_a_process_takes_its_keys_out_of_the_environment(keys):
    environ = {CURVE_KEYS_VARIABLE: keys.for_role("actor").to_json(), "OTHER": "kept"}
    assert curve_keys_for_process("actor", TransportConfig(curve="on"), environ) == keys.for_role("actor")
    assert environ == {"OTHER": "kept"}, "helpers the process starts must not inherit the keys"
    environ = {CURVE_KEYS_VARIABLE: keys.for_role("actor").to_json()}
    assert curve_keys_for_process("actor", TransportConfig(), environ) is None
    assert environ == {}


@pytest.mark.parametrize(
    "text, role, message",
    [
        (None, "learner", "set LONGHORIZON_CURVE_KEYS to the contents of the learner.keys file"),
        ("not json", "actor", "expected the contents of the actor.keys file"),
        ("ACTOR", "learner", "no server_secret, which the learner needs"),
        ("MIXED", "actor", "client_public does not belong to client_secret"),
        ('{"server_public": "short", "client_public": "x", "client_secret": "y"}', "actor", "not a CurveZMQ key"),
    ],
)
def test_missing_or_wrong_keys_name_the_fix(keys, text, role, message):
    if text == "ACTOR":
        text = keys.for_role("actor").to_json()
    elif text == "MIXED":
        text = replace(keys.for_role("actor"), client_public=CurveKeys.make().client_public).to_json()
    environ = {} if text is None else {CURVE_KEYS_VARIABLE: text}
    with pytest.raises(CurveKeyError, match=message):
        curve_keys_for_process(role, TransportConfig(host="10.1.2.3"), environ)


def test_a_worker_without_keys_stops_before_opening_a_socket(tmp_path):
    config_path = tmp_path / "config.toml"
    config_path.write_text(dump_toml(load_config(None, ["env.name=codebook", "transport.host='10.1.2.3'"])))
    environ = {name: value for name, value in os.environ.items() if name != CURVE_KEYS_VARIABLE}
    finished = subprocess.run(
        [sys.executable, "-m", "longhorizon.launch.worker", "actor", "--config", str(config_path)],
        env=environ, capture_output=True, text=True, timeout=60, cwd=REPO_ROOT,
    )
    assert finished.returncode == 2
    assert "10.1.2.3' is not loopback" in finished.stderr and "longhorizon keys DIR" in finished.stderr


def test_key_files_are_never_readable_by_others(tmp_path):
    previous_umask = os.umask(0)  # the mode must come from creation, not from a friendly umask
    try:
        learner_file, actor_file = write_key_files(tmp_path / "keys")
    finally:
        os.umask(previous_umask)
    for path in (learner_file, actor_file):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert "client_secret" not in json.loads(learner_file.read_text())
    learner_keys = CurveKeys.from_json(learner_file.read_text(), role="learner", source=str(learner_file))
    actor_keys = CurveKeys.from_json(actor_file.read_text(), role="actor", source=str(actor_file))
    assert learner_keys.server_public == actor_keys.server_public
    with pytest.raises(CurveKeyError, match="exists; keys are not replaced"):
        write_key_files(tmp_path / "keys")


# --------------------------------------------------------------------------------------------
# A real run
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def byte_model(tmp_path_factory):
    from longhorizon.common.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-bytes", words=[f"w{i}" for i in range(260)])


def _knock_with_other_keys(config_path: Path, other_keys: CurveKeys, done: threading.Event) -> None:
    """Once the launcher has written the run's config, keep a connection with another run's keys
    pointed at the learner's trajectory port until the run is over."""
    while not config_path.exists() and not done.is_set():
        done.wait(0.01)
    if done.is_set():
        return
    transport = load_config(config_path).transport
    context = zmq.Context()
    try:
        socket = context.socket(zmq.PUSH)
        socket.setsockopt(zmq.LINGER, 0)
        for option, value in other_keys.client_options().items():
            socket.setsockopt(option, value)
        socket.connect(f"tcp://127.0.0.1:{transport.trajectory_port}")
        done.wait()
        socket.close()
    finally:
        context.destroy(linger=0)


@pytest.mark.slow
def test_a_run_with_curve_on_completes_and_counts_a_stranger(tmp_path, byte_model, monkeypatch):
    from longhorizon.launch.launchers.local import launch_local

    other_keys = CurveKeys.make().for_role("actor")
    made = []
    make = CurveKeys.make
    monkeypatch.setattr(CurveKeys, "make", classmethod(lambda cls: made.append(make()) or made[-1]))
    config = load_config(REPO_ROOT / "configs" / "codebook.toml", [
        f"run.output_dir={str(tmp_path)!r}", "run.total_steps=3", f"model.path={str(byte_model)!r}",
        "actor.engine='scripted'", "actor.scripted_policy='random'", "actor.num_actors=1",
        "actor.group_size=4", "actor.concurrent_groups=2", "learner.groups_per_step=2",
        "learner.checkpoint_every=10", "transport.curve='on'",
    ])
    done = threading.Event()
    stranger = threading.Thread(target=_knock_with_other_keys, args=(config.run_dir / "config.toml", other_keys, done))
    stranger.start()
    lines = []
    try:
        assert launch_local(config, progress=lines.append) == 0, "\n".join(lines)
    finally:
        done.set()
        stranger.join()
    records = read_metrics(config.run_dir)
    assert [record["step"] for record in records] == [1, 2, 3]
    assert records[-1]["actors_seen"] == 1
    assert records[-1]["auth_refused"] >= 1
    learner_log = (config.run_dir / "logs" / "learner.log").read_text()
    assert "does not have this run's server key" in learner_log
    [keys] = made
    for path in config.run_dir.rglob("*"):  # the secrets live in the processes' memory only
        if path.is_file():
            content = path.read_bytes()
            assert keys.server_secret.encode() not in content and keys.client_secret.encode() not in content, path
