"""Credit per turn: each turn of a multi-turn episode gets an advantage of its own, beside its
episode's (`learner.step_credit`).

`anchor_states` (after GiGPO, Feng et al. 2025): the turns of a group's episodes that start from
the same observation form a step group, whatever turn of its episode each was. Each turn's
return is the discounted sum of its episode's turn rewards from that turn on; within a step group
of two or more turns, a turn's step advantage is its return's distance from the step group's mean
in units of its spread (0 alone, or when every return in it is equal). A generated token of turn
k then trains with A_episode + weight * A_step(k).

Everything here is a pure function of token ids, loss masks and turn rewards, so the learner can
apply it to any algorithm that scores groups by their rewards (`Algorithm.takes_step_credit`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

STEP_CREDIT_MODES = ("none", "anchor_states")
STEP_CREDIT_KEYS = ("step_credit_weight", "step_discount")
"""The learner keys only an active step credit reads."""


@dataclass(frozen=True)
class StepCredit:
    """learner.step_credit's settings for one run."""

    weight: float
    """How much a turn's step advantage counts beside its episode's."""
    discount: float
    """Per turn: a turn's return is r_k + discount * r_{k+1} + discount^2 * r_{k+2} + ..."""
    eps: float = 1e-6


def turn_spans(loss_mask: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of each run of generated tokens (loss_mask 1): the replies, one per turn."""
    generated = np.asarray(loss_mask) > 0
    spans, start = [], None
    for index, flag in enumerate(generated):
        if flag and start is None:
            start = index
        elif not flag and start is not None:
            spans.append((start, index))
            start = None
    if start is not None:
        spans.append((start, len(generated)))
    return spans


def observation_keys(token_ids: np.ndarray, spans: Sequence[tuple[int, int]]) -> list[bytes]:
    """The state each turn starts from, as the tokens the model read just before its reply: the
    prompt for the first turn, the tokens since the previous reply (the env's observation in the
    chat template) for the others. Equal keys are the same anchor state."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    keys, previous_end = [], 0
    for start, end in spans:
        keys.append(tokens[previous_end:start].tobytes())
        previous_end = end
    return keys


def turn_returns(turn_rewards: Sequence[float], turns: int, discount: float) -> np.ndarray:
    """Each turn's discounted return. Rewards are matched to turns in order; an episode cut off
    after its last reply (more rewards than replies) has the extra rewards added to its last turn,
    and replies beyond the rewards get 0, so that the first turn's return with discount 1 is the
    episode's total reward."""
    rewards = np.zeros(turns, dtype=np.float64)
    if turns == 0:
        return rewards
    for index, reward in enumerate(turn_rewards):
        rewards[min(index, turns - 1)] += float(reward)
    returns = np.zeros(turns, dtype=np.float64)
    following = 0.0
    for index in range(turns - 1, -1, -1):
        following = rewards[index] + discount * following
        returns[index] = following
    return returns


def anchor_state_advantages(keys: Sequence[Sequence[bytes]], returns: Sequence[np.ndarray],
                            eps: float = 1e-6) -> list[np.ndarray]:
    """Each member's per-turn step advantages: `keys[i][k]` is the state member i's turn k started
    from and `returns[i][k]` that turn's return; turns that share a state are normalised against
    each other ((G - mean) / (population std + eps)), a state met once gives 0."""
    if len(keys) != len(returns) or any(len(k) != len(r) for k, r in zip(keys, returns)):
        raise ValueError("every member needs one key and one return per turn")
    groups: dict[bytes, list[tuple[int, int]]] = defaultdict(list)
    for member, member_keys in enumerate(keys):
        for turn, key in enumerate(member_keys):
            groups[key].append((member, turn))
    advantages = [np.zeros(len(member_returns), dtype=np.float64) for member_returns in returns]
    for places in groups.values():
        if len(places) < 2:
            continue
        values = np.array([returns[member][turn] for member, turn in places], dtype=np.float64)
        spread = values.std(ddof=0)
        if spread == 0:  # every turn from this state did as well: nothing to tell them apart
            continue
        centred = (values - values.mean()) / (spread + eps)
        for (member, turn), value in zip(places, centred):
            advantages[member][turn] = value
    return advantages


def token_advantages(length: int, spans: Sequence[tuple[int, int]], episode_advantage: float,
                     step_advantages: np.ndarray, weight: float) -> np.ndarray:
    """Per token: episode_advantage everywhere, plus weight * the turn's step advantage on the
    turn's generated tokens (the others are out of the loss)."""
    values = np.full(length, float(episode_advantage), dtype=np.float32)
    for (start, end), step in zip(spans, step_advantages):
        values[start:end] += np.float32(weight * step)
    return values


def group_token_advantages(members: Sequence, episode_advantages: Sequence[float],
                           credit: StepCredit) -> list[np.ndarray]:
    """Each member's per-token advantages, its turns credited against the group's other turns from
    the same anchor state."""
    spans = [turn_spans(member.loss_mask) for member in members]
    keys = [observation_keys(member.token_ids, member_spans) for member, member_spans in zip(members, spans)]
    returns = [turn_returns(_turn_rewards(member, len(member_spans)), len(member_spans), credit.discount)
               for member, member_spans in zip(members, spans)]
    steps = anchor_state_advantages(keys, returns, credit.eps)
    return [token_advantages(len(member.token_ids), member_spans, advantage, member_steps, credit.weight)
            for member, member_spans, advantage, member_steps in zip(members, spans, episode_advantages, steps)]


def _turn_rewards(member, turns: int) -> list[float]:
    """A member's rewards per turn; one that reports none has its reward on its last turn."""
    rewards = list(getattr(member, "turn_rewards", None) or [])
    return rewards or [0.0] * max(turns - 1, 0) + [float(member.reward)]


def step_credit_from(config) -> StepCredit | None:
    """The run's step credit (`config` is a LearnerConfig), None when it is off; ValueError for a
    mode there is not, or a step key set while it is off."""
    mode = config.step_credit
    if mode not in STEP_CREDIT_MODES:
        raise ValueError(f"learner.step_credit must be one of {', '.join(STEP_CREDIT_MODES)}, got {mode!r}")
    if mode == "none":
        defaults = type(config).model_fields
        for key in STEP_CREDIT_KEYS:
            if getattr(config, key) != defaults[key].default:
                raise ValueError(f"learner.{key} is not used by learner.step_credit = 'none': "
                                 f"remove it or set learner.step_credit = \"anchor_states\"")
        return None
    return StepCredit(weight=config.step_credit_weight, discount=config.step_discount)
