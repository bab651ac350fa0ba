"""The env service's instance table driven directly, without HTTP: create, reset, step, close and
the refusals each turns into a status code (envs/service.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from longhorizon.envs.service import EnvService, ServiceError, ServiceSettings, build_task_table


def _service(**env_options) -> EnvService:
    settings = ServiceSettings("codebook", env_options=env_options)
    return EnvService(settings, build_task_table("codebook", env_options))


async def test_an_episode_runs_from_create_to_close():
    service = _service(num_turns=2)
    created = await service.create(3, None, "127.0.0.1")
    instance_id = created["id"]
    assert created["data_idx"] == 3 and created["done"] is False and created["reward"] == 0.0
    assert await service.observation(instance_id) == created["observation"]
    first = await service.step(instance_id, "a0")
    assert first["done"] is False and first["score"] == first["reward"]
    second = await service.step(instance_id, "a0")
    assert second["done"] is True and second["score"] == first["reward"] + second["reward"]
    with pytest.raises(ServiceError) as finished:
        await service.step(instance_id, "a0")
    assert finished.value.status == 409 and "/reset" in finished.value.message
    again = await service.reset(instance_id, 3, None)
    assert again["id"] == instance_id and again["done"] is False
    assert again["observation"] == created["observation"]  # no seed: seed 0 both times
    assert (await service.step(instance_id, "a0"))["score"] == first["reward"]
    assert await service.close(instance_id) == {"id": instance_id, "closed": True}
    with pytest.raises(ServiceError) as gone:
        await service.step(instance_id, "a0")
    assert gone.value.status == 404
    assert (await service.health())["instances"] == 0


async def test_bad_task_numbers_and_ids_are_refused_before_anything_is_built():
    service = _service()
    with pytest.raises(ServiceError) as bad_task:
        await service.create(10**9, None, "127.0.0.1")
    assert bad_task.value.status == 400 and "data_idx" in bad_task.value.message
    assert not service.instances
    with pytest.raises(ServiceError) as unknown:
        await service.reset(12345, 0, None)
    assert unknown.value.status == 404


async def test_instance_ids_count_up_from_the_start_time():
    service = _service()
    first = (await service.create(None, None, "127.0.0.1"))["id"]
    second = (await service.create(None, None, "127.0.0.1"))["id"]
    assert second == first + 1 and first > 10**12  # milliseconds since the epoch
    await service.close_all()
    assert not service.instances


def test_the_service_does_not_need_the_http_layer():
    code = (
        "import sys, longhorizon.envs.service\n"
        "assert 'http.server' not in sys.modules and 'longhorizon.envs.server' not in sys.modules, sorted(sys.modules)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
