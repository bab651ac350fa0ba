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
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Mapping

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
) -> list[str]:
    """The tree's lines from CDP accessibility nodes (a pure function, tested on hand-built nodes)."""
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


async def capture_tree(session: Any, page: Any) -> list[str]:
    """The tree lines of one tab (runs on the browser's asyncio thread)."""
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
        return render_tree(tree.get("nodes") or [], bid_of, clickable, root_bid)
    raise RuntimeError(f"could not read the page: {last_error}")


async def capture(session: Any, *, error: str = "", goal: str = "", max_chars: int = 0) -> str:
    """The observation text of a browser session's current state (asyncio thread)."""
    # One tab for the tree and the header: a tab that opens meanwhile shows in the next observation.
    page = await session.ensure_page()
    active, tabs = session.active, list(session.pages)
    tree_lines = await capture_tree(session, page)
    url = page.url
    titles = []
    for tab in tabs:
        try:
            titles.append(await tab.title())
        except Exception:
            titles.append("")
    dialogs, session.dialogs = session.dialogs, []
    return format_observation(
        url=url, tab_titles=titles, active_tab=active, tree_lines=tree_lines,
        error=error, goal=goal, dialogs=dialogs, max_chars=max_chars,
    )
