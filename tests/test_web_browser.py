"""The browser layer: action parsing, the tree text, request blocking, crash and hang recovery, the plan oracle."""

from __future__ import annotations

import http.server
import random
import threading

import psutil
import pytest
import trio

from longhorizon.envs.base import Task, action_from_reply
from longhorizon.envs.web.actions import ActionError, parse_action
from longhorizon.envs.web.browser import BrowserFailure, BrowserPool, SessionOptions, is_allowed, normalize_origins, origin_of
from longhorizon.envs.web.env import BrowserEnv, replace_placeholders
from longhorizon.envs.web.observation import quote, render_tree
from longhorizon.envs.web.policies import PlanOraclePolicy, RandomClickerPolicy, find_bid, parse_nodes

# -- pure parts ------------------------------------------------------------------------------------


def test_origins_are_normalised_and_only_allowed_ones_pass():
    assert origin_of("http://127.0.0.1:8000/a?b=1") == "http://127.0.0.1:8000"
    assert origin_of("https://Example.com/x") == "https://example.com:443"
    assert origin_of("ws://localhost:9/socket") == "http://localhost:9"
    assert origin_of("file:///etc/passwd") == ""
    allowed = normalize_origins(["http://127.0.0.1:8000"])
    assert is_allowed("http://127.0.0.1:8000/page", allowed)
    assert not is_allowed("http://127.0.0.1:8001/page", allowed)
    assert not is_allowed("http://localhost:8000/page", allowed)  # another host name is another origin
    assert not is_allowed("https://example.com/", allowed)
    assert not is_allowed("file:///etc/passwd", allowed)
    assert is_allowed("data:text/plain,hi", allowed) and is_allowed("about:blank", allowed)
    with pytest.raises(ValueError, match="not an http"):
        normalize_origins(["127.0.0.1:8000"])


def test_actions_parse_into_calls_with_checked_arguments():
    assert parse_action("click('12')").args == ("12",)
    assert parse_action("click(12)").args == ("12",)
    assert parse_action("click('ab3')").args == ("ab3",)  # element 3 of a frame inside a frame
    assert parse_action("```\nfill('3', \"it's here\")\n```").args == ("3", "it's here")
    assert parse_action("select_option('4', ['a', 'b'])").args == ("4", ["a", "b"])
    assert parse_action("scroll(0, 300)").args == (0, 300)
    assert parse_action("press(bid='5', key_comb='Enter')").args == ("5", "Enter")
    assert parse_action("go_back()").args == ()
    stop = parse_action("stop()")
    assert stop.terminal and stop.answer == ""
    assert parse_action("send_msg_to_user('42 apples')").answer == "42 apples"
    for bad, message in [
        ("", "empty"),
        ("click", "not an action call"),
        ("clik('1')", "unknown action"),
        ("click('1'", "could not parse"),
        ("click(__import__('os'))", "plain strings"),
        ("click('12a')", "not an element id"),
        ("click('A12')", "not an element id"),
        ("fill('1')", "needs the argument"),
        ("scroll('down')", "wrong type"),
        ("go_back(1)", "at most 0"),
        ("click('1'); click('2')", "could not parse"),
    ]:
        with pytest.raises(ActionError, match=message):
            parse_action(bad)


def _ax(node_id, role, name="", parent=None, children=(), backend=None, **extra):
    node = {"nodeId": node_id, "role": {"value": role}, "name": {"value": name}, "childIds": list(children),
            "backendDOMNodeId": backend}
    if parent:
        node["parentId"] = parent
    node.update(extra)
    return node


def test_tree_text_follows_the_contract():
    nodes = [
        _ax("1", "RootWebArea", "Tickets - Demo", children=["2", "3", "9"], backend=100),
        _ax("2", "generic", parent="1", children=["4", "5"], backend=102),
        _ax("4", "link", "Home", parent="2", children=["6"], backend=104),
        _ax("6", "StaticText", "Home", parent="4", children=["7"], backend=106),
        _ax("7", "InlineTextBox", "Home", parent="6"),
        _ax("5", "heading", "Tickets", parent="2", backend=105,
            properties=[{"name": "level", "value": {"value": 1}}]),
        _ax("3", "textbox", "Title", parent="1", backend=103, value={"value": "it's"},
            properties=[{"name": "focused", "value": {"value": True}}, {"name": "required", "value": {"value": False}}]),
        _ax("9", "generic", parent="1", children=["10"], backend=109),
        _ax("10", "StaticText", "Lorem 'ipsum'\n dolor", parent="9", backend=110),
    ]
    bids = {102: "2", 103: "3", 104: "4", 105: "5", 109: "9"}
    lines = render_tree(nodes, bids, clickable_backend_nodes={109}, root_bid="1")
    assert lines == [
        "[1] RootWebArea 'Tickets - Demo'",
        "  [4] link 'Home'",  # the plain container is left out; the repeated link text too
        "  [5] heading 'Tickets' level=1",
        "  [3] textbox 'Title' value='it\\'s' focused",
        "  [9] generic",  # a container with a click handler stays, so it can be clicked
        "    StaticText 'Lorem \\'ipsum\\' dolor'",
    ]
    assert quote("a\\b") == "'a\\\\b'"
    assert find_bid("\n".join(lines), "textbox", "Title") == "3"
    assert find_bid("\n".join(lines), "link", "hom", exact=False) == "4"
    assert find_bid("\n".join(lines), "link", "Away") is None
    assert [node.name for node in parse_nodes("\n".join(lines))][-1] == ""


def test_placeholders_are_replaced_by_base_urls():
    urls = {"__SHOP__": "http://127.0.0.1:5/", "__SHOP_ADMIN__": "http://127.0.0.1:6"}
    assert replace_placeholders("__SHOP_ADMIN__/x and __SHOP__/y", urls) == "http://127.0.0.1:6/x and http://127.0.0.1:5/y"


# -- against a real Chromium and local servers -------------------------------------------------------

DEMO_PAGE = """<html><head><title>Demo - Tickets</title></head><body>
<h1>Tickets</h1>
<a href="/other.html">Other page</a>
<a href="/other.html" target="_blank">Other in a new tab</a>
<label for="title">Title</label><input id="title">
<select aria-label="Status"><option value="o">Open</option><option value="f">Fixed</option></select>
<button onclick="document.getElementById('out').textContent =
  'Saved ' + document.getElementById('title').value + ' as ' + document.querySelector('select').value">Save</button>
<button onclick="while (true) {}">Freeze</button>
<button onclick="document.getElementById('out').textContent = confirm('Really remove?') ? 'Removed' : 'Kept'">Remove</button>
<p id="out">Nothing saved</p>
</body></html>"""
OTHER_PAGE = "<html><head><title>Other</title></head><body><p>The second page</p></body></html>"
LEAKY_PAGE = """<html><head><title>Leaky</title>
<link rel="stylesheet" href="https://example.com/style.css"></head><body>
<img src="http://example.com/pixel.png"><img src="__FORBIDDEN__/pixel.png">
<p id="result">pending</p>
<script>
async function probe(url) { try { const r = await fetch(url); return 'LEAKED ' + (await r.text()); }
                            catch (e) { return 'blocked'; } }
(async () => {
  const outside = await probe('http://example.com/');
  const forbidden = await probe('__FORBIDDEN__/secret');
  let socket = 'blocked';
  await new Promise((resolve) => {
    try { const ws = new WebSocket('ws://example.com/ws'); ws.onopen = () => { socket = 'LEAKED'; resolve(); };
          ws.onerror = ws.onclose = () => resolve(); } catch (e) { resolve(); }
    setTimeout(resolve, 3000);
  });
  document.getElementById('result').textContent = 'outside ' + outside + ', forbidden ' + forbidden + ', socket ' + socket;
})();
</script></body></html>"""


class _CountingServer:
    """A static server on 127.0.0.1 that counts the requests it gets."""

    def __init__(self, pages: dict[str, str]) -> None:
        self.requests: list[str] = []
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                owner.requests.append(self.path)
                body = pages.get(self.path.split("?")[0], "secret").encode()
                self.send_response(200 if self.path.split("?")[0] in pages or self.path == "/secret" else 404)
                self.send_header("Content-Type", "text/html; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class DemoSite:
    """A Site over a counting server; check_state checks are recorded and answered from `state`."""

    def __init__(self, name: str, server: _CountingServer) -> None:
        self.name = name
        self.server = server
        self.state = {"saved": False}
        self.starts = self.resets = self.stops = 0

    @property
    def base_url(self) -> str:
        return self.server.url

    @property
    def allowed_origins(self) -> tuple[str, ...]:
        return (self.server.url,)

    def start(self) -> None:
        self.starts += 1

    def reset(self) -> None:
        self.resets += 1

    def check_state(self, check):
        if check.get("type") != "flag":
            raise ValueError(f"unknown check {check}")
        return bool(self.state.get(check["flag"])) == check["expected"], f"flag {check['flag']}"

    def stop(self) -> None:
        self.stops += 1


@pytest.fixture(scope="module")
def servers():
    forbidden = _CountingServer({"/pixel.png": "x"})
    allowed = _CountingServer({
        "/page.html": DEMO_PAGE,
        "/other.html": OTHER_PAGE,
        "/leaky.html": LEAKY_PAGE.replace("__FORBIDDEN__", forbidden.url),
    })
    yield allowed, forbidden
    allowed.stop()
    forbidden.stop()


@pytest.fixture(scope="module")
def pool():
    browser_pool = BrowserPool(1)
    yield browser_pool
    browser_pool.close()


def _task(task_id: str, **data) -> Task:
    return Task(env_name="webtest", task_id=task_id, split="train", data={"sites": ["demo"], **data})


async def _play(env: BrowserEnv, policy, task: Task, max_steps: int = 15):
    observation, _ = await env.reset(task, seed=0)
    policy.reset(task, observation, random.Random(0))
    for _ in range(max_steps):
        action = action_from_reply(policy.act(observation), env.prompt_format)
        observation, reward, terminated, truncated, info = await env.step(action)
        if terminated or truncated:
            return observation, reward, info
    raise AssertionError(f"no end within {max_steps} steps; last observation:\n{observation}")


@pytest.mark.browser
async def test_plan_oracle_fills_selects_clicks_and_is_scored(servers, pool):
    allowed, _ = servers
    site = DemoSite("demo", allowed)
    env = BrowserEnv(name="webtest", sites={"demo": site}, pool=pool)
    plan = [
        ["fill", {"role": "textbox", "name": "Title"}, "Crash on start"],
        ["select_option", {"role": "combobox", "name": "Status"}, "Fixed"],
        ["click", {"role": "button", "name": "Save"}],
        ["stop", "Saved Crash on start"],
    ]
    task = _task(
        "save", intent="Save the ticket.", start_url="__DEMO__/page.html", oracle=plan,
        eval={"eval_types": ["string_match", "url_match", "program_html", "state_check"],
              "reference_answers": {"must_include": ["crash on start"]},
              "reference_url": "__DEMO__/page.html", "url_note": "GOLD in PRED",
              "program_html": [{"url": "last", "locator": "document.querySelector('#out').textContent",
                                "required_contents": {"exact_match": "Saved Crash on start as f"}}],
              "state_check": [{"type": "flag", "flag": "saved", "expected": True}]},
    )
    try:
        observation, _ = await env.reset(task)
        assert observation.startswith("Goal: Save the ticket.\nURL: " + allowed.url + "/page.html\n")
        assert "Tabs: [0] 'Demo - Tickets' (active)" in observation
        assert "button 'Save'" in observation and "StaticText 'Nothing saved'" in observation

        site.state["saved"] = True  # what the app would record after the save
        observation, reward, info = await _play(env, PlanOraclePolicy(), task)
        assert (reward, info["success"]) == (1.0, True), info
        assert info["eval_details"] == ["string_match: passed", "url_match: passed", "program_html: passed",
                                        "state_check: passed"]

        # A wrong final state fails the same plan; the second episode reset the site first.
        site.state["saved"] = False
        _, reward, info = await _play(env, PlanOraclePolicy(), task)
        assert (reward, info["success"]) == (0.0, False)
        assert info["eval_details"][-1] == "state_check 0: flag saved"
        assert (site.starts, site.resets) == (1, 2)  # started once, reset before each later episode

        # A plan whose target is missing gives up with a message naming it.
        broken = _task("broken", intent="x", start_url="__DEMO__/page.html",
                       oracle=[["click", {"role": "button", "name": "Delete"}]],
                       eval={"eval_types": ["string_match"], "reference_answers": {"exact_match": "done"}})
        policy = PlanOraclePolicy()
        _, reward, info = await _play(env, policy, broken)
        assert reward == 0.0 and "Delete" in policy.problem and "oracle failed" in info["answer"]
    finally:
        await env.close()
    assert site.stops == 1


@pytest.mark.browser
async def test_errors_tabs_and_navigation(servers, pool):
    allowed, _ = servers
    env = BrowserEnv(name="webtest", sites={"demo": DemoSite("demo", allowed)}, pool=pool)
    task = _task("tabs", intent="Look around.", start_url="__DEMO__/page.html",
                 eval={"eval_types": ["string_match"], "reference_answers": {"exact_match": "x"}})
    try:
        first, _ = await env.reset(task)
        observation, reward, terminated, truncated, info = await env.step("clik('1')")
        assert info["invalid_action"] and "Error: unknown action 'clik'" in observation
        assert (reward, terminated, truncated) == (0.0, False, False)
        observation, *_, info = await env.step("click('99999')")
        assert info["invalid_action"] and "no element with id 99999" in observation
        # Ids stay put between observations of the same document.
        observation, *_, info = await env.step("noop(10)")
        assert not info["invalid_action"] and observation == first

        link = find_bid(observation, "link", "Other in a new tab")
        observation, *_ = await env.step(f"click({link!r})")
        assert "Tabs: [0] 'Demo - Tickets', [1] 'Other' (active)" in observation
        assert "StaticText 'The second page'" in observation
        observation, *_ = await env.step("tab_focus(0)")
        assert "[1] 'Other'\n" in observation.replace("(active)", "") and observation.count("(active)") == 1
        assert "heading 'Tickets'" in observation
        observation, *_, info = await env.step("tab_focus(5)")
        assert info["invalid_action"] and "there is no tab 5" in observation
        observation, *_ = await env.step("goto('__DEMO__/other.html')")
        assert f"URL: {allowed.url}/other.html" in observation
        observation, *_ = await env.step("go_back()")
        assert f"URL: {allowed.url}/page.html" in observation
        observation, *_, info = await env.step("goto('file:///etc/passwd')")
        assert info["invalid_action"] and "blocked" in observation and "URL: file:" not in observation
        observation, *_ = await env.step(f"click({find_bid(observation, 'button', 'Remove')!r})")
        assert "\nDialog: confirm 'Really remove?' (accepted)\n" in observation
        assert "StaticText 'Removed'" in observation
        observation, *_ = await env.step("noop(10)")
        assert "Dialog:" not in observation  # each dialog is reported once
        observation, *_ = await env.step("new_tab()")
        assert "[2] '' (active)" in observation
        observation, reward, terminated, *_ = await env.step("stop('y')")
        assert terminated and reward == 0.0
        with pytest.raises(RuntimeError, match="reset"):
            await env.step("noop()")
    finally:
        await env.close()


@pytest.mark.browser
async def test_pages_cannot_reach_other_origins(servers, pool):
    allowed, forbidden = servers
    env = BrowserEnv(name="webtest", sites={"demo": DemoSite("demo", allowed)}, pool=pool)
    task = _task("leak", intent="Wait.", start_url="__DEMO__/leaky.html",
                 eval={"eval_types": ["string_match"], "reference_answers": {"exact_match": "x"}})
    before = len(forbidden.requests)
    try:
        await env.reset(task)
        with trio.fail_after(15):
            while True:
                observation, *_ = await env.step("noop(300)")
                if "pending" not in observation:
                    break
        assert "StaticText 'outside blocked, forbidden blocked, socket blocked'" in observation, observation
        observation, *_, info = await env.step(f"goto('{forbidden.url}/secret')")
        assert info["invalid_action"] and "outside the sites of the task and was blocked" in observation
        assert "secret" not in observation.split("Error:")[0]
        blocked = env._episode.session.blocked_requests
        assert any(url.startswith("https://example.com/style.css") for url in blocked)
        assert any(url.startswith("ws://example.com") for url in blocked)
        assert any(url.startswith(forbidden.url) for url in blocked)
    finally:
        await env.close()
    assert forbidden.requests[before:] == []  # the not-allowed local server got nothing at all


@pytest.mark.browser
async def test_killed_browser_fails_the_episode_and_the_next_one_works(servers, pool):
    allowed, _ = servers
    env = BrowserEnv(name="webtest", sites={"demo": DemoSite("demo", allowed)}, pool=pool)
    task = _task("crash", intent="Survive.", start_url="__DEMO__/page.html",
                 eval={"eval_types": ["string_match"], "reference_answers": {"exact_match": "x"}})
    try:
        await env.reset(task)
        (pid,) = pool.browser_pids()
        relaunches = pool.stats.relaunches
        psutil.Process(pid).kill()
        psutil.Process(pid).wait(10) if psutil.pid_exists(pid) else None
        with pytest.raises(BrowserFailure, match="crashed or was killed"):
            for _ in range(10):  # the disconnect event may take a moment to arrive
                await env.step("noop(100)")
        with pytest.raises(RuntimeError, match="reset"):
            await env.step("noop()")
        observation, _ = await env.reset(task)
        assert "button 'Save'" in observation
        observation, *_, info = await env.step("noop(10)")
        assert not info["invalid_action"]
        assert pool.stats.relaunches == relaunches + 1 and pool.browser_pids() != [pid]
    finally:
        await env.close()


@pytest.mark.browser
async def test_a_frozen_page_fails_its_episode_without_costing_the_browser(servers, pool):
    allowed, _ = servers
    env = BrowserEnv(name="webtest", sites={"demo": DemoSite("demo", allowed)}, pool=pool)
    env.session_options = SessionOptions(action_timeout_s=1.0, navigation_timeout_s=3.0, hang_grace_s=1.5)
    task = _task("freeze", intent="Freeze.", start_url="__DEMO__/page.html",
                 eval={"eval_types": ["string_match"], "reference_answers": {"exact_match": "x"}})
    try:
        observation, _ = await env.reset(task)
        pids = pool.browser_pids()
        freeze = find_bid(observation, "button", "Freeze")
        with pytest.raises(BrowserFailure, match="did not answer"):
            await env.step(f"click({freeze!r})")
        observation, _ = await env.reset(task)
        assert "button 'Save'" in observation
        assert pool.browser_pids() == pids  # the browser itself kept running
    finally:
        await env.close()


@pytest.mark.browser
async def test_random_clicker_plays_without_errors(servers, pool):
    allowed, _ = servers
    env = BrowserEnv(name="webtest", sites={"demo": DemoSite("demo", allowed)}, pool=pool, action_timeout_s=1.0)
    task = _task("random", intent="Click around.", start_url="__DEMO__/page.html",
                 eval={"eval_types": ["string_match"], "reference_answers": {"exact_match": "x"}})
    policy = RandomClickerPolicy(stop_probability=0.0)
    try:
        observation, _ = await env.reset(task)
        policy.reset(task, observation, random.Random(3))
        for _ in range(6):
            reply = policy.act(observation)
            action = action_from_reply(reply, env.prompt_format)
            if f"'{find_bid(observation, 'button', 'Freeze')}'" in action:
                continue  # the freezing button is the hang test's business
            observation, reward, terminated, truncated, info = await env.step(action)
            assert observation.startswith("Goal: Click around.") and reward == 0.0
            if terminated:
                break
    finally:
        await env.close()


@pytest.mark.browser
async def test_a_pool_spreads_concurrent_sessions_over_its_browsers(servers):
    allowed, _ = servers
    two = BrowserPool(2)
    try:
        sessions = []

        async def open_one() -> None:
            sessions.append(await two.open_session([allowed.url]))

        async with trio.open_nursery() as nursery:
            for _ in range(4):
                nursery.start_soon(open_one)
        assert sorted(session.slot.index for session in sessions) == [0, 0, 1, 1]
        assert len(set(two.browser_pids())) == 2 and two.stats.launches == 2
        # Contexts are isolated: a cookie set in one is not seen by another on the same browser.
        first, second = [session for session in sessions if session.slot.index == 0]

        async def set_cookie(session) -> None:
            await session.context.add_cookies([{"name": "who", "value": "first", "url": allowed.url}])

        async def cookies(session) -> list:
            return await session.context.cookies()

        await first.call(set_cookie, timeout_s=5)
        assert [cookie["value"] for cookie in await first.call(cookies, timeout_s=5)] == ["first"]
        assert await second.call(cookies, timeout_s=5) == []
        for session in sessions:
            await session.aclose()
        assert [slot.live_sessions for slot in two._slots] == [0, 0]
    finally:
        await two.aclose()
