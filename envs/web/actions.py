"""BrowserGym-style browser actions: parse `click('12')`-like text safely, then execute it on a session.

The text is parsed with Python's `ast` as one function call whose arguments are literals (never
evaluated as code). Anything else raises ActionError, whose message the env shows the agent.
"""

from __future__ import annotations

import ast
import asyncio
import re
from dataclasses import dataclass
from typing import Any, Callable
from urllib.parse import urljoin

from longhorizon.envs.tools import EnvTool, object_schema
from longhorizon.envs.web.browser import is_allowed
from longhorizon.envs.web.observation import BID_ATTRIBUTE


class ActionError(ValueError):
    """An action that cannot be parsed or executed; the message becomes the observation's Error line."""


@dataclass(frozen=True)
class ActionSpec:
    params: tuple[tuple[str, type | tuple[type, ...]], ...]
    """(name, accepted types) of each parameter, in order."""
    required: int
    """How many leading parameters must be given."""
    help: str


_NUMBER = (int, float)
ACTION_SPECS: dict[str, ActionSpec] = {
    "click": ActionSpec((("bid", (str, int)),), 1, "click('12'): click element 12"),
    "dblclick": ActionSpec((("bid", (str, int)),), 1, "dblclick('12'): double-click element 12"),
    "hover": ActionSpec((("bid", (str, int)),), 1, "hover('12'): move the mouse over element 12"),
    "focus": ActionSpec((("bid", (str, int)),), 1, "focus('12'): focus element 12"),
    "clear": ActionSpec((("bid", (str, int)),), 1, "clear('12'): empty text field 12"),
    "fill": ActionSpec((("bid", (str, int)), ("value", str)), 2, "fill('12', 'text'): type text into field 12, replacing its content"),
    "select_option": ActionSpec(
        (("bid", (str, int)), ("options", (str, list))), 2,
        "select_option('12', 'value'): choose an option (by its text or value) in list 12",
    ),
    "press": ActionSpec((("bid", (str, int)), ("key_comb", str)), 2, "press('12', 'Enter'): press a key (or 'Control+a') in element 12"),
    "keyboard_press": ActionSpec((("key", str),), 1, "keyboard_press('Enter'): press a key on the focused element"),
    "keyboard_type": ActionSpec((("text", str),), 1, "keyboard_type('text'): type text into the focused element"),
    "scroll": ActionSpec((("delta_x", _NUMBER), ("delta_y", _NUMBER)), 2, "scroll(0, 300): scroll the page by pixels (right, down)"),
    "goto": ActionSpec((("url", str),), 1, "goto('url'): open a URL in the current tab"),
    "go_back": ActionSpec((), 0, "go_back(): the previous page"),
    "go_forward": ActionSpec((), 0, "go_forward(): the next page"),
    "new_tab": ActionSpec((), 0, "new_tab(): open an empty tab and switch to it"),
    "tab_focus": ActionSpec((("index", int),), 1, "tab_focus(1): switch to tab 1"),
    "tab_close": ActionSpec((), 0, "tab_close(): close the current tab"),
    "noop": ActionSpec((("wait_ms", _NUMBER),), 0, "noop(): do nothing (wait a moment and look again)"),
    "send_msg_to_user": ActionSpec((("text", str),), 1, "send_msg_to_user('answer'): give your answer and finish"),
    "stop": ActionSpec((("answer", str),), 0, "stop('answer'): finish (with an answer if the task asks for one)"),
}
TERMINAL_ACTIONS = frozenset({"send_msg_to_user", "stop"})
_BID = re.compile(r"[0-9]+")
_OPENS_TAB_JS = """(element) => {
  const link = element.closest('a[href], area[href]');
  return !!link && !!link.target && !['_self', '_parent', '_top'].includes(link.target.toLowerCase());
}"""
_FENCE = re.compile(r"^```[a-zA-Z]*\s*|\s*```$")


@dataclass(frozen=True)
class Action:
    name: str
    args: tuple[Any, ...]

    @property
    def terminal(self) -> bool:
        return self.name in TERMINAL_ACTIONS

    @property
    def answer(self) -> str:
        """The text a terminal action hands the user ("" for stop())."""
        return str(self.args[0]) if self.terminal and self.args else ""

    def __str__(self) -> str:
        return f"{self.name}({', '.join(repr(arg) for arg in self.args)})"


def _json_schema(types: type | tuple[type, ...]) -> dict:
    """A parameter's JSON type: an element id is a string, a number an int or float."""
    accepted = types if isinstance(types, tuple) else (types,)
    if str in accepted:
        return {"type": "string"}
    return {"type": "integer"} if accepted == (int,) else {"type": "number"}


def action_tools() -> tuple[EnvTool, ...]:
    """Every action as a tool of the same name and parameters; a call becomes the action's text
    (`click('12')`), parsed and run as a typed action is."""

    def text_of(name: str, spec: ActionSpec) -> Callable[[dict], str]:
        def action(arguments: dict) -> str:
            given = [arguments[param] for param, _ in spec.params if param in arguments]
            return f"{name}({', '.join(repr(value) for value in given)})"
        return action

    def arguments_of(name: str, spec: ActionSpec) -> Callable[[str], dict | None]:
        def read(text: str) -> dict | None:
            try:
                parsed = parse_action(text)
            except ActionError:
                return None
            return dict(zip((param for param, _ in spec.params), parsed.args)) if parsed.name == name else None
        return read

    tools = []
    for name, spec in ACTION_SPECS.items():
        properties = {param: _json_schema(types) for param, types in spec.params}
        required = [param for param, _ in spec.params[:spec.required]]
        description = spec.help.split(": ", 1)[-1]
        tools.append(EnvTool(name, description[:1].upper() + description[1:] + ".",
                             object_schema(properties, required), text_of(name, spec), arguments_of(name, spec)))
    return tuple(tools)


def action_help() -> str:
    """One line per action, for the instructions."""
    return "\n".join(f"- {spec.help}" for spec in ACTION_SPECS.values())


def parse_action(text: str) -> Action:
    """One action from its text; raises ActionError with a message meant for the agent."""
    if not isinstance(text, str):
        raise ActionError("the action must be text such as click('12')")
    source = _FENCE.sub("", text.strip()).strip()
    if not source:
        raise ActionError("empty action: write one action such as click('12')")
    try:
        tree = ast.parse(source, mode="eval")
    except SyntaxError:
        raise ActionError(f"could not parse {source[:120]!r}: write one call such as click('12') or fill('3', 'text')") from None
    call = tree.body
    if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name):
        raise ActionError(f"{source[:120]!r} is not an action call; write e.g. click('12')")
    name = call.func.id
    spec = ACTION_SPECS.get(name)
    if spec is None:
        raise ActionError(f"unknown action {name!r}; valid actions: {', '.join(ACTION_SPECS)}")
    try:
        positional = [ast.literal_eval(argument) for argument in call.args]
        keywords = {keyword.arg: ast.literal_eval(keyword.value) for keyword in call.keywords}
    except (ValueError, SyntaxError, TypeError):
        raise ActionError(f"{name}: arguments must be plain strings or numbers ({spec.help})") from None
    if None in keywords:
        raise ActionError(f"{name}: **arguments are not allowed ({spec.help})")
    names = [param for param, _ in spec.params]
    if len(positional) > len(names):
        raise ActionError(f"{name} takes at most {len(names)} argument(s), got {len(positional)} ({spec.help})")
    values: dict[str, Any] = dict(zip(names, positional))
    for key, value in keywords.items():
        if key not in names:
            raise ActionError(f"{name} has no argument {key!r} ({spec.help})")
        if key in values:
            raise ActionError(f"{name}: argument {key!r} given twice ({spec.help})")
        values[key] = value
    args = []
    for index, (param, types) in enumerate(spec.params):
        if param not in values:
            if index < spec.required:
                raise ActionError(f"{name} needs the argument {param!r} ({spec.help})")
            break
        value = values[param]
        if isinstance(value, bool) or not isinstance(value, types):
            raise ActionError(f"{name}: {param} has the wrong type {type(value).__name__} ({spec.help})")
        if param == "bid":
            value = str(value).strip()
            if not _BID.fullmatch(value):
                raise ActionError(f"{name}: {value!r} is not an element id; ids are the numbers in [brackets]")
        if param == "options" and isinstance(value, list) and not all(isinstance(item, str) for item in value):
            raise ActionError(f"{name}: options must be a string or a list of strings")
        args.append(value)
    return Action(name, tuple(args))


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    # Playwright appends a call log after the first line; the agent only needs the reason.
    line = text.splitlines()[0] if text else type(error).__name__
    return line.removeprefix("Locator.").removeprefix("Page.")


async def _element(page: Any, bid: str) -> Any:
    locator = page.locator(f'[{BID_ATTRIBUTE}="{bid}"]')
    if await locator.count() == 0:
        raise ActionError(f"no element with id {bid} on this page (use an id from the latest observation)")
    return locator.first


async def execute(session: Any, action: Action, *, resolve_url: Callable[[str], str] = lambda url: url,
                  settle_ms: int = 50) -> None:
    """Run a non-terminal action on the session's active tab (asyncio thread).

    Raises ActionError for anything the agent did wrong (missing element, timeout, blocked URL);
    other exceptions mean the browser itself failed.
    """
    from playwright.async_api import Error as PlaywrightError

    page = await session.ensure_page()
    name, args = action.name, action.args
    try:
        if name in ("click", "dblclick", "hover", "focus", "clear", "fill", "select_option", "press"):
            element = await _element(page, args[0])
            if name == "click":
                if await element.evaluate(_OPENS_TAB_JS):
                    # A link into a new tab: wait for the tab, so the observation shows it.
                    async with session.context.expect_page(timeout=session.options.navigation_timeout_s * 1000):
                        await element.click()
                else:
                    await element.click()
            elif name == "dblclick":
                await element.dblclick()
            elif name == "hover":
                await element.hover()
            elif name == "focus":
                await element.focus()
            elif name == "clear":
                await element.clear()
            elif name == "fill":
                await element.fill(args[1])
            elif name == "select_option":
                await element.select_option(args[1])
            else:
                await element.press(args[1])
        elif name == "keyboard_press":
            await page.keyboard.press(args[0])
        elif name == "keyboard_type":
            await page.keyboard.type(args[0])
        elif name == "scroll":
            await page.mouse.wheel(float(args[0]), float(args[1]))
        elif name == "goto":
            url = urljoin(page.url, resolve_url(args[0]))
            if not is_allowed(url, session.allowed_origins) or url.split(":", 1)[0].lower() == "javascript":
                raise ActionError(f"{action} failed: this URL is outside the sites of the task and was blocked")
            await page.goto(url, wait_until="domcontentloaded")
        elif name == "go_back":
            await page.go_back(wait_until="domcontentloaded")
        elif name == "go_forward":
            await page.go_forward(wait_until="domcontentloaded")
        elif name == "new_tab":
            await session.context.new_page()
        elif name == "tab_focus":
            index = args[0]
            session.pages = [tab for tab in session.pages if not tab.is_closed()]
            if not 0 <= index < len(session.pages):
                raise ActionError(f"there is no tab {index}; open tabs are 0 to {len(session.pages) - 1}")
            session.active = index
            await session.pages[index].bring_to_front()
        elif name == "tab_close":
            await page.close()
            await session.ensure_page()
        elif name == "noop":
            await page.wait_for_timeout(min(float(args[0]) if args else 500.0, 5000.0))
        else:
            raise ActionError(f"{name} cannot be executed here")
    except ActionError:
        raise
    except PlaywrightError as error:
        if not session.alive:
            raise
        message = _first_line(error)
        if "ERR_BLOCKED_BY_CLIENT" in message:
            message = "this URL is outside the sites of the task and was blocked"
        raise ActionError(f"{action} failed: {message}") from None
    # Let what the action triggered (a script, a navigation, a new tab) settle before the page is
    # read: first a short pause, in which a tab opened by the action gets announced and becomes
    # the active one, then the active tab's document must be parsed.
    try:
        if settle_ms:
            await asyncio.sleep(settle_ms / 1000)
        page = await session.ensure_page()
        await page.wait_for_load_state("domcontentloaded", timeout=session.options.navigation_timeout_s * 1000)
    except PlaywrightError:
        if not session.alive:
            raise
