"""RemoteEnv: our async Env protocol played against an AgentGym-style env service over HTTP.

Registered as the env "remote", so a config trains through a service exactly as in-process:

    [env]
    name = "remote"
    options = { url = "http://127.0.0.1:8700", env = "textcraft" }

Options: `url` (the service), `env` (the env it serves; checked against the service's /info),
`env_options` (the options it was started with: checked when given, and used for scripted
policies and for the task list when the service has no /tasks), `timeout_s` (per HTTP call).

Tasks come from the service's GET /tasks, each carrying its AgentGym `data_idx` in
`task.data["data_idx"]`; reset sends that data_idx. With a reference AgentGym service (no /tasks,
no /info) the task list is the local env's, and a task's data["index"] serves as data_idx. For
TextCraft that index is our own numbering, which the reference does not share (its order follows
its recipe folder's directory listing; see envs/textcraft/env.py): such a service plays a goal of
its own choosing for that number, and the goal to go by is the one its first observation names,
not the task's. Requests use the standard library's http.client on trio worker
threads (no extra dependency); each RemoteEnv keeps one keep-alive connection and one service
instance, created on the first reset and reused across episodes.

A service that dies (killed, crashed, restarted) fails the call in flight with RemoteEnvError at
once (a refused or dropped connection; a service that hangs fails after `timeout_s`), so the
episode is recorded as failed. The env then forgets its instance: the next reset connects afresh
and creates a new one, so play resumes as soon as the service is back, without restarting the
client. Forgetting matters because a restarted service may give the old id to another client.
"""

from __future__ import annotations

import http.client
import json
import random
import socket
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import urlencode, urlsplit

import trio

from longhorizon.common.config import Section, bounded
from longhorizon.envs.agents import AgentLoopError, get_agent_loop
from longhorizon.envs.base import (
    SPLITS,
    EnvSpec,
    ScriptedPolicy,
    Task,
    get_env_spec,
    make_env,
    make_policy,
)

ENV_NAME = "remote"
MAX_RESPONSE_BYTES = 64 * 1024 * 1024
_STALE_CONNECTION_ERRORS = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError)


class RemoteEnvError(RuntimeError):
    """The env service could not be reached or refused a request; the message says which and why."""

    def __init__(self, message: str, status: int | None = None, *, lost_connection: bool = False):
        super().__init__(message)
        self.status = status
        self.lost_connection = lost_connection
        """True when the service refused or dropped the connection: it is down or was restarted."""


class ServiceClient:
    """Blocking JSON-over-HTTP calls to one env service through one reusable connection.

    Not thread-safe: one caller at a time (RemoteEnv serialises its calls).
    """

    def __init__(self, url: str, timeout_s: float):
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"env service url must look like http://HOST:PORT, got {url!r}")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise ValueError(f"remote env timeout_s must be a positive number, got {timeout_s!r}")
        self.url = url.rstrip("/")
        self._scheme = parts.scheme
        self._host = parts.hostname
        self._port = parts.port
        self._base_path = parts.path.rstrip("/")
        self.timeout_s = float(timeout_s)
        self._connection: http.client.HTTPConnection | None = None
        self._requests_on_connection = 0

    def _connect(self) -> http.client.HTTPConnection:
        if self._connection is None:
            kind = http.client.HTTPSConnection if self._scheme == "https" else http.client.HTTPConnection
            self._connection = kind(self._host, self._port, timeout=self.timeout_s)
            self._requests_on_connection = 0
        return self._connection

    def close(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None

    def request(self, method: str, path: str, payload: Mapping[str, Any] | None = None) -> Any:
        """The decoded JSON answer; RemoteEnvError for transport failures and HTTP errors."""
        body = None if payload is None else json.dumps(payload).encode("utf-8")
        for attempt in range(2):
            connection = self._connect()
            reused = self._requests_on_connection > 0
            try:
                headers = {"Accept": "application/json"}
                if body is not None:
                    headers["Content-Type"] = "application/json"
                connection.request(method, self._base_path + path, body=body, headers=headers)
                response = connection.getresponse()
                raw = response.read(MAX_RESPONSE_BYTES + 1)
                self._requests_on_connection += 1
                if response.will_close:
                    self.close()
                break
            except _STALE_CONNECTION_ERRORS as error:
                self.close()
                # A kept-alive connection the server has since closed fails before the request
                # reaches it; one retry on a fresh connection is safe. A fresh one failing is real.
                if reused and attempt == 0:
                    continue
                raise RemoteEnvError(
                    f"env service {self.url}: {method} {path} failed: {error!r}", lost_connection=True
                ) from None
            except (OSError, http.client.HTTPException) as error:
                self.close()
                timed_out = isinstance(error, (socket.timeout, TimeoutError))
                raise RemoteEnvError(
                    f"env service {self.url}: {method} {path} {'timed out' if timed_out else 'failed'} "
                    f"({error!r}; timeout {self.timeout_s} s)",
                    lost_connection=not timed_out,
                ) from None
        if len(raw) > MAX_RESPONSE_BYTES:
            self.close()
            raise RemoteEnvError(f"env service {self.url}: {path} answered more than {MAX_RESPONSE_BYTES} bytes")
        try:
            decoded = json.loads(raw) if raw else None
        except ValueError:
            decoded = None
            if response.status < 400:
                raise RemoteEnvError(
                    f"env service {self.url}: {path} answered HTTP {response.status} with a body that is not JSON: {raw[:200]!r}"
                ) from None
        if response.status >= 400:
            message = decoded.get("error") if isinstance(decoded, dict) else None
            message = message or (decoded.get("detail") if isinstance(decoded, dict) else None) or raw[:200].decode("utf-8", "replace")
            raise RemoteEnvError(
                f"env service {self.url}: {method} {path} answered HTTP {response.status}: {message}", status=response.status
            )
        # The reference services report failures as HTTP 200 with an "error" field.
        if isinstance(decoded, dict) and decoded.get("error"):
            raise RemoteEnvError(f"env service {self.url}: {method} {path} reported an error: {decoded['error']}")
        return decoded


def _check_remote_options(url: Any, env: Any, env_options: Any) -> None:
    if not isinstance(url, str) or not url:
        raise ValueError("the remote env needs option url (e.g. 'http://127.0.0.1:8700')")
    if not isinstance(env, str) or not env:
        raise ValueError("the remote env needs option env: the name of the env the service serves")
    if env_options is not None and not isinstance(env_options, Mapping):
        raise ValueError(f"remote env option env_options must be a table of the served env's options, got {env_options!r}")


def _service_info(client: ServiceClient) -> dict | None:
    """The service's /info, or None for a reference service that has none."""
    try:
        info = client.request("GET", "/info")
    except RemoteEnvError as error:
        if error.status in (404, 405):
            return None
        raise
    if not isinstance(info, dict):
        raise RemoteEnvError(f"env service {client.url}: /info did not answer a JSON object")
    return info


def _check_served_env(info: Mapping[str, Any], url: str, env: str, env_options: Mapping[str, Any] | None) -> None:
    if info.get("env") != env:
        raise ValueError(f"the env service at {url} serves {info.get('env')!r}, not {env!r}")
    if env_options is not None and dict(info.get("options") or {}) != dict(env_options):
        raise ValueError(
            f"the env service at {url} serves {env!r} with options {info.get('options')!r}, "
            f"but env_options says {dict(env_options)!r}"
        )


def remote_tasks(
    split: str, *, url: str = "", env: str = "", env_options: Mapping[str, Any] | None = None, timeout_s: float = 30.0
) -> list[Task]:
    """The split's tasks as the service lists them, each with data["data_idx"]; env name "remote"."""
    _check_remote_options(url, env, env_options)
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r} for env {ENV_NAME!r}; valid splits: {', '.join(SPLITS)}")
    client = ServiceClient(url, timeout_s)
    try:
        info = _service_info(client)
        if info is None:
            return _local_tasks(split, env, env_options)
        _check_served_env(info, url, env, env_options)
        tasks: list[Task] = []
        while True:
            page = client.request("GET", "/tasks?" + urlencode({"split": split, "offset": len(tasks)}))
            if not isinstance(page, dict) or not isinstance(page.get("tasks"), list):
                raise RemoteEnvError(f"env service {url}: /tasks did not answer a task listing")
            tasks.extend(_task_from_listing(entry, split) for entry in page["tasks"])
            if not page["tasks"] or len(tasks) >= int(page.get("total", 0)):
                return tasks
    finally:
        client.close()


def _task_from_listing(entry: Any, split: str) -> Task:
    if not isinstance(entry, dict) or not isinstance(entry.get("data_idx"), int) or not isinstance(entry.get("task_id"), str):
        raise RemoteEnvError(f"the env service listed a malformed task: {str(entry)[:200]}")
    data = dict(entry.get("data") or {})
    data["data_idx"] = entry["data_idx"]
    return Task(env_name=ENV_NAME, task_id=entry["task_id"], split=split, category=str(entry.get("category", "")), data=data)


def _local_tasks(split: str, env: str, env_options: Mapping[str, Any] | None) -> list[Task]:
    # A reference service cannot list its tasks; our own copy of the env can, when its tasks carry
    # a data["index"] to send as data_idx (TextCraft's, which is our numbering, not the reference's).
    try:
        spec = get_env_spec(env)
    except ValueError:
        raise ValueError(
            f"the env service has no /tasks endpoint and env {env!r} is not registered here, so its task list is unknown"
        ) from None
    local = spec.tasks(split, **dict(env_options or {}))
    result = []
    for task in local:
        index = task.data.get("index") if isinstance(task.data, Mapping) else None
        if not isinstance(index, int) or isinstance(index, bool):
            raise ValueError(
                f"the env service has no /tasks endpoint and the local {env!r} tasks carry no data['index'] to use as data_idx"
            )
        result.append(Task(env_name=ENV_NAME, task_id=task.task_id, split=task.split, category=task.category, data={**task.data, "data_idx": index}))
    return result


def data_idx_of(task: Task) -> int:
    """The AgentGym data_idx that selects `task` on the service."""
    data = task.data if isinstance(task.data, Mapping) else {}
    for key in ("data_idx", "index"):
        value = data.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    raise ValueError(
        f"task {task.task_id!r} has no data['data_idx'] (or data['index']); take tasks from list_tasks('remote', ...)"
    )


class RemoteEnv:
    """One service instance driven through the Env protocol; reuse it across episodes with reset."""

    name = ENV_NAME

    def __init__(
        self, *, url: str = "", env: str = "", env_options: Mapping[str, Any] | None = None, timeout_s: float = 30.0
    ):
        _check_remote_options(url, env, env_options)
        self.served_env = env
        self.env_options = dict(env_options) if env_options is not None else None
        self._client = ServiceClient(url, timeout_s)
        self._lock = trio.Lock()
        self._seed_source = random.Random()
        self._instance_id: int | None = None
        self._metadata: dict | None = None
        self._episode_active = False

    @property
    def url(self) -> str:
        return self._client.url

    @property
    def prompt_format(self) -> str:
        return self._described()["prompt_format"]

    def instructions(self) -> str:
        return self._described()["instructions"]

    def _described(self) -> dict:
        # Known after the first reset; before it, the local env of that name (if any) says the same.
        if self._metadata is None:
            return self._local_metadata() or {"prompt_format": "react", "instructions": ""}
        return self._metadata

    def _local_metadata(self) -> dict | None:
        try:
            local = make_env(self.served_env, **(self.env_options or {}))
        except ValueError:
            return None
        return {"prompt_format": local.prompt_format, "instructions": local.instructions()}

    async def _call(self, method: str, path: str, payload: Mapping[str, Any] | None = None) -> Any:
        try:
            return await trio.to_thread.run_sync(self._client.request, method, path, payload)
        except RemoteEnvError as error:
            if error.lost_connection:
                # The service is down or was restarted: our instance is gone with it (see the
                # module docstring), so the next reset creates a new one.
                self._instance_id = None
                self._episode_active = False
            raise

    async def _load_metadata(self) -> None:
        info = await trio.to_thread.run_sync(_service_info, self._client)
        if info is None:
            self._metadata = self._local_metadata() or {"prompt_format": "react", "instructions": ""}
            return
        _check_served_env(info, self.url, self.served_env, self.env_options)
        prompt_format = info.get("prompt_format")
        instructions = info.get("instructions")
        if not isinstance(prompt_format, str) or not isinstance(instructions, str):
            raise RemoteEnvError(f"env service {self.url}: /info lacks a valid prompt_format and instructions")
        try:
            get_agent_loop(prompt_format)  # a built-in format or a plug-in loop installed here too
        except AgentLoopError as error:
            raise RemoteEnvError(f"env service {self.url}: its prompt_format names no agent loop here: {error}") from None
        self._metadata = {"prompt_format": prompt_format, "instructions": instructions}

    async def reset(self, task: Task, *, seed: int | None = None) -> tuple[str, dict]:
        data_idx = data_idx_of(task)
        if seed is None:
            seed = self._seed_source.getrandbits(32)
        async with self._lock:
            if self._metadata is None:
                await self._load_metadata()
            if self._instance_id is None:
                await self._create()
            payload = {"id": self._instance_id, "data_idx": data_idx, "seed": seed}
            try:
                answer = await self._call("POST", "/reset", payload)
            except RemoteEnvError as error:
                if error.status != 404:
                    raise
                # The service expired our idle instance between episodes: start a new one.
                await self._create()
                payload["id"] = self._instance_id
                answer = await self._call("POST", "/reset", payload)
            observation = await self._observation_from(answer)
            self._episode_active = True
            info = answer.get("info") if isinstance(answer, dict) and isinstance(answer.get("info"), dict) else {}
            return observation, {"success": False, "invalid_action": False, **info}

    async def _create(self) -> None:
        answer = await self._call("POST", "/create", {})
        # AgentGym services answer {"id": n}; a few answer a bare integer.
        instance_id = answer.get("id") if isinstance(answer, dict) else answer
        if isinstance(instance_id, bool) or not isinstance(instance_id, int):
            raise RemoteEnvError(f"env service {self.url}: /create answered no instance id: {str(answer)[:200]}")
        self._instance_id = instance_id

    async def _observation_from(self, answer: Any) -> str:
        if isinstance(answer, dict) and isinstance(answer.get("observation"), str):
            return answer["observation"]
        fetched = await self._call("GET", f"/observation?id={self._instance_id}")
        if not isinstance(fetched, str):
            raise RemoteEnvError(f"env service {self.url}: no observation for instance {self._instance_id}")
        return fetched

    async def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        if not self._episode_active or self._instance_id is None:
            raise RuntimeError("remote env: call reset() before step(), and again after an episode ends")
        async with self._lock:
            try:
                answer = await self._call("POST", "/step", {"id": self._instance_id, "action": action})
            except RemoteEnvError as error:
                if error.status == 409:
                    self._episode_active = False
                    raise RuntimeError(f"remote env: the episode has ended ({error})") from None
                if error.status == 404:
                    self._instance_id = None
                    self._episode_active = False
                raise
            if not isinstance(answer, dict):
                raise RemoteEnvError(f"env service {self.url}: /step did not answer a JSON object")
            observation = answer.get("observation")
            reward = answer.get("reward", 0.0)
            if not isinstance(observation, str) or isinstance(reward, bool) or not isinstance(reward, (int, float)):
                raise RemoteEnvError(f"env service {self.url}: /step answered no observation and reward: {str(answer)[:200]}")
            done = bool(answer.get("done", False))
            terminated = bool(answer.get("terminated", done))
            truncated = bool(answer.get("truncated", False))
            info = dict(answer["info"]) if isinstance(answer.get("info"), dict) else {}
            if not isinstance(info.get("success"), bool):
                # Reference services have no success flag: a finished episode with reward won.
                info["success"] = done and float(reward) > 0
            if terminated or truncated:
                self._episode_active = False
            return observation, float(reward), terminated, truncated, info

    async def close(self) -> None:
        """Close the service instance (a 404 means it is already gone) and the connection."""
        async with self._lock:
            instance_id, self._instance_id = self._instance_id, None
            self._episode_active = False
            try:
                if instance_id is not None:
                    try:
                        await self._call("POST", "/close", {"id": instance_id})
                    except RemoteEnvError as error:
                        if error.status != 404:
                            raise
            finally:
                self._client.close()


def make_remote_env(url: str, env_name: str, **options: Any) -> RemoteEnv:
    """A RemoteEnv for the service at `url` serving `env_name` (options: env_options, timeout_s)."""
    return RemoteEnv(url=url, env=env_name, **options)


def _delegated_policy(policy_name: str) -> Callable[..., ScriptedPolicy]:
    # The scripted engine builds policies by the config's env name; through "remote" it gets the
    # served env's own policy, which reads observations only.
    def build(
        *, url: str = "", env: str = "", env_options: Mapping[str, Any] | None = None, timeout_s: float = 30.0
    ) -> ScriptedPolicy:
        _check_remote_options(url, env, env_options)
        return make_policy(env, policy_name, **dict(env_options or {}))

    build.__qualname__ = f"remote_{policy_name}_policy"
    return build


class RemoteOptions(Section):
    """remote: any env played through an env service over HTTP."""

    url: str = ""
    """The env service, http://HOST:PORT."""
    env: str = ""
    """The env it serves (checked against the service's /info)."""
    env_options: dict | None = None
    """The options the service was started with: checked when given, and used for scripted
    policies and for the task list when the service has no /tasks."""
    timeout_s: float = bounded(30.0, gt=0)
    """Most seconds one HTTP call may take."""


# The registry (envs/base.py) finds this env here by name.
SPEC = EnvSpec(
    name=ENV_NAME,
    factory=RemoteEnv,
    tasks=remote_tasks,
    policies={"oracle": _delegated_policy("oracle"), "random": _delegated_policy("random")},
    Options=RemoteOptions,
)
