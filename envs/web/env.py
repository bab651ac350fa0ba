"""BrowserEnv: the async text env over a real Chromium, for WebArena-style tasks on sites.

Usage (the "weblocal" and "webarena" envs build one; MiniWoB subclasses it):

    env = BrowserEnv(name="weblocal", sites={"fossil": FossilSite(), "shop": ShopSite()})
    observation, info = await env.reset(task)       # task.data: a WebArena-style config (below)
    observation, reward, terminated, truncated, info = await env.step("click('12')")
    ...                                             # "send_msg_to_user('42')" or "stop()" ends it
    await env.close()                               # stops the sites; the browser pool stays

task.data holds one task config: "sites" (keys of `sites`), "intent" (the goal shown to the agent),
"start_url" (with "__NAME__" placeholders for the sites' base URLs), "require_reset", and "eval"
(eval_types string_match / url_match / program_html / state_check, see evaluators.py; each
state check goes to its task's site, or to the one its "site" key names when a task has several,
and a site's ValueError for a check it does not know scores that check as failed). Each site
is started on first use and reset before every episode that follows one which used it, so
episodes never see each other's changes. The browser context of an episode may only load the
allowed origins of the task's sites.

Observations (observation.py) start with "Goal: <intent>", then URL, tabs, the last action's error
and the accessibility tree with element ids. `observation_modes` adds visual forms to the info of
reset and step: "screenshot" (info["screenshot"], PNG bytes of the viewport at `screenshot_size`)
and "som" (info["som"], the same with element ids drawn at their boxes, and info["som_marks"]);
leaving out "text" leaves the tree out of the observation. Only the forms asked for are computed. Actions follow BrowserGym (actions.py): one per step,
or with `multiaction` several, one per line, run in order until the first that fails (BrowserGym's
multi-action mode). A malformed or failing action gives an error observation with
info["invalid_action"] = True; it never raises. If the browser
crashes or hangs, step/reset raise BrowserFailure: the rollout records the episode as failed (it is
not trained on), the pool relaunches the browser, and the next reset of this env works.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, Sequence

import trio
from pydantic.json_schema import SkipJsonSchema

from longhorizon.common.config import Section, bounded
from longhorizon.envs.agents import ActionParseError, ReactLoop, parse_react_reply
from longhorizon.envs.base import Task
from longhorizon.envs.tools import ToolSet
from longhorizon.envs.web.actions import (
    Action,
    ActionError,
    action_help,
    action_tools,
    execute,
    parse_action,
    parse_actions,
)
from longhorizon.envs.web.browser import BrowserFailure, BrowserPool, BrowserSession, SessionOptions, shared_pool
from longhorizon.envs.web.evaluators import evaluate
from longhorizon.envs.web.observation import DEFAULT_SCREENSHOT_SIZE, ObservationForms, capture, fit_viewport

log = logging.getLogger(__name__)

PLACEHOLDER = re.compile(r"__([A-Z][A-Z0-9_]*?)__")

INSTRUCTIONS = """\
You are an agent browsing the web to complete a task. Each observation shows the goal, the URL, \
the open tabs, the error of your last action (if any) and the page as an accessibility tree: one \
element per line, with an id in brackets for elements you can act on, e.g. [12] button 'Submit'.

Actions ({how_many}; ids are the ones in brackets; x and y are pixels from the top left \
corner of the visible part of the page):
{actions}

Reply with your reasoning and {reply_actions}, in exactly this format:
Thought:
<your reasoning>

Action:
{action_layout}"""

SINGLE_ACTION = {"how_many": "one per turn", "reply_actions": "one action", "action_layout": "<one action, e.g. click('12')>"}
MULTI_ACTION = {
    "how_many": "one or several per turn, one per line, run in order until one fails",
    "reply_actions": "your actions",
    "action_layout": "<one or several actions, one per line, e.g. fill('3', 'text') then click('12') on the next line>",
}


TOOL_INSTRUCTIONS = """\
You are an agent browsing the web to complete a task. Each observation shows the goal, the URL, \
the open tabs, the error of your last action (if any) and the page as an accessibility tree: one \
element per line, with an id in brackets for elements you can act on, e.g. [12] button 'Submit'. \
Act with the tools, naming elements by those ids ("12"). Call one tool per turn."""


def placeholder(site_name: str) -> str:
    """How tasks write a site's base URL: "shop" -> "__SHOP__"."""
    return f"__{site_name.upper()}__"


def replace_placeholders(text: str, base_urls: Mapping[str, str]) -> str:
    """Replace every known "__NAME__" in text by its base URL (keys are placeholders)."""
    for key in sorted(base_urls, key=len, reverse=True):
        text = text.replace(key, base_urls[key].rstrip("/"))
    return text


@dataclass
class Episode:
    """The running episode: its task config, browser session and goal (subclasses read it in hooks)."""

    task: Task
    config: Mapping[str, Any]
    session: BrowserSession
    goal: str
    base_urls: dict[str, str]
    finished: bool = False
    steps: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


class BrowserOptions(Section):
    """The options every web env takes for its browser (each web env's `Options` adds its own)."""

    num_browsers: int = bounded(1, ge=1)
    """Chromium processes shared by the env's episodes in this process."""
    action_timeout_s: float = bounded(5.0, gt=0)
    """Most seconds one action may take (a click waiting for its element, typing)."""
    navigation_timeout_s: float = bounded(20.0, gt=0)
    """Most seconds a page may take to load."""
    multiaction: bool = False
    """Several actions in one step, one per line, run in order until the first error
    (BrowserGym's multi-action mode; docs/web.md)."""
    observation_modes: Sequence[Literal["text", "screenshot", "som"]] = ("text",)
    """What each observation holds: `text` (the accessibility tree with element ids, as the model
    reads it), `screenshot` (info["screenshot"]: PNG of the viewport), `som` (info["som"]: the
    screenshot with each interactive element's id drawn at its box; info["som_marks"]). Only
    what is named is computed (docs/web.md)."""
    screenshot_size: Sequence[int] = DEFAULT_SCREENSHOT_SIZE
    """[width, height] of the viewport in pixels when a screenshot form is on."""
    pool: SkipJsonSchema[Any] = None
    """A browser pool to share, from Python only (tests, benchmarks); not a config value."""


class BrowserEnv:
    """One episode at a time in its own browser context; reuse the object across episodes."""

    prompt_format = "react"
    MULTI_ACTION_FORMAT = "longhorizon.envs.web.env:MultiActionReactLoop"

    def __init__(
        self,
        *,
        name: str,
        sites: Mapping[str, Any] | None = None,
        pool: BrowserPool | None = None,
        num_browsers: int = 1,
        action_timeout_s: float = 5.0,
        navigation_timeout_s: float = 20.0,
        max_observation_chars: int = 30000,
        multiaction: bool = False,
        observation_modes: Sequence[str] = ("text",),
        screenshot_size: Sequence[int] = DEFAULT_SCREENSHOT_SIZE,
    ) -> None:
        if not isinstance(multiaction, bool):
            raise ValueError(f"multiaction must be true or false, got {multiaction!r}")
        if action_timeout_s <= 0 or navigation_timeout_s <= 0:
            raise ValueError("action_timeout_s and navigation_timeout_s must be positive")
        self.name = name
        self.sites: dict[str, Any] = dict(sites or {})
        self._pool = pool
        self._num_browsers = num_browsers
        self.session_options = SessionOptions(action_timeout_s=action_timeout_s, navigation_timeout_s=navigation_timeout_s)
        self.max_observation_chars = max_observation_chars
        self.multiaction = multiaction
        """Several actions in one step, one per line (BrowserGym's multi-action mode)."""
        if multiaction:
            self.prompt_format = self.MULTI_ACTION_FORMAT
        self.observation_forms = ObservationForms()
        self.configure_observation(observation_modes, screenshot_size)
        self._episode: Episode | None = None
        self._started_sites: set[str] = set()
        self._pristine_sites: set[str] = set()

    @property
    def pool(self) -> BrowserPool:
        if self._pool is None:
            self._pool = shared_pool(self._num_browsers)
        return self._pool

    def configure_observation(self, observation_modes: Sequence[str], screenshot_size: Sequence[int]) -> None:
        """Which observation forms to compute from the next observation on (ValueError if bad)."""
        forms = ObservationForms.checked(observation_modes, screenshot_size)
        if "som" in forms.modes:
            import importlib.util

            if importlib.util.find_spec("PIL") is None:
                raise ValueError("the 'som' observation mode draws with Pillow: pip install pillow")
        self.observation_forms = forms

    def instructions(self) -> str:
        return INSTRUCTIONS.format(actions=action_help(), **(MULTI_ACTION if self.multiaction else SINGLE_ACTION))

    def tool_set(self) -> ToolSet:
        return ToolSet(TOOL_INSTRUCTIONS, action_tools())

    # -- hooks for subclasses ----------------------------------------------------------------------

    async def _prepare_sites(self, task: Task, config: Mapping[str, Any]) -> tuple[list[str], dict[str, str]]:
        """Start and reset the task's sites; returns their allowed origins and placeholder URLs."""
        names = config.get("sites") or []
        if isinstance(names, str):
            names = [names]
        unknown = [site for site in names if site not in self.sites]
        if unknown:
            raise ValueError(
                f"task {task.task_id!r} needs site(s) {unknown}; this env has: {', '.join(sorted(self.sites)) or '(none)'}"
            )
        origins: list[str] = []
        base_urls: dict[str, str] = {}
        for site_name in names:
            site = self.sites[site_name]
            # Abandoned (not waited for) if the rollout's env-call timeout fires; the env is then
            # closed as broken, and a server its thread still starts dies with this process.
            if site_name not in self._started_sites:
                await trio.to_thread.run_sync(site.start, abandon_on_cancel=True)
                self._started_sites.add(site_name)
                self._pristine_sites.add(site_name)
            elif site_name not in self._pristine_sites:
                await trio.to_thread.run_sync(site.reset, abandon_on_cancel=True)
            self._pristine_sites.discard(site_name)
            origins.extend(site.allowed_origins)
            base_urls[placeholder(site_name)] = site.base_url
        return origins, base_urls

    def _session_options(self, task: Task, config: Mapping[str, Any]) -> SessionOptions:
        return self.session_options

    async def _on_loaded(self, episode: Episode, seed: int | None) -> None:
        """After the start URL loaded (MiniWoB starts its task here)."""

    async def _after_action(self, session: BrowserSession, episode: Episode) -> tuple[float, bool, dict] | None:
        """Asyncio side, after each action: (reward, success, info) to end the episode, else None."""
        return None

    async def _score(self, episode: Episode, answer: str) -> tuple[float, bool, dict]:
        """The reward when the agent ends the episode with `answer` (evaluators + site state checks)."""
        eval_config = episode.config.get("eval") or {}
        final_url, page_contents = await episode.session.call(
            _read_program_html, list(eval_config.get("program_html") or ()), episode.base_urls,
            timeout_s=60.0,
        )
        state_results = []
        for check in eval_config.get("state_check") or ():
            try:
                site = self._site_for_check(episode, check)
                state_results.append(await trio.to_thread.run_sync(site.check_state, check, abandon_on_cancel=True))
            except ValueError as error:  # a check the site does not understand fails; it does not crash
                state_results.append((False, f"bad check: {error}"))
        reference_url = replace_placeholders(str(eval_config.get("reference_url") or ""), episode.base_urls)
        result = evaluate(
            {**eval_config, "reference_url": reference_url},
            answer=answer, final_url=final_url, page_contents=page_contents, state_results=state_results,
        )
        return result.score, result.success, {"eval_details": result.details}

    def _site_for_check(self, episode: Episode, check: Mapping[str, Any]) -> Any:
        names = list(episode.config.get("sites") or [])
        site_name = check.get("site") if isinstance(check, Mapping) else None
        if site_name is None:
            if len(names) != 1:
                raise ValueError(f"state check {check!r} must name its \"site\" (the task uses {names})")
            site_name = names[0]
        if site_name not in self.sites:
            raise ValueError(f"state check {check!r} names an unknown site; this env has {sorted(self.sites)}")
        return self.sites[site_name]

    # -- the Env protocol --------------------------------------------------------------------------

    async def reset(self, task: Task, *, seed: int | None = None) -> tuple[str, dict]:
        await self._end_episode()
        config = task.data if isinstance(task.data, Mapping) else {}
        if not config.get("start_url"):
            raise ValueError(f"task {task.task_id!r} has no start_url in its data")
        origins, base_urls = await self._prepare_sites(task, config)
        goal = str(config.get("intent") or "")
        start_url = replace_placeholders(str(config["start_url"]), base_urls)
        options = self._session_options(task, config)
        # A browser that dies before the episode's first observation (between episodes, or while
        # this reset opens its context) costs nothing yet: the pool relaunches it and we try again.
        for attempt in range(2):
            try:
                session = await self.pool.open_session(origins, options)
            except BrowserFailure:
                if attempt == 1:
                    raise
                continue
            episode = Episode(task=task, config=config, session=session, goal=goal, base_urls=base_urls)
            self._episode = episode
            try:
                forms = self.observation_forms
                await session.call(_goto, start_url, forms.screenshot_size if forms.visual else None,
                                   timeout_s=options.navigation_timeout_s)
                await self._on_loaded(episode, seed)
                observation, visuals = await session.call(self._observe, "", timeout_s=options.navigation_timeout_s)
                return observation, {"success": False, "invalid_action": False, **visuals}
            except BrowserFailure:
                await self._end_episode()
                if attempt == 1:
                    raise
            except BaseException:
                await self._end_episode()
                raise
        raise AssertionError("unreachable")

    async def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        episode = self._episode
        if episode is None:
            raise RuntimeError(f"{self.name} env: call reset() before step()")
        if episode.finished:
            raise RuntimeError(f"{self.name} env: the episode has ended; call reset() to start another")
        episode.steps += 1
        try:
            try:
                actions = self._parse(action)
            except ActionError as error:
                observation, visuals = await episode.session.call(self._observe, str(error), timeout_s=10.0)
                return observation, 0.0, False, False, {"success": False, "invalid_action": True, **visuals}
            ending = actions.pop() if actions[-1].terminal else None
            error, outcome, visuals = "", None, {}
            if actions:
                timeout = (self.session_options.navigation_timeout_s + self.session_options.action_timeout_s) * len(actions)
                observation, visuals, error, outcome = await episode.session.call(
                    self._act, actions, 1 if ending else 0, timeout_s=timeout)
            if ending is not None and not error and outcome is None:
                reward, success, info = await self._score(episode, ending.answer)
                episode.finished = True
                observation = f"The episode is over. Your message to the user: {ending.answer!r}"
                await self._close_session(episode)
                return observation, float(reward), True, False, {
                    "success": bool(success), "invalid_action": False, "answer": ending.answer, **info,
                }
        except BrowserFailure:
            episode.finished = True
            await self._close_session(episode)
            raise
        if outcome is not None:
            reward, success, info = outcome
            episode.finished = True
            await self._close_session(episode)
            return observation, float(reward), True, False, {
                "success": bool(success), "invalid_action": bool(error), **info, **visuals,
            }
        return observation, 0.0, False, False, {"success": False, "invalid_action": bool(error), **visuals}

    async def close(self) -> None:
        await self._end_episode()
        sites = [self.sites[name] for name in self._started_sites]
        self._started_sites.clear()
        self._pristine_sites.clear()
        for site in sites:
            try:
                await trio.to_thread.run_sync(site.stop)
            except Exception as error:
                log.warning("stopping site %r failed: %r", getattr(site, "name", site), error)

    # -- internals ---------------------------------------------------------------------------------

    async def _observe(self, session: BrowserSession, error: str) -> tuple[str, dict[str, Any]]:
        """Asyncio side: the observation of the current page, and its visual forms as info entries."""
        episode = self._episode
        return await capture(session, error=error, goal=episode.goal if episode else "",
                             max_chars=self.max_observation_chars, forms=self.observation_forms)

    def _parse(self, text: str) -> list[Action]:
        """The step's actions; a terminal one only as the last (ActionError otherwise)."""
        if not self.multiaction:
            return [parse_action(text)]
        actions = parse_actions(text)
        for number, action in enumerate(actions[:-1], 1):
            if action.terminal:
                raise ActionError(f"action {number} of {len(actions)}: {action.name} ends the episode, so it can only "
                                  "be the last action of a step; nothing was run")
        return actions

    async def _act(self, session: BrowserSession, actions: list[Action],
                   ending: int = 0) -> tuple[str, dict[str, Any], str, tuple | None]:
        """Asyncio side: run the actions in order, after each asking the subclass whether it ended
        the episode; stop at the first error or the end; then observe. `ending` counts a terminal
        action the step holds after these (for the error's count of actions not run)."""
        episode = self._episode
        assert episode is not None
        error, outcome = "", None
        total = len(actions) + ending
        for number, action in enumerate(actions, 1):
            try:
                await execute(session, action, resolve_url=lambda url: replace_placeholders(url, episode.base_urls))
            except ActionError as action_error:
                error = str(action_error)
                if total > 1:
                    left = total - number
                    error = f"action {number} of {total}: {error}" + (
                        f" ({left} action{'s' if left > 1 else ''} after it not run)" if left else "")
            outcome = await self._after_action(session, episode)
            if error or outcome is not None:
                break
        observation, visuals = await self._observe(session, error)
        return observation, visuals, error, outcome

    async def _close_session(self, episode: Episode) -> None:
        await episode.session.aclose()

    async def _end_episode(self) -> None:
        episode, self._episode = self._episode, None
        if episode is not None:
            await episode.session.aclose()


_ACTION_MARKER = re.compile(r"(?im)^\s*\**\s*action\s*\**\s*:")


class MultiActionReactLoop(ReactLoop):
    """The react layout with one or several actions after `Action:`, one per line (the prompt
    format of a BrowserEnv in multi-action mode)."""

    def parse_action(self, reply: str) -> str:
        parse_react_reply(reply)  # the same checks: one marker, something after it
        rest = _ACTION_MARKER.split(reply)[-1]
        lines = [line.strip().strip("`*").strip() for line in rest.splitlines()]
        # A fence's language tag ("```python") is left as a word of its own: not an action.
        actions = [line for line in lines if line and line not in ("python", "py")]
        return "\n".join(actions)

    def error_observation(self, error: ActionParseError) -> str:
        return (f"Invalid reply: {error}. Answer as:\nThought:\n<your reasoning>\n\n"
                "Action:\n<one or several actions, one per line>")


START_URL_SEPARATOR = " |AND| "
"""WebArena's way to open several tabs at the start: "URL1 |AND| URL2" (the first tab is active)."""


async def _goto(session: BrowserSession, start_url: str, viewport: tuple[int, int] | None = None) -> None:
    """Asyncio side: load the start URL(s), one tab each, and make the first tab active; with a
    viewport (screenshot runs) each page loads at that size, as the agent will see it."""
    from playwright.async_api import Error as PlaywrightError

    for index, url in enumerate(part.strip() for part in start_url.split(START_URL_SEPARATOR)):
        page = await session.ensure_page() if index == 0 else await session.context.new_page()
        if viewport is not None:
            await fit_viewport(page, viewport)
        try:
            await page.goto(url, wait_until="load")
        except PlaywrightError as error:
            if not session.alive:
                raise
            raise RuntimeError(f"the start URL {url} did not load: {str(error).splitlines()[0]}") from None
    session.active = 0
    await session.page().bring_to_front()


async def _read_program_html(session: BrowserSession, targets: list, base_urls: Mapping[str, str]) -> tuple[str, list]:
    """Asyncio side: the final URL, then the text each program_html target selects (None if unreadable).

    As in WebArena, a target with url "last" reads the page the agent ended on; other targets load
    their URL in the same tab first.
    """
    page = await session.ensure_page()
    final_url = page.url
    contents: list[str | None] = []
    for target in targets:
        url = str(target.get("url", "last"))
        locator = str(target.get("locator", "")).strip()
        if url.startswith("func:") or locator.startswith("func:"):
            contents.append(None)  # WebArena's Python helpers are not available (see unsupported_features)
            continue
        try:
            if url != "last":
                await page.goto(replace_placeholders(url, base_urls), wait_until="load")
            if not locator:
                contents.append(await page.content())
            else:
                for prep in target.get("prep_actions") or ():
                    await page.evaluate(f"() => {prep}")
                value = await page.evaluate(f"() => {locator}")
                contents.append("" if value is None else str(value))
        except Exception:
            if not session.alive:
                raise
            contents.append("" if locator else None)
    return final_url, contents
