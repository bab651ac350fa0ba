"""dapo: decoupled clip and dynamic sampling (Yu et al., DAPO, 2025). GRPO with a wider upper clip
(clip-higher, room for unlikely tokens to grow), token-level aggregation, groups without signal
replaced by fresh ones (dynamic sampling, done by the learner's batch collection), and an optional
soft penalty on episodes that run into a length budget (overlong shaping)."""

from __future__ import annotations

from longhorizon.learner.advantages import overlong_penalty
from longhorizon.common.config import bounded
from longhorizon.learner.algorithms.base import OPTIONS_KEY, AlgorithmError, CorrectionOptions
from longhorizon.learner.algorithms.grpo import GRPO
from longhorizon.learner.scoring import generated_tokens


class DAPOOptions(CorrectionOptions):
    """dapo's keys."""

    clip_eps_low: float = 0.2
    """The ratio is clipped below at 1 - clip_eps_low."""
    clip_eps_high: float = 0.28
    """...and above at 1 + clip_eps_high (clip-higher: wider than below)."""
    overlong_max_tokens: int = bounded(0, ge=0)
    """Generated tokens (over all turns) at which the overlong penalty reaches -1; 0 turns the
    shaping off."""
    overlong_buffer_tokens: int = bounded(0, ge=0)
    """The penalty falls linearly from 0 to -1 over this many tokens before `overlong_max_tokens`."""


class DAPO(GRPO):
    summary = "clip-higher, token-level loss, dynamic sampling, overlong shaping (Yu et al. 2025)"
    Options = DAPOOptions
    resamples_flat_groups = True
    aggregation = "token"
    asymmetric_clip = True

    def check_settings(self) -> None:
        options = self.options
        if options.overlong_buffer_tokens and not options.overlong_max_tokens:
            raise AlgorithmError(f"{OPTIONS_KEY}.overlong_buffer_tokens needs {OPTIONS_KEY}.overlong_max_tokens")
        if options.overlong_max_tokens and not 0 < options.overlong_buffer_tokens < options.overlong_max_tokens:
            raise AlgorithmError(f"{OPTIONS_KEY}.overlong_buffer_tokens must be between 0 and {OPTIONS_KEY}.overlong_max_tokens")
        super().check_settings()

    def scores_every_generated_token(self) -> bool:
        # The penalty counts every generated token.
        return self.options.overlong_max_tokens > 0 or super().scores_every_generated_token()

    def shaped_reward(self, trajectory) -> float:
        """The reward plus the overlong penalty, when `overlong_max_tokens` is set."""
        reward = float(trajectory.reward)
        if self.options.overlong_max_tokens > 0:
            reward += overlong_penalty(generated_tokens(trajectory), self.options.overlong_max_tokens,
                                       self.options.overlong_buffer_tokens)
        return reward
