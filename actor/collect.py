"""Play an env's split with any engine and write the conversations as JSONL (`longhorizon collect`).

The engine is the config's actor type: the env's scripted oracle (`actor.engine = "scripted"`), a
model folder (`hf`, `vllm`) or an OpenAI-compatible endpoint (`openai`). Every episode that ends
without an error becomes one line of the file (format: common/conversations.py, docs/offline.md):
its messages, reward, success and task id, and its token ids and loss mask in the tokenizer of the
model that will be trained on it (`--model`, by default `model.path`).

Token ids are made from the messages with that tokenizer, in the layout the actor builds for RL
(`tokenize_conversation`), never taken from the engine: the scripted engine speaks bytes, and a
teacher model's tokenizer is not the student's. A trainer whose model has another tokenizer
tokenizes the messages again itself.

The file is written as episodes end, to `<output>.partial`, and renamed when all are done: an
interrupted collection leaves the partial file and never a truncated file under the final name.
Lines are written in episode order (an episode that ends early waits for those before it), so the
same config and seed write the same file however the episodes interleave: a trainer that shuffles
with its own seed then sees the same batches.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import trio

from longhorizon.actor.engines.base import capabilities_of, engine_class
from longhorizon.actor.rollout import AgentLoopSettings, EnvPool, run_episode
from longhorizon.common.config import Config
from longhorizon.common.conversations import (
    record_from_episode,
    record_line,
    tokenize_conversation,
    without_trailing_observations,
    tokenizer_fingerprint,
)
from longhorizon.actor.engines.factory import plan_engine
from longhorizon.common.chat import HFChatTokenizer
from longhorizon.common.models import ModelError, load_tokenizer, resolve_model_path
from longhorizon.envs.base import make_env, list_tasks


@dataclass
class CollectSummary:
    output: str
    episodes: int
    """Episodes played."""
    written: int
    """Conversations written to the file."""
    successful: int
    """Episodes that reached the goal (written or not)."""
    skipped_unsuccessful: int
    """Finished episodes left out by --only-successful."""
    failed: int
    """Episodes that ended in an env or engine error (never written)."""
    seconds: float
    tokenizer: dict | None
    """The tokenizer the token ids are in, or None when only messages were written."""
    first_error: str = ""


def make_play_engine(config: Config, engine_options: dict | None = None):
    """The config's engine, ready to play; returns (engine, model folder or "")."""
    engine_class, settings = plan_engine(config, "collect", engine_options=engine_options)
    return engine_class(settings), settings.model_path


def target_tokenizer(config: Config, model: str | None):
    """The chat tokenizer the token ids are written in, and its description for the file.

    `model` (a model.path value) names the model that will be trained; without it, model.path. When
    model.path is no local model (a hosted endpoint's model name) only messages are written:
    returns (None, None)."""
    spec = model or config.model.path
    try:
        folder = resolve_model_path(spec, config.model.cache_dir)
    except ModelError:
        if model:
            raise
        return None, None
    hf_tokenizer = load_tokenizer(folder)
    return HFChatTokenizer(hf_tokenizer), {"model": str(folder), "fingerprint": tokenizer_fingerprint(hf_tokenizer)}


async def collect_episodes(
    engine,
    config: Config,
    *,
    output: Path,
    tasks: list,
    episodes: int,
    engine_label: str,
    only_successful: bool = False,
    tokenizer=None,
    tokenizer_info: dict | None = None,
    horizon_cap: int,
    concurrency: int = 32,
    on_progress: Callable[[int, str], None] = lambda done, detail: None,
) -> CollectSummary:
    """Play `episodes` episodes (task i % len(tasks), reset seed run.seed + i) and write each
    finished one to `output` as it ends (see the module docstring for the partial file)."""
    if not tasks:
        raise ValueError(f"env {config.env.name!r} has no tasks to play")
    env_options = dict(config.env.options)
    pool = EnvPool(lambda: make_env(config.env.name, **env_options))
    limiter = trio.CapacityLimiter(max(1, concurrency))
    partial = output.with_name(output.name + ".partial")
    counts = {"done": 0, "written": 0, "successful": 0, "skipped": 0, "failed": 0}
    first_error = ""
    started = time.perf_counter()

    def detail() -> str:
        text = f"| {counts['successful']} successful, {counts['written']} written, {counts['failed']} failed"
        return text + (f", {counts['skipped']} unsuccessful left out" if only_successful else "")

    with partial.open("w", encoding="utf-8") as file:
        finished: dict[int, str | None] = {}  # episode index -> its line (None: not written)
        next_to_write = 0

        def write_in_order(index: int, line: str | None) -> None:
            nonlocal next_to_write
            finished[index] = line
            while next_to_write in finished:
                ready = finished.pop(next_to_write)
                if ready is not None:
                    file.write(ready)
                    counts["written"] += 1
                next_to_write += 1
            file.flush()

        async def one(index: int) -> None:
            nonlocal first_error
            task = tasks[index % len(tasks)]
            seed = config.run.seed + index
            async with limiter:
                env = pool.acquire()
                result = await run_episode(
                    env, engine, task, horizon_cap=horizon_cap,
                    max_context_tokens=config.actor.max_context_tokens,
                    max_new_tokens=config.actor.sampling.max_new_tokens, seed=seed,
                    episode_id=f"collect-{index}", invalid_reply_reward=config.actor.invalid_reply_reward,
                    env_call_timeout_s=config.actor.env_call_timeout_s,
                    loop_settings=AgentLoopSettings.from_actor(config.actor),
                )
                pool.release(env, broken=bool(result.error))
            counts["done"] += 1
            counts["successful"] += int(result.success)
            line = None
            if result.error or result.conversation is None:
                counts["failed"] += 1
                first_error = first_error or f"task {task.task_id}: {result.error}"
            elif only_successful and not result.success:
                counts["skipped"] += 1
            else:
                messages = without_trailing_observations(result.conversation.messages)
                tokenized = tokenize_conversation(tokenizer, messages) if tokenizer else None
                record = record_from_episode(
                    result.conversation, tokenized=tokenized, tokenizer=tokenizer_info,
                    reward=result.reward, success=bool(result.success), task_id=task.task_id,
                    env=config.env.name, split=task.split, category=task.category, num_turns=result.num_turns,
                    terminated=result.terminated, truncated=result.truncated, engine=engine_label,
                    episode=index, seed=seed,
                )
                line = record_line(record)
            write_in_order(index, line)
            on_progress(counts["done"], detail())

        try:
            on_progress(0, detail())
            async with trio.open_nursery() as nursery:
                for index in range(episodes):
                    nursery.start_soon(one, index)
        finally:
            await pool.close()
    return CollectSummary(
        output=str(output), episodes=counts["done"], written=counts["written"], successful=counts["successful"],
        skipped_unsuccessful=counts["skipped"], failed=counts["failed"],
        seconds=time.perf_counter() - started, tokenizer=tokenizer_info, first_error=first_error,
    )


def run_collect(
    config: Config,
    *,
    output: str | Path,
    episodes: int | None = None,
    split: str | None = None,
    only_successful: bool = False,
    model: str | None = None,
    horizon: int = 0,
    concurrency: int = 32,
    engine_options: dict | None = None,
    overwrite: bool = False,
    max_tasks: int = 0,
    first_task: int = 0,
    engine=None,
    on_progress: Callable[[int, int, str], None] | None = None,
    on_note: Callable[[str], None] = print,
) -> CollectSummary:
    """Everything `longhorizon collect` does: check the arguments, build the engine and the
    tokenizer, play, and put the file in place. Raises ValueError on bad input, before playing.

    `max_tasks` > 0 plays only that many tasks of the split, from task `first_task` on (wrapping
    round): with more episodes than tasks each task is played several times (pairs for DPO)."""
    output = Path(output)
    if output.suffix != ".jsonl":
        raise ValueError(f"--output must name a .jsonl file, got {str(output)!r}")
    if output.exists() and not overwrite:
        raise ValueError(f"{output} exists: choose another --output, or pass --overwrite to replace it")
    if episodes is not None and episodes < 1:
        raise ValueError(f"--episodes must be at least 1, got {episodes}")
    if horizon < 0 or concurrency < 1:
        raise ValueError("--horizon must be >= 0 (0: the last horizon stage) and --concurrency >= 1")
    if max_tasks < 0 or first_task < 0:
        raise ValueError(f"--tasks must be >= 0 (0: every task of the split), got {max_tasks}")
    split = split or config.env.train_split
    tasks = list_tasks(config.env.name, split, **dict(config.env.options))
    if not tasks:
        raise ValueError(f"env {config.env.name!r} has no tasks in split {split!r}")
    start = first_task % len(tasks)
    tasks = tasks[start:] + tasks[:start]
    if max_tasks:
        tasks = tasks[:max_tasks]
    episodes = episodes or len(tasks)
    horizon_cap = horizon or max(config.horizon.stages)
    tokenizer, tokenizer_info = target_tokenizer(config, model)
    if tokenizer is None:
        on_note(f"model.path {config.model.path!r} is no local model: writing messages without token ids "
                f"(pass --model FOLDER to add them; sft tokenizes messages itself)")
    capabilities = capabilities_of(engine_class(config.actor.engine))
    model_path = ""
    if engine is None:
        engine, model_path = make_play_engine(config, engine_options)
        if not capabilities.uses_model and tokenizer is not None:
            # Context budgets (actor.max_context_tokens) count the tokens of the model the data
            # is for, not the scripted engine's bytes, which are 3-4 times as many.
            engine.tokenizer = tokenizer
    name = config.actor.engine
    engine_label = f"{name}:{config.actor.scripted_policy}" if not capabilities.uses_model else (
        f"{name}:{model_path or config.model.path}")
    output.parent.mkdir(parents=True, exist_ok=True)

    async def play() -> CollectSummary:
        try:
            return await collect_episodes(
                engine, config, output=output, tasks=tasks, episodes=episodes, engine_label=engine_label,
                only_successful=only_successful, tokenizer=tokenizer, tokenizer_info=tokenizer_info,
                horizon_cap=horizon_cap, concurrency=concurrency,
                on_progress=(lambda done, detail: on_progress(done, episodes, detail)) if on_progress else
                (lambda done, detail: None),
            )
        finally:
            await engine.close()

    summary = trio.run(play)
    partial = output.with_name(output.name + ".partial")
    if summary.written == 0:
        partial.unlink(missing_ok=True)
        reason = (f"{summary.failed} of {summary.episodes} episodes failed (first: {summary.first_error})"
                  if summary.failed else f"none of the {summary.episodes} episodes succeeded")
        raise ValueError(f"no conversation to write: {reason}; {output} was not written"
                         + ("; drop --only-successful or use a stronger engine" if only_successful else ""))
    os.replace(partial, output)
    return summary
