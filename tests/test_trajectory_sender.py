"""A trajectory is taken only from the process the learner admitted for its actor id: the actor's
trajectory socket names its control connection in the handshake, and a process that holds the
run's secret but not that connection cannot train under an actor's name."""

import pytest
import trio

from longhorizon.common.auth import RunSecret
from longhorizon.common.config import load_config
from longhorizon.common.curve import CurveKeys
from longhorizon.common.models import build_tiny_model
from longhorizon.common.transport import (
    ZmqDealer,
    ZmqPushSender,
    new_connection_id,
    zmq_actor_endpoints,
    zmq_learner_endpoints,
)
from longhorizon.common.wire import Hello, Stop
from longhorizon.learner import worker as learner_worker
from longhorizon.learner.worker import Learner
from tests.test_transport import make_trajectory

LOOPBACK = "tcp://127.0.0.1:0"


def _hello(actor_id: str = "actor-0") -> Hello:
    return Hello(actor_id=actor_id, pid=1, hostname="test", policy_version=0, engine="scripted")


def _credentials(mechanism: str):
    """(learner's, actors') credentials for one run."""
    if mechanism == "secret":
        secret = RunSecret.make()
        return {"secret": secret}, {"secret": secret}
    keys = CurveKeys.make()
    return {"curve": keys.for_role("learner")}, {"curve": keys.for_role("actor")}


def _addresses(learner) -> dict:
    return dict(trajectory_address=learner.trajectories.address, broadcast_address=learner.broadcast.address,
                control_address=learner.control.address)


@pytest.mark.parametrize("mechanism", ["secret", "curve"])
async def test_the_learner_reads_which_admitted_connection_sent_each_trajectory(mechanism):
    learner_credentials, actor_credentials = _credentials(mechanism)
    learner = zmq_learner_endpoints(trajectory_address=LOOPBACK, broadcast_address=LOOPBACK,
                                    control_address=LOOPBACK, **learner_credentials)
    actor = zmq_actor_endpoints("actor-0", **_addresses(learner), **actor_credentials)
    # Holds the run's credentials, but not actor-0's connection.
    client = next(iter(actor_credentials.values()))
    forger = ZmqPushSender(learner.trajectories.address, connection=new_connection_id("actor-0"), credentials=client)
    anonymous = ZmqPushSender(learner.trajectories.address, credentials=client)
    try:
        with trio.fail_after(20):
            await actor.trajectories.send(make_trajectory(5, episode=1))
            sender, first = await learner.trajectories.receive_with_sender()
            assert sender == actor.control.connection and first.trajectory_id == "actor-0/episode-1"
            assert learner.control.vouches_for(sender, "actor-0") is None  # no Hello read yet
            await actor.control.send(_hello())
            assert (await learner.control.receive())[0] == "actor-0"
            assert learner.control.vouches_for(sender, "actor-0") is True
            assert learner.control.vouches_for(sender, "actor-1") is False  # names another id

            await forger.send(make_trajectory(5, episode=2))
            forged_sender, _ = await learner.trajectories.receive_with_sender()
            assert forged_sender != sender and learner.control.vouches_for(forged_sender, "actor-0") is None
            await anonymous.send(make_trajectory(5, episode=3))
            anonymous_sender, _ = await learner.trajectories.receive_with_sender()
            assert anonymous_sender is None and learner.control.vouches_for(None, "actor-0") is False
    finally:
        for socket in (forger, anonymous, actor):
            socket.close()
        learner.close()


async def test_a_second_process_under_a_live_actor_id_is_refused_on_both_sockets():
    secret = RunSecret.make()
    learner = zmq_learner_endpoints(trajectory_address=LOOPBACK, broadcast_address=LOOPBACK,
                                    control_address=LOOPBACK, secret=secret)
    actor = zmq_actor_endpoints("actor-0", **_addresses(learner), secret=secret)
    duplicate = zmq_actor_endpoints("actor-0", **_addresses(learner), secret=secret)
    try:
        with trio.fail_after(20):
            await actor.control.send(_hello())
            assert (await learner.control.receive())[0] == "actor-0"
            await duplicate.control.send(_hello())
            with trio.move_on_after(0.5):
                await learner.control.receive()  # the duplicate's Hello never comes out
                pytest.fail("the duplicate's Hello was read")
            assert isinstance(await duplicate.control.receive(), Stop)
            await duplicate.trajectories.send(make_trajectory(5, episode=1))
            sender, _ = await learner.trajectories.receive_with_sender()
            assert sender == duplicate.control.connection
            assert learner.control.vouches_for(sender, "actor-0") is False  # refused the id
    finally:
        duplicate.close()
        actor.close()
        learner.close()


def test_a_dealer_refuses_a_connection_that_names_another_actor():
    with pytest.raises(ValueError, match="does not speak for 'actor-0'"):
        ZmqDealer("actor-0", "tcp://127.0.0.1:1", connection=new_connection_id("actor-1"))


# -- the learner ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny", words=[f"w{i}" for i in range(64)])


def _learner_config(tmp_path, model):
    return load_config(None, [
        f"run.output_dir={str(tmp_path)!r}", "run.name='senders'", f"model.path={str(model)!r}",
        "env.name='codebook'", "actor.engine='scripted'", "actor.group_size=2", "learner.groups_per_step=1",
        "horizon.schedule='fixed'", "horizon.stages=[5]",
    ])


async def test_the_learner_trains_only_what_the_admitted_process_sent(tmp_path, model, monkeypatch):
    monkeypatch.setattr(learner_worker, "_UNVOUCHED_WAIT_S", 1.0)
    secret = RunSecret.make()
    endpoints = zmq_learner_endpoints(trajectory_address=LOOPBACK, broadcast_address=LOOPBACK,
                                      control_address=LOOPBACK, secret=secret)
    actor = zmq_actor_endpoints("actor-0", **_addresses(endpoints), secret=secret)
    forger = ZmqPushSender(endpoints.trajectories.address, connection=new_connection_id("actor-0"), credentials=secret)
    try:
        config = _learner_config(tmp_path, model)
        learner = await trio.to_thread.run_sync(Learner, config, endpoints, config.run_dir, str(model))
        received = learner.buffer.counters

        async def until(condition, what):
            deadline = trio.current_time() + 20
            while not condition():
                assert trio.current_time() < deadline, f"timed out waiting for {what}"
                await trio.sleep(0.01)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(learner._receive_trajectories)
            nursery.start_soon(learner._control)
            # Sent before its Hello: held, then taken once the Hello is read.
            await actor.trajectories.send(make_trajectory(5, episode=1))
            await until(lambda: len(learner._unvouched) == 1, "the first trajectory held")
            assert received["received"] == 0
            await actor.control.send(_hello())
            await until(lambda: received["received"] == 1, "the held trajectory taken")
            # Forged under actor-0's name, from a process whose connection never said Hello:
            # held, then refused after the wait; the real actor's next one is taken meanwhile.
            await forger.send(make_trajectory(5, episode=2))
            await actor.trajectories.send(make_trajectory(5, episode=3))
            await until(lambda: received["received"] == 2, "the actor's second trajectory taken")
            await trio.sleep(1.2)
            await actor.trajectories.send(make_trajectory(5, episode=4))  # settles the held ones
            await until(lambda: learner.counters["trajectories_wrong_sender"] == 1, "the forgery refused")
            nursery.cancel_scope.cancel()
        assert received["received"] == 3 and not learner._unvouched
        assert learner.counters["trajectories_received"] == 3
    finally:
        forger.close()
        actor.close()
        endpoints.close()
