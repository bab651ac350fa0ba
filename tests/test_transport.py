"""Tests for the transports: real ZeroMQ sockets on loopback under trio, the in-process twin, and the benchmark."""

import logging

import msgpack
import numpy as np
import pytest
import trio
import zmq

from longhorizon.common.transport import (
    Dealer,
    InProcessNetwork,
    Receiver,
    Router,
    Sender,
    UnknownPeer,
    ZmqDealer,
    ZmqPublisher,
    ZmqPullReceiver,
    ZmqPushSender,
    ZmqRouter,
    ZmqSubscriber,
    zmq_actor_endpoints,
    zmq_learner_endpoints,
)
from longhorizon.common.codec import WireLimits, encode
from longhorizon.common.wire import (
    Heartbeat,
    Hello,
    HorizonUpdate,
    Stop,
    Trajectory,
    WeightsUpdate,
)
from longhorizon.launch.bench.transport import bench_transport, print_report

LOOPBACK = "tcp://127.0.0.1:0"
TRANSPORT_LOGGER = "longhorizon.common.transport"


def make_trajectory(tokens: int, episode: int = 0) -> Trajectory:
    loss_mask = np.zeros(tokens, dtype=np.uint8)
    loss_mask[2:] = 1
    return Trajectory(
        trajectory_id=f"actor-0/episode-{episode}",
        actor_id="actor-0",
        env_name="toy",
        task_id="task-1",
        group_id="actor-0/group-0",
        group_size=2,
        token_ids=(np.arange(tokens, dtype=np.int32) * 7 + episode) % 5000,
        loss_mask=loss_mask,
        behaviour_logprobs=np.where(loss_mask == 1, -0.1, 0.0).astype(np.float32),
        policy_versions=np.where(loss_mask == 1, episode, -1).astype(np.int32),
        prompt_length=2,
        reward=float(episode),
        turn_rewards=[float(episode)],
        num_turns=1,
        horizon_cap=5,
        terminated=True,
        truncated=False,
        success=episode > 0,
        generation_seconds=0.5,
        env_seconds=0.125,
        text=f"episode {episode}",
        error="",
    )


def assert_same_trajectory(received, sent: Trajectory) -> None:
    assert isinstance(received, Trajectory)
    assert received.trajectory_id == sent.trajectory_id
    assert received.reward == sent.reward
    np.testing.assert_array_equal(received.token_ids, sent.token_ids)
    np.testing.assert_array_equal(received.policy_versions, sent.policy_versions)


@pytest.fixture
def context():
    """A context per test, destroyed afterwards so no socket outlives its test."""
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


async def publish_until_received(publisher: Sender, subscribers: list[Receiver], message) -> list:
    """Publish until every subscriber got one copy: a SUB only hears what is published after its
    connection is up, which takes a moment after connect()."""
    received: list = [None] * len(subscribers)

    async def listen(index: int) -> None:
        received[index] = await subscribers[index].receive()

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            for index in range(len(subscribers)):
                nursery.start_soon(listen, index)
            while any(item is None for item in received):
                await publisher.send(message)
                await trio.sleep(0.02)
    return received


# --------------------------------------------------------------------------------------------
# ZeroMQ sockets on loopback
# --------------------------------------------------------------------------------------------


async def test_push_pull_round_trip(context) -> None:
    receiver = ZmqPullReceiver(LOOPBACK, context=context)
    sender = ZmqPushSender(receiver.address, context=context)
    assert receiver.address.startswith("tcp://127.0.0.1:") and not receiver.address.endswith(":0")
    sent = [make_trajectory(10, episode=1), make_trajectory(40_000, episode=2), make_trajectory(3, episode=3)]
    with trio.fail_after(10):
        for trajectory in sent:
            await sender.send(trajectory)
        for trajectory in sent:
            assert_same_trajectory(await receiver.receive(), trajectory)
    assert receiver.rejected == 0
    sender.close()
    receiver.close()


async def test_push_waits_at_the_high_water_mark_and_drops_nothing(context) -> None:
    receiver = ZmqPullReceiver(LOOPBACK, receive_hwm=1, context=context)
    sender = ZmqPushSender(receiver.address, send_hwm=1, context=context)
    big = make_trajectory(250_000)  # ~3 MB: a few fill the socket buffers
    sent = 0
    with trio.move_on_after(1.0):
        while sent < 50:
            await sender.send(big)
            sent += 1
    assert 0 < sent < 50, "the sender should have been made to wait"
    with trio.fail_after(10):
        for _ in range(sent):
            assert_same_trajectory(await receiver.receive(), big)
        # Once drained, the sender can go on.
        await sender.send(make_trajectory(5, episode=9))
        assert (await receiver.receive()).trajectory_id == "actor-0/episode-9"
    sender.close()
    receiver.close()


async def test_pub_sub_reaches_every_subscriber(context) -> None:
    publisher = ZmqPublisher(LOOPBACK, context=context)
    subscribers = [ZmqSubscriber(publisher.address, context=context) for _ in range(2)]
    first = await publish_until_received(publisher, subscribers, HorizonUpdate(horizon_cap=10, stage=0, learner_step=0))
    assert all(vars(message) == vars(HorizonUpdate(10, 0, 0)) for message in first)
    tensors = {"layer.weight": np.arange(50_000, dtype=np.float32).reshape(250, 200), "scale": np.ones(3, np.float16)}
    await publisher.send(WeightsUpdate(version=7, tensors=tensors))
    with trio.fail_after(10):
        for subscriber in subscribers:
            message = await subscriber.receive()
            while not isinstance(message, WeightsUpdate):  # horizon updates still in flight
                message = await subscriber.receive()
            assert message.version == 7
            np.testing.assert_array_equal(message.tensors["layer.weight"], tensors["layer.weight"])
            np.testing.assert_array_equal(message.tensors["scale"], tensors["scale"])
    for endpoint in (publisher, *subscribers):
        endpoint.close()


async def test_router_dealer_round_trip_and_unknown_peer(context) -> None:
    router = ZmqRouter(LOOPBACK, context=context)
    dealer = ZmqDealer("actor-5", router.address, context=context)
    with trio.fail_after(10):
        await dealer.send(Hello(actor_id="actor-5", pid=77, hostname="host", policy_version=0, engine="scripted"))
        peer_id, message = await router.receive()
        assert peer_id == "actor-5"
        assert isinstance(message, Hello) and message.pid == 77
        await router.send("actor-5", Stop(reason="done"))
        assert vars(await dealer.receive()) == {"reason": "done"}
        with pytest.raises(UnknownPeer, match="actor-6"):
            await router.send("actor-6", Stop(reason="never delivered"))
    dealer.close()
    router.close()


async def test_one_socket_sending_and_receiving_from_concurrent_tasks(context) -> None:
    # The descriptor ZeroMQ exposes is edge-triggered and shared by both directions: a task
    # waiting to receive must not miss a message whose edge a concurrent send consumed.
    router = ZmqRouter(LOOPBACK, context=context)
    dealer = ZmqDealer("actor-1", router.address, context=context)
    rounds = 1000
    replies: list[int] = []

    async def echo() -> None:
        for _ in range(rounds):
            peer_id, heartbeat = await router.receive()
            await router.send(peer_id, Stop(reason=str(heartbeat.episodes_done)))

    async def send_heartbeats() -> None:
        for count in range(rounds):
            await dealer.send(Heartbeat(actor_id="actor-1", policy_version=0, episodes_done=count, time=0.0))
            if count % 7 == 0:
                await trio.sleep(0)

    async def collect_replies() -> None:
        for _ in range(rounds):
            replies.append(int((await dealer.receive()).reason))

    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(echo)
            nursery.start_soon(collect_replies)
            nursery.start_soon(send_heartbeats)
    assert replies == list(range(rounds))
    dealer.close()
    router.close()


async def test_malformed_and_oversized_messages_are_rejected_counted_and_logged(context, caplog) -> None:
    limits = WireLimits(max_message_bytes=300_000)
    receiver = ZmqPullReceiver(LOOPBACK, limits=limits, context=context)
    raw = context.socket(zmq.PUSH)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(receiver.address)
    valid = encode(make_trajectory(20_000, episode=1))
    header = msgpack.unpackb(bytes(valid[0]), raw=False)
    bad_messages = [
        [b"\xc1 garbage"],
        [msgpack.packb({**header, "type": "no_such_type"}), *valid[1:]],
        [msgpack.packb({**header, "schema": 99}), *valid[1:]],
        [valid[0], bytes(valid[1])[:-8]],  # truncated arrays
        [b"x" * 200_000, b"y" * 200_000],  # every frame under MAXMSGSIZE, the total over the limit
    ]
    caplog.set_level(logging.WARNING, logger=TRANSPORT_LOGGER)
    with trio.fail_after(10):
        for frames in bad_messages:
            raw.send_multipart(frames)
        raw.send_multipart(valid)
        assert_same_trajectory(await receiver.receive(), make_trajectory(20_000, episode=1))
    assert receiver.rejected == len(bad_messages)
    warnings = [record for record in caplog.records if record.name == TRANSPORT_LOGGER]
    assert len(warnings) == 1, "a burst of bad messages is reported once, not once each"
    assert "not valid MessagePack" in warnings[0].getMessage()

    # One frame beyond MAXMSGSIZE: libzmq drops it and the connection; the peer reconnects by
    # itself and what it sends next still arrives. The decoder never saw it, so no count.
    raw.send_multipart([b"z" * 400_000])
    raw.send_multipart(encode(make_trajectory(8, episode=2)))
    with trio.fail_after(10):
        assert (await receiver.receive()).trajectory_id == "actor-0/episode-2"
    assert receiver.rejected == len(bad_messages)
    raw.close(linger=0)
    receiver.close()


async def test_router_rejects_bad_control_messages(context) -> None:
    router = ZmqRouter(LOOPBACK, context=context)
    raw = context.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.setsockopt(zmq.IDENTITY, b"rogue")
    raw.connect(router.address)
    raw.send_multipart([b"not msgpack \xc1"])
    raw.send_multipart(encode(make_trajectory(20_000)))  # two frames: more than control allows
    raw.send_multipart(encode(Stop(reason="valid")))
    with trio.fail_after(10):
        peer_id, message = await router.receive()
    assert (peer_id, vars(message)) == ("rogue", {"reason": "valid"})
    assert router.rejected == 2
    raw.close(linger=0)
    router.close()


async def test_close_wakes_a_blocked_receiver(context) -> None:
    receiver = ZmqPullReceiver(LOOPBACK, context=context)
    outcome: list[str] = []

    async def wait_for_message() -> None:
        try:
            await receiver.receive()
        except trio.ClosedResourceError:
            outcome.append("closed")

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(wait_for_message)
            await trio.sleep(0.05)
            receiver.close()
    assert outcome == ["closed"]
    with pytest.raises(trio.ClosedResourceError):
        await receiver.receive()


def test_bad_addresses_give_clear_errors(context, caplog) -> None:
    receiver = ZmqPullReceiver(LOOPBACK, context=context)
    with pytest.raises(OSError, match="cannot bind to"):
        ZmqPullReceiver(receiver.address, context=context)
    with pytest.raises(ValueError, match="not a ZeroMQ address"):
        ZmqPushSender("127.0.0.1:5555", context=context)
    with pytest.raises(ValueError, match="non-empty actor id"):
        ZmqDealer("", receiver.address, context=context)
    caplog.set_level(logging.WARNING, logger=TRANSPORT_LOGGER)
    exposed = ZmqPublisher("tcp://0.0.0.0:0", context=context)
    exposed.close()
    assert any("beyond loopback" in record.getMessage() for record in caplog.records)
    receiver.close()


# --------------------------------------------------------------------------------------------
# The bundles, over ZeroMQ and in-process: one scenario, same results
# --------------------------------------------------------------------------------------------


async def exercise_learner_and_two_actors(learner, actors) -> None:
    with trio.fail_after(20):
        for index, actor in enumerate(actors):
            await actor.control.send(Hello(actor_id=f"actor-{index}", pid=100 + index, hostname="h", policy_version=-1, engine="scripted"))
        hellos = {}
        for _ in actors:
            peer_id, hello = await learner.control.receive()
            hellos[peer_id] = hello.pid
        assert hellos == {"actor-0": 100, "actor-1": 101}

        for index, actor in enumerate(actors):
            await actor.trajectories.send(make_trajectory(20_000 if index else 6, episode=index + 1))
        received = sorted([await learner.trajectories.receive() for _ in actors], key=lambda t: t.reward)
        assert [trajectory.trajectory_id for trajectory in received] == ["actor-0/episode-1", "actor-0/episode-2"]
        assert_same_trajectory(received[1], make_trajectory(20_000, episode=2))

        horizon = HorizonUpdate(horizon_cap=12, stage=1, learner_step=80)
        updates = await publish_until_received(learner.broadcast, [actor.broadcast for actor in actors], horizon)
        assert [vars(update) for update in updates] == [vars(horizon)] * 2

        await learner.control.send("actor-1", Stop(reason="enough"))
        assert vars(await actors[1].control.receive()) == {"reason": "enough"}
        with pytest.raises(UnknownPeer):
            await learner.control.send("actor-9", Stop(reason="nobody"))
    assert learner.trajectories.rejected == 0 and learner.control.rejected == 0


async def test_zmq_bundles(context) -> None:
    learner = zmq_learner_endpoints(
        trajectory_address=LOOPBACK, broadcast_address=LOOPBACK, control_address=LOOPBACK, context=context
    )
    actors = [
        zmq_actor_endpoints(
            f"actor-{index}",
            trajectory_address=learner.trajectories.address,
            broadcast_address=learner.broadcast.address,
            control_address=learner.control.address,
            context=context,
        )
        for index in range(2)
    ]
    await exercise_learner_and_two_actors(learner, actors)
    for endpoints in (learner, *actors):
        endpoints.close()


async def test_in_process_bundles() -> None:
    network = InProcessNetwork()
    learner = network.learner_endpoints()
    actors = [network.actor_endpoints(f"actor-{index}") for index in range(2)]
    await exercise_learner_and_two_actors(learner, actors)
    for endpoints in (learner, *actors):
        endpoints.close()


def test_every_endpoint_satisfies_its_interface(context) -> None:
    network = InProcessNetwork()
    pull = ZmqPullReceiver(LOOPBACK, context=context)
    router = ZmqRouter(LOOPBACK, context=context)
    zmq_endpoints = [
        (ZmqPushSender(pull.address, context=context), Sender),
        (pull, Receiver),
        (ZmqPublisher(LOOPBACK, context=context), Sender),
        (ZmqSubscriber(pull.address, context=context), Receiver),
        (router, Router),
        (ZmqDealer("a", router.address, context=context), Dealer),
    ]
    twin_endpoints = [
        (network.push_sender(), Sender), (network.pull_receiver(), Receiver),
        (network.publisher(), Sender), (network.subscriber(), Receiver),
        (network.router(), Router), (network.dealer("a"), Dealer),
    ]
    for endpoint, interface in zmq_endpoints + twin_endpoints:
        assert isinstance(endpoint, interface), (endpoint, interface)
        endpoint.close()


# --------------------------------------------------------------------------------------------
# The in-process twin's own behaviour
# --------------------------------------------------------------------------------------------


async def test_in_process_push_waits_when_the_buffer_is_full() -> None:
    network = InProcessNetwork(trajectory_buffer=2)
    sender, receiver = network.push_sender(), network.pull_receiver()
    sent = 0
    with trio.move_on_after(0.2):
        for episode in range(5):
            await sender.send(make_trajectory(4, episode=episode))
            sent += 1
    assert sent == 2
    assert [(await receiver.receive()).reward for _ in range(2)] == [0.0, 1.0]


async def test_in_process_subscriber_keeps_the_latest_and_only_what_came_after_it() -> None:
    network = InProcessNetwork(broadcast_keep_latest=2)
    publisher = network.publisher()
    await publisher.send(HorizonUpdate(horizon_cap=5, stage=0, learner_step=0))
    subscriber = network.subscriber()
    for stage in range(1, 6):
        await publisher.send(HorizonUpdate(horizon_cap=5 + stage, stage=stage, learner_step=10 * stage))
    assert [(await subscriber.receive()).stage for _ in range(2)] == [4, 5]
    subscriber.close()
    await publisher.send(HorizonUpdate(horizon_cap=20, stage=6, learner_step=60))
    with pytest.raises(trio.ClosedResourceError):
        await subscriber.receive()


async def test_in_process_rejects_bad_frames_and_copies_what_it_carries() -> None:
    network = InProcessNetwork()
    sender, receiver = network.push_sender(), network.pull_receiver()
    await sender.send_frames([b"garbage"])
    trajectory = make_trajectory(20_000, episode=4)
    await sender.send(trajectory)
    trajectory.token_ids[:] = 0  # the sender reusing its buffer must not change what was sent
    received = await receiver.receive()
    assert receiver.rejected == 1
    np.testing.assert_array_equal(received.token_ids, make_trajectory(20_000, episode=4).token_ids)


async def test_in_process_dealer_with_the_same_id_takes_over() -> None:
    network = InProcessNetwork()
    router = network.router()
    old, new = network.dealer("actor-0"), network.dealer("actor-0")
    await router.send("actor-0", Stop(reason="to the new one"))
    assert (await new.receive()).reason == "to the new one"
    with trio.move_on_after(0.05) as waited:
        await old.receive()
    assert waited.cancelled_caught
    new.close()
    with pytest.raises(UnknownPeer):
        await router.send("actor-0", Stop(reason="gone"))


# --------------------------------------------------------------------------------------------
# The benchmark runs (tiny sizes: this checks its output, not the speed)
# --------------------------------------------------------------------------------------------


def test_bench_transport_reports_every_figure(capsys) -> None:
    # Whatever this process already keeps: the setting cannot be undone, and another test in the
    # same process (the weights benchmark, run in-process) may have applied it first.
    from longhorizon.common.memory import keeping_freed_message_memory

    keep = keeping_freed_message_memory()
    result = bench_transport(trajectory_bytes=4096, messages=5, rounds=1, keep_freed_memory=keep)
    assert result["keep_freed_memory"] is keep
    for prefix in ("raw", "trajectory", "raw_split"):
        for figure in ("message_bytes", "messages", "seconds", "messages_per_s", "mb_per_s"):
            assert result[f"{prefix}_{figure}"] > 0, f"{prefix}_{figure}"
    assert result["raw_message_bytes"] == 4096
    assert result["ratio"] == pytest.approx(result["trajectory_mb_per_s"] / result["raw_mb_per_s"])
    assert result["raw_split_message_bytes"] == result["trajectory_message_bytes"]
    expected = {
        "trajectory_tokens", "trajectory_frames", "raw_split_ratio", "target_ratio", "meets_target", "round_ratios",
        "keep_freed_memory",
    }
    assert expected <= set(result)
    print_report(result)
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) > 2 and lines[0].startswith("transport over tcp loopback")


async def test_subscriber_rejects_bad_broadcasts(context) -> None:
    raw = context.socket(zmq.PUB)
    raw.setsockopt(zmq.LINGER, 0)
    port = raw.bind_to_random_port("tcp://127.0.0.1")
    subscriber = ZmqSubscriber(f"tcp://127.0.0.1:{port}", context=context)
    bad_schema = msgpack.packb({"type": "horizon_update", "schema": 99, "fields": {}})
    valid = encode(HorizonUpdate(horizon_cap=5, stage=1, learner_step=9))
    received = []

    async def receive() -> None:
        received.append(await subscriber.receive())

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(receive)
            # PUB drops everything until the subscription has arrived: repeat until one lands.
            while not received:
                raw.send_multipart(valid)
                await trio.sleep(0.05)
        assert subscriber.rejected == 0
        raw.send_multipart([b"\xc1 not msgpack"])
        raw.send_multipart([bad_schema])
        raw.send_multipart(encode(HorizonUpdate(horizon_cap=6, stage=2, learner_step=10)))
        while not received or received[-1].learner_step != 10:  # skip phase-one repeats still queued
            await receive()
    assert vars(received[-1]) == {"horizon_cap": 6, "stage": 2, "learner_step": 10}
    assert subscriber.rejected == 2
    subscriber.close()
    raw.close(linger=0)


def test_endpoints_close_their_sockets_then_terminate_their_own_context():
    """Terminating waits for ZeroMQ's I/O threads to let go of every lent buffer, so a process
    that exits right after close() cannot have them read freed memory."""
    from longhorizon.common.transport import zmq_actor_endpoints, zmq_learner_endpoints

    learner = zmq_learner_endpoints(
        trajectory_address="tcp://127.0.0.1:*", broadcast_address="tcp://127.0.0.1:*",
        control_address="tcp://127.0.0.1:*",
    )
    actor = zmq_actor_endpoints(
        "actor-0", trajectory_address=learner.trajectories.address,
        broadcast_address=learner.broadcast.address, control_address=learner.control.address,
    )
    contexts = [learner.owned_context, actor.owned_context]
    assert all(context is not None and not context.closed for context in contexts)
    assert learner.owned_context is not actor.owned_context
    actor.close()
    learner.close()
    assert all(context.closed for context in contexts)
    learner.close()  # closing twice is harmless
