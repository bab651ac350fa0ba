"""WebArena's evaluators on hand-built cases, and WebArena task configs run against a local site."""

from __future__ import annotations

import http.server
import json
import random
import threading
from urllib.parse import urlsplit

import pytest

from longhorizon.envs.base import action_from_reply, list_tasks, make_env, make_policy
from longhorizon.envs.web.browser import BrowserPool
from longhorizon.envs.web.evaluators import (
    evaluate, exact_match, fuzzy_match, must_include, required_contents_match, string_match,
    unsupported_features, url_match,
)
from longhorizon.envs.web.webarena import site_name, split_of

# -- the evaluators --------------------------------------------------------------------------------


def test_string_match_follows_webarena():
    assert exact_match("Yes", ' "yes" ') and not exact_match("yes", "yes!")
    assert must_include("1", "10 items", tokenize=False)
    assert not must_include("1", "10 items", tokenize=True)  # one short reference must be a whole token
    assert must_include("1", "it is 1 item", tokenize=True)
    assert fuzzy_match("New York", "It is in new-york!") and not fuzzy_match("York", "Yorkshire")
    assert string_match({"exact_match": "42"}, "'42'") == (True, "string_match: passed")
    assert string_match({"must_include": ["lamp", "19.99"]}, "The Lamp costs $19.99")[0]
    ok, detail = string_match({"must_include": ["lamp", "21"]}, "The Lamp costs $19.99")
    assert not ok and "'21'" in detail
    assert string_match({"must_include": ["7"]}, "in 2017")[0] is False
    assert string_match({"fuzzy_match": "N/A"}, "n/a")[0] and not string_match({"fuzzy_match": "N/A"}, "none")[0]
    assert string_match({"fuzzy_match": ["Pittsburgh", "PA"]}, "pittsburgh, pa")[0]
    assert not string_match({"regex": "x"}, "x")[0] and not string_match({}, "x")[0]


def test_url_match_is_gold_in_pred():
    gold = "http://shop:7770/catalog/search?q=lamp"
    assert url_match(gold, "http://shop:7770/catalog/search/?q=lamp&page=2")[0]  # gold path contained, query kept
    assert url_match(gold, "http://shop:7770/catalog/search?page=2&q=lamp")[0]
    assert url_match(gold, "http://shop:7770/catalog/search?q=desk")[0] is False
    assert url_match(gold + "/", "http://shop:7770/catalog/search?q=lamp")[0]
    assert url_match("http://shop:7770/a |OR| http://shop:7770/b", "http://shop:7770/b")[0]
    assert url_match("http://shop:7770/a", "http://shop:7770/a/b/c")[0]  # the gold path is contained
    assert url_match("http://shop:7770/a", "http://shop:7770/c")[0] is False
    assert url_match(gold, gold, url_note="EXACT")[0] is False


def test_program_html_and_combined_scores():
    assert required_contents_match({"exact_match": "fish & chips"}, "Fish &amp; chips")[0]  # the page text is unescaped
    assert required_contents_match({"must_include": ["lamp |OR| light", "desk"]}, "Desk light")[0]
    assert not required_contents_match({"must_include": ["lamp |OR| light", "desk"]}, "Table light")[0]
    config = {
        "eval_types": ["string_match", "program_html"],
        "reference_answers": {"must_include": ["done"]},
        "program_html": [{"url": "last", "locator": "", "required_contents": {"must_include": ["Saved"]}}],
    }
    assert evaluate(config, answer="done", final_url="x", page_contents=["<p>Saved</p>"]).score == 1.0
    failed = evaluate(config, answer="done", final_url="x", page_contents=["<p>Draft</p>"])
    assert failed.score == 0.0 and not failed.success and "program_html target 0" in failed.details[1]
    assert evaluate(config, answer="done", final_url="x", page_contents=[None]).score == 0.0
    state = {"eval_types": ["state_check"], "state_check": [{"a": 1}, {"b": 2}]}
    assert evaluate(state, answer="", final_url="", state_results=[(True, "a"), (True, "b")]).score == 1.0
    assert evaluate(state, answer="", final_url="", state_results=[(True, "a"), (False, "b wrong")]).details == [
        "state_check 1: b wrong"]
    assert evaluate(state, answer="", final_url="", state_results=[(True, "a")]).score == 0.0
    assert evaluate({"eval_types": []}, answer="", final_url="").score == 0.0
    assert unsupported_features({"eval_types": ["program_html", "llm_judge"], "program_html": [
        {"url": "func:reddit_get_post_url('__last_url__')", "locator": "document.body.textContent"},
        {"url": "last", "locator": "func:get_query_text(__page__, '.x')"},
    ]}) == ["eval type 'llm_judge'",
            "program_html url \"func:reddit_get_post_url('__last_url__')\" (a WebArena helper function)",
            "program_html locator \"func:get_query_text(__page__, '.x')\" (a WebArena helper function)"]


def test_site_names_and_splits():
    assert site_name("__SHOPPING_ADMIN__") == "shopping_admin" and site_name("gitlab") == "gitlab"
    with pytest.raises(ValueError):
        site_name("__bad url__")
    assert split_of("17") == split_of("17") and {split_of(str(i)) for i in range(50)} == {"train", "test"}


# -- WebArena configs against a local shop -------------------------------------------------------------

SHOP_PAGES = {
    "/": "<html><head><title>One Stop Market</title></head><body><h1>One Stop Market</h1>"
         "<a href='/product/42'>Desk lamp</a> <a href='/catalog/search?q=lamp'>Search lamps</a>"
         "<a href='/account'>My account</a></body></html>",
    "/product/42": "<html><head><title>Desk lamp</title></head><body><h1>Desk lamp</h1>"
                   "<p>Price: $19.99</p></body></html>",
    "/catalog/search": "<html><head><title>Search</title></head><body><p>1 result for lamp</p></body></html>",
    "/account": "<html><head><title>Account</title></head><body><p id='who'></p>"
                "<script>document.getElementById('who').textContent = 'Signed in: ' + document.cookie;</script>"
                "</body></html>",
}


@pytest.fixture(scope="module")
def shop():
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = SHOP_PAGES.get(urlsplit(self.path).path)
            self.send_response(200 if body else 404)
            payload = (body or "not found").encode()
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    server.server_close()


def _config(task_id, intent, eval_config, *, oracle, sites=("shopping",), start_url="__SHOPPING__", **extra):
    return {"sites": list(sites), "task_id": task_id, "require_login": True,
            "storage_state": "./.auth/shopping_state.json", "start_url": start_url, "geolocation": None,
            "intent_template": intent, "instantiation_dict": {}, "intent": intent, "require_reset": False,
            "eval": {"reference_url": "", "program_html": [], "url_note": "GOLD in PRED", **eval_config},
            "oracle": oracle, **extra}


def _write_configs(folder, shop_url):
    folder.mkdir()
    configs = [
        _config(0, "What is the price of the desk lamp?",
                {"eval_types": ["string_match"], "reference_answers": {"must_include": ["19.99"]}},
                oracle=[["click", {"role": "link", "name": "Desk lamp"}], ["stop", "$19.99"]]),
        _config(1, "Show me the search results for lamps.",
                {"eval_types": ["url_match"], "reference_url": "__SHOPPING__/catalog/search?q=lamp"},
                oracle=[["click", {"role": "link", "name": "lamps", "exact": False}], ["stop", ""]]),
        _config(2, "Open my account page.",
                {"eval_types": ["program_html"], "program_html": [
                    {"url": "__SHOPPING__/account", "locator": "document.querySelector('#who').textContent",
                     "required_contents": {"must_include": ["session=emma"]}}]},
                oracle=[["stop", ""]]),
        _config(3, "Which post is newest?",
                {"eval_types": ["program_html"], "program_html": [
                    {"url": "func:reddit_get_post_url('__last_url__')", "locator": "",
                     "required_contents": {"must_include": ["x"]}}]},
                oracle=[["stop", ""]]),
        _config(4, "Star the repo.", {"eval_types": ["url_match"], "reference_url": "__GITLAB__/x"},
                oracle=[["stop", ""]], sites=("gitlab",), start_url="__GITLAB__"),
        _config(5, "What is the price of the flying car?",
                {"eval_types": ["string_match"], "reference_answers": {"fuzzy_match": "N/A"}},
                oracle=[["go_back"], ["stop", "N/A"]], start_url="__SHOPPING__/product/42 |AND| __SHOPPING__"),
    ]
    (folder / "test.raw.json").write_text(json.dumps(configs[:3]))
    for config in configs[3:]:
        (folder / f"{config['task_id']}.json").write_text(json.dumps(config))
    auth = folder.parent / ".auth"
    auth.mkdir()
    host = urlsplit(shop_url).hostname
    (auth / "shopping_state.json").write_text(json.dumps({"cookies": [
        {"name": "session", "value": "emma", "domain": host, "path": "/", "expires": -1, "httpOnly": False,
         "secure": False, "sameSite": "Lax"}], "origins": []}))
    return auth


@pytest.fixture(scope="module")
def pool():
    browser_pool = BrowserPool(1)
    yield browser_pool
    browser_pool.close()


@pytest.mark.browser
async def test_webarena_configs_run_against_a_local_site(shop, pool, tmp_path):
    auth = _write_configs(tmp_path / "configs", shop)
    options = {"config": str(tmp_path / "configs"), "sites": {"__SHOPPING__": shop}, "storage_state_dir": str(auth),
               "all_test": True, "pool": pool}
    tasks = list_tasks("webarena", "test", **options)
    # 3: a Python helper evaluator; 4: a site without a URL.
    assert [task.task_id for task in tasks] == ["0", "1", "2", "5"]
    assert list_tasks("webarena", "train", **options) == []
    assert [task.task_id for task in list_tasks("webarena", "test", **{**options, "skip_unsupported": False})] == [
        "0", "1", "2", "3", "5"]
    env = make_env("webarena", **options)
    try:
        for task in tasks:
            observation, _ = await env.reset(task)
            assert observation.startswith(f"Goal: {task.data['intent']}\nURL: {shop}")
            policy = make_policy("webarena", "oracle", **options)
            policy.reset(task, observation, random.Random(0))
            for _ in range(5):
                action = action_from_reply(policy.act(observation), env.prompt_format)
                observation, reward, terminated, _, info = await env.step(action)
                if terminated:
                    break
            assert (reward, info["success"]) == (1.0, True), (task.task_id, info, observation)

        # A wrong answer fails, and the start URL with " |AND| " opened two tabs with the first active.
        observation, _ = await env.reset(tasks[3])
        assert f"URL: {shop}/product/42" in observation
        assert "Tabs: [0] 'Desk lamp' (active), [1] 'One Stop Market'" in observation
        _, reward, _, _, info = await env.step("send_msg_to_user('It costs $5')")
        assert (reward, info["success"]) == (0.0, False)
        # The browser only reaches the given sites.
        await env.reset(tasks[0])
        observation, *_, info = await env.step("goto('http://127.0.0.1:9/')")
        assert info["invalid_action"] and "blocked" in observation
    finally:
        await env.close()

    logged_out = make_env("webarena", **{**options, "storage_state_dir": str(tmp_path / "configs")})
    try:
        with pytest.raises(ValueError, match="auto_login"):
            await logged_out.reset(tasks[0])
    finally:
        await logged_out.close()
    with pytest.raises(ValueError, match="placeholders"):
        make_env("webarena", config=options["config"], sites={})
