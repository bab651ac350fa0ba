"""A run survives SIGKILL of what its envs depend on: Chromium, the ScienceWorld JVM, an env service.

Each test plays real episodes through the rollout (run_episode, EnvPool), kills the real helper
process at a chosen moment, and checks what a user meets: the episode in flight fails with a clear
error in bounded time (or, for ScienceWorld, is recovered), and the next episode plays. The last
test kills an owner process and checks that the working folders of its web app servers go too.
Helpers are found by walking this process's own tree with psutil; only those are killed.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import psutil
import pytest
import trio

from longhorizon.actor.engines.base import EngineSettings, GenerationResult
from longhorizon.actor.engines.scripted import ScriptedEngine
from longhorizon.actor.rollout import EnvPool, run_episode
from longhorizon.common.chat import ByteChatTokenizer
from longhorizon.envs.base import Task, list_tasks, make_env, react_reply
from tests.fakes import InterruptedEngine

DEADLINE_S = 20.0
ROLLOUT = {"horizon_cap": 8, "max_context_tokens": 100_000, "max_new_tokens": 64}


def own_descendants() -> list[psutil.Process]:
    try:
        return psutil.Process().children(recursive=True)
    except psutil.Error:
        return []


def named(process: psutil.Process) -> str:
    try:
        return process.name()
    except psutil.Error:
        return ""


def wait_until(condition, what: str, deadline_s: float = DEADLINE_S) -> None:
    deadline = time.monotonic() + deadline_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen within {deadline_s} s"
        time.sleep(0.05)


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def kill_and_wait(processes: list[psutil.Process]) -> list[int]:
    for process in processes:
        try:
            process.kill()
        except psutil.Error:
            pass
    # A zombie has exited: only its parent (perhaps not us) has yet to collect its status.
    wait_until(lambda: all(gone(process.pid) for process in processes), "killed processes exiting")
    return [process.pid for process in processes]


class DelegatingEnv:
    """Another env's attributes and methods; subclasses replace one to inject a fault."""

    def __init__(self, env) -> None:
        self.env = env

    def __getattr__(self, name: str):
        return getattr(self.env, name)


class CommandEngine:
    """Replies with fixed commands in the react format; `on_turn(n)` runs before turn n's reply."""

    def __init__(self, commands: list[str], on_turn=None) -> None:
        self.tokenizer = ByteChatTokenizer()
        self.policy_version = 0
        self.commands = commands
        self.on_turn = on_turn
        self.turns = 0

    async def generate(self, request) -> GenerationResult:
        self.turns += 1
        if self.on_turn is not None:
            self.on_turn(self.turns)
        text = react_reply("Next command.", self.commands[(self.turns - 1) % len(self.commands)])
        tokens = self.tokenizer.encode(text) + [self.tokenizer.eos_token_id]
        return GenerationResult(token_ids=tokens, logprobs=[0.0] * len(tokens), text=text, stopped_on_eos=True,
                                policy_version=0)

    def end_episode(self, episode_id: str) -> None:
        pass


# -- Chromium -------------------------------------------------------------------------------------


def main_chromium_processes(exclude: set[int]) -> list[psutil.Process]:
    """Browser (main) processes among our descendants: Chromium whose parent is not Chromium (it is
    Playwright's driver), less those in `exclude` (browsers of other pools in this process)."""
    found = []
    for process in own_descendants():
        try:
            if "chrom" in named(process).lower() and "chrom" not in named(process.parent()).lower():
                if process.pid not in exclude:
                    found.append(process)
        except (psutil.Error, AttributeError):
            continue
    return found


@pytest.mark.browser
@pytest.mark.slow
async def test_a_killed_chromium_fails_its_episode_and_the_next_one_plays():
    from longhorizon.envs.web.browser import BrowserPool

    foreign = {process.pid for process in main_chromium_processes(set())}

    def kill_our_browser() -> list[int]:
        return kill_and_wait(main_chromium_processes(foreign))

    pool = BrowserPool(1)
    options = {"task_names": ["enter-text"], "instances_per_task": 1, "pool": pool}
    (task,) = list_tasks("miniwob", "train", **options)
    engine = ScriptedEngine(EngineSettings(env_name="miniwob", env_options=options, scripted_policy="oracle"))
    envs = EnvPool(lambda: make_env("miniwob", **options))
    killed: list[int] = []

    class KilledMidStep(DelegatingEnv):
        """The env, except that its first step has the page wait 3 s (so a browser call is surely in
        flight) and Chromium is SIGKILLed 0.5 s into it."""

        async def step(self, action: str):
            async def kill_soon() -> None:
                await trio.sleep(0.5)
                killed.extend(await trio.to_thread.run_sync(kill_our_browser))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(kill_soon)
                try:
                    return await self.env.step("noop(3000)")
                except Exception as error:  # raised outside the nursery, not as an exception group
                    failure = error
            raise failure

    try:
        env = envs.acquire()
        result = await run_episode(env, engine, task, episode_id="warm", **ROLLOUT)
        assert (result.error, result.success) == ("", True)
        envs.release(env)

        # Killed in the middle of a step: the episode fails at once with a clear error.
        env = envs.acquire()
        started = time.monotonic()
        result = await run_episode(KilledMidStep(env), engine, task, episode_id="killed", **ROLLOUT)
        assert killed, "no Chromium of ours was found to kill"
        assert result.error.startswith("BrowserFailure: the browser crashed or was killed during the episode")
        assert not result.success and time.monotonic() - started < 10
        envs.release(env, broken=True)

        # The next episode, on a fresh env from the pool, gets a relaunched browser.
        fresh = envs.acquire()
        assert fresh is not env
        result = await run_episode(fresh, engine, task, episode_id="fresh", **ROLLOUT)
        assert (result.error, result.success) == ("", True)
        assert pool.stats.relaunches >= 1

        # Killed between episodes: the same env plays its next episode on a relaunched browser.
        assert kill_our_browser()
        result = await run_episode(fresh, engine, task, episode_id="between", **ROLLOUT)
        assert (result.error, result.success) == ("", True)

        # Killed while reset opens the episode's context and loads the page: reset tries again on a
        # relaunched browser. (Playwright can leave a new_page call pending for ever when the
        # browser dies under it; the pool must notice the death, not wait.)
        for delay in (0.1, 0.2, 0.3):
            async def kill_after(delay: float = delay) -> None:
                await trio.sleep(delay)
                await trio.to_thread.run_sync(kill_our_browser)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(kill_after)
                with trio.fail_after(DEADLINE_S):
                    observation, _ = await fresh.reset(task)
            assert observation.startswith("Goal: "), observation[:200]
        result = await run_episode(fresh, engine, task, episode_id="after-resets", **ROLLOUT)
        assert (result.error, result.success) == ("", True)
    finally:
        await envs.close()
        await pool.aclose()


# -- ScienceWorld ---------------------------------------------------------------------------------


FIND_TASK = "find-non-living-thing"


def java_processes(exclude: set[int]) -> list[psutil.Process]:
    return [process for process in own_descendants() if named(process) == "java" and process.pid not in exclude]


@pytest.mark.slow
async def test_a_killed_sciworld_jvm_is_replaced_and_a_hopeless_one_fails_the_episode_clearly():
    foreign = {process.pid for process in java_processes(set())}
    task = Task(env_name="sciworld", task_id=f"train-{FIND_TASK}-0", split="train", category=FIND_TASK,
                data={"task_name": FIND_TASK, "variation": 0})
    commands = ["look around", "open door to kitchen", "go to kitchen"]
    rollout = {**ROLLOUT, "horizon_cap": 3}
    envs = EnvPool(lambda: make_env("sciworld", task_names=[FIND_TASK]))
    try:
        # Killed while reset loads the task (a JVM call of about a second): the env starts a new
        # JVM, loads again, and the episode plays on as if nothing happened.
        env = envs.acquire()

        async def kill_during_load() -> None:
            while env.jvm_pid is None:
                await trio.sleep(0.01)
            await trio.sleep(0.2)
            await trio.to_thread.run_sync(kill_and_wait, [psutil.Process(env.jvm_pid)])

        async with trio.open_nursery() as nursery:
            nursery.start_soon(kill_during_load)
            result = await run_episode(env, CommandEngine(commands), task, episode_id="recovered", **rollout)
        assert (result.error, result.num_turns, result.truncated) == ("", 3, True)
        assert env.simulators_started == 2 and env.jvm_pid is not None
        envs.release(env)

        # Before the second step the JVM is killed, and so is every JVM started after it: recovery
        # is impossible, and the step fails the episode with a clear error instead of hanging.
        stop = threading.Event()

        def kill_every_jvm() -> None:
            while not stop.is_set():
                kill_and_wait(java_processes(foreign))
                time.sleep(0.01)

        killer = threading.Thread(target=kill_every_jvm, daemon=True)

        def before_turn(turn: int) -> None:
            if turn == 2:
                kill_and_wait(java_processes(foreign))  # the episode's JVM, surely dead before the step
                killer.start()

        env = envs.acquire()
        started = time.monotonic()
        try:
            result = await run_episode(env, CommandEngine(commands, before_turn), task, episode_id="hopeless",
                                       **rollout)
        finally:
            stop.set()
            if killer.is_alive():
                killer.join()
        assert result.error.startswith("RuntimeError: sciworld simulator failed twice"), result.error
        assert result.num_turns == 2 and time.monotonic() - started < 60
        envs.release(env, broken=True)

        # A fresh env from the pool plays on a new JVM.
        fresh = envs.acquire()
        assert fresh is not env
        result = await run_episode(fresh, CommandEngine(commands), task, episode_id="fresh", **rollout)
        assert (result.error, result.num_turns) == ("", 3)
        jvm = fresh.jvm_pid
        assert jvm is not None and not gone(jvm)

        # An episode that fails on the engine's side also discards its env; the pool closes it at
        # once, so its JVM does not linger until the run ends.
        result = await run_episode(fresh, CommandEngine(commands), task, episode_id="too-long",
                                   **{**rollout, "max_context_tokens": 32})
        assert result.error.startswith("ValueError: the first prompt has")
        envs.release(fresh, broken=True)
        await trio.to_thread.run_sync(lambda: wait_until(lambda: gone(jvm), "the discarded env's JVM exiting"))
    finally:
        await envs.close()


@pytest.mark.slow
def test_the_shared_reference_jvm_is_replaced_after_a_kill():
    from longhorizon.envs.sciworld.policies import shared_reference

    # The scripted policies share one reference JVM per process: when it dies, the next question
    # gets a new one rather than a dead gateway.
    reference = shared_reference()
    reference.close()  # an earlier test may have started it: its next use starts a JVM we can tell apart
    foreign = {process.pid for process in java_processes(set())}
    try:
        valid = reference.valid_actions_after(FIND_TASK, 0, "", ["open door to kitchen"])
        assert "go to kitchen" in valid and "open door to kitchen" not in valid
        killed = kill_and_wait(java_processes(foreign))  # only the reference runs one of ours now
        assert len(killed) == 1
        assert reference.valid_actions_after(FIND_TASK, 0, "", ["open door to kitchen"]) == valid
        replacement = [process.pid for process in java_processes(foreign)]
        assert len(replacement) == 1 and replacement != killed
    finally:
        reference.close()


# -- an env service -------------------------------------------------------------------------------


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_service(port: int, log: Path) -> subprocess.Popen:
    with open(log, "ab") as output:
        service = subprocess.Popen(
            [sys.executable, "-m", "longhorizon.launch.cli", "env", "serve", "textcraft", "--port", str(port)],
            stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT,
        )

    def healthy() -> bool:
        assert service.poll() is None, f"the env service exited: {log.read_text()[-2000:]}"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    wait_until(healthy, "the env service answering", deadline_s=60)
    return service


def live_instances(port: int) -> int:
    import json

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
        return json.loads(response.read())["instances"]


async def test_a_killed_env_service_fails_its_episode_and_play_resumes_once_it_is_back(tmp_path):
    port = free_port()
    log = tmp_path / "service.log"
    service = await trio.to_thread.run_sync(start_service, port, log)
    options = {"url": f"http://127.0.0.1:{port}", "env": "textcraft", "timeout_s": 10.0}
    envs = EnvPool(lambda: make_env("remote", **options))
    idle = make_env("remote", **options)
    try:
        task = list_tasks("remote", "train", **options)[0]
        engine = ScriptedEngine(EngineSettings(env_name="remote", env_options=options, scripted_policy="oracle"))
        env = envs.acquire()
        result = await run_episode(env, engine, task, episode_id="warm", **ROLLOUT)
        assert (result.error, result.success) == ("", True)
        envs.release(env)
        # A second client holds an instance across the restart and will not notice it.
        await idle.reset(task)

        def kill_service():
            service.kill()
            service.wait()

        env = envs.acquire()
        started = time.monotonic()
        result = await run_episode(env, InterruptedEngine(engine, turn=2, interrupt=kill_service), task,
                                   episode_id="killed", **ROLLOUT)
        assert result.error.startswith(f"RemoteEnvError: env service {options['url']}: POST /step failed"), result.error
        assert "ConnectionRefusedError" in result.error and result.num_turns == 2
        assert time.monotonic() - started < 5
        envs.release(env, broken=True)
        # While the service is down, episodes fail as fast.
        result = await run_episode(envs.acquire(), engine, task, episode_id="down", **ROLLOUT)
        assert "ConnectionRefusedError" in result.error

        service = await trio.to_thread.run_sync(start_service, port, log)
        # The client that did not notice the restart resets first and gets a new instance. (With ids
        # reused across restarts it would take over the id the other client held, and that client's
        # next reset would land on its instance.)
        await idle.reset(task)
        result = await run_episode(env, engine, task, episode_id="same-client", **ROLLOUT)  # the env that failed
        assert (result.error, result.success) == ("", True)
        result = await run_episode(envs.acquire(), engine, task, episode_id="fresh-client", **ROLLOUT)
        assert (result.error, result.success) == ("", True)
        observation, _, terminated, _, _ = await idle.step("inventory")
        assert observation.startswith("Inventory") and not terminated
        assert await trio.to_thread.run_sync(live_instances, port) == 3
    finally:
        await idle.close()
        await envs.close()
        service.kill()
        service.wait()


# -- working folders ------------------------------------------------------------------------------


OWNER_SCRIPT = r"""
import sys
from longhorizon.common.processes import janitor_pid, tied_folder
from longhorizon.envs.web.apps.shop import ShopSite

site = ShopSite()
site.start()
print(site.workdir, janitor_pid(), flush=True)
sys.stdin.readline()  # the test kills the janitor meanwhile
spare = tied_folder("longhorizon-faults-")
print(spare, janitor_pid(), flush=True)
sys.stdin.readline()  # until the test kills this process
"""


def test_working_folders_go_with_their_owner_even_after_its_janitor_was_killed(tmp_path):
    owner = subprocess.Popen([sys.executable, "-c", OWNER_SCRIPT], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    assert owner.stdin is not None and owner.stdout is not None

    def said() -> list[str]:
        ready, _, _ = select.select([owner.stdout], [], [], 60)
        line = owner.stdout.readline() if ready else ""
        assert line, f"the owner said nothing (exit code {owner.poll()})"
        return line.split()

    helpers: list[psutil.Process] = []
    try:
        site_folder, first_janitor = said()
        assert Path(site_folder).is_dir() and Path(site_folder).name.startswith("longhorizon-shop-")
        # The janitor dies first: the owner's next folder starts a new one, which learns of both.
        kill_and_wait([psutil.Process(int(first_janitor))])
        owner.stdin.write("\n")
        owner.stdin.flush()
        spare_folder, second_janitor = said()
        assert second_janitor != first_janitor and Path(spare_folder).is_dir()
        helpers = psutil.Process(owner.pid).children(recursive=True)
        owner.kill()
        assert owner.wait(timeout=DEADLINE_S) < 0  # SIGKILL: no cleanup code of the owner ran
        wait_until(lambda: not os.path.exists(site_folder) and not os.path.exists(spare_folder),
                   "the owner's working folders being deleted")
        wait_until(lambda: gone(int(second_janitor)), "the janitor exiting")
    finally:
        # Whatever the outcome, leave nothing of the owner's behind.
        kill_and_wait([helper for helper in helpers if not gone(helper.pid)])
        if owner.poll() is None:
            owner.kill()
            owner.wait()
        owner.stdin.close()
        owner.stdout.close()


def test_remove_tied_folder_deletes_at_once():
    from longhorizon.common.processes import remove_tied_folder, tied_folder

    folder = Path(tied_folder("longhorizon-faults-"))
    (folder / "inside").write_text("x")
    remove_tied_folder(folder)
    assert not folder.exists()
    remove_tied_folder(folder)  # a second call finds nothing to do
