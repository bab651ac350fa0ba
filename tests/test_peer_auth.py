"""Peers prove they belong to the run on loopback too, and one connection at a time speaks for an
actor: a stranger without the run's secret can neither push a trajectory nor read a broadcast,
nobody can take the place of a live actor, and a restarted actor still rejoins at once. The
launcher makes the secret per run and hands it over in the environment only.

Real sockets on 127.0.0.1 with the run's secret (ZeroMQ PLAIN), which is what a run on loopback
gets by default.
"""

import pytest
import trio

from longhorizon.common.auth import (
    RUN_SECRET_VARIABLE,
    RunSecret,
    RunSecretError,
    auth_environments,
    auth_mechanism,
    credentials_for_process,
)
from longhorizon.common.config import TransportConfig, load_config
from longhorizon.common.curve import CURVE_KEYS_VARIABLE
from longhorizon.common.transport import (
    UnknownPeer,
    ZmqDealer,
    ZmqPushSender,
    ZmqRouter,
    ZmqSubscriber,
    zmq_learner_endpoints,
)
from longhorizon.common.wire import Heartbeat, Hello, Stop
from tests.test_curve import (
    assert_broadcast_unheard,
    assert_push_refused,
    intruder_sends,
    refused_once,
)

LOOPBACK = "tcp://127.0.0.1:0"

# Peers without the run's secret, and what the learner's log may say about each (a peer without
# PLAIN may notice the mismatch first and hang up).
STRANGERS = {
    "no secret": (lambda: None, ("presents no run secret", "hung up or went silent")),
    "another run's secret": (RunSecret.make, ("does not have this run's secret",)),
}


@pytest.fixture
def secret() -> RunSecret:
    return RunSecret.make()


@pytest.fixture
def learner(secret):
    endpoints = zmq_learner_endpoints(
        trajectory_address=LOOPBACK, broadcast_address=LOOPBACK, control_address=LOOPBACK, secret=secret,
    )
    yield endpoints
    endpoints.close()


def _hello(pid: int, hostname: str) -> Hello:
    return Hello(actor_id="actor-0", pid=pid, hostname=hostname, policy_version=0, engine="scripted")


def _heartbeat(episodes: int) -> Heartbeat:
    return Heartbeat(actor_id="actor-0", policy_version=0, episodes_done=episodes, time=0.0)


# --------------------------------------------------------------------------------------------
# Without the run's secret: refused and counted
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stranger", STRANGERS)
async def test_a_stranger_without_the_run_secret_cannot_push_a_trajectory(
    secret, learner, client_context, caplog, stranger
):
    stranger_secret, reasons = STRANGERS[stranger]
    address = learner.trajectories.address
    intruder = ZmqPushSender(address, context=client_context, credentials=stranger_secret())
    member = ZmqPushSender(address, context=client_context, credentials=secret)
    await assert_push_refused(learner, intruder, member, caplog, reasons)


async def test_a_stranger_without_the_run_secret_cannot_read_a_broadcast(secret, learner, client_context, caplog):
    address = learner.broadcast.address
    intruder = ZmqSubscriber(address, context=client_context)
    member = ZmqSubscriber(address, context=client_context, credentials=secret)
    await refused_once(learner, caplog, STRANGERS["no secret"][1])
    await assert_broadcast_unheard(learner, intruder, member)


# --------------------------------------------------------------------------------------------
# One connection speaks for an actor
# --------------------------------------------------------------------------------------------


async def _make_learner(tmp_path, model, endpoints):
    from longhorizon.learner.worker import Learner

    config = load_config(None, [
        f"run.output_dir={str(tmp_path)!r}", "run.name='takeover'", f"model.path={str(model)!r}",
        "env.name='codebook'", "actor.num_actors=1", "actor.group_size=2", "learner.groups_per_step=2",
    ])
    return await trio.to_thread.run_sync(Learner, config, endpoints, config.run_dir, str(model))


@pytest.mark.parametrize("stranger_holds_the_secret", [False, True], ids=["stranger", "process of the run"])
async def test_nobody_takes_the_place_of_a_live_actor(
    tmp_path, tiny_codebook_model, secret, learner, stranger_holds_the_secret
):
    """A second connection says Hello as actor-0 while actor-0 is live: refused and counted; the
    real actor-0 keeps being heard and gets Stop at the end. A stranger without the secret never
    gets past the handshake; a process of the run that holds it is told to stop."""
    real = ZmqDealer("actor-0", learner.control.address, credentials=secret)
    stranger = ZmqDealer(
        "actor-0", learner.control.address, credentials=secret if stranger_holds_the_secret else None,
    )
    try:
        trainer = await _make_learner(tmp_path, tiny_codebook_model, learner)
        peers = trainer.peers
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trainer._control)
            await real.send(_hello(pid=1, hostname="real"))
            with trio.fail_after(10):
                while "actor-0" not in peers:
                    await trio.sleep(0.01)
            await intruder_sends(stranger, _hello(pid=666, hostname="stranger"))
            await intruder_sends(stranger, _heartbeat(episodes=666))
            with trio.fail_after(10):
                while learner.auth_refused == 0:
                    await trio.sleep(0.01)
            for episodes in (1, 2, 3):
                await real.send(_heartbeat(episodes))
            with trio.fail_after(10):
                while peers.episodes_reported.get(("actor-0", ("real", 1))) != 3:
                    await trio.sleep(0.01)
            assert peers.known["actor-0"]["incarnation"] == ("real", 1)
            assert peers.live() == ["actor-0"] and peers.episodes_reported_total() == 3
            assert await trainer.stop_actors("training finished") == 1
            with trio.fail_after(10):
                assert vars(await real.receive()) == {"reason": "training finished"}
            if stranger_holds_the_secret:
                with trio.fail_after(10):
                    told = await stranger.receive()
                assert isinstance(told, Stop) and "actor-0 is already live" in told.reason
                assert learner.control.takeovers_refused == 1
            with trio.move_on_after(0.3) as nothing_more:
                await stranger.receive()
            assert nothing_more.cancelled_caught, "the stranger got a message meant for actor-0"
            nursery.cancel_scope.cancel()
    finally:
        real.close()
        stranger.close()


async def _until_gone(router: ZmqRouter, peer_id: str) -> None:
    """Wait until the router has seen the peer's connection close: sending to it then fails."""
    with trio.fail_after(10):
        while True:
            try:
                await router.send(peer_id, Stop(reason="probe"))
            except UnknownPeer:
                return
            await trio.sleep(0.02)


async def test_a_restarted_actor_rejoins_at_once_and_a_hung_one_is_replaced(client_context):
    router = ZmqRouter(LOOPBACK, context=client_context, takeover_after_s=0.5)
    heard_send, heard = trio.open_memory_channel(100)

    async def listen() -> None:  # the router decides who speaks for whom as it receives
        while True:
            await heard_send.send(await router.receive())

    first = ZmqDealer("actor-0", router.address, context=client_context)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(listen)
        with trio.fail_after(10):
            await first.send(_hello(pid=1, hostname="h"))
            assert (await heard.receive())[1].pid == 1
        # The process ended (its connection closed): its successor is heard at once.
        first.close()
        await _until_gone(router, "actor-0")
        restarted = ZmqDealer("actor-0", router.address, context=client_context)
        with trio.fail_after(10):
            await restarted.send(_hello(pid=2, hostname="h"))
            assert (await heard.receive())[1].pid == 2
        assert router.takeovers_refused == 0
        # A third says Hello while the second is live: refused, told why.
        third = ZmqDealer("actor-0", router.address, context=client_context)
        with trio.fail_after(10):
            await third.send(_hello(pid=3, hostname="h"))
            assert "actor-0 is already live" in (await third.receive()).reason
        assert router.takeovers_refused == 1
        # Once the second has been silent past takeover_after_s (hung, still connected), the
        # third may take over; the second, heard again, is the one refused.
        await trio.sleep(0.6)
        with trio.fail_after(10):
            await third.send(_heartbeat(episodes=3))
            peer_id, message = await heard.receive()
            assert (peer_id, message.episodes_done) == ("actor-0", 3)
            await router.send("actor-0", Stop(reason="for the third"))
            assert (await third.receive()).reason == "for the third"
            await restarted.send(_heartbeat(episodes=2))
            assert "actor-0 is already live" in (await restarted.receive()).reason
        assert router.takeovers_refused == 2
        assert heard.statistics().current_buffer_used == 0, "a refused connection was heard"
        nursery.cancel_scope.cancel()
    for endpoint in (restarted, third, router):
        endpoint.close()


# --------------------------------------------------------------------------------------------
# Settings and the secret's hand-off
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "settings, mechanism",
    [
        ({}, "secret"),
        ({"host": "127.0.0.2"}, "secret"),
        ({"curve": "off"}, "secret"),
        ({"insecure": True}, "none"),
        ({"curve": "on"}, "curve"),
        ({"host": "10.1.2.3"}, "curve"),
        ({"host": "10.1.2.3", "insecure": True}, "none"),
    ],
)
def test_which_mechanism_a_run_uses(settings, mechanism):
    assert auth_mechanism(TransportConfig(**settings)) == mechanism


def test_the_launcher_makes_one_secret_per_run_for_every_process():
    environments = auth_environments(TransportConfig())
    learner, actor = environments["learner"], environments["actor"]
    assert set(learner) == set(actor) == {RUN_SECRET_VARIABLE}
    assert learner[RUN_SECRET_VARIABLE] == actor[RUN_SECRET_VARIABLE]
    assert len(learner[RUN_SECRET_VARIABLE]) == 64
    assert auth_environments(TransportConfig()) != environments, "a secret is made per run"
    assert set(auth_environments(TransportConfig(host="10.1.2.3"))["actor"]) == {CURVE_KEYS_VARIABLE}
    assert auth_environments(TransportConfig(insecure=True)) == {"learner": {}, "actor": {}}


def test_a_process_takes_the_secret_out_of_its_environment(secret):
    environ = {RUN_SECRET_VARIABLE: secret.value, "OTHER": "kept"}
    assert credentials_for_process("actor", TransportConfig(), environ) == secret
    assert environ == {"OTHER": "kept"}, "helpers the process starts must not inherit the secret"
    environ = {RUN_SECRET_VARIABLE: secret.value}
    assert credentials_for_process("learner", TransportConfig(insecure=True), environ) is None
    assert environ == {}
    assert secret.value not in repr(secret) and secret.value not in str(secret), "a log line could print it"


@pytest.mark.parametrize(
    "text, message", [(None, f"set {RUN_SECRET_VARIABLE} to the same secret"), ("short", "16 to 255 characters")],
)
def test_a_missing_or_unusable_secret_names_the_fix(text, message):
    environ = {} if text is None else {RUN_SECRET_VARIABLE: text}
    with pytest.raises(RunSecretError, match=message):
        credentials_for_process("actor", TransportConfig(), environ)


@pytest.mark.parametrize("stranger", STRANGERS)
async def test_an_actor_the_learner_refuses_stops_with_a_clear_error(tmp_path, secret, learner, stranger):
    """ZeroMQ does not retry a refused handshake and a refused socket has nowhere to queue, so an
    actor with the wrong credentials would wait for ever on its first send; it says why and stops."""
    from longhorizon.actor.worker import ActorRefused, run_actor
    from longhorizon.common.transport import zmq_actor_endpoints
    from longhorizon.launch.worker import error_of_kind

    stranger_secret, _ = STRANGERS[stranger]
    config = load_config(None, [
        f"run.output_dir={str(tmp_path)!r}", "env.name='codebook'", "actor.engine='scripted'",
        "actor.scripted_policy='random'", "actor.num_actors=1",
    ])
    endpoints = zmq_actor_endpoints(
        "actor-0", trajectory_address=learner.trajectories.address, broadcast_address=learner.broadcast.address,
        control_address=learner.control.address, secret=stranger_secret(),
    )
    try:
        with trio.fail_after(30):
            with pytest.raises(BaseException) as ended:
                await run_actor(config, 0, endpoints)
    finally:
        endpoints.close()
    refused = error_of_kind(ended.value, ActorRefused)
    assert refused is not None, ended.value
    expected = "does not hold this run's secret" if stranger == "another run's secret" else "another security mechanism"
    assert str(refused).startswith("actor-0: the learner ") and expected in str(refused)


async def test_an_admitted_actor_reports_no_refusal(secret, learner):
    member = ZmqDealer("actor-0", learner.control.address, credentials=secret)
    try:
        await member.send(_hello(pid=1, hostname="here"))
        with trio.fail_after(10):
            await learner.control.receive()
        assert member.refusal() is None
    finally:
        member.close()


async def test_a_learner_that_keeps_hanging_up_mid_handshake_is_a_refusal():
    """A learner refusing this side's mechanism mostly closes the connection before this side has
    read why (no detail in the handshake event), so hang-ups in a row count as a refusal. A
    listener that closes every connection at once stands in for it, every time."""
    import socket as socket_module

    listener = socket_module.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    listener.setblocking(False)
    member = ZmqDealer("actor-0", f"tcp://127.0.0.1:{listener.getsockname()[1]}")
    try:
        with trio.fail_after(20):
            while (reason := member.refusal()) is None:
                await trio.sleep(0.05)
                try:
                    listener.accept()[0].close()
                except BlockingIOError:
                    pass
        assert "hung up during the handshake 3 times in a row" in reason
        assert "another security mechanism" in reason
    finally:
        member.close()
        listener.close()
