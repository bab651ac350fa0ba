"""The page as text: an accessibility tree with element ids, the URL, the open tabs and the last error.

Element ids ("bids") are numbers a script writes into the page as a `data-bid` attribute on every
element, in document order; an element keeps its id while the document lives, so ids are stable
between steps and the same page gives the same ids on every run. The tree itself is Chromium's
accessibility tree (CDP `Accessibility.getFullAXTree`), joined to the ids through the DOM
snapshot's backend node ids. The format follows BrowserGym:

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
from typing import Any, Iterable, Mapping, Sequence

from longhorizon.envs.web.marks import draw_marks

BID_ATTRIBUTE = "data-bid"

# Gives every element without an id the next one. A WeakMap remembers which element got which id,
# so an element cloned together with its attribute (cloneNode) is recognised and renumbered.
MARK_ELEMENTS_JS = """
() => {
  const attribute = %r;
  if (!window.__lhBids) { window.__lhBids = new WeakMap(); window.__lhNextBid = 1; }
  const known = window.__lhBids;
  const visit = (root) => {
    for (const element of root.querySelectorAll('*')) {
      const current = element.getAttribute(attribute);
      if (current === null || known.get(element) !== current) {
        const bid = String(window.__lhNextBid++);
        element.setAttribute(attribute, bid);
        known.set(element, bid);
      }
      if (element.shadowRoot) visit(element.shadowRoot);
    }
  };
  visit(document);
}
""" % BID_ATTRIBUTE

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
) -> list[str]:
    """The tree's lines from CDP accessibility nodes (a pure function, tested on hand-built nodes).

    `interactive_bids`, when given, receives in tree order the bids shown on nodes an agent acts on
    (an interactive role, or a click handler): the elements a set-of-marks image marks.
    """
    by_id = {node["nodeId"]: node for node in nodes}
    clickable = set(clickable_backend_nodes)
    roots = [node for node in nodes if not node.get("parentId") or node.get("parentId") not in by_id]
    lines: list[str] = []

    def visit(node: Mapping[str, Any], depth: int, parent_name: str) -> None:
        role = str(_value(node.get("role")) or "")
        if role in SKIPPED_ROLES:
            return
        name = _WHITESPACE.sub(" ", str(_value(node.get("name")) or "")).strip()
        backend = node.get("backendDOMNodeId")
        bid = bid_of_backend_node.get(backend) if backend is not None else None
        if role == "RootWebArea" and bid is None:
            bid = root_bid
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
                visit(child, child_depth, child_parent_name)

    for root in roots:
        visit(root, 0, "")
    return lines


def bids_from_snapshot(snapshot: Mapping[str, Any]) -> tuple[dict[int, str], set[int], str | None]:
    """From a CDP DOMSnapshot: backend node id -> bid, the clickable backend nodes, the <html> bid."""
    strings = snapshot.get("strings") or []
    bid_of: dict[int, str] = {}
    clickable: set[int] = set()
    root_bid = None
    for document_index, document in enumerate(snapshot.get("documents") or ()):
        nodes = document.get("nodes") or {}
        backend_ids = nodes.get("backendNodeId") or []
        attributes = nodes.get("attributes") or []
        names = nodes.get("nodeName") or []
        for index, backend in enumerate(backend_ids):
            pairs = attributes[index] if index < len(attributes) else []
            for position in range(0, len(pairs) - 1, 2):
                if strings[pairs[position]] == BID_ATTRIBUTE:
                    bid_of[backend] = strings[pairs[position + 1]]
                    break
            if (document_index == 0 and root_bid is None and index < len(names)
                    and strings[names[index]] == "HTML" and backend in bid_of):
                root_bid = bid_of[backend]
        for index in (nodes.get("isClickable") or {}).get("index") or ():
            if index < len(backend_ids):
                clickable.add(backend_ids[index])
    return bid_of, clickable, root_bid


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
            await page.evaluate(MARK_ELEMENTS_JS)
            cdp = await session.cdp(page)
            snapshot = await cdp.send("DOMSnapshot.captureSnapshot", {"computedStyles": []})
            tree = await cdp.send("Accessibility.getFullAXTree")
        except Exception as error:  # a navigation replaced the document mid-capture: wait and retry
            last_error = error
            if page.is_closed():
                raise RuntimeError("the tab closed while it was being read") from error
            try:
                await page.wait_for_load_state("domcontentloaded", timeout=5000)
            except Exception:
                pass
            continue
        bid_of, clickable, root_bid = bids_from_snapshot(snapshot)
        if interactive_bids is not None:
            interactive_bids.clear()  # a retried capture starts over
        return render_tree(tree.get("nodes") or [], bid_of, clickable, root_bid, interactive_bids)
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

# Each asked-for element's box in viewport CSS pixels, clipped to the viewport; elements without a
# visible area there are left out. Looks inside shadow roots too, as MARK_ELEMENTS_JS numbers them.
MARK_BOXES_JS = """
(bids) => {
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
  const width = window.innerWidth, height = window.innerHeight;
  const boxes = [];
  for (const bid of bids) {
    const element = found.get(bid);
    if (!element) continue;
    const rect = element.getBoundingClientRect();
    const left = Math.max(0, rect.left), top = Math.max(0, rect.top);
    const right = Math.min(width, rect.right), bottom = Math.min(height, rect.bottom);
    if (right - left < 1 || bottom - top < 1) continue;
    boxes.push({bid, x: Math.round(left), y: Math.round(top),
                width: Math.round(right - left), height: Math.round(bottom - top)});
  }
  return boxes;
}
""" % BID_ATTRIBUTE


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
        marks = await page.evaluate(MARK_BOXES_JS, interactive_bids) if wants_marks else []
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
