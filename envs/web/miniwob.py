"""The "miniwob" env: MiniWoB++ task pages (from the `miniwob` package) served locally, played in Chromium.

Each MiniWoB task is a small web page that generates a problem from a seeded random generator,
shows an instruction ("Click on the "OK" button.") and scores the agent's interaction itself. We
serve the package's html folder from 127.0.0.1 (one static server per process), load a task page
in a fresh browser context, seed it (`Math.seedrandom`, with the same number BrowserGym uses for
that seed: see page_seed), raise its episode time limit, start the episode and read the instruction
from the page. After every action the page's raw reward is read:
the episode ends when the page says so, with reward = the raw reward (1 correct, -1 wrong or out
of time, partial credit on a few tasks) and success = raw reward > 0. stop()/send_msg_to_user()
ends it early with the raw reward so far (0 when the page has not scored yet).

Tasks: all 125 MiniWoB task types. TASK_NAMES, the default, are those a text agent can solve
through the action set; VISUAL_TASKS are the 22 whose problem shows only in a picture, offered when
the observation carries one (`observation_modes` with "screenshot" or "som"), each with what the
picture holds. A Task is one (type, seed) instance: train instances
use seeds 0.. and test instances seeds from TEST_SEED_BASE, so both splits cover every type with
different problems. The reset seed is not used: the task names the instance, and instance seed s
shows the same problem as BrowserGym's `reset(seed=s)` on that task (tests/test_web_miniwob_seeds.py
checks recorded instructions, and a replay of BrowserGym's start-up for the types not recorded).
The scripted oracle (policy "oracle") is in miniwob_oracles.py.
"""

from __future__ import annotations

import functools
import http.server
import importlib.util
import json
import threading
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence

import numpy as np

from longhorizon.common.config import bounded
from longhorizon.envs.base import EnvSpec, Task
from longhorizon.envs.web.browser import BrowserSession
from longhorizon.envs.web.env import BrowserEnv, BrowserOptions, Episode
from longhorizon.envs.web.observation import DEFAULT_SCREENSHOT_SIZE
from longhorizon.envs.web.miniwob_oracles import SOLVERS, MiniWobOraclePolicy
from longhorizon.envs.web.policies import RandomClickerPolicy

ENV_NAME = "miniwob"
TEST_SEED_BASE = 1_000_000
# BrowserGym draws the page's seed from [0, PAGE_SEED_END).
PAGE_SEED_END = 1_000_000
REWARD_MODES = ("raw", "success")

# The 125 task types the miniwob package registers (BrowserGym's MiniWoB list), less VISUAL_TASKS:
# the types a model can solve from the text observation with the action set (clicks, typing, keys
# and key combinations, drags between elements, mouse actions at points).
TASK_NAMES = (
    "ascending-numbers", "book-flight", "book-flight-nodelay", "buy-ticket", "choose-date",
    "choose-date-easy", "choose-date-medium", "choose-date-nodelay", "choose-list", "click-button",
    "click-button-sequence", "click-checkboxes", "click-checkboxes-large", "click-checkboxes-soft",
    "click-checkboxes-transfer", "click-collapsible", "click-collapsible-2", "click-collapsible-2-nodelay",
    "click-collapsible-nodelay", "click-dialog", "click-dialog-2", "click-link", "click-menu", "click-menu-2",
    "click-option", "click-pie", "click-pie-nodelay", "click-scroll-list", "click-tab", "click-tab-2",
    "click-tab-2-easy", "click-tab-2-hard", "click-tab-2-medium", "click-test", "click-test-2",
    "click-test-transfer", "click-widget", "copy-paste", "copy-paste-2", "daily-calendar", "drag-box",
    "drag-circle", "drag-cube", "drag-items", "drag-items-grid", "drag-single-shape", "drag-sort-numbers",
    "email-inbox", "email-inbox-delete", "email-inbox-forward", "email-inbox-forward-nl",
    "email-inbox-forward-nl-turk", "email-inbox-important", "email-inbox-nl-turk", "email-inbox-noscroll",
    "email-inbox-reply", "email-inbox-star-reply", "enter-date", "enter-password", "enter-text",
    "enter-text-2", "enter-text-dynamic", "enter-time", "find-greatest", "find-word", "focus-text",
    "focus-text-2", "form-sequence", "form-sequence-2", "form-sequence-3", "generate-number", "guess-number",
    "hot-cold", "login-user", "login-user-popup", "multi-layouts", "multi-orderings", "navigate-tree",
    "odd-or-even", "order-food", "phone-book", "read-table", "read-table-2", "scroll-text", "scroll-text-2",
    "search-engine", "sign-agreement", "simple-algebra", "simple-arithmetic", "social-media",
    "social-media-all", "social-media-some", "stock-market", "terminal", "text-editor", "text-transform",
    "tic-tac-toe", "unicode-test", "use-autocomplete", "use-autocomplete-nodelay", "use-slider",
    "use-slider-2", "use-spinner",
)
# Registered types whose problem is in a picture, with what the picture holds: the text observation
# cannot give it, so they are offered only to a policy that sees screenshots (and acts at pixel
# positions with the mouse actions).
VISUAL_TASKS: dict[str, str] = {
    "bisect-angle": "the angle is drawn in an SVG picture; its lines have no text form",
    "circle-center": "the circle is a picture; its centre has no text form",
    "click-color": "the boxes differ only by background colour, which the tree does not show",
    "click-shades": "the tiles differ only by colour, which the tree does not show",
    "click-shape": "shapes, colours and sizes are SVG drawing with no text form",
    "count-shape": "the shapes to count are SVG drawing with no text form",
    "count-sides": "the polygon is drawn on a canvas",
    "drag-shapes": "which shapes are triangles shows only in the SVG drawing",
    "drag-shapes-2": "shape colours show only in the SVG drawing",
    "draw-circle": "the marked point is a picture; drawing needs its pixel position",
    "draw-line": "the dot is a picture; drawing needs its pixel position",
    "find-midpoint": "the two points are a picture; the midpoint needs their pixel positions",
    "grid-coordinate": "the grid and its points are SVG drawing; no element carries a coordinate",
    "highlight-text": "selecting the paragraph needs a mouse drag between pixel positions the tree does not give",
    "highlight-text-2": "selecting the paragraph needs a mouse drag between pixel positions the tree does not give",
    "identify-shape": "the figure is an SVG picture with no text form",
    "number-checkboxes": "the digit pattern to copy is a picture",
    "resize-textarea": "the resize corner has no element id and the tree gives no pixel positions",
    "right-angle": "the two points are a picture; the third needs their pixel positions",
    "use-colorwheel": "the wheel is a picture: a colour's place on it has no text form",
    "use-colorwheel-2": "the wheel is a picture: a colour's place on it has no text form",
    "visual-addition": "the blocks to count are pictures",
}
# Pages in the package's folder that neither the package nor BrowserGym registers as tasks.
UNREGISTERED = ("button-delay", "chase-circle", "hover-shape", "moving-items", "simon-says")

INSTRUCTIONS_EXTRA = """

The page is a small MiniWoB task; the goal line repeats its instruction. The task scores itself \
when you complete it (for example by pressing its Submit button); you do not need to stop()."""

# Hides MiniWoB's reward/timer panel (its countdown would make every observation differ) and
# starts a seeded episode with our time limit; returns the instruction.
_START_JS = """
([seed, maxTimeMs]) => {
  const style = document.createElement('style');
  style.textContent = '#reward-display, #click-canvas, #sync-task-cover { display: none !important; }';
  document.head.appendChild(style);
  Math.seedrandom(seed);  // a number, as in BrowserGym: seedrandom keys 5 and '5' differently
  core.EPISODE_MAX_TIME = maxTimeMs;
  core.startEpisodeReal();
  window.__longhorizonSeeded = true;
  return WOB_TASK_READY;
}
"""
_READY_JS = "() => WOB_TASK_READY"
_UTTERANCE_JS = "() => { const u = core.getUtterance(); return typeof u === 'string' ? u : JSON.stringify(u); }"
# Only the page this episode seeded may score it: any other page of the server (another task, or
# this one reloaded) is a fresh document without the mark, so the agent cannot win an easier task
# and be credited for this one.
_STATUS_JS = """
() => (window.__longhorizonSeeded === true && typeof WOB_DONE_GLOBAL !== 'undefined')
  ? {done: WOB_DONE_GLOBAL, raw: WOB_RAW_REWARD_GLOBAL, reason: WOB_REWARD_REASON}
  : {done: false, raw: 0, reason: 'not on the page this episode started'}
"""


def page_seed(seed: int) -> int:
    """The number a MiniWoB page is seeded with (`Math.seedrandom(n)`) for instance seed `seed`.

    BrowserGym's MiniWoB task makes `numpy.random.RandomState(seed)` and seeds the page with that
    generator's first `randint(0, 1_000_000)`; doing the same gives its problem for the same seed.
    The page must get it as a number: seedrandom turns a number into a different key than the
    string of its digits.
    """
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**32:
        raise ValueError(f"a MiniWoB seed must be an integer in [0, 2**32), got {seed!r}")
    return int(np.random.RandomState(seed).randint(0, PAGE_SEED_END))


def miniwob_html_dir() -> Path:
    """The html folder shipped by the miniwob package."""
    spec = importlib.util.find_spec("miniwob")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the miniwob env needs the MiniWoB++ pages: pip install miniwob==1.1.0")
    html = Path(list(spec.submodule_search_locations)[0]) / "html"
    if not (html / "miniwob").is_dir():
        raise RuntimeError(f"the miniwob package has no task pages under {html}")
    return html


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    # The task pages are UTF-8 without a <meta charset>: say so, or Chromium reads them as Latin-1.
    extensions_map = {
        **http.server.SimpleHTTPRequestHandler.extensions_map,
        ".html": "text/html; charset=utf-8",
        ".js": "text/javascript; charset=utf-8",
        ".css": "text/css; charset=utf-8",
    }

    def log_message(self, *args: Any) -> None:
        pass


class _Server(http.server.ThreadingHTTPServer):
    # The listen backlog. socketserver's default of 5 overflows when a few dozen episodes load
    # their pages at once (each page fetches several files): the kernel drops the connections
    # beyond it, TCP resends each after 1, 2, 4, 8 and 16 s, and page loads ran out their
    # 20 s (64 of 120 oracle episodes, 32 at a time on 2 busy cores, 2026-12-08).
    request_queue_size = 1024


class StaticServer:
    """A static file server on 127.0.0.1 in a daemon thread."""

    def __init__(self, directory: Path) -> None:
        handler = functools.partial(_QuietHandler, directory=str(directory))
        self._server = _Server(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_port}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="miniwob-static", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


_server: StaticServer | None = None
_server_lock = threading.Lock()


def shared_server() -> StaticServer:
    """One server per process: every env instance sees the same URLs, so observations replay exactly."""
    global _server
    with _server_lock:
        if _server is None:
            _server = StaticServer(miniwob_html_dir())
        return _server


ALL_TASK_NAMES = tuple(sorted((*TASK_NAMES, *VISUAL_TASKS)))
IMAGE_MODES = ("screenshot", "som")


def _check_options(task_names: Any, instances_per_task: Any, time_limit_s: Any, reward_mode: Any,
                   observation_modes: Sequence[str] = ("text",)) -> tuple[str, ...]:
    names = tuple(TASK_NAMES if task_names is None else task_names)
    unknown = [name for name in names if name not in ALL_TASK_NAMES]
    if unknown or not names:
        raise ValueError(f"unknown MiniWoB task(s) {unknown or '(none given)'}; valid: {', '.join(ALL_TASK_NAMES)}")
    visual = [name for name in names if name in VISUAL_TASKS]
    if visual and not any(mode in IMAGE_MODES for mode in observation_modes):
        raise ValueError(
            f"MiniWoB task(s) {', '.join(visual)} show their problem only in a picture "
            f"({VISUAL_TASKS[visual[0]]}); add \"screenshot\" or \"som\" to the env's observation_modes"
        )
    if not isinstance(instances_per_task, int) or isinstance(instances_per_task, bool) or instances_per_task < 1:
        raise ValueError(f"instances_per_task must be a positive integer, got {instances_per_task!r}")
    if not isinstance(time_limit_s, (int, float)) or time_limit_s <= 0:
        raise ValueError(f"time_limit_s must be a positive number of seconds, got {time_limit_s!r}")
    if reward_mode not in REWARD_MODES:
        raise ValueError(f"unknown reward_mode {reward_mode!r}; valid: {', '.join(REWARD_MODES)}")
    return names


def tasks(split: str, *, task_names: list[str] | None = None, instances_per_task: int = 10,
          time_limit_s: float = 600.0, reward_mode: str = "raw", observation_modes: Sequence[str] = ("text",),
          **_browser_options: Any) -> list[Task]:
    """instances_per_task seeded instances of every task type, ordered by type then seed."""
    names = _check_options(task_names, instances_per_task, time_limit_s, reward_mode, observation_modes)
    if split not in ("train", "test"):
        raise ValueError(f"unknown split {split!r} for env {ENV_NAME!r}; valid splits: train, test")
    base = 0 if split == "train" else TEST_SEED_BASE
    return [
        Task(env_name=ENV_NAME, task_id=f"{split}-{name}-{index}", split=split, category=name,
             data={"task": name, "seed": base + index})
        for name in names
        for index in range(instances_per_task)
    ]


class MiniWobEnv(BrowserEnv):
    """MiniWoB++ episodes; one at a time per instance, in a context of the process's browser pool."""

    def __init__(
        self,
        *,
        task_names: list[str] | None = None,
        instances_per_task: int = 10,
        time_limit_s: float = 600.0,
        reward_mode: str = "raw",
        num_browsers: int = 1,
        action_timeout_s: float = 5.0,
        navigation_timeout_s: float = 20.0,
        multiaction: bool = False,
        observation_modes: Sequence[str] = ("text",),
        screenshot_size: Sequence[int] = DEFAULT_SCREENSHOT_SIZE,
        pool: Any = None,
    ) -> None:
        _check_options(task_names, instances_per_task, time_limit_s, reward_mode, observation_modes)
        super().__init__(name=ENV_NAME, sites={}, pool=pool, num_browsers=num_browsers,
                         action_timeout_s=action_timeout_s, navigation_timeout_s=navigation_timeout_s,
                         multiaction=multiaction, observation_modes=observation_modes, screenshot_size=screenshot_size)
        self.time_limit_s = float(time_limit_s)
        self.reward_mode = reward_mode
        self._server = shared_server()

    def instructions(self) -> str:
        return super().instructions() + INSTRUCTIONS_EXTRA

    async def reset(self, task: Task, *, seed: int | None = None) -> tuple[str, dict]:
        data = task.data if isinstance(task.data, Mapping) else {}
        name = data.get("task")
        if name not in ALL_TASK_NAMES or not isinstance(data.get("seed"), int):
            raise ValueError(f"miniwob task {task.task_id!r} needs data {{'task': a MiniWoB task type, 'seed': int}}, got {dict(data)}")
        if name in VISUAL_TASKS and not self.observation_forms.visual:
            raise ValueError(f"miniwob task {name!r} shows its problem only in a picture ({VISUAL_TASKS[name]}); "
                             "add \"screenshot\" or \"som\" to the env's observation_modes")
        config = {"start_url": f"__MINIWOB__/miniwob/{name}.html", "sites": [], "page_seed": page_seed(data["seed"])}
        return await super().reset(Task(task.env_name, task.task_id, task.split, task.category, config), seed=seed)

    async def _prepare_sites(self, task: Task, config: Mapping[str, Any]) -> tuple[list[str], dict[str, str]]:
        return [self._server.url], {"__MINIWOB__": self._server.url}

    async def _on_loaded(self, episode: Episode, seed: int | None) -> None:
        episode.goal = await episode.session.call(
            _start_episode, episode.config["page_seed"], int(self.time_limit_s * 1000), timeout_s=20.0,
        )

    async def _after_action(self, session: BrowserSession, episode: Episode) -> tuple[float, bool, dict] | None:
        try:
            status = await session.page().evaluate(_STATUS_JS)
        except Exception:
            if not session.alive:
                raise
            return None  # the agent left the task page; the task cannot score until it returns
        if not status.get("done"):
            return None
        return self._outcome(status)

    async def _score(self, episode: Episode, answer: str) -> tuple[float, bool, dict]:
        status = await episode.session.call(_read_status, timeout_s=10.0)
        if not status.get("done"):
            status = {**status, "raw": 0.0, "reason": "stopped before the task scored itself"}
        return self._outcome(status)

    def _outcome(self, status: Mapping[str, Any]) -> tuple[float, bool, dict]:
        raw = float(status.get("raw") or 0.0)
        success = raw > 0
        reward = raw if self.reward_mode == "raw" else float(success)
        return reward, success, {"raw_reward": raw, "reward_reason": str(status.get("reason") or "")}


async def _start_episode(session: BrowserSession, seed: int, max_time_ms: int) -> str:
    """Asyncio side: seed and start the loaded task page; returns its instruction."""
    import asyncio

    page = session.page()
    ready = await page.evaluate(_START_JS, [seed, max_time_ms])
    for _ in range(100):  # a few tasks build their problem asynchronously
        if ready:
            break
        await asyncio.sleep(0.05)
        ready = await page.evaluate(_READY_JS)
    else:
        raise RuntimeError("the MiniWoB task page did not become ready within 5 s")
    utterance = await page.evaluate(_UTTERANCE_JS)
    try:
        parsed = json.loads(utterance)
        if isinstance(parsed, dict):
            utterance = str(parsed.get("utterance", utterance))
    except ValueError:
        pass
    return " ".join(str(utterance).split())


async def _read_status(session: BrowserSession) -> dict:
    return await session.page().evaluate(_STATUS_JS)


def _random_policy(**options: Any) -> RandomClickerPolicy:
    return RandomClickerPolicy()


def _oracle_policy(**options: Any) -> MiniWobOraclePolicy:
    return MiniWobOraclePolicy()


class MiniWobOptions(BrowserOptions):
    """miniwob: MiniWoB++ tasks in a real Chromium, seeded as BrowserGym seeds them."""

    task_names: list[str] | None = None
    """MiniWoB++ task types to play (e.g. ["click-button", "enter-text"]); none: every supported one."""
    instances_per_task: int = bounded(10, ge=1)
    """Seeds per task type and split."""
    time_limit_s: float = bounded(600.0, gt=0)
    """The task page's own episode timer, in seconds."""
    reward_mode: Literal["raw", "success"] = "raw"
    """`raw`: the page's own reward (1 correct, -1 wrong or out of time, partial credit on a few
    tasks); `success`: 1 on success, else 0."""


# The registry (envs/base.py) finds this env here by name.
SPEC = EnvSpec(
    name=ENV_NAME,
    factory=MiniWobEnv,
    tasks=tasks,
    policies={"oracle": _oracle_policy, "random": _random_policy},
    needs=("playwright", "miniwob"),
    extra="web",
    Options=MiniWobOptions,
)

ORACLE_TASKS = tuple(sorted(SOLVERS))
"""The task types MiniWobOraclePolicy solves."""
