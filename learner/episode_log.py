"""The episodes an RL run trained on, written as conversation files (`run.save_episodes`).

Every member of every group a learner step took from the buffer (the groups of its batch: those
with signal, flat ones, which count in the update's denominator, and the usable members of groups
the update could not score) becomes one line of `<run_dir>/episodes/episodes-NNNN.jsonl`, in the
format `longhorizon collect` writes (common/conversations.py), so `sft` and `dpo` read the files as
they are. A member without an assistant reply (an episode that failed before the model wrote
anything) is no conversation and is left out, counted in `skipped` and logged.

Each line holds the messages, the token ids exactly as sampled (with the learner's tokenizer
fingerprint, cut after the last reply as the messages are) and how the episode went; `metadata`
holds what an RL run adds: the step it was trained at, the policy versions that sampled it, its
advantage, its group and actor.

A step's lines go to one file in one write, after the step. A file is closed for good once it holds
`episodes_per_file` episodes or `max_file_bytes` bytes, and the next step starts the next file. A
learner that resumes from a checkpoint removes the lines of later steps (it trains them again), as
it does their metrics records.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from longhorizon.common.conversations import (
    message_structure_problem,
    record_line,
    tokenizer_fingerprint,
    without_trailing_observations,
)
from longhorizon.learner.buffer import staleness
from longhorizon.learner.scoring import usable_groups

log = logging.getLogger(__name__)

EPISODES_PER_FILE = 1000
"""A new file starts once the current one holds this many episodes..."""
MAX_FILE_BYTES = 128 << 20
"""...or this many bytes (long episodes: about 50 kB each at 4,000 tokens)."""
FOLDER = "episodes"


def episode_file_name(index: int) -> str:
    return f"episodes-{index:04d}.jsonl"


def episode_files(folder: Path) -> list[Path]:
    """A run's episode files, in the order they were written."""
    return sorted(path for path in Path(folder).glob("episodes-*.jsonl") if path.stem[len("episodes-"):].isdigit())


def member_advantages(groups, examples) -> dict[int, float | None]:
    """The advantage each trajectory (by id()) was trained at. An example is a copy of its
    trajectory's arrays, found among the members of its group (`Example.group` indexes the usable
    groups, as the scoring functions number them) by equal token ids; an example without a group
    is matched against every member. None where the algorithm's advantages are per token (a
    critic's): the example's scalar is then a placeholder. Members without an example are absent."""
    kept, _, _ = usable_groups(groups)
    everyone = [t for group in groups for t in group.trajectories]
    found: dict[int, float | None] = {}
    for example in examples:
        tokens = np.asarray(example.token_ids)
        inside = example.group is not None and 0 <= example.group < len(kept)
        for trajectory in kept[example.group] if inside else everyone:
            if id(trajectory) not in found and np.array_equal(trajectory.token_ids, tokens):
                found[id(trajectory)] = None if example.token_rewards is not None else float(example.advantage)
                break
    return found


def episode_record(
    trajectory, *, step: int, trained_version: int, advantage: float | None, update_applied: bool,
    tokenizer: dict | None, episode: int,
) -> tuple[dict | None, str]:
    """One trained-on episode as a conversation-file record, or (None, why it cannot be one)."""
    if trajectory.messages is None:
        return None, "the actor sent no messages"
    if not any(message["role"] == "assistant" for message in trajectory.messages):
        return None, "the model wrote no reply"
    messages = without_trailing_observations(trajectory.messages)
    problem = message_structure_problem(messages)
    if problem is not None:
        return None, problem
    mask = np.asarray(trajectory.loss_mask)
    generated = np.flatnonzero(mask)
    # The tokens up to the last reply, as the messages end there (a trailing observation teaches nothing).
    end = int(generated[-1]) + 1 if generated.size else 0
    versions = np.asarray(trajectory.policy_versions)[generated]
    record: dict[str, Any] = {"messages": messages}
    if tokenizer is not None and end:
        record["token_ids"] = np.asarray(trajectory.token_ids[:end]).tolist()
        record["loss_mask"] = mask[:end].tolist()
        record["tokenizer"] = dict(tokenizer)
    record.update(
        reward=float(trajectory.reward), success=bool(trajectory.success), task_id=trajectory.task_id,
        env=trajectory.env_name, num_turns=int(trajectory.num_turns), terminated=bool(trajectory.terminated),
        truncated=bool(trajectory.truncated), episode=episode,
    )
    record["metadata"] = {
        # The learner step whose update this episode was in (its record in metrics.jsonl).
        "step": step,
        # The policy version the update started from, and those that sampled the episode (weights
        # can change mid-episode: its oldest and newest generated tokens).
        "trained_version": trained_version,
        "policy_version": int(versions.min()) if versions.size else -1,
        "policy_version_newest": int(versions.max()) if versions.size else -1,
        "staleness": staleness(trained_version, trajectory.policy_versions, trajectory.loss_mask),
        # None: not passed through the model (a flat group's member, counted in the denominator
        # only; a failed episode; a group of one), or the algorithm's advantages are per token.
        "advantage": advantage,
        # False: the step left the weights as they were (no group had signal, or its update was
        # skipped as non-finite).
        "update_applied": update_applied,
        "group_id": trajectory.group_id,
        "group_size": int(trajectory.group_size),
        "actor_id": trajectory.actor_id,
        "trajectory_id": trajectory.trajectory_id,
        "horizon_cap": int(trajectory.horizon_cap),
        "invalid_actions": int(trajectory.invalid_actions),
        "turn_rewards": [float(r) for r in trajectory.turn_rewards],
        "error": trajectory.error,
    }
    return record, ""


class EpisodeLog:
    """Appends each step's episodes to the run's episode files (see the module docstring)."""

    def __init__(
        self, folder: Path, *, tokenizer: dict | None, resume_step: int | None = None,
        episodes_per_file: int = EPISODES_PER_FILE, max_file_bytes: int = MAX_FILE_BYTES,
    ) -> None:
        """`tokenizer`: {"model", "fingerprint"} of the learner's tokenizer (None: messages only).
        `resume_step`: the step a resumed learner starts from; lines of later steps are removed."""
        self.folder = Path(folder)
        self.tokenizer = tokenizer
        self.episodes_per_file = episodes_per_file
        self.max_file_bytes = max_file_bytes
        self.skipped: Counter = Counter()
        """Members left out, by reason."""
        self.removed = 0
        """Lines removed when the learner resumed (steps after its checkpoint, a torn last line)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        self.episodes = 0
        """Lines in the files: the next episode's number."""
        self.index, self.file_episodes, self.file_bytes = 0, 0, 0
        for path in episode_files(self.folder):
            lines = self._kept_lines(path, resume_step)
            self.episodes += lines
            if lines:
                self.index = int(path.stem[len("episodes-"):])
                self.file_episodes, self.file_bytes = lines, path.stat().st_size

    def _kept_lines(self, path: Path, resume_step: int | None) -> int:
        """Cut `path` to its whole lines, and on a resume to the steps up to `resume_step`
        (written beside it and renamed); returns the lines kept. An emptied file is removed."""
        data = path.read_bytes()
        whole = data[: data.rfind(b"\n") + 1]  # a step cut short by a crash leaves a torn last line
        lines = whole.splitlines(keepends=True)
        if resume_step is not None and lines and _step_of(lines[-1]) > resume_step:
            lines = [line for line in lines if _step_of(line) <= resume_step]
        kept = b"".join(lines)
        if kept != data:
            self.removed += len(data.splitlines()) - len(lines)
            if not lines:
                path.unlink()
                return 0
            partial = path.with_name(path.name + ".partial")
            partial.write_bytes(kept)
            partial.replace(path)
        return len(lines)

    def write_step(self, step: int, trained_version: int, groups, scored, train_metrics: dict) -> int:
        """Append the episodes of one step's groups; returns how many lines were written."""
        advantages = member_advantages(groups, scored.examples)
        applied = (bool(scored.examples) and not train_metrics.get("nonfinite_step", 0.0)
                   and train_metrics.get("optimizer_steps_applied", 1.0) > 0)
        lines = []
        for group in groups:
            for trajectory in group.trajectories:
                record, problem = episode_record(
                    trajectory, step=step, trained_version=trained_version,
                    advantage=advantages.get(id(trajectory)),
                    update_applied=applied, tokenizer=self.tokenizer, episode=self.episodes + len(lines),
                )
                if record is None:
                    self._skip(trajectory, problem)
                else:
                    lines.append(record_line(record))
        if not lines:
            return 0
        if self.file_episodes >= self.episodes_per_file or self.file_bytes >= self.max_file_bytes:
            self.index, self.file_episodes, self.file_bytes = self.index + 1, 0, 0
        data = "".join(lines).encode("utf-8")
        with (self.folder / episode_file_name(self.index)).open("ab") as file:
            file.write(data)
        self.episodes += len(lines)
        self.file_episodes += len(lines)
        self.file_bytes += len(data)
        return len(lines)

    def _skip(self, trajectory, problem: str) -> None:
        reason = "no messages" if trajectory.messages is None else "no conversation"
        if not self.skipped[reason]:
            log.warning(
                "episode %s of group %s is not saved to %s: %s (%s); such episodes are left out, "
                "the first is logged", trajectory.trajectory_id, trajectory.group_id, self.folder, problem,
                trajectory.error or "no error",
            )
        self.skipped[reason] += 1


def _step_of(line: bytes) -> int:
    """The learner step a line was trained at; a line that is not a record counts as after every step."""
    try:
        step = json.loads(line)["metadata"]["step"]
    except (ValueError, KeyError, TypeError):
        return 1 << 62
    return step if isinstance(step, int) else 1 << 62


def open_episode_log(config, run_dir: Path, hf_tokenizer, model_path: Path, *, start_step: int) -> EpisodeLog | None:
    """The run's episode log when `run.save_episodes` is on (else None); a resumed run's files
    are cut to the steps up to `start_step`, the step the learner continues from."""
    if not config.run.save_episodes:
        return None
    tokenizer = {"model": str(model_path), "fingerprint": tokenizer_fingerprint(hf_tokenizer)}
    episode_log = EpisodeLog(Path(run_dir) / FOLDER, tokenizer=tokenizer,
                             resume_step=start_step if config.run.resume else None)
    if episode_log.removed:
        log.info("%d lines removed from the saved episodes: steps after %d (trained again) or a line "
                 "cut short by a crash", episode_log.removed, start_step)
    return episode_log
