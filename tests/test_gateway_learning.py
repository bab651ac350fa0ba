"""A black-box agent learns through the gateway: the example agent (only the `openai` client and HTTP)
plays codebook episodes served by `env serve` against a training run whose actor is a gateway.

Real processes: the learner and one gateway actor started by the local launcher, the agent in a
process of its own, the env in an HTTP service. The held-out check is the built-in loop's
(tests/test_learning.py): greedy play of the final checkpoint on held-out tasks above 80%, where
the untrained model is below 20%.
"""

import subprocess
import sys
import time
from pathlib import Path

import pytest
import trio

from longhorizon.actor.engines.base import make_engine
from longhorizon.actor.engines.factory import engine_settings
from longhorizon.actor.evaluate import evaluate, greedy
from longhorizon.common.config import load_config
from longhorizon.common.metrics import read_metrics
from longhorizon.envs.server import EnvServer
from longhorizon.envs.service import ServiceSettings
from longhorizon.learner.checkpoint import latest_checkpoint

REPO_ROOT = Path(__file__).resolve().parent.parent
AGENT = REPO_ROOT / "examples" / "openai-agent" / "agent.py"


def _overrides(tmp_path, model_folder):
    return [
        f"run.output_dir={str(tmp_path)!r}", f"model.path={str(model_folder)!r}",
        "actor.driver='gateway'", "gateway.port=0", "actor.num_actors=1",
        # As the built-in loop's learning runs (tests/test_learning.py): stop once training holds
        # 95%, with the bonus that thaws a policy frozen on a wrong answer.
        "run.target_success=0.95", "learner.entropy_coef=0.5", "learner.entropy_scope='frozen_groups'",
        # Half the built-in loop's groups a step: every call here crosses the agent, the gateway
        # and the env service, which cost a step of 16 groups about 6 s on 2 cores against about
        # 1 s in the built-in loop. With 8 the 3-turn target took 64-79 steps in 6 runs (58 with
        # 16), a third fewer episodes; held out 100% in each of the 4 evaluated.
        "learner.groups_per_step=8",
        # Two turns: an episode is 7 HTTP calls instead of 9 and the target comes in fewer steps,
        # while the agent still sends each turn's history back (the part the gateway must keep
        # whole). The 3-turn run cost 345 s of CPU, 162 s of it in the agent's OpenAI client.
        "env.options={num_turns = 2, num_symbols = 4, num_actions = 4}",
    ]


def _held_out_success(config, model_folder) -> float:
    engine = make_engine("hf", greedy(engine_settings(config, str(model_folder))))
    result = trio.run(lambda: evaluate(
        engine, config.env.name, dict(config.env.options), split="test", episodes=200,
        horizon_cap=config.horizon.stages[0], max_new_tokens=config.actor.sampling.max_new_tokens))
    assert result.failed_episodes == 0
    return result.success_rate


def _train_with_the_agent(config_file: Path, overrides: list[str], agent_arguments: list[str], *,
                          timeout_s: float) -> str:
    """`longhorizon train` and the example agent, each in a process of its own, until training
    ends; either failing fails the test (an agent that died leaves the learner waiting). Returns
    what the agent printed."""
    training = subprocess.Popen(
        [sys.executable, "-m", "longhorizon.launch.cli", "train", str(config_file), *overrides, "--no-plots"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO_ROOT)
    agent = subprocess.Popen([sys.executable, str(AGENT), *agent_arguments],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = None
    try:
        deadline = time.monotonic() + timeout_s
        while training.poll() is None and time.monotonic() < deadline:
            if output is None and agent.poll() is not None:
                output = agent.stdout.read()
                # Before the launcher returns only once the gateway has stopped (its actor is
                # done while the learner writes its last checkpoint).
                assert "the gateway has stopped" in output, f"the agent ended before training did:\n{output}"
            time.sleep(1)
        assert training.poll() == 0, training.stdout.read()
        if output is None:
            output, _ = agent.communicate(timeout=120)
    finally:
        for process in (training, agent):
            if process.poll() is None:
                process.kill()
    assert agent.returncode == 0, output
    return output


def test_the_example_agent_imports_nothing_of_longhorizon():
    source = AGENT.read_text()
    assert "longhorizon" not in "".join(line for line in source.splitlines() if line.startswith(("import", "from")))


@pytest.mark.slow
def test_a_black_box_agent_learns_codebook_through_the_gateway(tmp_path, tiny_codebook_model):
    config = load_config(REPO_ROOT / "configs" / "codebook.toml", _overrides(tmp_path, tiny_codebook_model))
    untrained = _held_out_success(config, tiny_codebook_model)
    assert untrained < 0.2
    with EnvServer(ServiceSettings("codebook", env_options=dict(config.env.options))) as server:
        _train_with_the_agent(
            REPO_ROOT / "configs" / "codebook.toml", _overrides(tmp_path, tiny_codebook_model),
            ["--env-url", server.url, "--gateway-dir", str(config.run_dir / "gateway"), "--threads", "8",
             "--group-size", str(config.actor.group_size)], timeout_s=900)
    records = read_metrics(config.run_dir)
    assert records[-1].get("target_reached") or records[-1]["step"] == config.run.total_steps
    assert records[-1]["actors_seen"] == 1 and records[-1]["trajectories_trained"] > 0
    assert records[-1]["history_breaks"] == 0  # the agent sends its history back as it got it
    checkpoint = latest_checkpoint(config.run_dir)
    trained = _held_out_success(config, checkpoint)
    print(f"held-out greedy success through the gateway: untrained {untrained:.1%}, trained {trained:.1%}")
    assert trained > 0.8


@pytest.mark.slow
def test_the_example_agent_plays_textcraft_by_its_own_tools_through_env_serve_and_the_gateway(tmp_path):
    """The whole path with TextCraft's tools, no model needed: the gateway's engine is the scripted
    oracle playing by tool calls (actor.agent = "tools"), the agent turns the `tool_calls` it gets
    into TextCraft commands through `env serve`, and the learner trains on the sessions."""
    from longhorizon.common.models import build_tiny_model

    byte_model = build_tiny_model(tmp_path / "tiny-bytes", words=[f"w{i}" for i in range(260)])
    overrides = [
        f"run.output_dir={str(tmp_path)!r}", "run.name='tools'", "run.total_steps=3", f"model.path={str(byte_model)!r}",
        "actor.engine='scripted'", "actor.agent='tools'", "actor.driver='gateway'", "gateway.port=0",
        "actor.num_actors=1", "actor.group_size=4", "learner.groups_per_step=2", "learner.micro_batch_size=8",
        "horizon.schedule='fixed'", "horizon.stages=[20]", "actor.max_context_tokens=16384",
        "actor.sampling.max_new_tokens=1024",
    ]
    run_dir = tmp_path / "tools"
    with EnvServer(ServiceSettings("textcraft")) as server:
        output = _train_with_the_agent(
            REPO_ROOT / "configs" / "textcraft.toml", overrides,
            ["--env-url", server.url, "--gateway-dir", str(run_dir / "gateway"), "--tools", "textcraft",
             "--threads", "2", "--group-size", "4"], timeout_s=600)
    # The gateway's address file goes with it, which tells the agent at once that training ended.
    assert not list((run_dir / "gateway").glob("*.json"))
    assert "the gateway has stopped (its address file is gone)" in output
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3]
    # The oracle wins its episodes through the agent's own tools and the env service.
    assert min(r["success_rate"] for r in records) == 1.0
