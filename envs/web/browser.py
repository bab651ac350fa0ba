"""Chromium through Playwright for trio code: an asyncio thread, a pool of browsers, isolated sessions.

Playwright's async API runs on asyncio, the rest of longhorizon on trio. We keep Playwright on one
dedicated asyncio event loop in a daemon thread per process (common/asyncio_thread.py, owned by a
BrowserPool): trio awaits the pool's calls without holding a worker thread, and the process's
asyncio policy is left alone for anything else that uses asyncio (HTTP clients, vLLM's async
engine). Playwright objects never leave the asyncio thread: trio code holds handles and calls
coroutine functions through the pool.

A pool launches `num_browsers` Chromium processes lazily and gives every episode its own browser
context (separate cookies, storage and cache). Every request of a context is routed: anything whose
origin is not in the episode's allow-list is aborted, service workers are blocked and WebSockets to
other origins are closed, so agents cannot reach the internet. A browser that disconnects (crash,
kill) or stops answering (a call outlives its hang guard) is killed and relaunched on next use;
the episode that was using it gets BrowserFailure, which the rollout records as a failed episode.
Every call races the browser's "disconnected" event: Playwright does not always fail a pending
call when the browser dies (a `new_page` in flight when Chromium is SIGKILLed can wait for ever),
so the event, not the call, tells us the browser is gone, within a fraction of a second.

Process lifetime: nothing here ties Chromium to this process because Playwright already does.
Its node driver reads commands from a pipe of this process and exits when that pipe closes, and
Chromium, started with --remote-debugging-pipe, exits when its pipe from the driver closes (even
when the driver was SIGKILLed too). The kernel closes the pipes however a process ends, so after
a SIGKILL of this process the driver and every Chromium process are gone within seconds
(tests/test_orphans.py checks it).
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Iterable, TypeVar
from urllib.parse import urlsplit

import trio

from longhorizon.common.asyncio_thread import AsyncioThread

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_CHROMIUM = "/usr/bin/chromium"
# Flags that keep a headless Chromium quiet on a machine without GPU or network: no background
# downloads, no component updates, no sync, no first-run work.
CHROMIUM_ARGS = (
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-default-apps",
    "--disable-extensions",
    "--no-first-run",
    "--no-default-browser-check",
    "--metrics-recording-only",
    "--mute-audio",
)
# Schemes that load nothing from a network: always allowed.
LOCAL_SCHEMES = ("about", "data", "blob", "javascript")


class BrowserFailure(RuntimeError):
    """The browser crashed, was killed or hung; the episode using it is lost and reported failed."""


def origin_of(url: str) -> str:
    """"scheme://host:port" of an http(s)/ws(s) URL with the port made explicit, or "" if it has none."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return ""
    scheme = parts.scheme.lower()
    host = (parts.hostname or "").lower()
    if scheme not in ("http", "https", "ws", "wss") or not host:
        return ""
    if port is None:
        port = 443 if scheme in ("https", "wss") else 80
    if ":" in host:  # an IPv6 literal keeps its brackets in an origin
        host = f"[{host}]"
    # A WebSocket to an origin counts as that origin's http(s) traffic.
    scheme = {"ws": "http", "wss": "https"}.get(scheme, scheme)
    return f"{scheme}://{host}:{port}"


def normalize_origins(origins: Iterable[str]) -> frozenset[str]:
    """The allow-list in origin_of's form; raises ValueError for an entry that is not an http(s) origin."""
    normalized = set()
    for origin in origins:
        value = origin_of(origin)
        if not value:
            raise ValueError(f"not an http(s) origin: {origin!r} (expected e.g. 'http://127.0.0.1:8000')")
        normalized.add(value)
    return frozenset(normalized)


def is_allowed(url: str, allowed_origins: frozenset[str]) -> bool:
    """Whether the browser may load `url`: a local scheme, or an http(s) URL of an allowed origin."""
    scheme = url.split(":", 1)[0].lower()
    if scheme in LOCAL_SCHEMES:
        return True
    origin = origin_of(url)
    return bool(origin) and origin in allowed_origins


@dataclass(frozen=True)
class BrowserSettings:
    """How to launch Chromium and how long calls may take."""

    executable_path: str = DEFAULT_CHROMIUM
    """Playwright cannot download browsers here: we always drive the system's Chromium."""
    headless: bool = True
    launch_timeout_s: float = 30.0
    extra_args: tuple[str, ...] = ()
    viewport: tuple[int, int] = (1280, 720)


def _chromium_descendants() -> dict[int, int]:
    """pid -> parent pid of this process's Chromium descendants (Playwright's driver spawns them)."""
    import psutil

    found: dict[int, int] = {}
    try:
        children = psutil.Process(os.getpid()).children(recursive=True)
    except psutil.Error:
        return found
    for child in children:
        try:
            if "chrom" in child.name().lower():
                found[child.pid] = child.ppid()
        except psutil.Error:
            continue
    return found


@dataclass
class _BrowserSlot:
    """One Chromium process of the pool (launched lazily, replaced when it dies)."""

    index: int
    browser: Any = None
    pid: int | None = None
    generation: int = 0
    """Counts launches: a session remembers the generation it was opened in."""
    live_sessions: int = 0
    connected: bool = False
    disconnected: asyncio.Event | None = None
    """Set when this generation's browser disconnects or is discarded; calls race it."""

    def usable(self) -> bool:
        return self.browser is not None and self.connected and self.browser.is_connected()


@dataclass
class PoolStats:
    launches: int = 0
    relaunches: int = 0
    sessions_opened: int = 0
    failures: list[str] = field(default_factory=list)


class BrowserPool:
    """A few Chromium processes shared by the env instances of one process (one actor).

    Every episode gets a BrowserSession: its own context on the least loaded browser. All
    Playwright work happens on the pool's asyncio thread; trio code awaits `pool.run(...)`.
    """

    def __init__(self, num_browsers: int = 1, settings: BrowserSettings | None = None) -> None:
        if not isinstance(num_browsers, int) or num_browsers < 1:
            raise ValueError(f"num_browsers must be a positive integer, got {num_browsers!r}")
        self.settings = settings or BrowserSettings()
        self.num_browsers = num_browsers
        self.stats = PoolStats()
        self._thread: AsyncioThread | None = None
        self._playwright: Any = None
        self._slots = [_BrowserSlot(index) for index in range(num_browsers)]
        self._launch_lock: asyncio.Lock | None = None
        self._closed = False
        self._start_lock = threading.Lock()

    # -- the asyncio side -------------------------------------------------------------------

    def _ensure_thread(self) -> AsyncioThread:
        with self._start_lock:
            if self._closed:
                raise RuntimeError("this BrowserPool has been closed")
            if self._thread is None or not self._thread.running:
                self._thread = AsyncioThread("playwright-asyncio")
            return self._thread

    async def _ensure_playwright(self) -> Any:
        if self._playwright is None:
            try:
                from playwright.async_api import async_playwright
            except ImportError as error:
                raise RuntimeError(
                    "the web envs need Playwright: pip install playwright (browsers are not downloaded; "
                    f"install Chromium with apt-get install chromium): {error}"
                ) from error
            self._playwright = await async_playwright().start()
        return self._playwright

    async def _launch(self, slot: _BrowserSlot) -> None:
        if self._launch_lock is None:  # created on the loop's thread, where it is used
            self._launch_lock = asyncio.Lock()
        # One launch at a time: concurrent first sessions must not start two Playwright drivers,
        # and a new browser process is told apart from the others by what appeared during launch.
        async with self._launch_lock:
            playwright = await self._ensure_playwright()
            if slot.usable():
                return
            if slot.browser is not None:
                await self._discard(slot)
            if slot.generation > 0:
                self.stats.relaunches += 1
            if not os.path.exists(self.settings.executable_path):
                raise RuntimeError(
                    f"Chromium not found at {self.settings.executable_path}: "
                    "install it with `apt-get install -y chromium` (Playwright's own download is not used)"
                )
            before = _chromium_descendants()
            browser = await playwright.chromium.launch(
                executable_path=self.settings.executable_path,
                headless=self.settings.headless,
                args=[*CHROMIUM_ARGS, *self.settings.extra_args],
                timeout=self.settings.launch_timeout_s * 1000,
            )
            after = _chromium_descendants()
            new = {pid: parent for pid, parent in after.items() if pid not in before}
            # The browser's main process is the new Chromium whose parent is not Chromium (it is
            # Playwright's driver); renderers that other browsers start meanwhile have a Chromium parent.
            roots = [pid for pid, parent in new.items() if parent not in after]
            slot.browser = browser
            slot.pid = roots[0] if len(roots) == 1 else None
            slot.generation += 1
            slot.connected = True
            slot.disconnected = asyncio.Event()
            generation, disconnected = slot.generation, slot.disconnected

            def on_disconnected(_browser: Any, slot: _BrowserSlot = slot, generation: int = generation) -> None:
                disconnected.set()
                if slot.generation == generation:
                    slot.connected = False
                    self.stats.failures.append(f"browser {slot.index} disconnected")

            browser.on("disconnected", on_disconnected)
            self.stats.launches += 1

    async def _discard(self, slot: _BrowserSlot) -> None:
        """Kill a slot's browser process (it may already be dead) and forget it."""
        browser, pid = slot.browser, slot.pid
        slot.browser, slot.pid, slot.connected = None, None, False
        if slot.disconnected is not None:
            slot.disconnected.set()  # calls still waiting on this browser give up now
        if pid is not None:
            _kill_process_tree(pid)
        if browser is not None:
            try:
                await asyncio.wait_for(browser.close(), 5)
            except Exception:
                pass

    async def _open(self, allowed_origins: frozenset[str], options: "SessionOptions") -> "BrowserSession":
        # The least loaded browser (one that is up on a tie: a launch costs a second), launched
        # or relaunched first if needed; reserving it at once spreads sessions opened together.
        slot = min(self._slots, key=lambda candidate: (candidate.live_sessions, not candidate.usable()))
        slot.live_sessions += 1
        try:
            if not slot.usable():
                await self._launch(slot)
            generation, disconnected = slot.generation, slot.disconnected
            assert disconnected is not None
            try:
                session = await _unless_set(disconnected, BrowserSession.open(self, slot, allowed_origins, options), 30)
            except asyncio.TimeoutError:
                await self._recover(slot, generation, "opening a browser context took over 30 s")
                raise BrowserFailure(f"browser {slot.index} did not open a context within 30 s and was relaunched") from None
            except _EventSet:
                raise BrowserFailure(f"browser {slot.index} died while opening a context") from None
            except Exception as error:
                # Opening a context on a live browser does not fail; an error is the browser
                # dying, even when Playwright reports it before its "disconnected" event.
                if await _set_within(disconnected, DEATH_NOTICE_S):
                    raise BrowserFailure(
                        f"browser {slot.index} died while opening a context ({type(error).__name__}: {_first_line(error)})"
                    ) from error
                raise BrowserFailure(f"browser {slot.index} could not open a context: {_first_line(error)}") from error
        except BaseException:
            slot.live_sessions = max(0, slot.live_sessions - 1)
            raise
        self.stats.sessions_opened += 1
        return session

    async def _recover(self, slot: _BrowserSlot, generation: int, reason: str) -> None:
        """After a hang or crash: kill the browser so the next session gets a fresh one."""
        if slot.generation != generation or slot.browser is None:
            return  # already replaced
        log.warning("browser %d is being relaunched: %s", slot.index, reason)
        self.stats.failures.append(reason)
        await self._discard(slot)

    async def _shutdown(self) -> None:
        for slot in self._slots:
            if slot.browser is not None:
                try:
                    await asyncio.wait_for(slot.browser.close(), 10)
                except Exception:
                    if slot.pid is not None:
                        _kill_process_tree(slot.pid)
                slot.browser, slot.connected = None, False
        if self._playwright is not None:
            try:
                await asyncio.wait_for(self._playwright.stop(), 10)
            except Exception:
                pass
            self._playwright = None

    # -- the trio side ------------------------------------------------------------------------

    async def run(self, function: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Await `function(*args)` (a coroutine function using Playwright) on the pool's loop."""
        return await self._ensure_thread().call(function(*args))

    def run_blocking(self, function: Callable[..., Awaitable[T]], *args: Any, timeout: float | None = None) -> T:
        """The same from a plain thread (benchmarks, scripts)."""
        return self._ensure_thread().call_blocking(function(*args), timeout)

    async def open_session(self, allowed_origins: Iterable[str], options: "SessionOptions | None" = None) -> "BrowserSession":
        """A new isolated context that may only load from `allowed_origins`, with one blank tab."""
        return await self.run(self._open, normalize_origins(allowed_origins), options or SessionOptions())

    async def launch(self) -> None:
        """Start every browser now (otherwise each starts with its first session)."""

        async def launch_all() -> None:
            for slot in self._slots:
                if not slot.usable():
                    await self._launch(slot)

        await self.run(launch_all)

    def browser_pids(self) -> list[int]:
        """Process ids of the live browsers (for tests that kill one and for memory figures)."""
        return [slot.pid for slot in self._slots if slot.pid is not None and slot.connected]

    def close(self) -> None:
        """Close every browser and stop the asyncio thread (idempotent; blocking)."""
        with self._start_lock:
            thread, self._thread = self._thread, None
            self._closed = True
        if thread is None or not thread.running:
            return
        try:
            thread.call_blocking(self._shutdown(), timeout=30)
        except Exception as error:
            log.warning("closing the browser pool failed: %r", error)
            for slot in self._slots:
                if slot.pid is not None:
                    _kill_process_tree(slot.pid)
        thread.stop()

    async def aclose(self) -> None:
        await trio.to_thread.run_sync(self.close)


DEATH_NOTICE_S = 2.0
"""After a failed call, how long to wait for the "disconnected" event that tells a dead browser
from a page-level error (it comes within about 100 ms of the browser's death)."""


class _EventSet(Exception):
    """Raised by _unless_set when the event it watched was set first."""


async def _unless_set(event: asyncio.Event, coroutine: Awaitable[T], timeout: float) -> T:
    """Await `coroutine`, but raise _EventSet as soon as `event` is set and asyncio.TimeoutError
    after `timeout` seconds; the coroutine is cancelled in both cases."""
    work = asyncio.ensure_future(coroutine)
    watcher = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait({work, watcher}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work.done():
            work.cancel()
            # Retrieved so that a call that fails while being cancelled is not logged as unhandled.
            work.add_done_callback(lambda task: task.cancelled() or task.exception())
    if work.done():
        return work.result()  # a result (or error) that came together with the event still counts
    if event.is_set():
        raise _EventSet()
    raise asyncio.TimeoutError()


async def _set_within(event: asyncio.Event, timeout: float) -> bool:
    """Whether `event` is set now or becomes set within `timeout` seconds."""
    if event.is_set():
        return True
    try:
        await asyncio.wait_for(event.wait(), timeout)
    except asyncio.TimeoutError:
        return False
    return True


def _kill_process_tree(pid: int) -> None:
    import psutil

    try:
        process = psutil.Process(pid)
        victims = [process, *process.children(recursive=True)]
    except psutil.Error:
        return
    for victim in victims:
        try:
            victim.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(victims, timeout=5)


@dataclass(frozen=True)
class SessionOptions:
    """Per-episode browser settings."""

    action_timeout_s: float = 5.0
    """Playwright's timeout for one element action (click, fill, ...)."""
    navigation_timeout_s: float = 20.0
    hang_grace_s: float = 15.0
    """A call that outlives its own timeout by this much means the browser hangs: it is relaunched."""
    storage_state: str | None = None
    """A Playwright storage-state JSON file (login cookies) to start the context with."""


class BrowserSession:
    """One episode's isolated context and its tabs. Its methods run on the pool's asyncio thread."""

    def __init__(self, pool: BrowserPool, slot: _BrowserSlot, context: Any, allowed_origins: frozenset[str],
                 options: SessionOptions) -> None:
        self.pool = pool
        self.slot = slot
        self.generation = slot.generation
        assert slot.disconnected is not None
        self.disconnected = slot.disconnected
        """The event of the browser this session lives on (not of a later relaunch)."""
        self.context = context
        self.allowed_origins = allowed_origins
        self.options = options
        self.pages: list[Any] = []
        self.active = 0
        self.blocked_requests: list[str] = []
        self._cdp: dict[int, Any] = {}
        self.closed = False
        self.dialogs: list[str] = []
        """Messages of alert/confirm/prompt dialogs not yet shown to the agent."""

    @classmethod
    async def open(cls, pool: BrowserPool, slot: _BrowserSlot, allowed_origins: frozenset[str],
                   options: SessionOptions) -> "BrowserSession":
        width, height = pool.settings.viewport
        context = await slot.browser.new_context(
            viewport={"width": width, "height": height},
            service_workers="block",  # a service worker's fetches would bypass routing
            storage_state=options.storage_state,
            accept_downloads=False,
        )
        session = cls(pool, slot, context, allowed_origins, options)
        context.set_default_timeout(options.action_timeout_s * 1000)
        context.set_default_navigation_timeout(options.navigation_timeout_s * 1000)
        await context.route("**/*", session._route)
        await context.route_web_socket("**/*", session._route_web_socket)
        context.on("page", session._on_page)
        await context.new_page()  # _on_page records it
        return session

    # Routing runs for every request of every tab: unknown origins never reach the network.
    async def _route(self, route: Any) -> None:
        url = route.request.url
        if is_allowed(url, self.allowed_origins):
            await route.fallback()
        else:
            if len(self.blocked_requests) < 1000:
                self.blocked_requests.append(url)
            await route.abort("blockedbyclient")

    async def _route_web_socket(self, socket: Any) -> None:
        if is_allowed(socket.url, self.allowed_origins):
            socket.connect_to_server()
        else:
            if len(self.blocked_requests) < 1000:
                self.blocked_requests.append(socket.url)
            await socket.close(code=1008, reason="blocked")

    def _on_page(self, page: Any) -> None:
        # A new tab (ours, or one a link opened) becomes the active one, as in BrowserGym.
        if page not in self.pages:
            self.pages.append(page)
            self.active = len(self.pages) - 1
            page.on("dialog", self._on_dialog)

    async def _on_dialog(self, dialog: Any) -> None:
        # A dialog blocks its page until answered. We accept it (a web app's "Really delete?" must
        # be confirmable) and tell the agent in the next observation.
        self.dialogs.append(f"{dialog.type} {dialog.message!r} (accepted)")
        try:
            await dialog.accept()
        except Exception:
            pass

    # -- helpers for the observation and the actions ---------------------------------------------

    @property
    def alive(self) -> bool:
        return not self.closed and self.slot.generation == self.generation and self.slot.usable()

    def page(self) -> Any:
        """The active tab; a closed tab is dropped (the previous one becomes active)."""
        self.pages = [page for page in self.pages if not page.is_closed()]
        if not self.pages:
            raise RuntimeError("no open tab")
        self.active = min(self.active, len(self.pages) - 1)
        return self.pages[self.active]

    async def ensure_page(self) -> Any:
        self.pages = [page for page in self.pages if not page.is_closed()]
        if not self.pages:
            await self.context.new_page()
        return self.page()

    async def cdp(self, page: Any) -> Any:
        key = id(page)
        session = self._cdp.get(key)
        if session is None:
            session = await self.context.new_cdp_session(page)
            self._cdp[key] = session
            page.on("close", lambda _page, key=key: self._cdp.pop(key, None))
        return session

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.slot.live_sessions = max(0, self.slot.live_sessions - 1)  # opened once, closed once
        try:
            await asyncio.wait_for(self.context.close(), 10)
        except Exception:
            pass

    # -- the trio side ------------------------------------------------------------------------------

    async def call(self, function: Callable[..., Awaitable[T]], *args: Any, timeout_s: float) -> T:
        """Run `function(self, *args)` on the asyncio thread, guarded against a hung or dead browser.

        Raises BrowserFailure (and has the browser relaunched) when the browser is gone or the call
        outlives timeout_s + hang_grace_s; other exceptions pass through unchanged.
        """
        if not self.alive:
            raise BrowserFailure(self._death_reason())
        guard = timeout_s + self.options.hang_grace_s

        async def guarded() -> T:
            try:
                return await _unless_set(self.disconnected, function(self, *args), guard)
            except asyncio.TimeoutError:
                await self._recover_from_hang(guard)
                raise BrowserFailure(f"the page did not answer within {guard:.0f} s; the episode's context was closed") from None
            except _EventSet:
                raise BrowserFailure(self._death_reason()) from None
            except Exception as error:
                # Playwright may report the browser's death (as an error of the page or context)
                # before its "disconnected" event arrives: give the event a moment to decide.
                if not self.alive or await _set_within(self.disconnected, DEATH_NOTICE_S):
                    raise BrowserFailure(f"{self._death_reason()} ({type(error).__name__}: {_first_line(error)})") from error
                raise

        return await self.pool.run(guarded)

    async def _recover_from_hang(self, waited_s: float) -> None:
        """A call outlived its guard: drop this episode's context; relaunch the browser only if it
        does not answer either (a page stuck in a script loop must not cost other episodes theirs)."""
        self.closed = True
        self.slot.live_sessions = max(0, self.slot.live_sessions - 1)
        try:
            await asyncio.wait_for(self.context.close(), 5)
            probe = await asyncio.wait_for(self.slot.browser.new_context(), 5)
            await asyncio.wait_for(probe.close(), 5)
        except Exception:
            await self.pool._recover(self.slot, self.generation, f"the browser hung (a call waited {waited_s:.0f} s)")

    async def aclose(self) -> None:
        """Close the context; never raises (the browser may be dead)."""
        if self.closed:
            return
        try:
            with trio.move_on_after(15):
                await self.pool.run(self.close)
        except Exception:
            self.closed = True

    def _death_reason(self) -> str:
        if self.closed:
            return "the browser session is closed"
        if self.slot.generation != self.generation:
            return "the browser was relaunched during the episode"
        return "the browser crashed or was killed during the episode"


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


_shared_pools: dict[tuple, BrowserPool] = {}
_shared_lock = threading.Lock()


def shared_pool(num_browsers: int = 1, executable_path: str = DEFAULT_CHROMIUM, headless: bool = True) -> BrowserPool:
    """The process's pool for these settings: env instances of one actor share its browsers.

    Closed at interpreter exit; a pool that was closed explicitly is replaced on next request.
    """
    key = (num_browsers, executable_path, headless)
    with _shared_lock:
        pool = _shared_pools.get(key)
        if pool is None or pool._closed:
            pool = BrowserPool(num_browsers, BrowserSettings(executable_path=executable_path, headless=headless))
            _shared_pools[key] = pool
        return pool


@atexit.register
def _close_shared_pools() -> None:
    with _shared_lock:
        pools = list(_shared_pools.values())
        _shared_pools.clear()
    for pool in pools:
        start = time.monotonic()
        pool.close()
        log.debug("closed a browser pool in %.1f s", time.monotonic() - start)
