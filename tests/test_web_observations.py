"""The web env's observation forms: text as before, the screenshot, set-of-marks joined to the tree's ids."""

from __future__ import annotations

import base64
import html
import io
import re

import pytest
from PIL import Image

from longhorizon.envs.base import Task
from longhorizon.envs.web import observation
from longhorizon.envs.web.browser import BrowserPool
from longhorizon.envs.web.env import BrowserEnv
from longhorizon.envs.web.marks import MARK_COLOURS
from longhorizon.envs.web.observation import ObservationForms, render_tree

# Every interactive element holds only text, so the element at the centre of its box is itself.
# The red block sits at a known place for the pixel check; the last button lies below the fold.
PAGE = """<html><head><title>Marks</title><style>
body { margin: 0; font: 16px sans-serif; }
#block { position: absolute; left: 0; top: 0; width: 60px; height: 40px; background: rgb(255, 0, 0); }
#form { position: absolute; left: 100px; top: 80px; }
#form > * { display: block; margin: 12px 0; }
#far { position: absolute; top: 3000px; left: 20px; }
</style></head><body>
<div id="block"></div>
<div id="form">
<h1>Order</h1>
<input aria-label="Name">
<button onclick="document.getElementById('out').textContent = 'saved'">Save</button>
<a href="#top">Top</a>
<input type="checkbox" aria-label="Gift">
<span onclick="this.textContent = 'clicked'">Clickable words</span>
<p id="out">Nothing yet</p>
</div>
<button id="far">Far away</button>
</body></html>"""
START_URL = "data:text/html;base64," + base64.b64encode(PAGE.encode()).decode()
TASK = Task(env_name="webtest", task_id="marks", split="train", data={"sites": [], "start_url": START_URL})


@pytest.fixture(scope="module")
def pool():
    browser_pool = BrowserPool(1)
    yield browser_pool
    browser_pool.close()


async def _evaluate(env: BrowserEnv, script: str, argument=None):
    async def run(session, script, argument):
        return await session.page().evaluate(script, argument)

    return await env._episode.session.call(run, script, argument, timeout_s=10.0)


def _bids_in_text(text: str) -> set[str]:
    return set(re.findall(r"\[([a-z]*\d+)\]", text.split("\n[", 1)[-1]))


def _bid_of(text: str, role: str, name: str) -> str:
    found = re.search(rf"\[([a-z]*\d+)\] {role} '{name}'", text)
    assert found, f"no {role} {name!r} in:\n{text}"
    return found.group(1)


def test_tree_reports_the_ids_of_interactive_nodes_in_order():
    def node(node_id, role, name="", children=(), backend=None, parent="1"):
        return {"nodeId": node_id, "role": {"value": role}, "name": {"value": name}, "childIds": list(children),
                "backendDOMNodeId": backend, "parentId": parent}

    nodes = [
        {**node("1", "RootWebArea", "Page", ["2", "3", "4", "5"], 100), "parentId": None},
        node("2", "heading", "Title", backend=102),
        node("3", "button", "Go", backend=103),
        node("4", "generic", backend=104),
        node("5", "textbox", "Name", backend=105),
    ]
    interactive: list[str] = []
    lines = render_tree(nodes, {100: "1", 102: "2", 103: "3", 104: "4", 105: "5"}, {104}, "1", interactive)
    assert interactive == ["3", "4", "5"]  # the heading has an id but nothing to act on
    assert lines == render_tree(nodes, {100: "1", 102: "2", 103: "3", 104: "4", 105: "5"}, {104}, "1")


def test_a_frames_document_is_shown_under_its_iframe_with_its_own_root():
    def node(node_id, role, name="", children=(), backend=None, parent="1"):
        return {"nodeId": node_id, "role": {"value": role}, "name": {"value": name}, "childIds": list(children),
                "backendDOMNodeId": backend, "parentId": parent}

    page = [
        {**node("1", "RootWebArea", "Page", ["2", "3"], 100), "parentId": None},
        node("2", "Iframe", backend=102),
        node("3", "button", "After", backend=103),
    ]
    # The frame's node ids may repeat the page's: each document is read with its own.
    frame = [
        {**node("1", "RootWebArea", "Inner", ["2"], 200), "parentId": None},
        node("2", "button", "Buy", backend=202),
    ]
    bids = {100: "1", 102: "2", 103: "3", 201: "a1", 202: "a2"}
    interactive: list[str] = []
    lines = render_tree(page, bids, (), "1", interactive, frames={102: (frame, "a1")})
    assert lines == [
        "[1] RootWebArea 'Page'",
        "  Iframe",
        "    [a1] RootWebArea 'Inner'",
        "      [a2] button 'Buy'",
        "  [3] button 'After'",
    ]
    assert interactive == ["a2", "3"]
    assert render_tree(page, bids, (), "1") == [lines[0], lines[1], lines[4]]  # no frame read: as before


def test_bad_observation_options_are_refused_in_one_line():
    for modes, size, message in [
        (["text", "video"], [1280, 720], r"unknown observation mode\(s\) \['video'\]"),
        ([], [1280, 720], "non-empty list"),
        ("som", [1280, 720], "non-empty list"),
        (["som"], [1280], r"screenshot_size must be \[width, height\]"),
        (["som"], [1280, 10], "from 64 to 4096"),
        (["som"], [1280.5, 720], "whole pixels"),
    ]:
        with pytest.raises(ValueError, match=message) as raised:
            BrowserEnv(name="webtest", observation_modes=modes, screenshot_size=size)
        assert "\n" not in str(raised.value)
    assert ObservationForms.checked(["som", "text", "som"], (800, 600)).modes == ("som", "text")


@pytest.mark.browser
async def test_text_only_default_computes_no_image_and_its_text_is_unchanged(pool, monkeypatch):
    visual_env = BrowserEnv(name="webtest", pool=pool, observation_modes=["text", "screenshot", "som"])
    visual_text, visual_info = await visual_env.reset(TASK)
    await visual_env.close()
    assert {"screenshot", "som", "som_marks"} <= set(visual_info)

    def refuse(*args, **kwargs):
        raise AssertionError("a text-only run took a screenshot")

    monkeypatch.setattr(observation, "screenshot_png", refuse)
    monkeypatch.setattr(observation, "MARK_BOXES_JS", "() => { throw new Error('boxes measured'); }")
    env = BrowserEnv(name="webtest", pool=pool)
    try:
        text, info = await env.reset(TASK)
        assert text == visual_text  # the same page at the same size reads the same
        assert set(info) == {"success", "invalid_action"}
        save = _bid_of(text, "button", "Save")
        text, _, _, _, info = await env.step(f"click('{save}')")
        assert "StaticText 'saved'" in text and set(info) == {"success", "invalid_action"}
        _, _, _, _, info = await env.step("click(")  # the error observation adds nothing either
        assert info["invalid_action"] and set(info) == {"success", "invalid_action"}
    finally:
        await env.close()


@pytest.mark.browser
async def test_screenshot_is_a_png_of_the_viewport_at_the_configured_size(pool):
    env = BrowserEnv(name="webtest", pool=pool, observation_modes=["screenshot"], screenshot_size=[800, 600])
    try:
        text, info = await env.reset(TASK)
        assert "som" not in info and "som_marks" not in info
        assert text.startswith("URL: data:text/html") and "button" not in text  # no tree without "text"
        assert info["screenshot"][:8] == b"\x89PNG\r\n\x1a\n"
        image = Image.open(io.BytesIO(info["screenshot"]))
        image.load()
        assert image.size == (800, 600)
        assert await _evaluate(env, "() => [window.innerWidth, window.innerHeight]") == [800, 600]
        rgb = image.convert("RGB")
        assert rgb.getpixel((30, 20)) == (255, 0, 0)  # inside the red block
        assert rgb.getpixel((70, 20)) == (255, 255, 255)  # just right of it
        # A step's observation has one too, and mouse coordinates use the same viewport.
        _, _, _, _, info = await env.step("mouse_click(790, 590)")
        assert not info["invalid_action"] and Image.open(io.BytesIO(info["screenshot"])).size == (800, 600)
        _, _, _, _, info = await env.step("mouse_click(810, 20)")
        assert info["invalid_action"] and Image.open(io.BytesIO(info["screenshot"])).size == (800, 600)
    finally:
        await env.close()


@pytest.mark.browser
async def test_set_of_marks_ids_agree_with_the_tree_and_the_page(pool):
    env = BrowserEnv(name="webtest", pool=pool, observation_modes=["text", "som"], screenshot_size=[1024, 768])
    try:
        text, info = await env.reset(TASK)
        assert "screenshot" not in info
        marks = info["som_marks"]
        marked = [mark["bid"] for mark in marks]
        expected = [_bid_of(text, "textbox", "Name"), _bid_of(text, "button", "Save"), _bid_of(text, "link", "Top"),
                    _bid_of(text, "checkbox", "Gift")]
        assert marked[:4] == expected  # tree order
        assert set(marked) <= _bids_in_text(text)
        assert _bid_of(text, "heading", "Order") not in marked  # named, but nothing to act on
        assert _bid_of(text, "button", "Far away") not in marked  # below the fold
        assert len(marked) == 5  # and the words with a click handler
        for mark in marks:
            assert mark["width"] > 0 and mark["height"] > 0
            assert 0 <= mark["x"] and mark["x"] + mark["width"] <= 1024 and mark["y"] + mark["height"] <= 768
            centre_bid = await _evaluate(
                env, "([x, y]) => document.elementFromPoint(x, y).getAttribute('data-bid')",
                [mark["x"] + mark["width"] / 2, mark["y"] + mark["height"] / 2])
            assert centre_bid == mark["bid"], mark

        som = Image.open(io.BytesIO(info["som"])).convert("RGB")
        assert som.size == (1024, 768)
        for index, mark in enumerate(marks):  # each box's left edge is drawn in its colour
            assert som.getpixel((mark["x"], mark["y"] + mark["height"] // 2)) == MARK_COLOURS[index % len(MARK_COLOURS)]
        assert som.getpixel((30, 20)) == (255, 0, 0)  # the page is left as it was where nothing is marked

        # After a scroll the far button is marked at its new place, and the ones scrolled away are not.
        # (Scrolled by script: a wheel's scroll may still be under way when the step observes.)
        await _evaluate(env, "() => window.scrollTo(0, 2900)")
        _, _, _, _, info = await env.step("noop(0)")
        far = _bid_of(text, "button", "Far away")
        assert [mark["bid"] for mark in info["som_marks"]] == [far]
    finally:
        await env.close()


@pytest.mark.browser
async def test_a_set_of_marks_observation_leaves_the_page_untouched(pool):
    env = BrowserEnv(name="webtest", pool=pool, observation_modes=["text", "screenshot", "som"])
    try:
        await env.reset(TASK)
        before = await _evaluate(env, """() => {
            window.__mutations = [];
            new MutationObserver((records) => window.__mutations.push(...records.map((r) => r.type)))
              .observe(document, {subtree: true, childList: true, attributes: true, characterData: true});
            return document.documentElement.outerHTML;
        }""")
        _, _, _, _, info = await env.step("noop(0)")
        assert info["som_marks"] and not info["invalid_action"]
        after = await _evaluate(env, "() => document.documentElement.outerHTML")
        mutations = await _evaluate(env, "() => window.__mutations")
        assert after == before and mutations == []
    finally:
        await env.close()


def _srcdoc(markup: str) -> str:
    return html.escape(markup, quote=True)


# A frame with a border and padding at a known place, holding a button, a field, a button cut off
# by the frame's edge and a frame of its own; each document sets its margins to 0.
DEEP = "<body style='margin:0'><a href='#deep' style='position:absolute;left:5px;top:5px'>Deep</a></body>"
INNER = (
    "<body style='margin:0;font:16px sans-serif'>"
    "<button style='position:absolute;left:10px;top:20px' "
    "onclick=\"document.getElementById('out').textContent = 'bought'\">Buy</button>"
    "<input aria-label='Quantity' style='position:absolute;left:10px;top:60px;width:80px'>"
    "<p id='out' style='position:absolute;left:150px;top:10px;margin:0'>not yet</p>"
    "<button style='position:absolute;left:240px;top:100px;width:100px'>Half</button>"
    f"<iframe style='position:absolute;left:150px;top:60px;width:80px;height:40px;border:0' srcdoc=\"{_srcdoc(DEEP)}\"></iframe>"
    "</body>"
)
FRAMED_PAGE = (
    "<html><head><title>Framed</title></head><body style='margin:0;font:16px sans-serif'>"
    "<button style='position:absolute;left:10px;top:10px'>Top</button>"
    "<iframe title='Shop' style='position:absolute;left:200px;top:100px;width:300px;height:150px;"
    f"border:4px solid black;padding:6px' srcdoc=\"{_srcdoc(INNER)}\"></iframe>"
    "</body></html>"
)
FRAMED_TASK = Task(env_name="webtest", task_id="frames", split="train",
                   data={"sites": [], "start_url": "data:text/html;base64," + base64.b64encode(FRAMED_PAGE.encode()).decode()})


async def _box_in_tab(env: BrowserEnv, bid: str) -> dict:
    """Playwright's box of the element `bid`, wherever its frame is, in the tab's viewport."""
    async def run(session, bid):
        for frame in session.page().frames:
            locator = frame.locator(f'[data-bid="{bid}"]')
            if await locator.count():
                return await locator.bounding_box()
        return None

    return await env._episode.session.call(run, bid, timeout_s=10.0)


@pytest.mark.browser
async def test_elements_inside_frames_have_ids_marks_and_take_actions(pool):
    env = BrowserEnv(name="webtest", pool=pool, observation_modes=["text", "som"], screenshot_size=[800, 600])
    try:
        text, info = await env.reset(FRAMED_TASK)
        top, buy, quantity = _bid_of(text, "button", "Top"), _bid_of(text, "button", "Buy"), _bid_of(text, "textbox", "Quantity")
        half, deep = _bid_of(text, "button", "Half"), _bid_of(text, "link", "Deep")
        assert top.isdigit() and buy[0] == quantity[0] == half[0] == "a" and deep[:2] == "aa", text
        assert len({top, buy, quantity, half, deep}) == 5
        # Each frame's document under its iframe, one level deeper, with its own root.
        depth = {line.strip(): (len(line) - len(line.lstrip())) // 2 for line in text.splitlines()}
        shop = next(line for line in depth if line.endswith("Iframe 'Shop'"))
        assert depth[shop] == 1 and depth["[a1] RootWebArea"] == 2, text
        assert depth[f"[{buy}] button 'Buy'"] == depth[f"[{half}] button 'Half'"] == depth["Iframe"] == 3
        assert depth["[aa1] RootWebArea"] == 4 and depth[f"[{deep}] link 'Deep'"] == 5
        # Marks: every interactive element, the frames' too, at Playwright's box in the tab,
        # and the one cut off by the frame's edge only as far as the frame shows it.
        marks = {mark["bid"]: mark for mark in info["som_marks"]}
        assert {top, buy, quantity, half, deep} <= set(marks), info["som_marks"]
        for bid in (top, buy, quantity, deep):
            box = await _box_in_tab(env, bid)
            assert abs(marks[bid]["x"] - box["x"]) <= 1 and abs(marks[bid]["y"] - box["y"]) <= 1, (bid, marks[bid], box)
            assert abs(marks[bid]["width"] - box["width"]) <= 1 and abs(marks[bid]["height"] - box["height"]) <= 1
        # The frame's content starts at 200 + 4 + 6 = 210 and is 300 wide: "Half" (at 240, 100 wide)
        # shows up to x = 510.
        assert marks[half]["x"] == 210 + 240 and marks[half]["x"] + marks[half]["width"] == 510, marks[half]

        # Actions reach into frames.
        text, _, _, _, info = await env.step(f"fill('{quantity}', '3')")
        assert not info["invalid_action"] and f"[{quantity}] textbox 'Quantity' value='3'" in text, text
        text, _, _, _, info = await env.step(f"click('{buy}')")
        assert not info["invalid_action"] and "StaticText 'bought'" in text, text
        assert _bid_of(text, "button", "Buy") == buy  # ids hold between steps
        text, _, _, _, info = await env.step("click('b7')")
        assert info["invalid_action"] and "no element with id b7" in text
    finally:
        await env.close()
