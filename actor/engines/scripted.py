"""The `scripted` engine: an environment's scripted policy (oracle or random) in place of a model.

No weights and no model: for tests and throughput benchmarks. Replies are tokenised with the byte
tokenizer so trajectories have real token arrays; an optional simulated per-token latency stands
in for generation time when benchmarking the rollout system.
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
        from longhorizon.envs.base import get_env_spec

        policies = get_env_spec(settings.env_name).policies
        if settings.scripted_policy not in policies:
            raise ValueError(
                f"env {settings.env_name!r} has no scripted policy {settings.scripted_policy!r}; "
                f"available: {', '.join(sorted(policies))}"
            )

    def __init__(self, settings: EngineSettings) -> None:
        from longhorizon.envs.base import get_env_spec

        reject_engine_options("scripted", settings)
        self.settings = settings
        self.tokenizer = ByteChatTokenizer()
        self.policy_version = 0
        self.check_settings(settings)
        self._policy_factory = get_env_spec(settings.env_name).policies[settings.scripted_policy]
        self._policies: dict[str, Any] = {}
        self._rng = random.Random(settings.seed)

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        observation = request.messages[-1]["content"] if request.messages else ""
        policy = self._policies.get(request.episode_id)
        if policy is None:
            policy = self._policy_factory(**self.settings.env_options)
            policy.reset(request.task, observation, random.Random(self._rng.random()))
            self._policies[request.episode_id] = policy
        version = self.policy_version
        reply = policy.act(observation)
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

    def update_weights(self, update: Any) -> None:
        self.policy_version = int(update.version)

    def end_episode(self, episode_id: str) -> None:
        self._policies.pop(episode_id, None)

    async def close(self) -> None:
        self._policies.clear()
