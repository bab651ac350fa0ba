"""Turn samples: a trajectory whose turns saw less than the whole history (actor.history_turns)
as the training sequences its replies were sampled in.

A trajectory's `sample_windows` hold three indices into its tokens per turn: where the turns the
model was shown begin (window_start), and its reply (reply_start, reply_end). Turn k's sample is
the first prompt, token_ids[:prompt_length], joined to token_ids[window_start:reply_end], with
loss on its reply alone; every generated token is in exactly one reply. A trajectory without
windows is one sample, itself. A vision-language trajectory's images go with the pieces that show
them (`images_of`).
"""

from __future__ import annotations

import numpy as np


def windows_of(trajectory) -> list[tuple[int, int, int]]:
    """The trajectory's (window_start, reply_start, reply_end) per turn; [] for one sample."""
    flat = list(getattr(trajectory, "sample_windows", None) or [])
    return [tuple(flat[index:index + 3]) for index in range(0, len(flat), 3)]


def window_problem(flat: list, loss_mask: np.ndarray, prompt_length: int) -> str | None:
    """What is wrong with a trajectory's sample_windows, or None: triples of integers, each window
    starting after the first prompt and before its reply, replies in order without overlap, on
    generated tokens only and together covering every generated token."""
    if not flat:
        return None
    if len(flat) % 3 or not all(isinstance(index, (int, np.integer)) and not isinstance(index, bool) for index in flat):
        return f"must be integers, three per turn, got {len(flat)} values"
    generated = np.asarray(loss_mask).astype(bool)
    length, previous_end, covered = len(generated), 0, 0
    for turn in range(len(flat) // 3):
        start, reply_start, reply_end = (int(index) for index in flat[3 * turn:3 * turn + 3])
        if not prompt_length <= start <= reply_start <= reply_end <= length:
            return (f"turn {turn}: window {start}, reply {reply_start}..{reply_end} must satisfy "
                    f"prompt_length ({prompt_length}) <= window <= reply start <= reply end <= {length}")
        if reply_start < previous_end:
            return f"turn {turn}: its reply starts at {reply_start}, inside the previous one (ending at {previous_end})"
        if not generated[reply_start:reply_end].all():
            return f"turn {turn}: its reply {reply_start}..{reply_end} holds tokens that were not generated"
        previous_end, covered = reply_end, covered + reply_end - reply_start
    if covered != int(generated.sum()):
        return f"the replies hold {covered} generated tokens of the trajectory's {int(generated.sum())}"
    return None


def sample_lengths(trajectory) -> list[int]:
    """The length of each training sequence the trajectory becomes."""
    windows = windows_of(trajectory)
    if not windows:
        return [len(trajectory.loss_mask)]
    prompt_length = int(trajectory.prompt_length)
    return [prompt_length + reply_end - start for start, _, reply_end in windows]


def cut(array: np.ndarray, prompt_length: int, start: int, end: int) -> np.ndarray:
    """`array` (per token) as one sample: its first prompt joined to [start, end)."""
    array = np.asarray(array)
    if start <= prompt_length:
        return array[:end].copy()
    return np.concatenate([array[:prompt_length], array[start:end]])


def reply_mask(loss_mask: np.ndarray, prompt_length: int, window: tuple[int, int, int]) -> np.ndarray:
    """The sample's loss mask: the trajectory's own (stale tokens may have left it) on the turn's
    reply, 0 on the context before it."""
    start, reply_start, reply_end = window
    mask = cut(loss_mask, prompt_length, start, reply_end).astype(np.float32)
    mask[: len(mask) - (reply_end - reply_start)] = 0.0
    return mask


def images_of(trajectory, window: tuple[int, int, int] | None = None) -> tuple[bytes, ...]:
    """The images a training sequence of the trajectory shows, in the order of their tokens: all
    of them (no window), or those of the first prompt and of the pieces inside a turn's window
    (an image belongs to the piece that begins at its offset, Trajectory.image_offsets)."""
    images = list(getattr(trajectory, "images", None) or [])
    if window is None or not images:
        return tuple(images)
    prompt_length, (start, _, end) = int(trajectory.prompt_length), window
    offsets = list(trajectory.image_offsets)
    if start <= prompt_length:  # the whole history up to `end` (as `cut` takes it)
        return tuple(image for image, offset in zip(images, offsets) if offset < end)
    return tuple(image for image, offset in zip(images, offsets)
                 if offset < prompt_length or start <= offset < end)
