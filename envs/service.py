"""The env service without its HTTP layer: one registered env as a table of live instances.

`EnvService` creates, resets, steps and closes instances on behalf of clients, expires idle ones
and enforces the table's limits; `envs/server.py` serves it over HTTP (the AgentGym protocol) and
is its only caller in production, while tests drive it directly. Every refusal is a
`ServiceError` carrying the HTTP status the server answers with.

data_idx: when every task of the env carries an integer data["data_idx"] or data["index"], that
number is its data_idx; otherwise the train tasks take 0..n-1 and the test tasks n..n+m-1, both in
list_tasks order. GET /tasks lists the mapping. How it compares with the reference AgentGym services
(each checked by a test in tests/test_env_service.py or tests/test_textcraft.py):
  - BabyAI uses the reference's numbering: data_idx i is level i % 40 + 1 of the reference's level
    table, laid out by seed i // 40, so a client gets the same minigrid level and layout (the
    observation text is our own).
  - SciWorld uses the reference's numbering: the position in the flat list of (task, variation)
    pairs, tasks in the simulator's order less the seven the reference leaves out.
  - TextCraft numbers are our own: the position among all craftable goals sorted by recipe depth,
    then name, the same on every machine. They cannot match the reference's, whose order (and even
    which of a few goals exist) follows the directory listing of its recipe folder on the machine
    it runs on; it also has 544 goals to our 551 (envs/textcraft/env.py says why). An AgentGym
    client's TextCraft data_idx therefore names one of our goals, usually not the one the
    reference would give; /create with "goal" names a goal exactly.
`seed` is our extension: reset without one uses seed 0, so a data_idx always gives the same first
observation to clients that do not send seeds.

Instance ids start at the service's start time in milliseconds and count up, so a restarted service
never hands out the ids of its previous run: a client still holding one (it did not notice the
restart) gets 404 and creates a new instance, instead of driving another client's new instance.

Limits against clients that hog the table: instances never used after /create expire after
unused_idle_timeout_s, others after idle_timeout_s, and one (non-loopback) address holds at most
max_instances_per_client of the table. An env call running past env_call_timeout_s is abandoned and
its instance dropped.

Every method of `EnvService` runs on one trio thread, the only owner of the table, so the table
needs no locks; a per-instance trio.Lock keeps two requests for the same instance from
interleaving.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

import trio
from longhorizon.envs.base import SPLITS, Env, Task, get_env_spec, list_tasks

log = logging.getLogger(__name__)

DEFAULT_SEED = 0


@dataclass(frozen=True)
class ServiceSettings:
    env_name: str
    """The registered env this service exposes."""
    env_options: Mapping[str, Any] = field(default_factory=dict)
    """Options for the env and its task list, as in config env.options."""
    host: str = "127.0.0.1"
    """Interface to bind; anything beyond loopback is reachable by others and has no authentication."""
    port: int = 0
    """TCP port; 0 picks a free one (read it back from EnvServer.port)."""
    max_instances: int = 128
    """Most live instances; /create answers 503 beyond it."""
    idle_timeout_s: float = 600.0
    """An instance untouched for this long is closed and forgotten."""
    unused_idle_timeout_s: float = 60.0
    """An instance nobody has touched since /create (no reset, step, observation or action hint) is
    closed after this long instead, so a burst of /create calls cannot hold the table for
    idle_timeout_s. RemoteEnv and AgentGym clients reset right after creating; a client that
    creates, then waits longer than this before its first call, finds its instance gone (404)."""
    max_instances_per_client: int | None = None
    """Most live instances one client address may hold; beyond it /create answers 429. None means
    half of max_instances (at least 1), so one remote client can never take the whole table from
    the others. Loopback clients are exempt: trainer and service on one machine all come from
    127.0.0.1, where a per-address cap could tell no one apart and would only shrink the table.
    Raise it for a single trusted remote trainer that needs more than half the table."""
    max_body_bytes: int = 1024 * 1024
    """Largest request body accepted; larger ones get 413."""
    max_connections: int = 1024
    """Most connections open at once. A new one beyond it takes the place of the connection that has
    waited longest without a whole request (common/http.py); only when every connection is being
    answered is it refused with 503."""
    keep_alive_timeout_s: float = 60.0
    """A connection idle this long between requests is closed."""
    header_timeout_s: float = 10.0
    """Deadline for a request's head, counted like request_timeout_s."""
    request_timeout_s: float = 30.0
    """Deadline for a whole request, head and body: counted from its first byte (from the accept
    for a connection's first request) across all reads, not per read, so a client that trickles
    bytes cannot hold a connection longer. A late request gets 408 and its connection is closed."""
    env_call_timeout_s: float = 120.0
    """An env reset or step still awaiting after this long is abandoned (504) and its instance dropped."""

    def __post_init__(self) -> None:
        for name in ("max_instances", "max_body_bytes", "max_connections"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"env service setting {name} must be a positive integer, got {value!r}")
        limit = self.max_instances_per_client
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise ValueError(f"env service setting max_instances_per_client must be None or a positive integer, got {limit!r}")
        for name in (
            "idle_timeout_s", "unused_idle_timeout_s", "keep_alive_timeout_s", "header_timeout_s", "request_timeout_s",
            "env_call_timeout_s",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"env service setting {name} must be a positive number of seconds, got {value!r}")
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"env service port must be an integer in 0..65535, got {self.port!r}")

    def client_instance_limit(self) -> int:
        """The most instances one non-loopback client address may hold."""
        if self.max_instances_per_client is not None:
            return self.max_instances_per_client
        return max(1, self.max_instances // 2)


class ServiceError(Exception):
    """A request the service refuses; becomes an HTTP status with {"error": message}."""

    def __init__(self, status: int, message: str, headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = dict(headers or {})


# ---------------------------------------------------------------- task table (data_idx <-> Task)


@dataclass(frozen=True)
class TaskTable:
    """The env's tasks keyed by AgentGym data_idx."""

    by_data_idx: Mapping[int, Task]
    data_idx_by_split: Mapping[str, tuple[int, ...]]
    """Each split's data_idx values in list_tasks order."""
    mapping: str
    """"index" (taken from task.data["index"]) or "position" (train then test)."""

    def task(self, data_idx: int) -> Task:
        task = self.by_data_idx.get(data_idx)
        if task is None:
            raise ServiceError(
                HTTPStatus.BAD_REQUEST,
                f"data_idx {data_idx} names no task of this env ({len(self.by_data_idx)} tasks; "
                "GET /tasks lists the valid data_idx values)",
            )
        return task

    def first_data_idx(self) -> int:
        for split in SPLITS:
            if self.data_idx_by_split.get(split):
                return self.data_idx_by_split[split][0]
        raise ServiceError(HTTPStatus.INTERNAL_SERVER_ERROR, "the env has no tasks")


def build_task_table(env_name: str, env_options: Mapping[str, Any]) -> TaskTable:
    """Every task of both splits under its data_idx (see the module docstring for the mapping)."""
    by_split = {split: list_tasks(env_name, split, **dict(env_options)) for split in SPLITS}
    every_task = [task for split in SPLITS for task in by_split[split]]
    if not every_task:
        raise ValueError(f"env {env_name!r} has no tasks to serve")

    def own_index(task: Task) -> int | None:
        # The reference's own numbering when the task carries it: "data_idx" (BabyAI: level and
        # seed; SciWorld: position in the flat (task, variation) list) or "index" (TextCraft).
        data = task.data if isinstance(task.data, Mapping) else {}
        index = data.get("data_idx", data.get("index"))
        return index if isinstance(index, int) and not isinstance(index, bool) and index >= 0 else None

    indexes = [own_index(task) for task in every_task]
    if all(index is not None for index in indexes) and len(set(indexes)) == len(indexes):
        mapping = "index"
        numbered = {split: [(own_index(task), task) for task in by_split[split]] for split in SPLITS}
    else:
        mapping = "position"
        numbered, offset = {}, 0
        for split in SPLITS:
            numbered[split] = [(offset + position, task) for position, task in enumerate(by_split[split])]
            offset += len(by_split[split])
    return TaskTable(
        by_data_idx={data_idx: task for split in SPLITS for data_idx, task in numbered[split]},
        data_idx_by_split={split: tuple(data_idx for data_idx, _ in numbered[split]) for split in SPLITS},
        mapping=mapping,
    )


def task_listing(table: TaskTable, split: str | None, offset: int, limit: int) -> dict:
    """One page of GET /tasks: the tasks of a split (or both) with their data_idx."""
    if split is not None and split not in SPLITS:
        raise ServiceError(HTTPStatus.BAD_REQUEST, f"unknown split {split!r}; valid splits: {', '.join(SPLITS)}")
    chosen = [split] if split is not None else list(SPLITS)
    data_idx_values = [data_idx for name in chosen for data_idx in table.data_idx_by_split.get(name, ())]
    page = data_idx_values[offset : offset + limit]
    tasks = []
    for data_idx in page:
        task = table.by_data_idx[data_idx]
        tasks.append(
            {
                "data_idx": data_idx,
                "task_id": task.task_id,
                "split": task.split,
                "category": task.category,
                "data": dict(task.data),
            }
        )
    return {
        "split": split or "all",
        "total": len(data_idx_values),
        "offset": offset,
        "mapping": table.mapping,
        "tasks": tasks,
    }


def _finite_reward(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ServiceError(HTTPStatus.INTERNAL_SERVER_ERROR, f"the env returned a reward that is not a finite number: {value!r}")
    return float(value)


def _info_for_json(info: Any) -> dict:
    # Env info dicts are meant to be plain data, but one stray object must not break the response.
    if not isinstance(info, dict) or not info:
        return {}
    return json.loads(json.dumps(info, default=repr, allow_nan=False))


# ---------------------------------------------------------------- the instance table (trio side)


def _is_loopback(client: str) -> bool:
    """Whether a client address is this machine's (IPv4-mapped IPv6 included)."""
    try:
        address = ipaddress.ip_address(client)
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


class _Instance:
    def __init__(self, env: Env, now: float, owner: str) -> None:
        self.env = env
        self.lock = trio.Lock()
        self.last_used = now
        self.owner = owner
        """The client address that created it (for max_instances_per_client)."""
        self.used = False
        """Whether a request other than /create has touched it (see unused_idle_timeout_s)."""
        self.observation = ""
        self.score = 0.0
        self.done = False
        self.data_idx: int | None = None
        self.task_id = ""
        self.reset_info: dict = {}


class EnvService:
    """The live instances of one env. Every method runs on the service's trio thread."""

    def __init__(self, settings: ServiceSettings, table: TaskTable, clock: Callable[[], float] = time.monotonic):
        self.settings = settings
        self.table = table
        self.clock = clock
        self.instances: dict[int, _Instance] = {}
        self.next_id = int(time.time() * 1000)  # see the module docstring: ids differ across restarts
        self.expired = 0
        self._spec = get_env_spec(settings.env_name)
        self._goal_to_data_idx = self._goal_lookup()

    def _goal_lookup(self) -> dict[str, int]:
        # TextCraft's /create may name a goal item instead of a data_idx; accept the full id
        # ("minecraft:stick") and the short name ("stick").
        lookup: dict[str, int] = {}
        for data_idx, task in self.table.by_data_idx.items():
            goal = task.data.get("goal") if isinstance(task.data, Mapping) else None
            if isinstance(goal, str):
                lookup.setdefault(goal, data_idx)
                lookup.setdefault(goal.split(":", 1)[-1].replace("_", " "), data_idx)
                lookup.setdefault(goal.split(":", 1)[-1], data_idx)
        return lookup

    def data_idx_for_goal(self, goal: str) -> int:
        data_idx = self._goal_to_data_idx.get(goal.strip())
        if data_idx is None:
            raise ServiceError(HTTPStatus.BAD_REQUEST, f"goal {goal[:80]!r} is not the goal of any task of this env")
        return data_idx

    def _idle_limit(self, instance: _Instance) -> float:
        if instance.used:
            return self.settings.idle_timeout_s
        return min(self.settings.unused_idle_timeout_s, self.settings.idle_timeout_s)

    async def expire_idle(self) -> int:
        """Close instances idle past their timeout; returns how many went."""
        now = self.clock()
        stale = [
            instance_id
            for instance_id, instance in self.instances.items()
            if instance.last_used < now - self._idle_limit(instance) and not instance.lock.locked()
        ]
        never_used = sum(1 for instance_id in stale if not self.instances[instance_id].used)
        for instance_id in stale:
            await self._drop(instance_id)
        self.expired += len(stale)
        if stale:
            log.info(
                "closed %d idle instance(s), %d of them never used after /create; %d live",
                len(stale), never_used, len(self.instances),
            )
        return len(stale)

    def _held_by(self, client: str) -> int:
        return sum(1 for instance in self.instances.values() if instance.owner == client)

    async def _drop(self, instance_id: int) -> None:
        instance = self.instances.pop(instance_id, None)
        if instance is None:
            return
        try:
            await instance.env.close()
        except Exception as error:  # a failing close must not keep the slot or stop the service
            log.warning("closing instance %d failed: %r", instance_id, error)

    def _instance(self, instance_id: int) -> _Instance:
        instance = self.instances.get(instance_id)
        if instance is None:
            raise ServiceError(HTTPStatus.NOT_FOUND, f"no live instance with id {instance_id} (closed, expired or never created)")
        return instance

    async def create(self, data_idx: int | None, seed: int | None, client: str) -> dict:
        """A new instance reset to a task; `client` is the requesting address (see max_instances_per_client)."""
        limit = None if _is_loopback(client) else self.settings.client_instance_limit()
        if len(self.instances) >= self.settings.max_instances or (limit is not None and self._held_by(client) >= limit):
            await self.expire_idle()
        if len(self.instances) >= self.settings.max_instances:
            raise ServiceError(
                HTTPStatus.SERVICE_UNAVAILABLE,
                f"the instance table is full ({self.settings.max_instances} live instances); "
                "close instances you no longer use or retry later",
                {"Retry-After": "1"},
            )
        if limit is not None and self._held_by(client) >= limit:
            raise ServiceError(
                HTTPStatus.TOO_MANY_REQUESTS,
                f"client {client} already holds {limit} live instances, the most one address may hold; "
                "close instances you no longer use or retry later",
                {"Retry-After": "1"},
            )
        chosen = self.table.first_data_idx() if data_idx is None else data_idx
        self.table.task(chosen)  # refuse a bad data_idx before building anything
        try:
            env = self._spec.factory(**dict(self.settings.env_options))
        except Exception as error:
            log.exception("building a %s env failed", self.settings.env_name)
            raise ServiceError(HTTPStatus.INTERNAL_SERVER_ERROR, f"building the env failed: {error!r}") from None
        instance_id = self.next_id
        self.next_id += 1
        instance = _Instance(env, self.clock(), client)
        self.instances[instance_id] = instance
        try:
            async with instance.lock:
                await self._reset_locked(instance_id, instance, chosen, seed)
        except BaseException:
            await self._drop(instance_id)
            raise
        return {"id": instance_id, **self._reset_response(instance)}

    async def reset(self, instance_id: int, data_idx: int, seed: int | None) -> dict:
        instance = self._instance(instance_id)
        self.table.task(data_idx)
        instance.used = True
        async with instance.lock:
            await self._reset_locked(instance_id, instance, data_idx, seed)
        return {"id": instance_id, **self._reset_response(instance)}

    async def _reset_locked(self, instance_id: int, instance: _Instance, data_idx: int, seed: int | None) -> None:
        task = self.table.task(data_idx)
        result = await self._call_env(instance_id, instance.env.reset(task, seed=DEFAULT_SEED if seed is None else seed))
        if not isinstance(result, tuple) or len(result) != 2 or not isinstance(result[0], str):
            raise ServiceError(HTTPStatus.INTERNAL_SERVER_ERROR, "the env's reset did not return (observation, info)")
        observation, info = result
        instance.observation = observation
        instance.score = 0.0
        instance.done = False
        instance.data_idx = data_idx
        instance.task_id = task.task_id
        instance.reset_info = _info_for_json(info)
        instance.last_used = self.clock()

    def _reset_response(self, instance: _Instance) -> dict:
        task = self.table.by_data_idx[instance.data_idx]
        return {
            "observation": instance.observation,
            "reward": 0.0,
            "score": 0.0,
            "done": False,
            "data_idx": instance.data_idx,
            "task_id": instance.task_id,
            **_task_fields(task, instance.observation),
            "info": instance.reset_info,
        }

    async def step(self, instance_id: int, action: str) -> dict:
        instance = self._instance(instance_id)
        instance.used = True
        async with instance.lock:
            if instance.done:
                raise ServiceError(
                    HTTPStatus.CONFLICT, f"the episode of instance {instance_id} has ended; POST /reset to start another"
                )
            result = await self._call_env(instance_id, instance.env.step(action))
            if not isinstance(result, tuple) or len(result) != 5:
                raise ServiceError(HTTPStatus.INTERNAL_SERVER_ERROR, "the env's step did not return five values")
            observation, reward, terminated, truncated, info = result
            reward = _finite_reward(reward)
            instance.observation = observation if isinstance(observation, str) else str(observation)
            instance.score += reward
            instance.done = bool(terminated) or bool(truncated)
            instance.last_used = self.clock()
            return {
                "observation": instance.observation,
                "reward": reward,
                "score": instance.score,
                "done": instance.done,
                "terminated": bool(terminated),
                "truncated": bool(truncated),
                "info": _info_for_json(info),
            }

    async def _call_env(self, instance_id: int, call) -> Any:
        try:
            # A plain cancel scope rather than trio.fail_after, a generator-based context manager
            # that costs several microseconds more on every step.
            with trio.move_on_after(self.settings.env_call_timeout_s):
                return await call
        except ServiceError:
            raise
        except RuntimeError as error:
            raise ServiceError(HTTPStatus.CONFLICT, f"the env refused the call: {error}") from None
        except Exception as error:
            log.exception("env call on instance %d failed", instance_id)
            raise ServiceError(HTTPStatus.INTERNAL_SERVER_ERROR, f"the env failed: {error!r}") from None
        # Only the deadline gets here. The env is in an unknown state mid-call: forget it rather
        # than hand it out again.
        self.instances.pop(instance_id, None)
        raise ServiceError(
            HTTPStatus.GATEWAY_TIMEOUT,
            f"the env call did not finish within {self.settings.env_call_timeout_s} s; instance {instance_id} was dropped",
        )

    async def close(self, instance_id: int) -> dict:
        instance = self._instance(instance_id)
        async with instance.lock:
            await self._drop(instance_id)
        return {"id": instance_id, "closed": True}

    async def action_hint(self, instance_id: int) -> dict:
        """The actions the env accepts right now, for envs that can list them (SciWorld)."""
        instance = self._instance(instance_id)
        valid_actions = getattr(instance.env, "valid_actions", None)
        if valid_actions is None:
            raise ServiceError(HTTPStatus.NOT_FOUND, f"env {self.settings.env_name!r} gives no action hints")
        async with instance.lock:
            instance.used = True
            instance.last_used = self.clock()
            actions = await self._call_env(instance_id, valid_actions())
        return {"id": instance_id, "action_hint": list(actions)}

    async def observation(self, instance_id: int) -> str:
        instance = self._instance(instance_id)
        instance.used = True
        instance.last_used = self.clock()
        return instance.observation

    async def health(self) -> dict:
        return {
            "status": "ok",
            "env": self.settings.env_name,
            "instances": len(self.instances),
            "max_instances": self.settings.max_instances,
            "expired_instances": self.expired,
        }

    async def close_all(self) -> None:
        for instance_id in list(self.instances):
            await self._drop(instance_id)


def _task_fields(task: Task, observation: str) -> dict:
    """The reset fields SciWorld clients read: the simulator's task name, variation and description
    when the task has them, else our task id and the first observation."""
    data = task.data if isinstance(task.data, Mapping) else {}
    if isinstance(data.get("task_name"), str) and isinstance(data.get("variation"), int):
        return {
            "task_name": data["task_name"],
            "var_num": data["variation"],
            "task_description": observation.split("\n", 1)[0],
        }
    return {"task_name": task.task_id, "task_description": observation}
