"""Scripted web policies for tests: a plan-following oracle, MiniWoB oracles and a random clicker.

They read the observation text exactly as a model would (observation.py's format) and reply in the
react format. A plan (task.data["oracle"]) names each target by ARIA role and accessible name; the
oracle finds the element id on the current page by matching the line `[bid] role 'name'`.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from longhorizon.envs.base import Task, react_reply

_NODE_LINE = re.compile(r"^(\s*)\[([a-z]*\d+)\] (\S+)(?: '((?:[^'\\]|\\.)*)')?(.*)$")
_GOAL_LINE = re.compile(r"^Goal: (.*)$", re.MULTILINE)
_MAX_WAITS = 2


@dataclass(frozen=True)
class Node:
    """One line of the tree that carries an element id."""

    bid: str
    role: str
    name: str
    depth: int
    rest: str
    """What follows the name: value='...', properties."""
    text: str = ""
    """The StaticText lines right under the node, joined by spaces (what a clickable container shows)."""


def _unescape(name: str) -> str:
    return re.sub(r"\\(.)", r"\1", name)


_TEXT_LINE = re.compile(r"^(\s*)StaticText '((?:[^'\\]|\\.)*)'")


def parse_nodes(observation: str) -> list[Node]:
    """Every `[bid] role 'name' ...` line of an observation, in order."""
    nodes: list[Node] = []
    texts: list[list[str]] = []
    for line in observation.splitlines():
        match = _NODE_LINE.match(line)
        if match:
            indent, bid, role, name, rest = match.groups()
            nodes.append(Node(bid, role, _unescape(name or ""), len(indent) // 2, rest.strip()))
            texts.append([])
            continue
        text = _TEXT_LINE.match(line)
        if text and nodes and len(text.group(1)) // 2 == nodes[-1].depth + 1:
            texts[-1].append(_unescape(text.group(2)))
    return [Node(node.bid, node.role, node.name, node.depth, node.rest, " ".join(words))
            for node, words in zip(nodes, texts)]


def goal_of(observation: str) -> str:
    match = _GOAL_LINE.search(observation)
    return match.group(1).strip() if match else ""


def find_bid(observation: str, role: str, name: str, *, nth: int = 0, exact: bool = True) -> str | None:
    """The id of the nth element with this role and name (exact, or a case-insensitive substring)."""
    wanted = " ".join(name.split())
    matches = [
        node.bid for node in parse_nodes(observation)
        if node.role == role and (node.name == wanted if exact else wanted.lower() in node.name.lower())
    ]
    return matches[nth] if 0 <= nth < len(matches) else None


def _quoted(text: Any) -> str:
    return repr(str(text))


class PlanOraclePolicy:
    """Follows task.data["oracle"]: steps such as ["click", {"role": "link", "name": "Tickets"}].

    Steps: click / dblclick / hover / focus / clear (target), fill / select_option / press (target,
    text), ["goto", url], ["go_back"], ["go_forward"], ["scroll", dx, dy], ["wait"] (re-observe),
    ["stop", answer] / ["send_msg_to_user", answer]. A target is {"role", "name", "nth" (0-based,
    optional), "exact" (default true)}. A target missing from the page is waited for twice, then
    the policy gives up with a message naming it.
    """

    def __init__(self, **_env_options: Any) -> None:
        self._plan: list[list[Any]] = []
        self._index = 0
        self._waits = 0
        self.problem = ""
        """Why the plan could not be followed ("" while it can)."""

    def reset(self, task: Task, first_observation: str, rng: random.Random) -> None:
        plan = task.data.get("oracle") if isinstance(task.data, Mapping) else None
        if not isinstance(plan, list) or not plan:
            raise ValueError(f"task {task.task_id!r} has no oracle plan in data['oracle']")
        self._plan = [list(step) for step in plan]
        self._index = 0
        self._waits = 0
        self.problem = ""

    def act(self, observation: str) -> str:
        if self._index >= len(self._plan):
            return react_reply("The plan is complete.", "stop()")
        step = self._plan[self._index]
        kind, args = str(step[0]), step[1:]
        if kind == "wait":
            self._index += 1
            return react_reply("Wait for the page to update.", "noop()")
        if args and isinstance(args[0], Mapping):
            target = args[0]
            bid = find_bid(
                observation, str(target.get("role", "")), str(target.get("name", "")),
                nth=int(target.get("nth", 0)), exact=bool(target.get("exact", True)),
            )
            if bid is None:
                if self._waits < _MAX_WAITS:
                    self._waits += 1
                    return react_reply("The element is not on the page yet.", "noop()")
                self.problem = f"step {self._index}: no {target.get('role')} {target.get('name')!r} on the page"
                self._index = len(self._plan)
                return react_reply("I cannot follow the plan.", f"send_msg_to_user({_quoted('oracle failed: ' + self.problem)})")
            self._waits = 0
            action = f"{kind}({', '.join([_quoted(bid), *(_quoted(arg) for arg in args[1:])])})"
        elif kind == "scroll":
            action = f"scroll({float(args[0]) if args else 0.0}, {float(args[1]) if len(args) > 1 else 300.0})"
        elif kind in ("stop", "send_msg_to_user"):
            action = f"{kind}({_quoted(args[0])})" if args else f"{kind}()"
        else:  # goto, go_back, go_forward, new_tab, tab_focus ...: arguments as written
            action = f"{kind}({', '.join(repr(arg) for arg in args)})"
        self._index += 1
        return react_reply(f"Plan step {self._index}.", action)


class RandomClickerPolicy:
    """Clicks random elements, now and then types into a text field, scrolls, or stops."""

    TEXT_ROLES = ("textbox", "searchbox")

    def __init__(self, stop_probability: float = 0.05, **_env_options: Any) -> None:
        self.stop_probability = stop_probability
        self._rng = random.Random(0)

    def reset(self, task: Task, first_observation: str, rng: random.Random) -> None:
        self._rng = rng

    def act(self, observation: str) -> str:
        roll = self._rng.random()
        nodes = [node for node in parse_nodes(observation) if node.role != "RootWebArea"]
        if roll < self.stop_probability or not nodes:
            return react_reply("I give up.", "stop()")
        text_fields = [node for node in nodes if node.role in self.TEXT_ROLES]
        if roll < 0.15 and text_fields:
            field = self._rng.choice(text_fields)
            word = self._rng.choice(["hello", "test", "42", "yes"])
            return react_reply("Type something.", f"fill({field.bid!r}, {word!r})")
        if roll < 0.2:
            return react_reply("Look further down.", "scroll(0, 200)")
        node = self._rng.choice(nodes)
        return react_reply(f"Click the {node.role}.", f"click({node.bid!r})")


# -- MiniWoB oracles: read the instruction (the Goal line) and the tree, act like a careful person --

MiniWobSolver = Callable[[str, list[Node], int], "str | None"]
"""(goal, nodes, step) -> the next action, or None when there is nothing more to do."""


def _by_name(nodes: list[Node], role: str, name: str) -> Node | None:
    for node in nodes:
        if node.role == role and node.name == name:
            return node
    return None


def _quoted_values(goal: str) -> list[str]:
    return re.findall(r'"([^"]*)"', goal)


def _solve_click_button(goal: str, nodes: list[Node], step: int) -> str | None:
    # 'Click on the "okay" button.'
    (label,) = _quoted_values(goal)[:1] or [""]
    node = _by_name(nodes, "button", label)
    return f"click({node.bid!r})" if node and step == 0 else None


def _solve_click_link(goal: str, nodes: list[Node], step: int) -> str | None:
    # 'Click on the link "ipsum".'
    (label,) = _quoted_values(goal)[:1] or [""]
    # MiniWoB's links are spans with a click handler: a clickable container showing the label.
    node = _by_name(nodes, "link", label) or next(
        (node for node in nodes if node.role == "generic" and node.text == label), None)
    return f"click({node.bid!r})" if node and step == 0 else None


def _solve_click_test(goal: str, nodes: list[Node], step: int) -> str | None:
    node = next((node for node in nodes if node.role == "button"), None)
    return f"click({node.bid!r})" if node and step == 0 else None


def _solve_enter_text(goal: str, nodes: list[Node], step: int) -> str | None:
    # 'Enter "Kasie" into the text field and press Submit.'
    (text,) = _quoted_values(goal)[:1] or [""]
    field = next((node for node in nodes if node.role == "textbox"), None)
    submit = _by_name(nodes, "button", "Submit")
    if field is None or submit is None:
        return None
    return [f"fill({field.bid!r}, {text!r})", f"click({submit.bid!r})", None][min(step, 2)]


def _solve_login_user(goal: str, nodes: list[Node], step: int) -> str | None:
    # 'Enter the username "kanesha" and the password "Ci" into the text fields and press login.'
    values = re.findall(r'the (?:username|password) "([^"]*)"', goal)
    fields = [node for node in nodes if node.role == "textbox"]
    login = next((node for node in nodes if node.role == "button" and node.name.lower() == "login"), None)
    if len(values) != 2 or len(fields) < 2 or login is None:
        return None
    plan = [f"fill({fields[0].bid!r}, {values[0]!r})", f"fill({fields[1].bid!r}, {values[1]!r})", f"click({login.bid!r})"]
    return plan[step] if step < len(plan) else None


def _solve_choose_list(goal: str, nodes: list[Node], step: int) -> str | None:
    # 'Select Kasie from the list and click Submit.'
    match = re.match(r"Select (.+) from the list and click Submit", goal)
    select = next((node for node in nodes if node.role == "combobox"), None)
    submit = _by_name(nodes, "button", "Submit")
    if match is None or select is None or submit is None:
        return None
    return [f"select_option({select.bid!r}, {match.group(1)!r})", f"click({submit.bid!r})", None][min(step, 2)]


def _solve_focus_text(goal: str, nodes: list[Node], step: int) -> str | None:
    field = next((node for node in nodes if node.role == "textbox"), None)
    return f"click({field.bid!r})" if field and step == 0 else None


def _solve_click_dialog(goal: str, nodes: list[Node], step: int) -> str | None:
    # 'Close the dialog box by clicking the "x".'  The jQuery UI close button is named "Close".
    node = next((node for node in nodes if node.role == "button" and node.name.lower() in ("close", "x")), None)
    return f"click({node.bid!r})" if node and step == 0 else None


def _solve_click_checkboxes(goal: str, nodes: list[Node], step: int) -> str | None:
    # 'Select words similar to ... / Select nTpaxt, tJ and click Submit.'
    match = re.match(r"Select (.*) and click Submit", goal)
    if match is None or "nothing" in match.group(1):
        wanted: list[str] = []
    else:
        wanted = [word.strip() for word in match.group(1).split(",") if word.strip()]
    boxes = [node for node in nodes if node.role == "checkbox"]
    submit = _by_name(nodes, "button", "Submit")
    if submit is None:
        return None
    plan = [f"click({box.bid!r})" for box in boxes if box.name in wanted] + [f"click({submit.bid!r})"]
    return plan[step] if step < len(plan) else None


MINIWOB_SOLVERS: dict[str, MiniWobSolver] = {
    "click-test": _solve_click_test,
    "click-button": _solve_click_button,
    "click-link": _solve_click_link,
    "enter-text": _solve_enter_text,
    "login-user": _solve_login_user,
    "choose-list": _solve_choose_list,
    "focus-text": _solve_focus_text,
    "click-dialog": _solve_click_dialog,
    "click-checkboxes": _solve_click_checkboxes,
}
