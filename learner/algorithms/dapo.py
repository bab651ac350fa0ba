"""dapo: decoupled clip and dynamic sampling (Yu et al., DAPO, 2025). GRPO with a wider upper clip
(clip-higher, room for unlikely tokens to grow), token-level aggregation, groups without signal
replaced by fresh ones (dynamic sampling, done by the learner's batch collection), and an optional
soft penalty on episodes that run into a length budget (overlong shaping)."""

from __future__ import annotations

from dataclasses import dataclass

from longhorizon.learner.advantages import overlong_penalty
from longhorizon.learner.algorithms.base import AlgorithmError
from longhorizon.learner.algorithms.grpo import GRPO
from longhorizon.learner.scoring import generated_tokens


@dataclass(frozen=True)
class DAPOSettings:
    clip_eps_low: float | None
    clip_eps_high: float | None
    loss: str
    weight_level: str
    behaviour_weight_cap: float
    overlong_max_tokens: int
    overlong_buffer_tokens: int


class DAPO(GRPO):
    summary = "clip-higher, token-level loss, dynamic sampling, overlong shaping (Yu et al. 2025)"
    Settings = DAPOSettings
    resamples_flat_groups = True
    aggregation = "token"
    default_clip = (0.2, 0.28)

    def check_settings(self) -> None:
        settings = self.settings
        if settings.overlong_buffer_tokens and not settings.overlong_max_tokens:
            raise AlgorithmError("learner.overlong_buffer_tokens needs learner.overlong_max_tokens")
        if settings.overlong_max_tokens and not 0 < settings.overlong_buffer_tokens < settings.overlong_max_tokens:
            raise AlgorithmError("learner.overlong_buffer_tokens must be between 0 and learner.overlong_max_tokens")
        super().check_settings()

    def scores_every_generated_token(self) -> bool:
        # The penalty counts every generated token.
        return self.settings.overlong_max_tokens > 0 or super().scores_every_generated_token()

    def shaped_reward(self, trajectory) -> float:
        """The reward plus the overlong penalty, when `overlong_max_tokens` is set."""
        reward = float(trajectory.reward)
        if self.settings.overlong_max_tokens > 0:
            reward += overlong_penalty(generated_tokens(trajectory), self.settings.overlong_max_tokens,
                                       self.settings.overlong_buffer_tokens)
        return reward
