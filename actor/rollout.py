"""Episode rollout: one episode of an agent in an env, and GRPO groups of episodes at once, with trio.

The horizon cap is applied here, outside the env, like a time limit: an episode that reaches the
cap without terminating is marked truncated. Each generated turn keeps its exact tokens, its
behaviour log-probs and the version of the weights that produced it. The agent loop
(envs/agents.py) decides the first prompt, how a reply becomes an action and what the model sees
of the history; the env's own prompt format names it unless `agent` picks another.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import numpy as np
import trio

from longhorizon.envs.agents import ActionParseError, AgentLoop, agent_loop_for, configured_agent, episode_loop
from longhorizon.actor.engines.base import Engine, GenerationRequest
from longhorizon.common.chat import NO_IMAGE_PROCESSOR, TokenConversation, takes_images
from longhorizon.common.codec import pack_arrays
from longhorizon.common.wire import CHAT_ROLES, Trajectory

log = logging.getLogger(__name__)

DEFAULT_ENV_CALL_TIMEOUT_S = 300.0


@dataclass
class EpisodeResult:
    conversation: TokenConversation | None
    reward: float = 0.0
    turn_rewards: list[float] = field(default_factory=list)
    num_turns: int = 0
    terminated: bool = False
    truncated: bool = False
    cut_by: str = ""
    """Why a truncated episode stopped: "env" (the env's own limit), "horizon" (the turn cap) or
    "context" (the next turn would not fit max_context_tokens); "" when it was not cut."""
    success: bool = False
    invalid_actions: int = 0
    generation_seconds: float = 0.0
    env_seconds: float = 0.0
    error: str = ""
    windows: list[tuple[int, int, int]] = field(default_factory=list)
    """Per turn, the context it was sampled in: (window_start, reply_start, reply_end) in the
    conversation's tokens (Trajectory.sample_windows)."""

    @property
    def windowed(self) -> bool:
        """Whether some turn was shown less than the whole history, so that its reply must train
        in a sample of its own."""
        prompt_length = self.conversation.prompt_length if self.conversation is not None else 0
        return any(start > prompt_length for start, _, _ in self.windows)


def _view(loop: AgentLoop, conversation: TokenConversation, history_turns: int):
    """What the model sees next: the first prompt and the last `history_turns` turns, or (0) what
    the agent loop shows."""
    return conversation.last_turns_view(history_turns) if history_turns else loop.model_view(conversation)


def with_summary(observation: str, env) -> str:
    """The observation followed by the env's summary of the episode so far (`env.summary()`)."""
    if not hasattr(env, "summary"):
        raise TypeError(f"actor.history_summary: env {getattr(env, 'name', '?')!r} gives no summary of an episode "
                        "(it has no summary() method)")
    summary = env.summary()
    if not isinstance(summary, str):
        raise TypeError(f"env {getattr(env, 'name', '?')!r}: summary() must return text, got {type(summary).__name__}")
    return f"{observation}\n\n{summary}" if summary else observation


NOTES_BLOCK = re.compile(r"<notes>(.*?)</notes>", re.DOTALL)
_NOTES_INSTRUCTIONS = (
    "Only the task and your last {turns} turn(s) stay in view. Begin each reply with "
    "<notes>...</notes> holding what you need to remember from the turns before (what you found, "
    "what you tried, what is left to do); your latest notes are shown after each observation. Then "
    "reply as usual."
)


def notes_instructions(history_turns: int) -> str:
    """What actor.history_notes adds to the env's instructions."""
    return _NOTES_INSTRUCTIONS.format(turns=history_turns)


def split_notes(reply: str) -> tuple[str | None, str]:
    """(the reply's last <notes> block, None if it wrote none; the reply without its notes), the
    latter for the agent loop to read the action from."""
    blocks = NOTES_BLOCK.findall(reply)
    if not blocks:
        return None, reply
    return blocks[-1].strip(), NOTES_BLOCK.sub("", reply).strip()


def with_notes(observation: str, notes: str | None) -> str:
    """The observation followed by the policy's latest notes, if it wrote any."""
    return f"{observation}\n\nYour notes: {notes}" if notes else observation


OBSERVATION_IMAGE_KEYS = ("screenshot", "som")
"""What `observation_image` may name: the env's info key of the image to show with each observation
(the web env's screenshot, or its set-of-marks copy with element ids drawn at their boxes)."""


def observation_image_of(info: dict, key: str, env) -> list[bytes]:
    """The image the env's `info[key]` holds, as the list an observation carries ([] without `key`)."""
    if not key:
        return []
    image = info.get(key) if isinstance(info, dict) else None
    if not isinstance(image, (bytes, bytearray)) or not image:
        raise ValueError(
            f"observation_image = {key!r}: env {getattr(env, 'name', '?')!r} gave no image in info[{key!r}] "
            f"(the web env computes it with env.options observation_modes including {key!r})")
    return [bytes(image)]


def _context_length(conversation: TokenConversation, view) -> int:
    """The context the learner will score the next reply in: the view when it leaves turns out
    (its turn then trains as a sample of its own), else the whole conversation."""
    return len(view.token_ids) if view.window_start > conversation.prompt_length else len(conversation)


@dataclass(frozen=True)
class AgentLoopSettings:
    """How episodes are played and shown to the model, beside the env and the engine: the agent
    loop and what of a long history the model sees (actor.agent and agent_options,
    history_turns, history_summary, history_notes, observation_image). Everything that plays
    episodes takes one of these, built from the config by `from_actor`, so a new option of the
    agent loop is a field here and its use in `run_episode`."""

    agent: AgentLoop | str = ""
    """The agent loop or its name ("": the one the env's prompt_format names)."""
    history_turns: int = 0
    """> 0: the model sees the first prompt and only the last that many turns."""
    history_summary: bool = False
    """Each observation after the first is followed by the env's summary of the episode so far."""
    observation_image: str = ""
    """"screenshot" or "som": the env's image of that name shown with every observation."""
    history_notes: bool = False
    """The policy begins each reply with its notes, shown again after each later observation."""

    @classmethod
    def from_actor(cls, actor) -> AgentLoopSettings:
        """The settings of a config's [actor] table."""
        return cls(agent=configured_agent(actor.agent, actor.agent_options), history_turns=actor.history_turns,
                   history_summary=actor.history_summary, observation_image=actor.observation_image,
                   history_notes=actor.history_notes)


PLAIN_LOOP = AgentLoopSettings()


async def run_episode(
    env,
    engine: Engine,
    task,
    *,
    horizon_cap: int,
    max_context_tokens: int,
    max_new_tokens: int,
    seed: int | None = None,
    episode_id: str | None = None,
    invalid_reply_reward: float = 0.0,
    env_call_timeout_s: float = DEFAULT_ENV_CALL_TIMEOUT_S,
    loop_settings: AgentLoopSettings = PLAIN_LOOP,
) -> EpisodeResult:
    """Play one episode. Env and engine failures are reported in `error`, never raised; an env
    reset or step that takes longer than `env_call_timeout_s` fails the episode (a hung browser
    or simulator must not hold an episode slot for ever). `loop_settings` (AgentLoopSettings) names
    the agent loop and what the model sees: with `history_turns` > 0 the first prompt and only the
    last that many turns, whatever the loop shows; `history_summary` adds the env's summary of the
    episode so far to each observation after the first, so what the left-out turns did stays in
    view; `observation_image` ("screenshot" or "som") shows the model the env's image of that name
    (`info[observation_image]`) with every observation the env gives, before its text (the
    engine's model must take images: a vision-language model's folder), every image of the turns
    in view staying in the context; `history_notes` asks the policy to begin each reply with its
    notes and shows its latest notes after each observation."""
    agent, history_turns = loop_settings.agent, loop_settings.history_turns
    history_summary, history_notes = loop_settings.history_summary, loop_settings.history_notes
    observation_image = loop_settings.observation_image
    episode_id = episode_id or uuid.uuid4().hex
    notes: str | None = None
    result = EpisodeResult(conversation=None)

    async def env_call(what: str, call, *args, **kwargs):
        with trio.move_on_after(env_call_timeout_s):
            return await call(*args, **kwargs)
        raise TimeoutError(f"env {what} on task {getattr(task, 'task_id', '?')} took over {env_call_timeout_s:g}s")

    try:
        if observation_image and observation_image not in OBSERVATION_IMAGE_KEYS:
            raise ValueError(f"observation_image must be one of {', '.join(OBSERVATION_IMAGE_KEYS)} "
                             f"or empty, got {observation_image!r}")
        if observation_image and not takes_images(engine.tokenizer):
            raise ValueError(f"observation_image = {observation_image!r}: {NO_IMAGE_PROCESSOR}")
        started = time.perf_counter()
        observation, info = await env_call("reset", env.reset, task, seed=seed)
        result.env_seconds += time.perf_counter() - started
        loop = episode_loop(agent_loop_for(env, agent), env, engine.tokenizer)
        prompt_tools = getattr(loop, "prompt_tools", lambda: None)()
        stop_strings = (loop.stop_strings(env) if hasattr(loop, "stop_strings")
                        else tuple(getattr(env, "stop_strings", ())))
        instructions = env.instructions()
        if history_notes:
            instructions = "\n\n".join(part for part in (instructions, notes_instructions(history_turns)) if part)
        first_messages = loop.first_messages(instructions, observation)
        images = observation_image_of(info, observation_image, env)
        if images:  # the first observation's image goes with the last message, which holds it
            first_messages = [*first_messages[:-1], {**first_messages[-1], "images": images}]
        conversation = TokenConversation.start(engine.tokenizer, first_messages, tools=prompt_tools)
        result.conversation = conversation
        if len(conversation) + max_new_tokens > max_context_tokens:
            # Nothing the model could write would fit; the learner would refuse it as too long.
            raise ValueError(
                f"the first prompt has {len(conversation)} tokens: with {max_new_tokens} new tokens "
                f"per turn it does not fit actor.max_context_tokens = {max_context_tokens}"
            )
        view = _view(loop, conversation, history_turns)
        while True:
            # The loop (or history_turns) picks what the model sees; the conversation (the
            # trajectory) keeps everything, and each turn's window says what it saw.
            reply_start = len(conversation)
            started = time.perf_counter()
            generation = await engine.generate(
                GenerationRequest(
                    token_ids=list(view.token_ids),
                    episode_id=episode_id,
                    messages=view.messages,
                    task=task,
                    stop_strings=stop_strings,
                    images=list(view.images),
                )
            )
            result.generation_seconds += time.perf_counter() - started
            conversation.add_generation(
                generation.token_ids, generation.logprobs, generation.policy_version, generation.text
            )
            result.windows.append((view.window_start, reply_start, len(conversation)))
            result.num_turns += 1
            images = []  # a reply the env could not read leaves the page, and so the image, as it was
            reply = generation.text
            if history_notes:
                written, reply = split_notes(reply)
                notes = written if written is not None else notes
            try:
                action = loop.parse_action(reply)
            except ActionParseError as exc:
                observation, terminated, truncated = loop.error_observation(exc), False, False
                reward = invalid_reply_reward
                result.invalid_actions += 1
            else:
                started = time.perf_counter()
                observation, reward, terminated, truncated, info = await env_call("step", env.step, action)
                result.env_seconds += time.perf_counter() - started
                if hasattr(loop, "env_observation"):
                    observation = loop.env_observation(observation)
                result.success = bool(info.get("success", False))
                if not (terminated or truncated):
                    images = observation_image_of(info, observation_image, env)
            result.turn_rewards.append(float(reward))
            if terminated or truncated:
                result.terminated, result.truncated = bool(terminated), bool(truncated)
                result.cut_by = "env" if truncated and not terminated else ""
                break
            if result.num_turns >= horizon_cap:
                result.truncated, result.cut_by = True, "horizon"
                break
            if history_summary:
                observation = with_summary(observation, env)
            if history_notes:
                observation = with_notes(observation, notes)
            conversation.add_observation(observation, stopped_on_eos=generation.stopped_on_eos, images=images)
            view = _view(loop, conversation, history_turns)
            if _context_length(conversation, view) + max_new_tokens > max_context_tokens:
                result.truncated, result.cut_by = True, "context"  # the next turn would not fit
                break
        result.reward = float(sum(result.turn_rewards))
    except trio.Cancelled:
        raise
    except Exception as exc:  # a broken env or engine fails this episode, not the actor
        log.warning("episode %s on task %s failed: %r", episode_id, getattr(task, "task_id", "?"), exc)
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        engine.end_episode(episode_id)
    return result


def to_trajectory(
    result: EpisodeResult,
    *,
    actor_id: str,
    task,
    group_id: str,
    group_size: int,
    horizon_cap: int,
    with_messages: bool = False,
) -> Trajectory:
    """Package a finished episode for the learner; `with_messages` adds the conversation's chat
    messages (for a run that saves the episodes it trains on)."""
    messages = None
    if with_messages and result.conversation is not None:
        messages = [{"role": m["role"], "content": m["content"]} for m in result.conversation.messages]
        if any(m["role"] not in CHAT_ROLES for m in messages):
            # An agent loop of other roles: the episode still trains, it just cannot be saved.
            log.warning("episode on task %s has a chat role outside %s: its messages are not sent",
                        task.task_id, ", ".join(CHAT_ROLES))
            messages = None
    if result.conversation is not None:
        # One buffer for all per-token arrays: the wire sends it as a single zero-copy frame.
        arrays = pack_arrays(result.conversation.arrays())
        prompt_length = result.conversation.prompt_length
        text = result.conversation.text()
        images, image_offsets = list(result.conversation.images), list(result.conversation.image_offsets)
    else:  # the episode failed before its first prompt was built
        arrays = {
            "token_ids": np.zeros(0, np.int32),
            "loss_mask": np.zeros(0, np.uint8),
            "behaviour_logprobs": np.zeros(0, np.float32),
            "policy_versions": np.zeros(0, np.int32),
        }
        prompt_length = 0
        text = ""
        images, image_offsets = [], []
    return Trajectory(
        trajectory_id=uuid.uuid4().hex,
        actor_id=actor_id,
        env_name=task.env_name,
        task_id=task.task_id,
        group_id=group_id,
        group_size=group_size,
        token_ids=arrays["token_ids"],
        loss_mask=arrays["loss_mask"],
        behaviour_logprobs=arrays["behaviour_logprobs"],
        policy_versions=arrays["policy_versions"],
        prompt_length=prompt_length,
        reward=result.reward,
        turn_rewards=list(result.turn_rewards),
        num_turns=result.num_turns,
        invalid_actions=result.invalid_actions,
        horizon_cap=horizon_cap,
        terminated=result.terminated,
        truncated=result.truncated,
        success=result.success,
        generation_seconds=result.generation_seconds,
        env_seconds=result.env_seconds,
        text=text,
        error=result.error,
        messages=messages,
        sample_windows=[index for window in result.windows for index in window] if result.windowed else [],
        cut_by=result.cut_by,
        images=images,
        image_offsets=image_offsets,
    )


class EnvPool:
    """Reusable env instances: one per concurrent episode, created on first need.

    An env whose episode failed is released as broken: it is never handed out again and is
    closed at once, in the background, because it may still hold a JVM, web app servers or a
    service instance, and a long run with many failures must not collect them until it ends.
    Every other env it made is closed at the end, including ones still mid-episode (remote envs
    hold server-side instances until closed)."""

    BROKEN_CLOSE_TIMEOUT_S = 60.0

    def __init__(self, make_env: Callable[[], object]) -> None:
        self._make_env = make_env
        self._free: list = []
        self._all: list = []
        self._created = 0
        self._closing: dict[int, trio.Event] = {}  # id(env) -> set once its background close ends

    @property
    def created(self) -> int:
        return self._created

    def acquire(self):
        if self._free:
            return self._free.pop()
        env = self._make_env()
        self._all.append(env)
        self._created += 1
        return env

    def release(self, env, *, broken: bool = False) -> None:
        if not broken:
            self._free.append(env)
            return
        try:
            # A system task, because release is synchronous and has no nursery to start one in.
            trio.lowlevel.spawn_system_task(self._close_broken, env, name="EnvPool close broken env")
        except RuntimeError:
            return  # not inside trio.run: it stays in _all and is closed with the pool
        self._all = [other for other in self._all if other is not env]
        self._closing[id(env)] = trio.Event()

    async def _close_broken(self, env) -> None:
        try:
            with trio.move_on_after(self.BROKEN_CLOSE_TIMEOUT_S):
                await env.close()
        except Exception as exc:  # a system task must not raise: trio would end the whole run
            log.warning("closing a broken env failed: %r", exc)
        finally:
            done = self._closing.pop(id(env), None)
            if done is not None:
                done.set()

    async def close(self) -> None:
        with trio.CancelScope(shield=True):  # runs while the actor is being cancelled
            for env in self._all:
                try:
                    with trio.move_on_after(5):
                        await env.close()
                except Exception as exc:
                    log.warning("closing env failed: %r", exc)
            with trio.move_on_after(5):  # one deadline for all the broken envs still closing
                for done in list(self._closing.values()):
                    await done.wait()
        self._free.clear()
        self._all.clear()


async def run_group_member(
    engine: Engine,
    env_pool: EnvPool,
    task,
    member: int,
    *,
    group_size: int,
    group_id: str,
    actor_id: str,
    horizon_cap: int,
    max_context_tokens: int,
    max_new_tokens: int,
    seed: int,
    on_trajectory: Callable[[Trajectory], Awaitable[None]],
    invalid_reply_reward: float = 0.0,
    env_call_timeout_s: float = DEFAULT_ENV_CALL_TIMEOUT_S,
    loop_settings: AgentLoopSettings = PLAIN_LOOP,
    with_messages: bool = False,
) -> Trajectory:
    """Run member `member` of a group (its episode id is `<group_id>-<member>`) and hand its
    trajectory over. Every member gets the same task instance (the reset `seed`) and cap; only
    the sampling differs. The arguments are run_group's."""
    env = env_pool.acquire()
    result = await run_episode(
        env,
        engine,
        task,
        horizon_cap=horizon_cap,
        max_context_tokens=max_context_tokens,
        max_new_tokens=max_new_tokens,
        seed=seed,
        episode_id=f"{group_id}-{member}",
        invalid_reply_reward=invalid_reply_reward,
        env_call_timeout_s=env_call_timeout_s,
        loop_settings=loop_settings,
    )
    env_pool.release(env, broken=bool(result.error))
    trajectory = to_trajectory(
        result, actor_id=actor_id, task=task, group_id=group_id, group_size=group_size,
        horizon_cap=horizon_cap, with_messages=with_messages,
    )
    await on_trajectory(trajectory)
    return trajectory


async def run_group(engine: Engine, env_pool: EnvPool, task, *, group_size: int, **member_settings) -> list[Trajectory]:
    """Run G episodes of one task concurrently; each trajectory is handed over as soon as it ends.
    `member_settings` are run_group_member's keyword arguments (group_id, actor_id, horizon_cap,
    max_context_tokens, max_new_tokens, seed, on_trajectory, ...)."""
    trajectories: list[Trajectory] = []
    settings = dict(member_settings, group_size=group_size)

    async def one(member: int) -> None:
        trajectories.append(await run_group_member(engine, env_pool, task, member, **settings))

    async with trio.open_nursery() as nursery:
        for member in range(group_size):
            nursery.start_soon(one, member)
    return trajectories
