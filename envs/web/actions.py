"""BrowserGym's high-level actions: parse `click('12')`-like text safely, then execute it on a session.

The text is parsed with Python's `ast` as function calls whose arguments are literals (never
evaluated as code). The names, argument orders and defaults are BrowserGym's, so a prompt written
for its action set works here: element actions by id (`click('12')`), coordinate actions in CSS
pixels of the viewport (`mouse_click(120, 48)`), keyboard actions with Playwright key names and
combinations (`keyboard_press('Control+a')`), navigation and tabs. Anything else raises ActionError,
whose message the env shows the agent as the observation's Error line.

One step is one action (`parse_action`), or, in multi-action mode, one or more actions one per line
(`parse_actions`), run in order until the first that fails.
"""

from __future__ import annotations

import ast
import asyncio
import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping
from urllib.parse import urljoin

from longhorizon.envs.tools import EnvTool, object_schema
from longhorizon.envs.web.browser import is_allowed
from longhorizon.envs.web.observation import BID_ATTRIBUTE, descendant_frames


class ActionError(ValueError):
    """An action that cannot be parsed or executed; the message becomes the observation's Error line."""


_REQUIRED = object()


@dataclass(frozen=True)
class Param:
    """One argument of an action."""

    name: str
    types: tuple[type, ...]
    default: Any = _REQUIRED
    choices: tuple[str, ...] = ()
    """The values allowed (for a list, for each of its items); empty: any value of the types."""

    @property
    def required(self) -> bool:
        return self.default is _REQUIRED


@dataclass(frozen=True)
class ActionSpec:
    params: tuple[Param, ...]
    """The arguments in BrowserGym's order; the required ones come first."""
    help: str
    """`example: what it does`, one line of the instructions."""


_NUMBER = (int, float)
BUTTONS = ("left", "middle", "right")
MODIFIERS = ("Alt", "Control", "ControlOrMeta", "Meta", "Shift")


def _bid(name: str = "bid") -> Param:
    return Param(name, (str, int))


def _coordinate(name: str) -> Param:
    return Param(name, _NUMBER)


_BUTTON = Param("button", (str,), "left", BUTTONS)
_MODIFIERS = Param("modifiers", (list,), (), MODIFIERS)
_XY = (_coordinate("x"), _coordinate("y"))

ACTION_SPECS: dict[str, ActionSpec] = {
    # Elements, by the ids of the observation.
    "click": ActionSpec((_bid(), _BUTTON, _MODIFIERS),
                        "click('12'): click element 12 (also click('12', button='right', modifiers=['Shift']))"),
    "dblclick": ActionSpec((_bid(), _BUTTON, _MODIFIERS), "dblclick('12'): double-click element 12"),
    "hover": ActionSpec((_bid(),), "hover('12'): move the mouse over element 12"),
    "focus": ActionSpec((_bid(),), "focus('12'): focus element 12"),
    "clear": ActionSpec((_bid(),), "clear('12'): empty text field 12"),
    "fill": ActionSpec((_bid(), Param("value", (str,)), Param("enable_autocomplete_menu", (bool,), False)),
                       "fill('12', 'text'): type text into field 12, replacing its content"),
    "select_option": ActionSpec((_bid(), Param("options", (str, list))),
                                "select_option('12', 'value'): choose an option (by its text or value) in list 12"),
    "press": ActionSpec((_bid(), Param("key_comb", (str,))), "press('12', 'Enter'): press a key (or 'Control+a') in element 12"),
    "drag_and_drop": ActionSpec((_bid("from_bid"), _bid("to_bid")),
                                "drag_and_drop('12', '15'): drag element 12 and drop it on element 15"),
    "scroll": ActionSpec((_coordinate("delta_x"), _coordinate("delta_y")),
                         "scroll(0, 300): scroll by pixels (right, down; negative for left, up) where the mouse is"),
    # The mouse, at coordinates: CSS pixels from the viewport's top left corner.
    "mouse_move": ActionSpec(_XY, "mouse_move(120, 48): move the mouse to x=120, y=48"),
    "mouse_click": ActionSpec((*_XY, _BUTTON), "mouse_click(120, 48): click at x=120, y=48 (button='right' for another button)"),
    "mouse_dblclick": ActionSpec((*_XY, _BUTTON), "mouse_dblclick(120, 48): double-click at x=120, y=48"),
    "mouse_down": ActionSpec((*_XY, _BUTTON), "mouse_down(120, 48): move to x=120, y=48 and press the mouse button"),
    "mouse_up": ActionSpec((*_XY, _BUTTON), "mouse_up(120, 48): move to x=120, y=48 and release the mouse button"),
    "mouse_drag_and_drop": ActionSpec(
        (_coordinate("from_x"), _coordinate("from_y"), _coordinate("to_x"), _coordinate("to_y")),
        "mouse_drag_and_drop(10, 20, 200, 40): drag from x=10, y=20 and drop at x=200, y=40",
    ),
    "scroll_at": ActionSpec((*_XY, _coordinate("dx"), _coordinate("dy")),
                            "scroll_at(120, 48, 0, 300): scroll by pixels with the mouse at x=120, y=48"),
    # The keyboard, on the focused element.
    "keyboard_press": ActionSpec((Param("key", (str,)),),
                                 "keyboard_press('Enter'): press a key or a combination ('Control+a', 'Shift+ArrowLeft')"),
    "keyboard_down": ActionSpec((Param("key", (str,)),), "keyboard_down('Shift'): press and hold a key"),
    "keyboard_up": ActionSpec((Param("key", (str,)),), "keyboard_up('Shift'): release a held key"),
    "keyboard_type": ActionSpec((Param("text", (str,)),), "keyboard_type('text'): type text, key by key"),
    "keyboard_insert_text": ActionSpec((Param("text", (str,)),),
                                       "keyboard_insert_text('text'): insert text at the cursor without key events"),
    # Navigation and tabs.
    "goto": ActionSpec((Param("url", (str,)),), "goto('url'): open a URL in the current tab"),
    "go_back": ActionSpec((), "go_back(): the previous page"),
    "go_forward": ActionSpec((), "go_forward(): the next page"),
    "new_tab": ActionSpec((), "new_tab(): open an empty tab and switch to it"),
    "tab_focus": ActionSpec((Param("index", (int,)),), "tab_focus(1): switch to tab 1"),
    "tab_close": ActionSpec((), "tab_close(): close the current tab"),
    "noop": ActionSpec((Param("wait_ms", _NUMBER, 500),), "noop(): do nothing (wait a moment and look again)"),
    # Ending the episode.
    "send_msg_to_user": ActionSpec((Param("text", (str,)),), "send_msg_to_user('answer'): give your answer and finish"),
    "stop": ActionSpec((Param("answer", (str,), ""),), "stop('answer'): finish (with an answer if the task asks for one)"),
}
TERMINAL_ACTIONS = frozenset({"send_msg_to_user", "stop"})
MAX_ACTIONS_PER_STEP = 20
"""Multi-action mode: more actions in one reply is an error (BrowserGym advises two or three)."""
NOOP_MAX_MS = 5000.0
_BID = re.compile(r"[a-z]*[0-9]+")  # a frame's letters, then the element's number
_OPENS_TAB_JS = """(element) => {
  const link = element.closest('a[href], area[href]');
  return !!link && !!link.target && !['_self', '_parent', '_top'].includes(link.target.toLowerCase());
}"""
_FENCE = re.compile(r"^```[a-zA-Z]*\s*|\s*```$")


@dataclass(frozen=True)
class Action:
    name: str
    arguments: Mapping[str, Any]
    """The arguments the text gave, by parameter name, in the action's parameter order."""

    @property
    def spec(self) -> ActionSpec:
        return ACTION_SPECS[self.name]

    @property
    def args(self) -> tuple[Any, ...]:
        """The given arguments' values, in parameter order."""
        return tuple(self.arguments.values())

    def value(self, param: str) -> Any:
        """An argument's value: the given one, else its default."""
        if param in self.arguments:
            return self.arguments[param]
        return next(spec.default for spec in self.spec.params if spec.name == param)

    @property
    def terminal(self) -> bool:
        return self.name in TERMINAL_ACTIONS

    @property
    def answer(self) -> str:
        """The text a terminal action hands the user ("" for stop())."""
        return str(self.args[0]) if self.terminal and self.args else ""

    def __str__(self) -> str:
        # Positional while no argument is skipped, by keyword after a skipped one, so that the
        # text parses back into the same arguments.
        parts, skipped = [], False
        for param in self.spec.params:
            if param.name not in self.arguments:
                skipped = True
                continue
            value = repr(self.arguments[param.name])
            parts.append(f"{param.name}={value}" if skipped else value)
        return f"{self.name}({', '.join(parts)})"


def _json_schema(param: Param) -> dict:
    """A parameter's JSON schema: an element id is a string, a number an int or float."""
    if param.types == (list,):
        item = {"type": "string", **({"enum": list(param.choices)} if param.choices else {})}
        return {"type": "array", "items": item}
    if str in param.types:
        return {"type": "string", **({"enum": list(param.choices)} if param.choices else {})}
    if param.types == (bool,):
        return {"type": "boolean"}
    return {"type": "integer"} if param.types == (int,) else {"type": "number"}


def action_tools() -> tuple[EnvTool, ...]:
    """Every action as a tool of the same name and parameters; a call becomes the action's text
    (`click('12')`), parsed and run as a typed action is."""

    def text_of(name: str) -> Callable[[dict], str]:
        def action(arguments: dict) -> str:
            given = {param.name: arguments[param.name] for param in ACTION_SPECS[name].params if param.name in arguments}
            return str(Action(name, given))
        return action

    def arguments_of(name: str) -> Callable[[str], dict | None]:
        def read(text: str) -> dict | None:
            try:
                parsed = parse_action(text)
            except ActionError:
                return None
            return dict(parsed.arguments) if parsed.name == name else None
        return read

    tools = []
    for name, spec in ACTION_SPECS.items():
        properties = {param.name: _json_schema(param) for param in spec.params}
        required = [param.name for param in spec.params if param.required]
        description = spec.help.split(": ", 1)[-1]
        tools.append(EnvTool(name, description[:1].upper() + description[1:] + ".",
                             object_schema(properties, required), text_of(name), arguments_of(name)))
    return tuple(tools)


def action_help() -> str:
    """One line per action, for the instructions."""
    return "\n".join(f"- {spec.help}" for spec in ACTION_SPECS.values())


def _source_of(text: Any) -> str:
    if not isinstance(text, str):
        raise ActionError("the action must be text such as click('12')")
    source = _FENCE.sub("", text.strip()).strip()
    if not source:
        raise ActionError("empty action: write one action such as click('12')")
    return source


def parse_action(text: str) -> Action:
    """One action from its text; raises ActionError with a message meant for the agent."""
    source = _source_of(text)
    try:
        tree = ast.parse(source, mode="eval")
    except SyntaxError:
        raise ActionError(f"could not parse {source[:120]!r}: write one call such as click('12') or fill('3', 'text')") from None
    return _action_of(tree.body, source)


def parse_actions(text: str) -> list[Action]:
    """One or more actions, one per line (BrowserGym's multi-action replies); raises ActionError
    naming the line of the first one that is wrong."""
    source = _source_of(text)
    try:
        tree = ast.parse(source, mode="exec")
    except SyntaxError as error:
        line = source.splitlines()[error.lineno - 1] if error.lineno and error.lineno <= len(source.splitlines()) else source
        raise ActionError(f"could not parse line {error.lineno} {line.strip()[:120]!r}: write one call per line "
                          "such as click('12') or fill('3', 'text')") from None
    if not tree.body:
        raise ActionError("empty action: write one action such as click('12')")
    if len(tree.body) > MAX_ACTIONS_PER_STEP:
        raise ActionError(f"{len(tree.body)} actions in one step; at most {MAX_ACTIONS_PER_STEP} are run")
    actions = []
    for statement in tree.body:
        text_of_statement = ast.get_source_segment(source, statement) or ""
        try:
            if not isinstance(statement, ast.Expr):
                raise ActionError(f"{text_of_statement[:120]!r} is not an action call; write e.g. click('12')")
            actions.append(_action_of(statement.value, text_of_statement))
        except ActionError as error:
            raise ActionError(f"line {statement.lineno}: {error}") from None
    return actions


def _action_of(call: ast.expr, source: str) -> Action:
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
        raise ActionError(f"{name}: arguments must be plain strings, numbers or lists ({spec.help})") from None
    if None in keywords:
        raise ActionError(f"{name}: **arguments are not allowed ({spec.help})")
    names = [param.name for param in spec.params]
    if len(positional) > len(names):
        raise ActionError(f"{name} takes at most {len(names)} argument(s), got {len(positional)} ({spec.help})")
    values: dict[str, Any] = dict(zip(names, positional))
    for key, value in keywords.items():
        if key not in names:
            raise ActionError(f"{name} has no argument {key!r} ({spec.help})")
        if key in values:
            raise ActionError(f"{name}: argument {key!r} given twice ({spec.help})")
        values[key] = value
    arguments = {}
    for param in spec.params:
        if param.name not in values:
            if param.required:
                raise ActionError(f"{name} needs the argument {param.name!r} ({spec.help})")
            continue
        arguments[param.name] = _checked(name, spec, param, values[param.name])
    return Action(name, arguments)


def _checked(name: str, spec: ActionSpec, param: Param, value: Any) -> Any:
    """The argument's value as the executor takes it; ActionError when it does not fit."""
    if (isinstance(value, bool) and bool not in param.types) or not isinstance(value, param.types):
        raise ActionError(f"{name}: {param.name} has the wrong type {type(value).__name__} ({spec.help})")
    if param.types == (str, int) and param.name.endswith("bid"):
        value = str(value).strip()
        if not _BID.fullmatch(value):
            raise ActionError(f"{name}: {value!r} is not an element id; ids are what the observation shows in [brackets]")
    if isinstance(value, list) and not all(isinstance(item, str) for item in value):
        raise ActionError(f"{name}: {param.name} must be a string or a list of strings")
    if param.choices:
        for item in value if isinstance(value, list) else [value]:
            if item not in param.choices:
                raise ActionError(f"{name}: {param.name} {item!r} is not one of {', '.join(map(repr, param.choices))}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ActionError(f"{name}: {param.name} must be a finite number")
    return value


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    # Playwright appends a call log after the first line; the agent only needs the reason.
    line = text.splitlines()[0] if text else type(error).__name__
    return line.removeprefix("Locator.").removeprefix("Page.")


async def _element(page: Any, bid: str) -> Any:
    # An id that begins with letters is in a frame (observation.py): looked for in the tab's frames.
    frames = [page.main_frame] if bid[0].isdigit() else descendant_frames(page)
    for frame in frames:
        locator = frame.locator(f'[{BID_ATTRIBUTE}="{bid}"]')
        try:
            if await locator.count():
                return locator.first
        except Exception:  # a frame that went away meanwhile holds nothing
            continue
    raise ActionError(f"no element with id {bid} on this page (use an id from the latest observation)")


def _point(page: Any, action: Action, x: float, y: float) -> tuple[float, float]:
    """The point, checked to lie in the viewport: the mouse cannot reach what is outside it."""
    size = page.viewport_size or {}
    width, height = size.get("width"), size.get("height")
    if width and height and not (0 <= x < width and 0 <= y < height):
        raise ActionError(f"{action} failed: ({x:g}, {y:g}) is outside the page's viewport, "
                          f"which is {width}x{height} (x from 0 to {width - 1}, y from 0 to {height - 1})")
    return float(x), float(y)


async def execute(session: Any, action: Action, *, resolve_url: Callable[[str], str] = lambda url: url,
                  settle_ms: int = 50) -> None:
    """Run a non-terminal action on the session's active tab (asyncio thread).

    Raises ActionError for anything the agent did wrong (missing element, point outside the page,
    unknown key, timeout, blocked URL); other exceptions mean the browser itself failed.
    """
    from playwright.async_api import Error as PlaywrightError

    page = await session.ensure_page()
    name, value = action.name, action.value
    try:
        if name in ("click", "dblclick", "hover", "focus", "clear", "fill", "select_option", "press"):
            element = await _element(page, value("bid"))
            if name == "click":
                options = {"button": value("button"), "modifiers": list(value("modifiers"))}
                if await element.evaluate(_OPENS_TAB_JS):
                    # A link into a new tab: wait for the tab, so the observation shows it.
                    async with session.context.expect_page(timeout=session.options.navigation_timeout_s * 1000):
                        await element.click(**options)
                else:
                    await element.click(**options)
            elif name == "dblclick":
                await element.dblclick(button=value("button"), modifiers=list(value("modifiers")))
            elif name == "hover":
                await element.hover()
            elif name == "focus":
                await element.focus()
            elif name == "clear":
                await element.clear()
            elif name == "fill":
                text = value("value")
                if value("enable_autocomplete_menu") and text:
                    # The last character typed as a key, so that an autocomplete menu opens.
                    await element.fill(text[:-1])
                    await element.press_sequentially(text[-1])
                else:
                    await element.fill(text)
            elif name == "select_option":
                await element.select_option(value("options"))
            else:
                await element.press(value("key_comb"))
        elif name == "drag_and_drop":
            source, target = await _element(page, value("from_bid")), await _element(page, value("to_bid"))
            await source.hover()
            await page.mouse.down()
            await target.hover()
            await page.mouse.up()
        elif name == "scroll":
            await page.mouse.wheel(float(value("delta_x")), float(value("delta_y")))
        elif name == "scroll_at":
            await page.mouse.move(*_point(page, action, value("x"), value("y")))
            await page.mouse.wheel(float(value("dx")), float(value("dy")))
        elif name == "mouse_move":
            await page.mouse.move(*_point(page, action, value("x"), value("y")))
        elif name == "mouse_click":
            await page.mouse.click(*_point(page, action, value("x"), value("y")), button=value("button"))
        elif name == "mouse_dblclick":
            await page.mouse.dblclick(*_point(page, action, value("x"), value("y")), button=value("button"))
        elif name in ("mouse_down", "mouse_up"):
            await page.mouse.move(*_point(page, action, value("x"), value("y")))
            if name == "mouse_down":
                await page.mouse.down(button=value("button"))
            else:
                await page.mouse.up(button=value("button"))
        elif name == "mouse_drag_and_drop":
            start = _point(page, action, value("from_x"), value("from_y"))
            end = _point(page, action, value("to_x"), value("to_y"))
            await page.mouse.move(*start)
            await page.mouse.down()
            # Several moves on the way, as a hand makes: drag code that follows mousemove (or an
            # HTML drag) needs more than one event to notice the drag.
            await page.mouse.move(*end, steps=5)
            await page.mouse.up()
        elif name == "keyboard_press":
            await page.keyboard.press(value("key"))
        elif name == "keyboard_down":
            await page.keyboard.down(value("key"))
        elif name == "keyboard_up":
            await page.keyboard.up(value("key"))
        elif name == "keyboard_type":
            await page.keyboard.type(value("text"))
        elif name == "keyboard_insert_text":
            await page.keyboard.insert_text(value("text"))
        elif name == "goto":
            url = urljoin(page.url, resolve_url(value("url")))
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
            index = value("index")
            session.pages = [tab for tab in session.pages if not tab.is_closed()]
            if not 0 <= index < len(session.pages):
                raise ActionError(f"there is no tab {index}; open tabs are 0 to {len(session.pages) - 1}")
            session.active = index
            await session.pages[index].bring_to_front()
        elif name == "tab_close":
            await page.close()
            await session.ensure_page()
        elif name == "noop":
            await page.wait_for_timeout(min(float(value("wait_ms")), NOOP_MAX_MS))
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
