"""The env checker passes the real envs and catches each kind of broken fake env."""

import itertools
import random

import pytest

from longhorizon.envs.base import EnvSpec, Task, register_env, unregister_env
from longhorizon.envs.checker import EnvCheckError, check_env


async def test_codebook_passes():
    await check_env("codebook")
    await check_env("codebook", {"num_turns": 5, "codebook_seed": 3}, split="test", policy="oracle", num_tasks=5)


async def test_textcraft_passes_with_random_and_oracle_policies():
    await check_env("textcraft", split="test", num_tasks=3, policy="random", max_steps=30)
    await check_env("textcraft", {"max_depth": 2, "num_distractors": 3}, policy="oracle")


async def test_bad_arguments_are_value_errors():
    with pytest.raises(ValueError, match="unknown env"):
        await check_env("nope")
    with pytest.raises(ValueError, match="unknown option 'depth'"):
        await check_env("textcraft", {"depth": 2})


_process_wide_counter = itertools.count()


class FakeEnv:
    """A three-step counting env; each flag breaks one rule of the contract."""

    name = "fake"
    prompt_format = "bare"

    def __init__(self, *, flaw: str = ""):
        self.flaw = flaw
        self.turn = 0
        self.closed = False
        if flaw == "unknown_prompt_format":
            self.prompt_format = "json"

    def instructions(self) -> str:
        return ""

    async def reset(self, task, *, seed=None):
        self.turn = 0
        observation = "start"
        if self.flaw == "nondeterministic":
            observation = f"start {random.random()}"
        if self.flaw == "depends_on_instance_history":
            observation = f"start {next(_process_wide_counter)}"
        return observation, {"success": False}

    async def step(self, action):
        if self.turn >= 3 and self.flaw != "steps_after_end":
            raise RuntimeError("episode over")
        self.turn += 1
        done = self.turn >= 3
        info = {} if self.flaw == "no_success" else {"success": done}
        reward = True if self.flaw == "bool_reward" else float(done)
        observation = f"turn {self.turn} {random.random()}" if self.flaw == "noisy_steps" else f"turn {self.turn}"
        return observation, reward, done, False, info

    async def close(self):
        if self.closed and self.flaw == "close_twice":
            raise RuntimeError("already closed")
        self.closed = True


class FakePolicy:
    def __init__(self, *, flaw: str = ""):
        pass

    def reset(self, task, first_observation, rng):
        self.rng = rng

    def act(self, observation):
        return self.rng.choice(["left", "right"])


def _fake_tasks(split, *, flaw=""):
    return [Task(env_name="fake", task_id=f"{split}-{index}", split=split) for index in range(2)]


@pytest.fixture
def fake_env():
    spec = EnvSpec(name="fake", factory=FakeEnv, tasks=_fake_tasks, policies={"random": FakePolicy})
    register_env(spec, replace=True)
    yield "fake"
    unregister_env("fake")


async def test_a_well_behaved_fake_passes(fake_env):
    await check_env(fake_env)


@pytest.mark.parametrize(
    ("flaw", "message"),
    [
        ("nondeterministic", "different first observations"),
        ("depends_on_instance_history", "different first observations"),
        ("noisy_steps", "differed between identical runs"),
        ("no_success", r"info\['success'\] must be a bool"),
        ("bool_reward", "reward must be a finite number"),
        ("steps_after_end", "step after termination must raise RuntimeError"),
        ("close_twice", "close must be idempotent"),
        ("unknown_prompt_format", "prompt_format must name an agent loop: unknown agent loop 'json'"),
    ],
)
async def test_each_flaw_is_caught(fake_env, flaw, message):
    with pytest.raises(EnvCheckError, match=message):
        await check_env(fake_env, {"flaw": flaw})


def test_check_errors_are_assertion_errors():
    assert issubclass(EnvCheckError, AssertionError)
