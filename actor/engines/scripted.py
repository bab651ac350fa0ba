"""The `scripted` engine: an environment's scripted policy (oracle or random) in place of a model.

No weights and no model: for tests and throughput benchmarks. Replies are tokenised with the byte
tokenizer so trajectories have real token arrays; an optional simulated per-token latency stands
in for generation time when benchmarking the rollout system.

A policy writes replies for its env's own agent loop. When `actor.agent` picks a loop that plays
the env by tool calls, each reply's action becomes that loop's call (its reasoning kept where the
format has room), and each tool result is unwrapped before the policy reads it: the oracles then
play, and `collect` records, episodes in tool-call form.
"""

from __future__ import annotations

import random
from typing import Any

import trio

from longhorizon.actor.engines.base import (
    EngineCapabilities,
    EngineSettings,
    GenerationRequest,
    GenerationResult,
    reject_engine_options,
)
from longhorizon.common.chat import ByteChatTokenizer
from longhorizon.envs.agents import configured_agent, episode_loop, get_agent_loop, ActionParseError, react_reasoning
from longhorizon.envs.base import get_env_spec


class ScriptedEngine:
    capabilities = EngineCapabilities(
        uses_model=False,
        needs_local_model=False,
        # Updates only move its version (training runs test the system with it), adapters too.
        accepts_weights=True,
        takes_lora=True,
        samples=False,
        weight_transports=("inline", "path"),
    )

    @classmethod
    def check_settings(cls, settings: EngineSettings) -> None:
        """The env must have the scripted policy asked for (ValueError)."""
        policies = get_env_spec(settings.env_name).policies
        if settings.scripted_policy not in policies:
            raise ValueError(
                f"env {settings.env_name!r} has no scripted policy {settings.scripted_policy!r}; "
                f"available: {', '.join(sorted(policies))}"
            )

    def __init__(self, settings: EngineSettings) -> None:
        reject_engine_options("scripted", settings)
        self.settings = settings
        self.tokenizer = ByteChatTokenizer()
        self.policy_version = 0
        self.check_settings(settings)
        self._policy_factory = get_env_spec(settings.env_name).policies[settings.scripted_policy]
        self._policies: dict[str, Any] = {}
        self._rng = random.Random(settings.seed)
        self._tools_loop, self._env_loop = _tool_translation(settings, self.tokenizer)

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        observation = request.messages[-1]["content"] if request.messages else ""
        if self._tools_loop is not None:
            observation = self._tools_loop.format.tool_result_content(observation)
        policy = self._policies.get(request.episode_id)
        if policy is None:
            policy = self._policy_factory(**self.settings.env_options)
            policy.reset(request.task, observation, random.Random(self._rng.random()))
            self._policies[request.episode_id] = policy
        version = self.policy_version
        reply = policy.act(observation)
        if self._tools_loop is not None:
            reply = self._as_tool_call(reply)
        tokens = self.tokenizer.encode(reply) + [self.tokenizer.eos_token_id]
        if self.settings.simulated_token_latency_s > 0:
            await trio.sleep(self.settings.simulated_token_latency_s * len(tokens))
        else:
            await trio.sleep(0)
        return GenerationResult(
            token_ids=tokens,
            logprobs=[0.0] * len(tokens),
            text=reply,
            stopped_on_eos=True,
            policy_version=version,
        )

    def _as_tool_call(self, reply: str) -> str:
        try:
            action = self._env_loop.parse_action(reply)
        except ActionParseError:  # a random policy's garbled reply stays garbled
            return reply
        try:
            return self._tools_loop.reply_for_action(action, react_reasoning(reply))
        except ValueError:  # an action no tool makes (a random policy's): shown as written
            return reply

    def update_weights(self, update: Any) -> None:
        self.policy_version = int(update.version)

    def end_episode(self, episode_id: str) -> None:
        self._policies.pop(episode_id, None)

    async def close(self) -> None:
        self._policies.clear()


def _tool_translation(settings: EngineSettings, tokenizer: Any) -> tuple[Any, Any]:
    """(the tools loop bound to the env, the env's own loop) when `settings.agent` plays the env
    by tool calls, else (None, None)."""
    if not settings.agent:
        return None, None

    loop = configured_agent(settings.agent, settings.agent_options)
    if isinstance(loop, str):
        loop = get_agent_loop(loop)
    if not getattr(loop, "needs_env_tools", False):
        return None, None
    env = get_env_spec(settings.env_name).factory(**settings.env_options)
    return episode_loop(loop, env, tokenizer), get_agent_loop(env.prompt_format)
