"""run.target_success: when a run ends before its step budget."""

from longhorizon.learner.worker import target_success_reached


def test_the_run_ends_once_the_window_averages_the_target():
    assert not target_success_reached([1.0, 1.0, 1.0, 1.0], 0.95, window=5)  # not a full window yet
    assert not target_success_reached([1.0, 1.0, 1.0, 1.0, 0.7], 0.95, window=5)  # mean 0.94
    assert target_success_reached([0.0, 1.0, 1.0, 1.0, 1.0, 0.75], 0.95, window=5)  # last five: 0.95
    assert target_success_reached([0.5, 0.5], 0.5, window=2)


def test_a_target_of_zero_never_ends_a_run():
    assert not target_success_reached([1.0] * 10, 0.0, window=5)
