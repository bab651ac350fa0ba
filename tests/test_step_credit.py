"""Credit per turn (learner.step_credit): turn spans, anchor-state keys, discounted turn returns
and step advantages on hand-computed values; how they reach the examples and the batch; which
algorithms take them."""

from types import SimpleNamespace

import numpy as np
import pytest

from longhorizon.common.config import ConfigError, LearnerConfig, load_config
from longhorizon.learner.algorithms import AlgorithmError, make_algorithm
from longhorizon.learner.logprobs import Example, pad_examples
from longhorizon.learner.step_credit import (
    StepCredit,
    anchor_state_advantages,
    group_token_advantages,
    observation_keys,
    token_advantages,
    turn_returns,
    turn_spans,
)


def test_turn_spans_are_the_runs_of_generated_tokens():
    assert turn_spans(np.array([0, 0, 1, 1, 0, 1, 0, 0, 1])) == [(2, 4), (5, 6), (8, 9)]
    assert turn_spans(np.array([1, 1, 0])) == [(0, 2)]
    assert turn_spans(np.zeros(4)) == []


def test_each_turn_is_keyed_by_what_the_model_read_since_its_last_reply():
    tokens = np.array([10, 11, 50, 51, 20, 60, 30, 31, 70])
    keys = observation_keys(tokens, [(2, 4), (5, 6), (8, 9)])
    assert keys == [np.array([10, 11]).tobytes(), np.array([20]).tobytes(), np.array([30, 31]).tobytes()]


def test_turn_returns_discount_the_rewards_that_follow():
    # Rewards 0, 0, 1 at discount 0.5: returns 0.25, 0.5, 1.
    assert turn_returns([0.0, 0.0, 1.0], 3, 0.5).tolist() == [0.25, 0.5, 1.0]
    # Progress rewards 0.2, 0.3 then 0.5 on a reply that was cut off: the last reward joins the last
    # turn, so at discount 1 the first turn's return is the episode's 1.0.
    assert turn_returns([0.2, 0.3, 0.5], 2, 1.0).tolist() == pytest.approx([1.0, 0.8])
    # Fewer rewards than replies: the rewards go to the turns in order, the later replies get 0.
    assert turn_returns([1.0], 3, 0.5).tolist() == [1.0, 0.0, 0.0]
    assert turn_returns([1.0], 0, 0.5).tolist() == []


def test_turns_from_the_same_state_are_compared_by_their_returns():
    # Member a: states P, X, Y with returns 0.81, 0.9, 1.0; member b: states P, X with returns 0, 0.
    # P: (0.81, 0) -> mean 0.405, std 0.405 -> +1, -1; X: (0.9, 0) -> +1, -1; Y met once -> 0.
    a, b = anchor_state_advantages([[b"P", b"X", b"Y"], [b"P", b"X"]],
                                   [np.array([0.81, 0.9, 1.0]), np.array([0.0, 0.0])], eps=0.0)
    assert a.tolist() == pytest.approx([1.0, 1.0, 0.0]) and b.tolist() == pytest.approx([-1.0, -1.0])
    # Equal returns from one state carry no step signal; a state a member meets twice counts twice:
    # X's returns (0.5, 0.5, 0.2) -> mean 0.4, std sqrt(0.02) -> 0.707, 0.707, -1.414.
    a, b = anchor_state_advantages([[b"P", b"X", b"X"], [b"P", b"X"]],
                                   [np.array([1.0, 0.5, 0.5]), np.array([1.0, 0.2])], eps=0.0)
    assert a.tolist() == pytest.approx([0.0, 0.5 ** 0.5, 0.5 ** 0.5]) and b.tolist() == pytest.approx([0.0, -(2 ** 0.5)])
    with pytest.raises(ValueError, match="one key and one return per turn"):
        anchor_state_advantages([[b"P"]], [np.array([1.0, 2.0])])


def test_each_generated_token_gets_its_episode_and_its_turn_advantage():
    values = token_advantages(9, [(2, 4), (5, 6), (8, 9)], 0.5, np.array([1.0, -1.0, 0.0]), 2.0)
    assert values.tolist() == [0.5, 0.5, 2.5, 2.5, 0.5, -1.5, 0.5, 0.5, 0.5] and values.dtype == np.float32


def _episode(turns: list[tuple[list[int], list[int]]], turn_rewards: list[float]):
    """An episode from (observation tokens, reply tokens) per turn, the first observation the prompt."""
    tokens, mask = [], []
    for observation, reply in turns:
        tokens += observation + reply
        mask += [0] * len(observation) + [1] * len(reply)
    return SimpleNamespace(token_ids=np.array(tokens), loss_mask=np.array(mask, np.float32), turn_rewards=turn_rewards,
                           reward=sum(turn_rewards))


def test_a_group_is_credited_turn_by_turn():
    """Two episodes from one prompt (state P): the first reaches X, then Y, and succeeds on its third
    turn; the second reaches X, then Z, and fails there. Discount 0.5, weight 1, episode advantages
    +1 and -1. Returns: first 0.25, 0.5, 1; second 0, 0. P: (0.25, 0) -> +1, -1; X: (0.5, 0) -> +1,
    -1; Y, Z once -> 0."""
    first = _episode([([1, 2], [50]), ([3], [51]), ([4], [52])], [0.0, 0.0, 1.0])
    second = _episode([([1, 2], [60]), ([3], [61]), ([5], [62])], [0.0, 0.0, 0.0])
    credit = StepCredit(weight=1.0, discount=0.5, eps=0.0)
    a, b = group_token_advantages([first, second], [1.0, -1.0], credit)
    assert a.tolist() == pytest.approx([1, 1, 2, 1, 2, 1, 1])
    assert b.tolist() == pytest.approx([-1, -1, -2, -1, -2, -1, -1])


def test_the_batch_carries_each_tokens_advantage_aligned_with_the_predicted_tokens():
    with_steps = Example(token_ids=np.array([1, 2, 3, 4]), loss_mask=np.array([0, 1, 0, 1], np.float32),
                         behaviour_logprobs=np.zeros(4, np.float32), advantage=0.5,
                         token_advantages=np.array([0.5, 1.5, 0.5, -0.5], np.float32))
    plain = Example(token_ids=np.array([1, 2, 3]), loss_mask=np.array([0, 1, 1], np.float32),
                    behaviour_logprobs=np.zeros(3, np.float32), advantage=-1.0)
    batch = pad_examples([with_steps, plain], pad_token_id=0)
    assert batch.advantages.tolist() == [[1.5, 0.5, -0.5], [-1.0, -1.0, -1.0]]
    assert pad_examples([plain], pad_token_id=0).advantages.tolist() == [-1.0]


def _group(*episodes):
    return SimpleNamespace(trajectories=[SimpleNamespace(error="", behaviour_logprobs=np.zeros(len(e.token_ids), np.float32),
                                                         success=e.reward > 0, **vars(e)) for e in episodes])


def test_group_algorithms_score_with_step_credit_and_the_others_refuse_it():
    first = _episode([([1, 2], [50]), ([3], [51]), ([4], [52])], [0.0, 0.0, 1.0])
    second = _episode([([1, 2], [60]), ([3], [61]), ([5], [62])], [0.0, 0.0, 0.0])
    on = dict(step_credit="anchor_states", step_discount=0.5)
    for name in ("grpo", "rloo", "reinforce_pp", "dr_grpo", "dapo", "cispo"):
        algorithm = make_algorithm(LearnerConfig(algorithm=name, **on))
        examples = algorithm.score([_group(first, second)]).examples
        assert all(e.token_advantages is not None for e in examples), name
        # The second reply (state X) gets the episode's advantage plus its turn's: more for the winner.
        (a, b) = examples
        assert a.token_advantages[4] - a.advantage == pytest.approx(1.0, abs=1e-4), name
        assert b.token_advantages[4] - b.advantage == pytest.approx(-1.0, abs=1e-4), name
    assert make_algorithm(LearnerConfig()).score([_group(first, second)]).examples[0].token_advantages is None
    for name in ("gspo", "ppo"):
        with pytest.raises(AlgorithmError, match=f"learner.algorithm = '{name}' does not take"):
            make_algorithm(LearnerConfig(algorithm=name, **on))
    with pytest.raises(AlgorithmError, match="learner.step_credit must be one of none, anchor_states"):
        make_algorithm(LearnerConfig(step_credit="gigpo"))
    with pytest.raises(AlgorithmError, match="learner.step_discount is not used by learner.step_credit = 'none'"):
        make_algorithm(LearnerConfig(step_discount=0.5))
    with pytest.raises(ConfigError, match=r"learner.step_discount must be in \[0, 1\], got 1.5"):
        load_config(None, ["learner.step_discount=1.5"])


def test_a_group_whose_episodes_all_succeeded_trains_on_the_faster_turns():
    """Both episodes succeed (reward 1: the group is flat), the first in 2 turns (P, then X), the
    second in 3 (P, then Y, then X). Discount 0.5, weight 1. Returns: first 0.5 (P), 1 (X); second
    0.25 (P), 0.5 (Y), 1 (X). P: (0.5, 0.25), mean 0.375, spread 0.125 -> +1, -1; X: (1, 1) -> 0;
    Y once -> 0. Episode advantages are 0, so only the first replies train: +1 and -1."""
    fast = _episode([([1, 2], [50]), ([3], [51])], [0.0, 1.0])
    slow = _episode([([1, 2], [60]), ([4], [61]), ([3], [62])], [0.0, 0.0, 1.0])
    algorithm = make_algorithm(LearnerConfig(step_credit="anchor_states", step_discount=0.5))
    scored = algorithm.score([_group(fast, slow)])
    assert (scored.groups_used, scored.groups_skipped_zero_variance) == (1, 0)
    a, b = scored.examples
    assert a.advantage == b.advantage == 0
    assert a.token_advantages.tolist() == pytest.approx([0, 0, 1, 0, 0], abs=1e-5)
    assert b.token_advantages.tolist() == pytest.approx([0, 0, -1, 0, 0, 0, 0], abs=1e-5)
    # Two episodes that play alike tell nothing apart: the group stays flat and is skipped.
    twin = _episode([([1, 2], [50]), ([3], [51])], [0.0, 1.0])
    scored = algorithm.score([_group(fast, twin)])
    assert (scored.groups_used, scored.groups_skipped_zero_variance, scored.examples) == (0, 1, [])
    # Without step credit the first group is flat too.
    assert make_algorithm(LearnerConfig()).score([_group(fast, slow)]).groups_skipped_zero_variance == 1


def test_dynamic_sampling_keeps_a_group_whose_turns_differ():
    fast = _episode([([1, 2], [50]), ([3], [51])], [0.0, 1.0])
    slow = _episode([([1, 2], [60]), ([4], [61]), ([3], [62])], [0.0, 0.0, 1.0])
    twin = _episode([([1, 2], [50]), ([3], [51])], [0.0, 1.0])
    dapo = make_algorithm(LearnerConfig(algorithm="dapo", step_credit="anchor_states", step_discount=0.5))
    assert dapo.carries_signal(_group(fast, slow)) and not dapo.carries_signal(_group(fast, twin))
    assert not make_algorithm(LearnerConfig(algorithm="dapo")).carries_signal(_group(fast, slow))
