"""Turn samples (actor.history_turns): a trajectory whose turns saw less than the whole history
becomes one example per turn, in the context that turn saw; the buffer refuses windows that do not
fit the trajectory and measures a trajectory by its longest sample."""

from types import SimpleNamespace

import numpy as np
import pytest

from longhorizon.common.config import ConfigError, load_config
from longhorizon.learner.buffer import GroupBuffer
from longhorizon.learner.samples import sample_lengths, window_problem
from longhorizon.learner.scoring import examples_from

# A prompt of 2 tokens (10, 11); turn 0: reply 50, 51, then observation 20; turn 1: reply 60, then
# observation 30, 31; turn 2: reply 70. Turn 2 saw the prompt and turn 1 only (from index 5).
TOKENS = np.array([10, 11, 50, 51, 20, 60, 30, 31, 70])
MASK = np.array([0, 0, 1, 1, 0, 1, 0, 0, 1], np.uint8)
WINDOWS = [2, 2, 4, 2, 5, 6, 5, 8, 9]


def _trajectory(windows=WINDOWS, **fields):
    values = dict(
        trajectory_id="t", group_id="g", group_size=2, reward=1.0, turn_rewards=[0.0, 0.0, 1.0], token_ids=TOKENS,
        loss_mask=MASK, behaviour_logprobs=-0.1 * MASK.astype(np.float32), policy_versions=np.where(MASK, 0, -1),
        prompt_length=2, num_turns=3, invalid_actions=0, generation_seconds=0.0, env_seconds=0.0, error="",
        sample_windows=windows,
    )
    values.update(fields)
    return SimpleNamespace(**values)


def test_each_turn_becomes_an_example_in_the_context_it_saw():
    first, second, third = examples_from(_trajectory(), 0.5, group=3)
    assert first.token_ids.tolist() == [10, 11, 50, 51] and first.loss_mask.tolist() == [0, 0, 1, 1]
    assert second.token_ids.tolist() == [10, 11, 50, 51, 20, 60] and second.loss_mask.tolist() == [0, 0, 0, 0, 0, 1]
    # The prompt joined to the last turn: turn 0 left out.
    assert third.token_ids.tolist() == [10, 11, 60, 30, 31, 70] and third.loss_mask.tolist() == [0, 0, 0, 0, 0, 1]
    assert third.behaviour_logprobs.tolist() == pytest.approx([0, 0, -0.1, 0, 0, -0.1])
    assert all(e.advantage == 0.5 and e.group == 3 for e in (first, second, third))
    # Every generated token trains exactly once.
    assert sum(float(e.loss_mask.sum()) for e in (first, second, third)) == MASK.sum()
    # Per-token advantages (step credit) are cut the same way.
    per_token = np.arange(9, dtype=np.float32)
    assert examples_from(_trajectory(), 0.5, token_advantages=per_token)[2].token_advantages.tolist() == [0, 1, 5, 6, 7, 8]
    # No windows: the trajectory is its one example.
    (whole,) = examples_from(_trajectory(windows=[]), 0.5)
    assert whole.token_ids.tolist() == TOKENS.tolist() and whole.loss_mask.tolist() == MASK.tolist()
    assert sample_lengths(_trajectory()) == [4, 6, 6] and sample_lengths(_trajectory(windows=[])) == [9]


@pytest.mark.parametrize("windows, problem", [
    ([2, 2], "three per turn"),
    ([1, 2, 4, 2, 5, 6, 5, 8, 9], "prompt_length (2) <= window"),  # the prompt would appear twice
    ([2, 2, 4, 2, 3, 6, 5, 8, 9], "inside the previous one"),
    ([2, 2, 5, 2, 5, 6, 5, 8, 9], "not generated"),  # token 4 is an observation
    ([2, 2, 4, 5, 8, 9], "the replies hold 3 generated tokens of the trajectory's 4"),  # turn 1's reply left out
    ([2, 2, 4, 2, 5, 6, 5, 8, 10], "reply end <= 9"),
    ([2, 2, 4.0, 2, 5, 6, 5, 8, 9], "must be integers"),
])
def test_windows_that_do_not_fit_the_trajectory_are_refused_at_the_buffer(windows, problem):
    assert problem in window_problem(windows, MASK, 2)
    buffer = GroupBuffer(max_staleness=1, group_timeout_s=30.0)
    buffer.add(_trajectory(windows=windows), learner_version=0)
    assert buffer.counters["dropped_malformed"] == 1 and buffer.refused_fields == {"sample_windows": 1}
    assert window_problem(WINDOWS, MASK, 2) is None


def test_the_buffer_measures_a_windowed_trajectory_by_its_longest_sample():
    buffer = GroupBuffer(max_staleness=1, group_timeout_s=30.0, max_tokens=6)
    buffer.add(_trajectory(), learner_version=0)  # 9 tokens, samples of at most 6
    buffer.add(_trajectory(windows=[], trajectory_id="whole"), learner_version=0)  # one sample of 9
    assert buffer.counters["accepted"] == 1 and buffer.counters["dropped_too_long"] == 1


def test_the_launcher_refuses_turn_samples_with_an_algorithm_that_reads_whole_episodes():
    from longhorizon.launch.checks import validate_config

    base = ["env.name='codebook'", "actor.engine='scripted'", "actor.history_turns=1"]
    validate_config(load_config(None, base))
    with pytest.raises(ConfigError, match="actor.history_turns = 1 trains each turn as a sample of its own, which "
                                          "learner.algorithm = 'ppo' does not take"):
        validate_config(load_config(None, [*base, "learner.algorithm='ppo'"]))
