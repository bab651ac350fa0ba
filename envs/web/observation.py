"""The page as text: an accessibility tree with element ids, the URL, the open tabs and the last error.

Element ids ("bids") are numbers a script writes into the page as a `data-bid` attribute on every
element, in document order; an element keeps its id while the document lives, so ids are stable
between steps and the same page gives the same ids on every run. Inside a frame (iframe) the ids
carry the frame's letters as BrowserGym's do: the page's first frame is `a`, so its elements are
`a1`, `a2`, ...; a frame inside that one is `aa`, `ab`, ... (letters `a`-`y`, then `z` followed by
more: no frame's letters begin another's, so every id is unique in the tab). The tree itself is
Chromium's accessibility tree (CDP `Accessibility.getFullAXTree`, one per frame, each frame's under
its iframe's node), joined to the ids through the DOM snapshot's backend node ids. A frame that
Chromium runs in another process (a page of another site) is marked, and its elements can be acted
on, but its tree is not read: it shows as an empty `Iframe`. The format follows BrowserGym:

    URL: http://127.0.0.1:40213/ticket
    Tabs: [0] 'Tickets - Demo' (active)
    Dialog: confirm 'Really delete?' (accepted)     <- only after a page opened a dialog
    Error: <the last action's error; the line is left out when there is none>
    [1] RootWebArea 'Tickets - Demo'
      [3] heading 'Tickets' level=1
      [5] button 'Submit'
      StaticText 'some text'

Two spaces of indent per depth; `[bid]` on nodes an agent can act on or that carry a name; role,
then the name in single quotes (backslash and quote escaped), then properties.

Besides the text, `capture` computes the visual forms a run asks for (OBSERVATION_MODES): a PNG
screenshot of the viewport, and a set-of-marks copy of it with the bid of every interactive element
of the tree drawn at its box (marks.py). Nothing visual is computed unless asked for.
"""

from __future__ import annotations

import base64
import re
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, NamedTuple, Sequence

from longhorizon.envs.web.marks import draw_marks

BID_ATTRIBUTE = "data-bid"
FRAME_ATTRIBUTE = "data-bid-frame"
"""On an iframe element: the letters that begin the ids of the elements in its document."""

# Gives every element without an id the next one, `prefix` (the frame's letters; "" in the page
# itself) then a number. A WeakMap remembers which element got which id, so an element cloned
# together with its attribute (cloneNode) is recognised and renumbered. Each iframe element gets
# the letters of its document's frames the same way.
MARK_ELEMENTS_JS = """
(prefix) => {
  const attribute = %r, frameAttribute = %r;
  if (!window.__lhBids || window.__lhPrefix !== prefix) {
    window.__lhBids = new WeakMap(); window.__lhNextBid = 1;
    window.__lhFrames = new WeakMap(); window.__lhNextFrame = 0; window.__lhPrefix = prefix;
  }
  const known = window.__lhBids, frames = window.__lhFrames;
  const letters = (n) => n < 25 ? String.fromCharCode(97 + n) : 'z' + letters(n - 25);
  const visit = (root) => {
    for (const element of root.querySelectorAll('*')) {
      const current = element.getAttribute(attribute);
      if (current === null || known.get(element) !== current) {
        const bid = prefix + String(window.__lhNextBid++);
        element.setAttribute(attribute, bid);
        known.set(element, bid);
      }
      if (element.tagName === 'IFRAME' || element.tagName === 'FRAME') {
        const letter = element.getAttribute(frameAttribute);
        if (letter === null || frames.get(element) !== letter) {
          const next = prefix + letters(window.__lhNextFrame++);
          element.setAttribute(frameAttribute, next);
          frames.set(element, next);
        }
      }
      if (element.shadowRoot) visit(element.shadowRoot);
    }
  };
  visit(document);
}
""" % (BID_ATTRIBUTE, FRAME_ATTRIBUTE)


def descendant_frames(page: Any) -> list[Any]:
    """The tab's frames below its main one, each after the frame that holds it (Playwright frames)."""
    found: list[Any] = []
    pending = list(reversed(page.main_frame.child_frames))
    while pending:
        frame = pending.pop()
        found.append(frame)
        pending.extend(reversed(frame.child_frames))
    return found


async def mark_elements(page: Any) -> None:
    """Give every element of the tab, its frames' included, an id (see the module's docstring)."""
    await page.evaluate(MARK_ELEMENTS_JS, "")
    for frame in descendant_frames(page):
        try:
            element = await frame.frame_element()
            prefix = await element.get_attribute(FRAME_ATTRIBUTE)
            if prefix:
                await frame.evaluate(MARK_ELEMENTS_JS, prefix)
        except Exception:  # a frame that navigated or went away meanwhile: the next observation has it
            continue


# Roles whose nodes the agent acts on: they always get an id, even without a name.
INTERACTIVE_ROLES = frozenset({
    "button", "link", "textbox", "searchbox", "combobox", "listbox", "option", "checkbox", "radio",
    "switch", "slider", "spinbutton", "tab", "menuitem", "menuitemcheckbox", "menuitemradio",
    "treeitem", "gridcell", "columnheader", "rowheader", "scrollbar", "textarea", "MenuListOption",
    "MenuListPopup", "ComboBoxMenuButton", "ComboBoxSelect",
})
# Containers without meaning of their own: left out (their children move up) unless clickable.
TRANSPARENT_ROLES = frozenset({"generic", "none", "presentation", "", "IframePresentational"})
SKIPPED_ROLES = frozenset({"InlineTextBox", "LineBreak"})
VALUE_ROLES = frozenset({"textbox", "searchbox", "combobox", "spinbutton", "slider", "textarea", "ComboBoxSelect"})
# Properties shown after the name, in this order.
SHOWN_PROPERTIES = ("level", "checked", "pressed", "selected", "expanded", "disabled", "required", "focused")

_WHITESPACE = re.compile(r"\s+")


def quote(text: str) -> str:
    """A name as the observation shows it: whitespace collapsed, in single quotes, \\ and ' escaped."""
    collapsed = _WHITESPACE.sub(" ", text).strip()
    return "'" + collapsed.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _value(field: Any) -> Any:
    return field.get("value") if isinstance(field, Mapping) else None


def _properties(node: Mapping[str, Any]) -> list[str]:
    found: dict[str, Any] = {}
    for prop in node.get("properties") or ():
        found[prop.get("name")] = _value(prop.get("value"))
    shown = []
    for name in SHOWN_PROPERTIES:
        if name not in found:
            continue
        value = found[name]
        if name in ("level",):
            shown.append(f"{name}={value}")
        elif name in ("checked", "pressed", "expanded"):
            shown.append(f"{name}={str(value).lower()}")
        elif value in (True, "true"):
            shown.append(name)
    return shown


def render_tree(
    nodes: list[Mapping[str, Any]],
    bid_of_backend_node: Mapping[int, str],
    clickable_backend_nodes: Iterable[int] = (),
    root_bid: str | None = None,
    interactive_bids: list[str] | None = None,
    frames: Mapping[int, tuple[list[Mapping[str, Any]], str | None]] | None = None,
) -> list[str]:
    """The tree's lines from CDP accessibility nodes (a pure function, tested on hand-built nodes).

    `interactive_bids`, when given, receives in tree order the bids shown on nodes an agent acts on
    (an interactive role, or a click handler): the elements a set-of-marks image marks. `frames`
    maps an iframe element's backend node id to its document's nodes and root bid: they are shown
    under the iframe's node.
    """
    clickable = set(clickable_backend_nodes)
    frames = frames or {}
    lines: list[str] = []

    def visit(node: Mapping[str, Any], by_id: Mapping[Any, Mapping[str, Any]], depth: int, parent_name: str,
              document_bid: str | None) -> None:
        role = str(_value(node.get("role")) or "")
        if role in SKIPPED_ROLES:
            return
        name = _WHITESPACE.sub(" ", str(_value(node.get("name")) or "")).strip()
        backend = node.get("backendDOMNodeId")
        bid = bid_of_backend_node.get(backend) if backend is not None else None
        if role == "RootWebArea" and bid is None:
            bid = document_bid
        shown = not node.get("ignored", False)
        if shown and role == "StaticText":
            shown = bool(name) and name != parent_name
        elif shown and role in TRANSPARENT_ROLES and not name:
            shown = bid is not None and backend in clickable
        child_depth, child_parent_name = depth, parent_name
        if shown:
            parts = []
            wants_bid = role in INTERACTIVE_ROLES or bool(name) or backend in clickable or role == "RootWebArea"
            if bid is not None and wants_bid and role != "StaticText":
                parts.append(f"[{bid}]")
                if interactive_bids is not None and (role in INTERACTIVE_ROLES or backend in clickable):
                    interactive_bids.append(bid)
            parts.append(role or "generic")
            if name:
                parts.append(quote(name))
            value = _value(node.get("value"))
            if role in VALUE_ROLES and value not in (None, ""):
                parts.append(f"value={quote(str(value))}")
            # The document is always the focused node of its own tree: saying so adds only noise.
            parts.extend(prop for prop in _properties(node) if not (role == "RootWebArea" and prop == "focused"))
            lines.append("  " * depth + " ".join(parts))
            child_depth, child_parent_name = depth + 1, name
        for child_id in node.get("childIds") or ():
            child = by_id.get(child_id)
            if child is not None:
                visit(child, by_id, child_depth, child_parent_name, document_bid)
        if backend in frames:
            frame_nodes, frame_root_bid = frames[backend]
            visit_document(frame_nodes, child_depth, child_parent_name, frame_root_bid)

    def visit_document(document_nodes: list[Mapping[str, Any]], depth: int, parent_name: str,
                       document_bid: str | None) -> None:
        by_id = {node["nodeId"]: node for node in document_nodes}
        for root in document_nodes:
            if not root.get("parentId") or root.get("parentId") not in by_id:
                visit(root, by_id, depth, parent_name, document_bid)

    visit_document(nodes, 0, "", root_bid)
    return lines


class SnapshotIds(NamedTuple):
    """What a CDP DOMSnapshot says of the tab's documents (those of its process)."""

    bid_of: dict[int, str]  # backend node id -> bid
    clickable: set[int]  # backend node ids with a click handler
    root_bid: str | None  # the page's <html> bid
    frames: dict[int, tuple[str, str | None]]  # iframe element's backend node id -> (frame id, its <html> bid)


def read_snapshot(snapshot: Mapping[str, Any]) -> SnapshotIds:
    """The ids and frames of a CDP DOMSnapshot (a pure function)."""
    strings = snapshot.get("strings") or []
    documents = snapshot.get("documents") or ()
    bid_of: dict[int, str] = {}
    clickable: set[int] = set()
    root_bids: list[str | None] = []
    contents: list[tuple[int, int]] = []  # (iframe backend id, its document's index)
    for document in documents:
        nodes = document.get("nodes") or {}
        backend_ids = nodes.get("backendNodeId") or []
        attributes = nodes.get("attributes") or []
        names = nodes.get("nodeName") or []
        root_bid = None
        for index, backend in enumerate(backend_ids):
            pairs = attributes[index] if index < len(attributes) else []
            for position in range(0, len(pairs) - 1, 2):
                if strings[pairs[position]] == BID_ATTRIBUTE:
                    bid_of[backend] = strings[pairs[position + 1]]
                    break
            if root_bid is None and index < len(names) and strings[names[index]] == "HTML" and backend in bid_of:
                root_bid = bid_of[backend]
        root_bids.append(root_bid)
        for index in (nodes.get("isClickable") or {}).get("index") or ():
            if index < len(backend_ids):
                clickable.add(backend_ids[index])
        content = nodes.get("contentDocumentIndex") or {}
        for index, document_index in zip(content.get("index") or (), content.get("value") or ()):
            if index < len(backend_ids):
                contents.append((backend_ids[index], document_index))
    frames: dict[int, tuple[str, str | None]] = {}
    for backend, document_index in contents:
        if 0 <= document_index < len(documents) and "frameId" in documents[document_index]:
            frame_id = strings[documents[document_index]["frameId"]]
            if frame_id:
                frames[backend] = (frame_id, root_bids[document_index])
    return SnapshotIds(bid_of, clickable, root_bids[0] if root_bids else None, frames)


def format_observation(
    *,
    url: str,
    tab_titles: list[str],
    active_tab: int,
    tree_lines: list[str],
    error: str = "",
    goal: str = "",
    dialogs: list[str] | None = None,
    max_chars: int = 0,
) -> str:
    """The full observation text (header, then the tree), cut at max_chars (0: no cut)."""
    header = []
    if goal:
        header.append(f"Goal: {goal}")
    header.append(f"URL: {url}")
    tabs = ", ".join(
        f"[{index}] {quote(title)}" + (" (active)" if index == active_tab else "")
        for index, title in enumerate(tab_titles)
    )
    header.append(f"Tabs: {tabs}")
    for dialog in dialogs or ():
        header.append("Dialog: " + _WHITESPACE.sub(" ", dialog).strip())
    if error:
        header.append("Error: " + _WHITESPACE.sub(" ", error).strip())
    text = "\n".join(header + tree_lines)
    if max_chars and len(text) > max_chars:
        text = text[:max_chars].rsplit("\n", 1)[0] + "\n... (the page is longer; scroll or navigate to see more)"
    return text


async def capture_tree(session: Any, page: Any, interactive_bids: list[str] | None = None) -> list[str]:
    """The tree lines of one tab (runs on the browser's asyncio thread); `interactive_bids` as in
    render_tree."""
    last_error: Exception | None = None
    for _ in range(3):
        try:
            await mark_elements(page)
            cdp = await session.cdp(page)
            snapshot = await cdp.send("DOMSnapshot.captureSnapshot", {"computedStyles": []})
            tree = await cdp.send("Accessibility.getFullAXTree")
            ids = read_snapshot(snapshot)
            frames = {}
            for backend, (frame_id, frame_root_bid) in ids.frames.items():
                try:
                    frame_tree = await cdp.send("Accessibility.getFullAXTree", {"frameId": frame_id})
                except Exception:  # the frame went away meanwhile: it shows as an empty Iframe
                    continue
                frames[backend] = (frame_tree.get("nodes") or [], frame_root_bid)
        except Exception as error:  # a navigation replaced the document mid-capture: wait and retry
            last_error = error
            if page.is_closed():
                raise RuntimeError("the tab closed while it was being read") from error
            try:
                await page.wait_for_load_state("domcontentloaded", timeout=5000)
            except Exception:
                pass
            continue
        if interactive_bids is not None:
            interactive_bids.clear()  # a retried capture starts over
        return render_tree(tree.get("nodes") or [], ids.bid_of, ids.clickable, ids.root_bid, interactive_bids, frames)
    raise RuntimeError(f"could not read the page: {last_error}")


OBSERVATION_MODES = ("text", "screenshot", "som")
"""The observation forms a web env can compute: the accessibility tree in the observation text,
a PNG screenshot of the viewport (info["screenshot"]), and the set-of-marks image with its marks
(info["som"], info["som_marks"])."""

DEFAULT_SCREENSHOT_SIZE = (1280, 720)
"""BrowserGym's viewport, and the pool's: width, height in CSS pixels."""


@dataclass(frozen=True)
class ObservationForms:
    """Which observation forms an env computes, and the viewport size of its screenshots."""

    modes: tuple[str, ...] = ("text",)
    screenshot_size: tuple[int, int] = DEFAULT_SCREENSHOT_SIZE

    @classmethod
    def checked(cls, modes: Sequence[str], screenshot_size: Sequence[int]) -> "ObservationForms":
        """The forms from option values; ValueError in one line for a bad value."""
        if isinstance(modes, str) or not isinstance(modes, Sequence) or not modes:
            raise ValueError(f"observation_modes must be a non-empty list of {list(OBSERVATION_MODES)}, got {modes!r}")
        unknown = [mode for mode in modes if mode not in OBSERVATION_MODES]
        if unknown:
            raise ValueError(f"unknown observation mode(s) {unknown}; valid modes: {', '.join(OBSERVATION_MODES)}")
        if (isinstance(screenshot_size, str) or not isinstance(screenshot_size, Sequence) or len(screenshot_size) != 2
                or not all(isinstance(side, int) and not isinstance(side, bool) and 64 <= side <= 4096
                           for side in screenshot_size)):
            raise ValueError(f"screenshot_size must be [width, height], whole pixels from 64 to 4096, got {screenshot_size!r}")
        return cls(tuple(dict.fromkeys(modes)), (screenshot_size[0], screenshot_size[1]))

    @property
    def visual(self) -> bool:
        return "screenshot" in self.modes or "som" in self.modes


TEXT_ONLY = ObservationForms()

# Each asked-for element of one frame with its box in the tab's viewport, CSS pixels: `origin` is
# where the frame's own viewport starts in the tab's, `clip` [left, top, right, bottom] (the tab's
# coordinates) what of it shows. Elements without a visible area there are left out. Looks inside
# shadow roots too, as MARK_ELEMENTS_JS numbers them.
MARK_BOXES_JS = """
([bids, origin, clip]) => {
  const attribute = %r;
  const wanted = new Set(bids), found = new Map();
  const visit = (root) => {
    for (const element of root.querySelectorAll('*')) {
      const bid = element.getAttribute(attribute);
      if (bid !== null && wanted.has(bid) && !found.has(bid)) found.set(bid, element);
      if (element.shadowRoot) visit(element.shadowRoot);
    }
  };
  visit(document);
  const [clipLeft, clipTop, clipRight, clipBottom] = clip;
  const boxes = [];
  for (const bid of bids) {
    const element = found.get(bid);
    if (!element) continue;
    const rect = element.getBoundingClientRect();
    const left = Math.max(clipLeft, origin[0] + rect.left), top = Math.max(clipTop, origin[1] + rect.top);
    const right = Math.min(clipRight, origin[0] + rect.right), bottom = Math.min(clipBottom, origin[1] + rect.bottom);
    if (right - left < 1 || bottom - top < 1) continue;
    boxes.push({bid, x: Math.round(left), y: Math.round(top),
                width: Math.round(right - left), height: Math.round(bottom - top)});
  }
  return boxes;
}
""" % BID_ATTRIBUTE

# An iframe element's content box (where its document shows) in its own frame's viewport:
# [left, top, right, bottom], past its border and padding.
FRAME_CONTENT_BOX_JS = """
(element) => {
  const rect = element.getBoundingClientRect(), style = getComputedStyle(element);
  const left = rect.left + element.clientLeft + parseFloat(style.paddingLeft);
  const top = rect.top + element.clientTop + parseFloat(style.paddingTop);
  return [left, top, left + element.clientWidth - parseFloat(style.paddingLeft) - parseFloat(style.paddingRight),
          top + element.clientHeight - parseFloat(style.paddingTop) - parseFloat(style.paddingBottom)];
}
"""


async def mark_boxes(page: Any, bids: list[str], viewport: tuple[int, int]) -> list[dict[str, Any]]:
    """The boxes of `bids` in the tab's viewport, in their order, each clipped to what shows of it
    (through every frame that holds it); those not visible are left out."""
    found: dict[str, dict[str, Any]] = {}
    # Only ids that begin with letters live in frames: without one, the frames are not measured.
    in_frames = any(not bid[0].isdigit() for bid in bids)

    async def visit(frame: Any, origin: list[float], clip: list[float]) -> None:
        for box in await frame.evaluate(MARK_BOXES_JS, [bids, origin, clip]):
            found.setdefault(box["bid"], box)
        for child in frame.child_frames if in_frames else ():
            try:
                element = await child.frame_element()
                left, top, right, bottom = await element.evaluate(FRAME_CONTENT_BOX_JS)
            except Exception:  # a frame that went away meanwhile: not marked this time
                continue
            child_origin = [origin[0] + left, origin[1] + top]
            child_clip = [max(clip[0], child_origin[0]), max(clip[1], child_origin[1]),
                          min(clip[2], origin[0] + right), min(clip[3], origin[1] + bottom)]
            if child_clip[2] - child_clip[0] >= 1 and child_clip[3] - child_clip[1] >= 1:
                await visit(child, child_origin, child_clip)

    await visit(page.main_frame, [0, 0], [0, 0, viewport[0], viewport[1]])
    return [found[bid] for bid in bids if bid in found]


async def fit_viewport(page: Any, size: tuple[int, int]) -> None:
    """Give a tab the screenshot size as its viewport (a tab opened later starts at the pool's)."""
    width, height = size
    current = page.viewport_size or {}
    if current.get("width") != width or current.get("height") != height:
        await page.set_viewport_size({"width": width, "height": height})


async def screenshot_png(session: Any, page: Any) -> bytes:
    """The viewport as PNG bytes, from CDP: nothing is injected into the page (Playwright's own
    screenshot adds a style to hide the caret), and the image is what the page shows now."""
    cdp = await session.cdp(page)
    shot = await cdp.send("Page.captureScreenshot", {"format": "png"})
    return base64.b64decode(shot["data"])


async def capture(
    session: Any,
    *,
    error: str = "",
    goal: str = "",
    max_chars: int = 0,
    forms: ObservationForms = TEXT_ONLY,
) -> tuple[str, dict[str, Any]]:
    """The observation text of a browser session's current state, and the visual forms asked for as
    info entries ("screenshot", "som", "som_marks"; none in text-only mode). Asyncio thread."""
    # One tab for the tree and the header: a tab that opens meanwhile shows in the next observation.
    page = await session.ensure_page()
    visuals: dict[str, Any] = {}
    if forms.visual:
        await fit_viewport(page, forms.screenshot_size)
    active, tabs = session.active, list(session.pages)
    wants_marks = "som" in forms.modes
    interactive_bids: list[str] | None = [] if wants_marks else None
    # Set-of-marks draws the tree's ids, so it reads the tree even when the text leaves it out.
    tree_lines = await capture_tree(session, page, interactive_bids) if "text" in forms.modes or wants_marks else []
    shown_lines = tree_lines if "text" in forms.modes else []
    if forms.visual:
        marks = await mark_boxes(page, interactive_bids, forms.screenshot_size) if wants_marks else []
        png = await screenshot_png(session, page)
        if "screenshot" in forms.modes:
            visuals["screenshot"] = png
        if wants_marks:
            visuals["som"] = draw_marks(png, marks)
            visuals["som_marks"] = marks
    url = page.url
    titles = []
    for tab in tabs:
        try:
            titles.append(await tab.title())
        except Exception:
            titles.append("")
    dialogs, session.dialogs = session.dialogs, []
    text = format_observation(
        url=url, tab_titles=titles, active_tab=active, tree_lines=shown_lines,
        error=error, goal=goal, dialogs=dialogs, max_chars=max_chars,
    )
    return text, visuals
