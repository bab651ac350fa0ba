"""The env service (envs/service.py, served over HTTP by envs/server.py) and RemoteEnv (envs/remote.py) over real loopback sockets."""

from __future__ import annotations

import http.client
import json
import random
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import trio
from longhorizon.envs.base import (
    Task,
    action_from_reply,
    list_tasks,
    make_env,
    make_policy,
)
from longhorizon.envs.babyai.levels import LevelSimulators
from longhorizon.envs.checker import check_env
from longhorizon.envs.remote import (
    RemoteEnv,
    RemoteEnvError,
    ServiceClient,
    data_idx_of,
    make_remote_env,
)
from longhorizon.envs.sciworld.catalog import SCIENCEWORLD_TASKS
from longhorizon.envs.server import EnvServer
from longhorizon.envs.service import ServiceSettings, build_task_table


def _request(port: int, method: str, path: str, body: bytes | dict | None = None, headers: dict | None = None,
             timeout_s: float = 10.0):
    """One request on a fresh connection: (status, decoded JSON body, response headers)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        connection.request(method, path, body=data, headers=headers or {})
        response = connection.getresponse()
        return response.status, json.loads(response.read()), dict(response.getheaders())
    finally:
        connection.close()


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


@pytest.fixture
def textcraft_server():
    with EnvServer(ServiceSettings("textcraft", max_instances=16)) as server:
        yield server


@pytest.fixture
def codebook_server():
    with EnvServer(ServiceSettings("codebook", env_options={"num_turns": 5}, max_instances=16)) as server:
        yield server


async def _play(env, task: Task, seed: int, policy, max_steps: int = 40) -> list[tuple]:
    """The transcript of one episode: first observation, then (obs, reward, terminated, truncated, success)."""
    observation, _ = await env.reset(task, seed=seed)
    transcript: list[tuple] = [observation]
    policy.reset(task, observation, random.Random(seed))
    for _ in range(max_steps):
        action = action_from_reply(policy.act(observation), env.prompt_format)
        observation, reward, terminated, truncated, info = await env.step(action)
        transcript.append((action, observation, reward, terminated, truncated, info["success"]))
        if terminated or truncated:
            break
    return transcript


def test_data_idx_mapping():
    textcraft = build_task_table("textcraft", {})
    assert textcraft.mapping == "index"
    for data_idx, task in textcraft.by_data_idx.items():
        assert task.data["index"] == data_idx
    # Codebook tasks carry no index: train takes 0..1999, test follows.
    codebook = build_task_table("codebook", {})
    assert codebook.mapping == "position"
    assert codebook.by_data_idx[0].task_id == "train-0"
    assert codebook.by_data_idx[1999].task_id == "train-1999"
    assert codebook.by_data_idx[2000].task_id == "test-0"
    assert codebook.data_idx_by_split["test"] == tuple(range(2000, 2200))


async def test_textcraft_through_remote_matches_in_process(textcraft_server):
    options = {"url": textcraft_server.url, "env": "textcraft"}
    remote_tasks = list_tasks("remote", "test", **options)
    local_tasks = list_tasks("textcraft", "test")
    assert [task.task_id for task in remote_tasks] == [task.task_id for task in local_tasks]
    assert all(remote.data == {**local.data, "data_idx": local.data["index"]} for remote, local in zip(remote_tasks, local_tasks))

    remote_env, local_env = make_env("remote", **options), make_env("textcraft")
    assert remote_env.instructions() == local_env.instructions()
    deep_tasks = [task for task in local_tasks if task.category in ("depth-2", "depth-3")][:2]
    for local_task in [local_tasks[0], *deep_tasks]:
        remote_task = next(task for task in remote_tasks if task.task_id == local_task.task_id)
        for seed, policy_name in ((0, "oracle"), (7, "random")):
            local = await _play(local_env, local_task, seed, make_policy("textcraft", policy_name))
            remote = await _play(remote_env, remote_task, seed, make_policy("remote", policy_name, **options))
            assert remote == local
            if policy_name == "oracle":
                assert remote[-1][2] == 1.0 and remote[-1][5] is True
    assert remote_env.prompt_format == "react"
    await remote_env.close()
    assert (await trio.to_thread.run_sync(_request, textcraft_server.port, "GET", "/health"))[1]["instances"] == 0


async def test_codebook_through_remote_matches_in_process(codebook_server):
    options = {"url": codebook_server.url, "env": "codebook", "env_options": {"num_turns": 5}}
    remote_tasks = list_tasks("remote", "train", **options)
    assert len(remote_tasks) == 2000 and data_idx_of(remote_tasks[1234]) == 1234
    test_tasks = list_tasks("remote", "test", **options)
    assert data_idx_of(test_tasks[0]) == 2000
    local_tasks = list_tasks("codebook", "train", num_turns=5)
    remote_env = make_remote_env(codebook_server.url, "codebook", env_options={"num_turns": 5})
    local_env = make_env("codebook", num_turns=5)
    for index in (0, 17, 1999):
        for seed in (1, 2):
            local = await _play(local_env, local_tasks[index], seed, make_policy("codebook", "random", num_turns=5))
            remote = await _play(remote_env, remote_tasks[index], seed, make_policy("remote", "random", **options))
            assert remote == local
            assert len(remote) == 6 and remote[-1][3] is True
    assert remote_env.prompt_format == "bare" and remote_env.instructions() == ""
    # A finished episode refuses further steps, as in-process.
    with pytest.raises(RuntimeError):
        await remote_env.step("a0")
    await remote_env.close()
    await remote_env.close()


async def test_env_checker_passes_through_the_service(codebook_server):
    await check_env("remote", {"url": codebook_server.url, "env": "codebook", "env_options": {"num_turns": 5}})


def test_agentgym_payload_shapes(textcraft_server):
    port = textcraft_server.port
    task = list_tasks("textcraft", "train")[5]
    status, created, _ = _request(port, "POST", "/create", {"commands": None, "goal": None})
    assert status == 200 and isinstance(created["id"], int)
    assert {"observation", "done", "reward"} <= set(created)
    status, reset, _ = _request(port, "POST", "/reset", {"id": created["id"], "data_idx": task.data["index"]})
    assert status == 200 and reset["done"] is False and reset["task_id"] == task.task_id

    async def first_observation() -> str:
        return (await make_env("textcraft").reset(task, seed=0))[0]

    # No seed in the request means seed 0, so clients that never send one always see the same text.
    assert reset["observation"] == trio.run(first_observation)
    status, stepped, _ = _request(port, "POST", "/step", {"id": created["id"], "action": "inventory"})
    assert status == 200
    assert stepped["observation"] == "Inventory: You are not carrying anything."
    assert (stepped["reward"], stepped["done"], stepped["score"]) == (0.0, False, 0.0)
    assert _request(port, "GET", f"/observation?id={created['id']}")[:2] == (200, stepped["observation"])
    # /create can name the goal the way AgentGym's TextCraft client does.
    status, by_goal, _ = _request(port, "POST", "/create", {"goal": task.data["goal"]})
    assert status == 200 and by_goal["task_id"] == task.task_id
    status, info, _ = _request(port, "GET", "/info")
    assert info["env"] == "textcraft" and info["data_idx_mapping"] == "index" and info["prompt_format"] == "react"
    status, page, _ = _request(port, "GET", "/tasks?split=train&offset=2&limit=3")
    assert page["total"] == 440 and [entry["task_id"] for entry in page["tasks"]] == [
        task.task_id for task in list_tasks("textcraft", "train")[2:5]
    ]
    for instance_id in (created["id"], by_goal["id"]):
        assert _request(port, "POST", "/close", {"id": instance_id})[:2] == (200, {"id": instance_id, "closed": True})


def test_errors_have_real_status_codes(textcraft_server):
    port = textcraft_server.port
    instance_id = _request(port, "POST", "/create", {})[1]["id"]
    cases = [
        ("POST", "/step", b"{not json", 400),
        ("POST", "/step", b"[1, 2]", 400),
        ("POST", "/step", {"action": "inventory"}, 400),
        ("POST", "/step", {"id": "0", "action": "inventory"}, 400),
        ("POST", "/step", {"id": True, "action": "inventory"}, 400),
        ("POST", "/step", {"id": instance_id, "action": 5}, 400),
        ("POST", "/step", {"id": 999, "action": "inventory"}, 404),
        ("POST", "/reset", {"id": instance_id, "data_idx": 10**9}, 400),
        ("POST", "/reset", {"id": instance_id}, 400),
        ("POST", "/create", {"commands": "craft 1 x using 1 y"}, 400),
        ("POST", "/create", {"goal": "no such item"}, 400),
        ("GET", "/observation?id=abc", None, 400),
        ("GET", "/observation", None, 400),
        ("GET", "/nowhere", None, 404),
        ("GET", "/step", None, 405),
        ("DELETE", "/close", None, 405),
        ("GET", "/tasks?split=validation", None, 400),
        ("GET", "/tasks?limit=0", None, 400),
        ("POST", "/step", b"\xff\xfe\x00garbage", 400),
        ("POST", "/step", b"[" * 100_000 + b"]" * 100_000, 400),
    ]
    for method, path, body, expected in cases:
        status, answer, _ = _request(port, method, path, body)
        assert status == expected, (method, path, body if not isinstance(body, bytes) else body[:20], answer)
        assert isinstance(answer["error"], str) and answer["error"]
    status, answer, _ = _request(port, "POST", "/step", b"x" * (2 * 1024 * 1024))
    assert status == 413 and "limit" in answer["error"]
    # The instance survived all of it.
    assert _request(port, "POST", "/step", {"id": instance_id, "action": "inventory"})[0] == 200


def test_step_after_the_episode_ended_is_a_conflict():
    with EnvServer(ServiceSettings("codebook", env_options={"num_turns": 1})) as server:
        instance_id = _request(server.port, "POST", "/create", {"data_idx": 0})[1]["id"]
        status, answer, _ = _request(server.port, "POST", "/step", {"id": instance_id, "action": "a0"})
        assert status == 200 and answer["done"] is True
        status, answer, _ = _request(server.port, "POST", "/step", {"id": instance_id, "action": "a0"})
        assert status == 409 and "/reset" in answer["error"]


def _hammer(port: int, rounds: int) -> None:
    """Malformed, unknown-id and oversized requests, many over kept-alive connections."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    bodies = [
        b"{",
        b"null",
        b'{"id": "x", "action": "get 1 stick"}',
        b'{"id": 123456, "action": "inventory"}',
        b'{"id": 424242}',
        json.dumps({"id": 424242, "action": ["list"]}).encode(),
    ]
    try:
        for round_index in range(rounds):
            body = bodies[round_index % len(bodies)]
            path = ("/step", "/reset", "/close", "/observation?id=77777")[round_index % 4]
            method = "GET" if path.startswith("/observation") else "POST"
            connection.request(method, path, body=body if method == "POST" else None)
            response = connection.getresponse()
            assert response.status in (400, 404), response.status
            assert "error" in json.loads(response.read())
        for _ in range(20):
            status, _, _ = _request(port, "POST", "/step", b"y" * (1024 * 1024 + 1))
            assert status == 413
        for _ in range(20):
            raw = socket.create_connection(("127.0.0.1", port), timeout=10)
            raw.sendall(b"NONSENSE\r\n\r\n")
            assert raw.recv(4096).startswith(b"HTTP/1.")
            raw.close()
    finally:
        connection.close()


def test_thousands_of_bad_requests_leave_the_service_bounded(textcraft_server):
    port = textcraft_server.port
    live_id = _request(port, "POST", "/create", {})[1]["id"]
    _hammer(port, 300)  # warm-up: thread stacks and caches reach their steady size
    resident_before, threads_before = _resident_bytes(), threading.active_count()
    workers = [threading.Thread(target=_hammer, args=(port, 1000)) for _ in range(3)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    status, health, _ = _request(port, "GET", "/health")
    assert status == 200 and health["instances"] == 1
    assert len(textcraft_server.service.instances) == 1
    assert sum(textcraft_server.error_counts.values()) > 3000
    assert _request(port, "POST", "/step", {"id": live_id, "action": "inventory"})[0] == 200
    deadline = time.monotonic() + 5
    while textcraft_server.open_connections() > 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert textcraft_server.open_connections() == 0
    assert threading.active_count() <= threads_before + 2
    assert _resident_bytes() - resident_before < 30 * 1024 * 1024


def test_instance_cap_refuses_with_503_then_frees_a_slot():
    with EnvServer(ServiceSettings("codebook", max_instances=3)) as server:
        ids = [_request(server.port, "POST", "/create", {})[1]["id"] for _ in range(3)]
        status, answer, headers = _request(server.port, "POST", "/create", {})
        assert status == 503 and "full" in answer["error"] and headers["Retry-After"] == "1"
        assert _request(server.port, "POST", "/close", {"id": ids[1]})[0] == 200
        assert _request(server.port, "POST", "/create", {})[0] == 200


async def test_idle_instances_expire_and_remote_env_recovers():
    with EnvServer(ServiceSettings("codebook", idle_timeout_s=0.3)) as server:
        tasks = list_tasks("remote", "train", url=server.url, env="codebook")
        env = RemoteEnv(url=server.url, env="codebook")
        first, _ = await env.reset(tasks[3], seed=0)
        assert len(server.service.instances) == 1
        await trio.sleep(0.8)
        assert len(server.service.instances) == 0 and server.service.expired == 1
        # The next episode silently gets a fresh instance; a step on the expired one would be an error.
        again, _ = await env.reset(tasks[3], seed=0)
        assert again == first and len(server.service.instances) == 1
        await env.close()


async def test_service_with_a_busy_instance_table_serves_concurrent_episodes(codebook_server):
    options = {"url": codebook_server.url, "env": "codebook", "env_options": {"num_turns": 5}}
    tasks = list_tasks("remote", "train", **options)[:8]
    rewards: dict[str, float] = {}

    async def episode(task: Task) -> None:
        env = make_env("remote", **options)
        transcript = await _play(env, task, 0, make_policy("remote", "oracle", **options))
        rewards[task.task_id] = transcript[-1][2]
        await env.close()

    async with trio.open_nursery() as nursery:
        for task in tasks:
            nursery.start_soon(episode, task)
    assert rewards == {task.task_id: 1.0 for task in tasks}
    assert len(codebook_server.service.instances) == 0


class _ReferenceStyleHandler(BaseHTTPRequestHandler):
    """Answers like an AgentGym service: no /info or /tasks, failures as HTTP 200 with "error"."""

    def do_GET(self) -> None:
        self._answer(404, {"detail": "Not Found"})

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        answers = {
            "/create": {"id": 0},
            "/reset": {"id": 0, "observation": "Goal: craft stick.", "reward": 0, "done": False},
            "/step": {"error": "env 0 crashed"},
            "/close": {"closed": True},
        }
        self._answer(200, answers.get(self.path, {"detail": "Not Found"}))

    def _answer(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format, *args) -> None:
        pass


async def test_remote_env_against_a_reference_style_service():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _ReferenceStyleHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        # No /tasks: the local TextCraft list, its own index serving as data_idx.
        tasks = list_tasks("remote", "train", url=url, env="textcraft")
        assert [task.task_id for task in tasks] == [task.task_id for task in list_tasks("textcraft", "train")]
        assert all(data_idx_of(task) == task.data["index"] for task in tasks)
        env = RemoteEnv(url=url, env="textcraft")
        observation, info = await env.reset(tasks[0], seed=0)
        assert observation == "Goal: craft stick." and info["success"] is False
        assert env.prompt_format == "react"
        with pytest.raises(RemoteEnvError, match="env 0 crashed"):
            await env.step("inventory")
        await env.close()
        with pytest.raises(ValueError, match="not registered here"):
            list_tasks("remote", "train", url=url, env="no_such_env")
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


async def test_unreachable_or_mismatched_service_gives_clear_errors(codebook_server):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed_port = probe.getsockname()[1]
    env = RemoteEnv(url=f"http://127.0.0.1:{closed_port}", env="codebook", timeout_s=2)
    with pytest.raises(RemoteEnvError, match="failed"):
        await env.reset(Task(env_name="remote", task_id="train-0", split="train", data={"data_idx": 0}), seed=0)
    with pytest.raises(ValueError, match="serves 'codebook', not 'textcraft'"):
        list_tasks("remote", "train", url=codebook_server.url, env="textcraft")
    with pytest.raises(ValueError, match="env_options says"):
        list_tasks("remote", "train", url=codebook_server.url, env="codebook", env_options={"num_turns": 3})
    with pytest.raises(ValueError, match="http://HOST:PORT"):
        ServiceClient("localhost:1234", 1.0)
    with pytest.raises(ValueError, match="needs option url"):
        make_env("remote", env="codebook")
    with pytest.raises(ValueError, match="no data\\['data_idx'\\]"):
        data_idx_of(Task(env_name="remote", task_id="x", split="train"))


def test_settings_refuse_nonsense():
    with pytest.raises(ValueError, match="max_instances"):
        ServiceSettings("codebook", max_instances=0)
    with pytest.raises(ValueError, match="idle_timeout_s"):
        ServiceSettings("codebook", idle_timeout_s=-1)
    with pytest.raises(ValueError, match="unknown env"):
        EnvServer(ServiceSettings("no-such-env"))


async def test_remote_env_survives_the_server_closing_an_idle_connection():
    with EnvServer(ServiceSettings("codebook", keep_alive_timeout_s=0.2)) as server:
        tasks = list_tasks("remote", "train", url=server.url, env="codebook")
        env = RemoteEnv(url=server.url, env="codebook")
        await env.reset(tasks[0], seed=0)
        await trio.sleep(0.5)  # the server has hung up the kept-alive connection by now
        observation, _, terminated, _, _ = await env.step("a0")
        assert observation == tasks[0].data["symbols"][1] and not terminated
        await env.close()


def test_connection_cap_evicts_the_oldest_waiting_connection_and_shutdown_is_clean():
    threads_before = threading.active_count()
    server = EnvServer(ServiceSettings("codebook", max_connections=2)).start()
    idle = [socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(2)]
    try:
        deadline = time.monotonic() + 5
        while server.open_connections() < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        # Both slots hold connections that never sent a request: a good request takes the oldest's place.
        status, answer, _ = _request(server.port, "GET", "/health")
        assert status == 200 and answer["status"] == "ok"
        assert idle[0].recv(4096) == b""  # closed without a word: it had not begun a request
        assert server.open_connections() <= 2
    finally:
        # One connection is still open and idle: stop() must not wait for its keep-alive timeout.
        started = time.monotonic()
        server.stop()
        assert time.monotonic() - started < 3
        for connection in idle:
            connection.close()
    deadline = time.monotonic() + 5
    while threading.active_count() > threads_before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert threading.active_count() <= threads_before
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", server.port), timeout=1).close()


async def test_training_runs_through_remote_envs(tmp_path):
    from longhorizon.common.config import load_config
    from longhorizon.common.metrics import read_metrics
    from longhorizon.common.models import build_tiny_model
    from longhorizon.launch.launchers.local import train_in_process

    model = build_tiny_model(tmp_path / "model", words=[f"w{index}" for index in range(260)])
    with EnvServer(ServiceSettings("codebook")) as server:
        config = load_config(
            Path(__file__).resolve().parent.parent / "configs" / "codebook.toml",
            [
                f"run.output_dir={str(tmp_path)!r}", "run.name='remote'", "run.total_steps=2", f"model.path={str(model)!r}",
                "env.name='remote'", f"env.options={{url={server.url!r}, env='codebook'}}", "actor.engine='scripted'",
                "actor.scripted_policy='oracle'", "actor.num_actors=1", "actor.group_size=4", "learner.groups_per_step=2",
            ],
        )
        await train_in_process(config)
        assert server.service.next_id >= 4  # the episodes really went through the service
    records = read_metrics(tmp_path / "remote")
    assert [record["step"] for record in records] == [1, 2]
    assert all(record["failed_episodes"] == 0 and record["reward_mean"] == 1.0 for record in records)


async def test_babyai_through_remote_matches_in_process():
    with EnvServer(ServiceSettings("babyai", max_instances=8)) as server:
        options = {"url": server.url, "env": "babyai"}
        remote_tasks = list_tasks("remote", "test", **options)
        local_tasks = list_tasks("babyai", "test")
        assert [task.task_id for task in remote_tasks] == [task.task_id for task in local_tasks]
        remote_env, local_env = make_env("remote", **options), make_env("babyai")
        try:
            # A few levels of different families, oracle and random play.
            for index in (0, 7, 23):
                for seed, policy_name in ((0, "oracle"), (3, "random")):
                    local = await _play(local_env, local_tasks[index], seed, make_policy("babyai", policy_name), 25)
                    remote = await _play(
                        remote_env, remote_tasks[index], seed, make_policy("remote", policy_name, **options), 25
                    )
                    assert remote == local
        finally:
            await remote_env.close()
            await local_env.close()


@pytest.mark.slow
async def test_sciworld_through_remote_matches_in_process():
    with EnvServer(ServiceSettings("sciworld", env_options={"task_names": ["boil"]}, max_instances=2)) as server:
        options = {"url": server.url, "env": "sciworld", "env_options": {"task_names": ["boil"]}}
        remote_tasks = list_tasks("remote", "test", **options)
        local_tasks = list_tasks("sciworld", "test", task_names=["boil"])
        assert [task.task_id for task in remote_tasks] == [task.task_id for task in local_tasks]
        remote_env = make_env("remote", **options)
        local_env = make_env("sciworld", task_names=["boil"])
        try:
            local = await _play(local_env, local_tasks[0], 0, make_policy("sciworld", "random", task_names=["boil"]), 6)
            remote = await _play(remote_env, remote_tasks[0], 0, make_policy("remote", "random", **options), 6)
            assert remote == local
        finally:
            await remote_env.close()
            await local_env.close()


@pytest.mark.slow
def test_sciworld_reset_fields_and_action_hints():
    with EnvServer(ServiceSettings("sciworld", env_options={"task_names": ["boil"]}, max_instances=2)) as server:
        # A SciWorld instance starts a JVM: on 2 busy cores that alone has taken over 10 s.
        status, created, _ = _request(server.port, "POST", "/create", {"data_idx": 0}, timeout_s=120)
        assert status == 200
        task = build_task_table("sciworld", {"task_names": ["boil"]}).by_data_idx[0]
        assert created["task_name"] == task.data["task_name"] == "boil"
        assert created["var_num"] == task.data["variation"]
        assert created["task_description"] == created["observation"].split("\n", 1)[0]
        status, hint, _ = _request(server.port, "GET", f"/action_hint?id={created['id']}", timeout_s=60)
        assert status == 200 and "look around" in hint["action_hint"]
        assert hint["action_hint"] == sorted(hint["action_hint"])
    with EnvServer(ServiceSettings("codebook")) as server:
        _, created, _ = _request(server.port, "POST", "/create", {})
        status, body, _ = _request(server.port, "GET", f"/action_hint?id={created['id']}")
        assert status == 404 and "no action hints" in body["error"]


# A few entries of the reference BabyAI service's level table (1-based level number -> gymnasium id).
REFERENCE_BABYAI_LEVELS = {
    1: "BabyAI-GoToRedBallGrey-v0",
    2: "BabyAI-GoToRedBall-v0",
    13: "BabyAI-OpenRedDoor-v0",
    24: "BabyAI-Unlock-v0",
    40: "BabyAI-BossLevelNoUnlock-v0",
}


async def test_babyai_data_idx_plays_the_reference_level_and_layout():
    import gymnasium
    import minigrid  # noqa: F401  (registers the BabyAI ids)

    table = build_task_table("babyai", {})
    assert table.mapping == "index"
    env = make_env("babyai")
    try:
        # Test seeds and train seeds (the last one included), over the levels listed above.
        for data_idx in (0, 41, 12, 143, 39, 223, 504 * 40 + 39):
            # The reference plays level data_idx % 40 + 1 of its table, laid out by seed data_idx // 40.
            level_number, seed = data_idx % 40 + 1, data_idx // 40
            task = table.by_data_idx[data_idx]
            reference = gymnasium.make(REFERENCE_BABYAI_LEVELS[level_number])
            reference.reset(seed=seed)
            ours = LevelSimulators().start(task.data["level"], task.data["seed"])
            assert (ours.grid.encode() == reference.unwrapped.grid.encode()).all()
            assert tuple(ours.agent_pos) == tuple(reference.unwrapped.agent_pos)
            assert ours.agent_dir == reference.unwrapped.agent_dir
            _, info = await env.reset(task, seed=0)
            assert info["mission"] == reference.unwrapped.mission
            reference.close()
    finally:
        await env.close()


def test_sciworld_data_idx_is_the_reference_flat_position():
    from scienceworld.constants import ID2TASK

    # The simulator's own task order is the one the reference walks (its env.tasks), and ours.
    assert [(info.task_id, info.name) for info in SCIENCEWORLD_TASKS] == list(ID2TASK.items())
    skipped = {"5-1", "5-2", "9-1", "9-2", "9-3", "10-1", "10-2"}
    variations = {info.name: info.total_variations for info in SCIENCEWORLD_TASKS}
    flat = [(name, variation) for task_id, name in ID2TASK.items() if task_id not in skipped
            for variation in range(variations[name])]
    table = build_task_table("sciworld", {})
    assert table.mapping == "index" and len(table.by_data_idx) > 1000
    for data_idx, task in table.by_data_idx.items():
        assert flat[data_idx] == (task.data["task_name"], task.data["variation"])
