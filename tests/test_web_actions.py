"""BrowserGym's action space in the web env: every action's arguments and errors, the tools made
from them, multi-action steps, and each action doing what it says on a page made for the test."""

from __future__ import annotations

import re
import urllib.parse

import pytest

from longhorizon.envs.agents import ActionParseError
from longhorizon.envs.base import Task, get_env_spec
from longhorizon.envs.tool_calls import ToolCall
from longhorizon.envs.tools import call_for_action
from longhorizon.envs.web.actions import (
    ACTION_SPECS,
    MAX_ACTIONS_PER_STEP,
    ActionError,
    action_tools,
    parse_action,
    parse_actions,
)
from longhorizon.envs.web.browser import BrowserPool
from longhorizon.envs.web.env import BrowserEnv, MultiActionReactLoop
from longhorizon.envs.web.policies import find_bid

# -- parsing, without a browser ----------------------------------------------------------------------

# Each action as BrowserGym's prompts write it, and the arguments it carries.
WRITTEN = [
    ("click('12')", "click", {"bid": "12"}),
    ("click('12', 'right', ['Shift', 'Control'])", "click", {"bid": "12", "button": "right", "modifiers": ["Shift", "Control"]}),
    ("dblclick('12', button='middle')", "dblclick", {"bid": "12", "button": "middle"}),
    ("hover(7)", "hover", {"bid": "7"}),
    ("focus('7')", "focus", {"bid": "7"}),
    ("clear('7')", "clear", {"bid": "7"}),
    ("fill('45', 'multi-line\\nexample')", "fill", {"bid": "45", "value": "multi-line\nexample"}),
    ("fill('45', 'Montre', True)", "fill", {"bid": "45", "value": "Montre", "enable_autocomplete_menu": True}),
    ("select_option('48', ['red', 'blue'])", "select_option", {"bid": "48", "options": ["red", "blue"]}),
    ("press('88', 'ControlOrMeta+a')", "press", {"bid": "88", "key_comb": "ControlOrMeta+a"}),
    ("drag_and_drop('56', '498')", "drag_and_drop", {"from_bid": "56", "to_bid": "498"}),
    ("scroll(-50.2, -100.5)", "scroll", {"delta_x": -50.2, "delta_y": -100.5}),
    ("mouse_move(65.2, 158.5)", "mouse_move", {"x": 65.2, "y": 158.5}),
    ("mouse_click(887.2, 68)", "mouse_click", {"x": 887.2, "y": 68}),
    ("mouse_click(56, 712.56, 'right')", "mouse_click", {"x": 56, "y": 712.56, "button": "right"}),
    ("mouse_dblclick(x=5, y=236, button='left')", "mouse_dblclick", {"x": 5, "y": 236, "button": "left"}),
    ("mouse_down(458, 254.5, 'middle')", "mouse_down", {"x": 458, "y": 254.5, "button": "middle"}),
    ("mouse_up(250, 120)", "mouse_up", {"x": 250, "y": 120}),
    ("mouse_drag_and_drop(10.7, 325, 235.6, 24.54)", "mouse_drag_and_drop",
     {"from_x": 10.7, "from_y": 325, "to_x": 235.6, "to_y": 24.54}),
    ("scroll_at(50, 100, -50, -100)", "scroll_at", {"x": 50, "y": 100, "dx": -50, "dy": -100}),
    ("keyboard_press('Meta+Shift+t')", "keyboard_press", {"key": "Meta+Shift+t"}),
    ("keyboard_down('Shift')", "keyboard_down", {"key": "Shift"}),
    ("keyboard_up(key='c')", "keyboard_up", {"key": "c"}),
    ("keyboard_type('Hello world!')", "keyboard_type", {"text": "Hello world!"}),
    ("keyboard_insert_text('Hello world!')", "keyboard_insert_text", {"text": "Hello world!"}),
    ("goto('http://www.example.com')", "goto", {"url": "http://www.example.com"}),
    ("go_back()", "go_back", {}),
    ("go_forward()", "go_forward", {}),
    ("new_tab()", "new_tab", {}),
    ("tab_focus(2)", "tab_focus", {"index": 2}),
    ("tab_close()", "tab_close", {}),
    ("noop(500)", "noop", {"wait_ms": 500}),
    ("send_msg_to_user('The city was built in 1751.')", "send_msg_to_user", {"text": "The city was built in 1751."}),
    ("stop()", "stop", {}),
]


def test_every_action_parses_with_browsergyms_names_and_argument_orders():
    assert {name for _, name, _ in WRITTEN} == set(ACTION_SPECS)
    for text, name, arguments in WRITTEN:
        action = parse_action(text)
        assert (action.name, dict(action.arguments)) == (name, arguments), text
        # Its text form parses back into the same action.
        assert parse_action(str(action)) == action, str(action)


def test_skipped_optional_arguments_take_their_defaults_and_print_by_keyword():
    action = parse_action("click('3', modifiers=['Shift'])")
    assert action.value("button") == "left" and action.value("modifiers") == ["Shift"]
    assert str(action) == "click('3', modifiers=['Shift'])"
    assert parse_action("mouse_click(1, 2)").value("button") == "left"
    assert parse_action("noop()").value("wait_ms") == 500
    assert parse_action("fill('1', 'x')").value("enable_autocomplete_menu") is False


@pytest.mark.parametrize("text, message", [
    ("mouse_click(10)", "mouse_click needs the argument 'y'"),
    ("mouse_click('10', 20)", "mouse_click: x has the wrong type str"),
    ("mouse_click(10, 20, 'top')", "button 'top' is not one of 'left', 'middle', 'right'"),
    ("mouse_click(10, 20, 'left', 1)", "mouse_click takes at most 3 argument(s), got 4"),
    ("mouse_click(10, 20, side='left')", "mouse_click has no argument 'side'"),
    ("mouse_click(10, y=20, x=5)", "argument 'x' given twice"),
    ("mouse_move(True, 3)", "x has the wrong type bool"),
    ("mouse_move(1e999, 3)", "x must be a finite number"),
    ("mouse_drag_and_drop(1, 2, 3)", "needs the argument 'to_y'"),
    ("mouse_down(1, 2, button=None)", "button has the wrong type NoneType"),
    ("scroll_at(1, 2, 3)", "scroll_at needs the argument 'dy'"),
    ("click('4', modifiers=['Hyper'])", "modifiers 'Hyper' is not one of 'Alt', 'Control', 'ControlOrMeta', 'Meta', 'Shift'"),
    ("click('4', modifiers='Shift')", "modifiers has the wrong type str"),
    ("click('4', modifiers=[1])", "modifiers must be a string or a list of strings"),
    ("drag_and_drop('1a', '2')", "'1a' is not an element id"),
    ("fill('1', 'x', 'yes')", "enable_autocomplete_menu has the wrong type str"),
    ("keyboard_press()", "keyboard_press needs the argument 'key'"),
    ("keyboard_press(13)", "key has the wrong type int"),
    ("keyboard_down(['Shift'])", "key has the wrong type list"),
    ("keyboard_type(text=x)", "arguments must be plain strings, numbers or lists"),
    ("tab_focus(1.5)", "index has the wrong type float"),
    ("mouse_clik(1, 2)", "unknown action 'mouse_clik'"),
    ("mouse_click(1, 2)\nmouse_click(3, 4)", "could not parse"),
])
def test_bad_arguments_are_errors_that_say_what_is_wrong(text, message):
    with pytest.raises(ActionError, match=re.escape(message)):
        parse_action(text)


def test_several_actions_one_per_line_parse_in_order():
    actions = parse_actions("```python\n# select all, then type\nmouse_click(10, 20)\n\n"
                            "keyboard_press('Control+a'); keyboard_type('new')\nfill('3',\n  'a')\n```")
    assert [str(action) for action in actions] == [
        "mouse_click(10, 20)", "keyboard_press('Control+a')", "keyboard_type('new')", "fill('3', 'a')"]
    assert [str(action) for action in parse_actions("click('1')")] == ["click('1')"]
    for text, message in [
        ("click('1')\nclik('2')", "line 2: unknown action 'clik'"),
        ("click('1')\nclick('2'", "could not parse line 2 \"click('2'\""),
        ("click('1')\nx = 3", "line 2: 'x = 3' is not an action call"),
        ("click('1')\nmouse_click(1)", "line 2: mouse_click needs the argument 'y'"),
        ("# only a comment", "empty action"),
        ("noop()\n" * (MAX_ACTIONS_PER_STEP + 1), f"at most {MAX_ACTIONS_PER_STEP} are run"),
    ]:
        with pytest.raises(ActionError, match=re.escape(message)):
            parse_actions(text)


def _sample(schema: dict, name: str, index: int):
    if schema["type"] == "array":
        return list(schema["items"].get("enum", ["a", "b"]))[:2]
    if "enum" in schema:
        return schema["enum"][-1]
    return {"string": str(index + 3), "integer": index + 1, "number": 10.5 + index, "boolean": True}[schema["type"]]


def test_every_tool_call_makes_an_action_that_reads_back_as_the_same_call():
    """For every tool: all arguments, only the required ones, and a later optional one without an
    earlier one (which the action writes by keyword)."""
    tools = action_tools()
    assert [tool.name for tool in tools] == list(ACTION_SPECS)
    calls = []
    for tool in tools:
        properties, required = tool.parameters["properties"], tool.parameters["required"]
        full = {name: _sample(schema, name, index) for index, (name, schema) in enumerate(properties.items())}
        calls += [ToolCall(tool.name, full), ToolCall(tool.name, {name: full[name] for name in required})]
        optional = [name for name in properties if name not in required]
        if len(optional) > 1:
            calls.append(ToolCall(tool.name, {**{name: full[name] for name in required}, optional[-1]: full[optional[-1]]}))
    tool_set = get_env_spec("weblocal").factory().tool_set()
    for call in calls:
        action = tool_set.action_for(call)
        parse_action(action)
        assert call_for_action(tool_set, action) == call, action
    click = tool_set.tool("click").schema()["function"]["parameters"]
    assert click["properties"]["button"] == {"type": "string", "enum": ["left", "middle", "right"]}
    assert click["properties"]["modifiers"]["items"]["enum"] == ["Alt", "Control", "ControlOrMeta", "Meta", "Shift"]
    assert tool_set.tool("mouse_click").parameters["required"] == ["x", "y"]


def test_the_multiaction_option_changes_the_instructions_and_the_reply_format():
    single, multi = BrowserEnv(name="webtest"), BrowserEnv(name="webtest", multiaction=True)
    assert "one per turn" in single.instructions() and "one or several" not in single.instructions()
    assert "one or several per turn, one per line" in multi.instructions()
    for env in (single, multi):
        assert all(f"- {spec.help}" in env.instructions() for spec in ACTION_SPECS.values())
    assert single.prompt_format == "react" and multi.prompt_format.endswith(":MultiActionReactLoop")
    assert get_env_spec("weblocal").factory(multiaction=True).multiaction
    with pytest.raises(ValueError, match="multiaction must be true or false"):
        BrowserEnv(name="webtest", multiaction="yes")

    loop = MultiActionReactLoop()
    reply = "Thought:\nSelect all, then type.\n\nAction:\n```python\nmouse_click(10, 20)\nkeyboard_press('Control+a')\n```\n"
    assert loop.parse_action(reply) == "mouse_click(10, 20)\nkeyboard_press('Control+a')"
    assert loop.parse_action("Action: click('1')") == "click('1')"
    with pytest.raises(ActionParseError, match="no action found"):
        loop.parse_action("Thought: nothing to do")


# -- in a real Chromium ------------------------------------------------------------------------------

# Elements at fixed places (viewport 1280x720): each event the test looks for is written into a
# paragraph that the observation's tree shows.
PAGE = """<!doctype html><html><head><title>Actions</title><style>
body { margin: 0; height: 3000px; }
#target { position: fixed; left: 100px; top: 100px; width: 80px; height: 40px; }
#other { position: fixed; left: 300px; top: 100px; width: 80px; height: 40px; }
#box { position: fixed; left: 100px; top: 300px; width: 50px; height: 50px; background: red; }
#field { position: fixed; left: 500px; top: 100px; width: 200px; height: 30px; }
p { position: fixed; left: 800px; margin: 0; }
</style></head><body>
<button id="target">Target</button><button id="other">Other</button>
<div id="box" role="button" aria-label="Box"></div>
<input id="field" aria-label="Field" value="old text">
<p id="log" style="top: 10px">log:</p><p id="value" style="top: 40px">value: old text</p>
<p id="place" style="top: 70px">box at 100,300</p><p id="scrolled" style="top: 100px">scrolled 0</p>
<script>
const log = document.getElementById('log');
const note = (text) => { log.textContent += ' ' + text; };
for (const id of ['target', 'other']) {
  const button = document.getElementById(id);
  for (const kind of ['click', 'dblclick', 'contextmenu', 'mouseover', 'mousedown', 'mouseup']) {
    button.addEventListener(kind, (event) => {
      if (kind === 'contextmenu') event.preventDefault();
      note(kind + (event.shiftKey ? '+shift' : '') + ' ' + id + (event.button ? ' button' + event.button : ''));
    });
  }
}
const field = document.getElementById('field');
field.addEventListener('input', () => { document.getElementById('value').textContent = 'value: ' + field.value; });
// Dragging the way page scripts (jQuery UI, MiniWoB) do it: follow mousemove while the button is down.
const box = document.getElementById('box');
let grab = null;
box.addEventListener('mousedown', (event) => { grab = [event.clientX - box.offsetLeft, event.clientY - box.offsetTop]; });
document.addEventListener('mousemove', (event) => {
  if (grab) { box.style.left = (event.clientX - grab[0]) + 'px'; box.style.top = (event.clientY - grab[1]) + 'px'; }
});
document.addEventListener('mouseup', () => {
  if (grab) { grab = null; document.getElementById('place').textContent = 'box at ' + box.offsetLeft + ',' + box.offsetTop; }
});
window.addEventListener('scroll', () => { document.getElementById('scrolled').textContent = 'scrolled ' + Math.round(window.scrollY); });
</script></body></html>"""


def _text(observation: str, prefix: str) -> str:
    """The text of the paragraph that starts with `prefix`, as the tree shows it."""
    found = re.search(r"StaticText '(" + re.escape(prefix) + r"[^']*)'", observation)
    assert found, f"no {prefix!r} in:\n{observation}"
    return found.group(1)


def _task() -> Task:
    url = "data:text/html," + urllib.parse.quote(PAGE)
    return Task(env_name="webtest", task_id="actions", split="train",
                data={"sites": [], "intent": "Try every action.", "start_url": url})


@pytest.fixture(scope="module")
def pool():
    browser_pool = BrowserPool(1)
    yield browser_pool
    browser_pool.close()


@pytest.mark.browser
async def test_coordinate_and_keyboard_actions_do_what_they_say(pool):
    env = BrowserEnv(name="webtest", pool=pool)

    async def step(action: str) -> str:
        observation, reward, terminated, truncated, info = await env.step(action)
        assert not info["invalid_action"] and not terminated, observation
        assert "Error:" not in observation
        return observation

    try:
        observation, _ = await env.reset(_task())
        assert _text(observation, "log:") == "log:"
        # A click at a point hits the element there, and only that one.
        assert _text(await step("mouse_click(140, 120)"), "log:") == "log: mouseover target mousedown target mouseup target click target"
        assert _text(await step("mouse_click(340, 120, 'right')"), "log:").endswith(
            "mouseover other mousedown other button2 contextmenu other button2 mouseup other button2")
        assert _text(await step("mouse_dblclick(x=340, y=120)"), "log:").endswith(
            "mouseup other click other mousedown other mouseup other click other dblclick other")
        assert _text(await step("mouse_move(150, 110)"), "log:").endswith("dblclick other mouseover target")
        assert _text(await step("mouse_down(150, 110)"), "log:").endswith("mouseover target mousedown target")
        assert _text(await step("mouse_up(350, 110)"), "log:").endswith("mousedown target mouseover other mouseup other")
        # The element actions take BrowserGym's button and modifiers too.
        target = find_bid(observation, "button", "Target")
        assert _text(await step(f"click({target!r}, modifiers=['Shift'])"), "log:").endswith("click+shift target")
        other = find_bid(observation, "button", "Other")
        assert _text(await step(f"dblclick({other!r}, modifiers=['Shift'])"), "log:").endswith("dblclick+shift other")

        # Dragging: by coordinates, by element ids, and by its three parts.
        assert _text(await step("mouse_drag_and_drop(125, 325, 425, 425)"), "box at") == "box at 400,400"
        box = find_bid(observation, "button", "Box")
        # The box's middle (425, 425) goes onto Other's middle (340, 120).
        assert _text(await step(f"drag_and_drop({box!r}, {other!r})"), "box at") == "box at 315,95"
        await step("mouse_down(340, 120)")
        await step("mouse_move(640, 420)")
        assert _text(await step("mouse_up(640, 420)"), "box at") == "box at 615,395"

        # Keys: Control+a selects the field's text, typing replaces it; Shift held types capitals.
        await step("mouse_click(600, 115)")
        assert _text(await step("keyboard_press('Control+a')"), "value:") == "value: old text"
        assert _text(await step("keyboard_type('new')"), "value:") == "value: new"
        await step("keyboard_down('Shift')")
        await step("keyboard_press('KeyA')")
        await step("keyboard_up('Shift')")
        assert _text(await step("keyboard_press('b')"), "value:") == "value: newAb"
        assert _text(await step("keyboard_insert_text(' + more')"), "value:") == "value: newAb + more"
        assert _text(await step("keyboard_press('Backspace')"), "value:") == "value: newAb + mor"
        field = find_bid(observation, "textbox", "Field")
        assert _text(await step(f"fill({field!r}, 'typed last', True)"), "value:") == "value: typed last"

        # Scrolling moves the page, where the mouse is or at a point.
        assert _text(await step("scroll(0, 300)"), "scrolled") == "scrolled 300"
        assert _text(await step("scroll_at(640, 360, 0, -100)"), "scrolled") == "scrolled 200"
    finally:
        await env.close()


@pytest.mark.browser
async def test_a_wrong_action_is_the_observations_error_never_an_exception(pool):
    env = BrowserEnv(name="webtest", pool=pool)
    try:
        await env.reset(_task())
        for action, message in [
            ("mouse_click(1280, 10)", "mouse_click(1280, 10) failed: (1280, 10) is outside the page's viewport, "
                                      "which is 1280x720 (x from 0 to 1279, y from 0 to 719)"),
            ("mouse_drag_and_drop(10, 10, 10, -5)", "(10, -5) is outside the page's viewport"),
            ("keyboard_press('Contrl+a')", "keyboard_press('Contrl+a') failed: Keyboard.press: Unknown key: \"Contrl\""),
            ("keyboard_down('NoSuchKey')", "Unknown key: \"NoSuchKey\""),
            ("drag_and_drop('99999', '1')", "no element with id 99999"),
            ("mouse_click(10, 'a')", "mouse_click: y has the wrong type str"),
        ]:
            observation, reward, terminated, truncated, info = await env.step(action)
            assert info["invalid_action"] and (reward, terminated, truncated) == (0.0, False, False), action
            error_line = next(line for line in observation.splitlines() if line.startswith("Error: "))
            assert message in error_line, observation
        observation, *_, info = await env.step("mouse_click(140, 120)")
        assert not info["invalid_action"] and "Error:" not in observation
        assert _text(observation, "log:").endswith("click target")
    finally:
        await env.close()


@pytest.mark.browser
async def test_several_actions_in_one_step_run_in_order_and_stop_at_the_first_error(pool):
    env = BrowserEnv(name="webtest", pool=pool, multiaction=True)
    try:
        await env.reset(_task())
        observation, _, terminated, _, info = await env.step(
            "mouse_click(600, 115)\nkeyboard_press('Control+a')\nkeyboard_type('multi')")
        assert not info["invalid_action"] and not terminated
        assert _text(observation, "value:") == "value: multi"

        observation, _, terminated, _, info = await env.step(
            "keyboard_type('X')\nclick('99999')\nkeyboard_type('Y')\nkeyboard_type('Z')")
        assert info["invalid_action"] and not terminated
        assert _text(observation, "value:") == "value: multiX"  # the actions after the error did not run
        assert ("\nError: action 2 of 4: no element with id 99999 on this page (use an id from the latest "
                "observation) (2 actions after it not run)\n") in observation

        # A line that does not parse runs nothing; nor does an episode end before its last line.
        for text, message in [("keyboard_type('Q')\nkeyboard_type('R'", "could not parse line 2"),
                              ("stop('early')\nkeyboard_type('Q')", "action 1 of 2: stop ends the episode")]:
            observation, _, terminated, _, info = await env.step(text)
            assert info["invalid_action"] and not terminated and message in observation
            assert _text(observation, "value:") == "value: multiX"

        # Actions before the episode's end run first; a failing one keeps the episode going.
        observation, _, terminated, _, info = await env.step("mouse_click(5000, 5)\nstop('done')")
        assert info["invalid_action"] and not terminated
        assert "Error: action 1 of 2: mouse_click(5000, 5) failed" in observation and "(1 action after it not run)" in observation
        observation, reward, terminated, _, info = await env.step("keyboard_type('!')\nsend_msg_to_user('done')")
        assert terminated and info["answer"] == "done" and not info["invalid_action"]
    finally:
        await env.close()


@pytest.mark.browser
async def test_one_action_a_step_refuses_several_as_before(pool):
    env = BrowserEnv(name="webtest", pool=pool)
    try:
        await env.reset(_task())
        observation, _, _, _, info = await env.step("mouse_click(600, 115)\nkeyboard_type('x')")
        assert info["invalid_action"] and "Error: could not parse" in observation
        assert _text(observation, "value:") == "value: old text"
    finally:
        await env.close()
