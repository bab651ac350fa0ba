"""Grouped metric names for TensorBoard and W&B (`train/`, `rollout/`, `system/`, `eval/`), while
metrics.jsonl keeps the flat keys."""

import json
import math

from longhorizon.common.metrics import MetricsWriter, grouped_name, grouped_scalars, metric_group


def test_each_kind_of_figure_lands_in_its_group():
    expected = {
        "train": ["loss", "entropy", "entropy_estimate", "grad_norm", "kl", "clip_fraction", "learning_rate",
                  "signal_fraction", "entropy_coef", "value_loss", "train_tokens"],
        "rollout": ["reward_mean", "success_rate", "episode_turns_mean", "truncated_rate", "cut_by_cap_rate",
                    "staleness_mean", "staleness_max", "horizon_cap", "groups_used", "groups_none_succeeded",
                    "invalid_action_rate", "failed_episodes", "history_breaks"],
        "system": ["time", "version", "episodes_per_s", "tokens_per_s", "learner_step_seconds", "weights_bytes",
                   "trajectories_received", "groups_dropped_stale", "groups_resampled", "actors_live",
                   "rejected_messages", "auth_refused", "memory_rss_mb"],
        "eval": ["eval_success_rate"],
    }
    for group, names in expected.items():
        for name in names:
            assert metric_group(name) == group, name
    assert grouped_name("tokens_per_s") == "system/tokens_per_s"
    assert grouped_name("a_new_loss_term") == "train/a_new_loss_term"  # unknown: a training figure


def test_grouped_scalars_keep_finite_numbers_only():
    record = {"step": 3, "loss": 0.5, "kl": math.nan, "target_reached": True, "checkpoint": "runs/x",
              "staleness_hist": {"0": 4}, "reward_mean": 1}
    assert grouped_scalars(record) == {"train/loss": 0.5, "rollout/reward_mean": 1}


def test_tensorboard_gets_grouped_tags_and_the_file_flat_keys(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    writer = MetricsWriter(tmp_path)
    writer.write({"step": 1, "loss": 0.25, "reward_mean": 0.5, "tokens_per_s": 10.0})
    writer.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "rollout/reward_mean", "system/tokens_per_s"} <= tags
    assert [(e.step, e.value) for e in events.Scalars("rollout/reward_mean")] == [(1, 0.5)]
    assert set(json.loads((tmp_path / "metrics.jsonl").read_text())) == {"step", "loss", "reward_mean", "tokens_per_s"}
