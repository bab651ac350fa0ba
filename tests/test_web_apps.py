"""Local web apps without a browser: start, serve over HTTP, check state, reset; and the task files."""

import json
import sqlite3
import urllib.error
import urllib.parse
import urllib.request

import psutil
import pytest

from longhorizon.envs.base import list_tasks, make_env
from longhorizon.envs.web.apps import tasks as task_files
from longhorizon.envs.web.apps.dokuwiki import DokuWikiSite, page_file
from longhorizon.envs.web.apps.fossil import FossilSite
from longhorizon.envs.web.apps.serving import check_sql
from longhorizon.envs.web.apps.shop import ShopSite
from longhorizon.envs.web.apps.shop_catalog import build_products, format_price
from longhorizon.envs.web.local import parse_sites
from longhorizon.envs.web.site import Site


def fetch(url: str, form: dict | None = None) -> tuple[int, str, str]:
    """(status, final URL, body) of a GET, or of a POST when `form` is given."""
    data = urllib.parse.urlencode(form).encode() if form is not None else None
    try:
        with urllib.request.urlopen(url, data=data, timeout=20) as response:
            return response.status, response.geturl(), response.read().decode("utf-8", errors="replace")
    except urllib.error.HTTPError as error:
        return error.code, url, error.read().decode("utf-8", errors="replace")


@pytest.fixture(scope="module")
def shop():
    with ShopSite() as site:
        yield site


@pytest.fixture(scope="module")
def fossil():
    with FossilSite() as site:
        yield site


@pytest.fixture(scope="module")
def dokuwiki():
    with DokuWikiSite() as site:
        yield site


# --- the SQL check, on a hand-built database --------------------------------------------------


def test_sql_check_compares_the_first_value(tmp_path):
    database = tmp_path / "check.sqlite"
    connection = sqlite3.connect(database)
    connection.executescript("CREATE TABLE t (name TEXT, n INTEGER); INSERT INTO t VALUES ('Closed/Fixed', 3);")
    connection.commit()
    connection.close()
    assert check_sql(database, {"type": "sql", "query": "SELECT n FROM t", "expected": 3})[0]
    assert not check_sql(database, {"type": "sql", "query": "SELECT n FROM t", "expected": 4})[0]
    assert check_sql(database, {"type": "sql", "query": "SELECT name FROM t", "expected": "fixed", "match": "contains"})[0]
    assert not check_sql(database, {"type": "sql", "query": "SELECT name FROM t WHERE n = 9", "expected": "x"})[0]
    assert check_sql(database, {"type": "sql", "query": "SELECT name FROM t WHERE n = 9", "expected": None})[0]
    with pytest.raises(ValueError, match="query"):
        check_sql(database, {"type": "sql", "expected": 1})
    with pytest.raises(ValueError, match="valid: exact, contains"):
        check_sql(database, {"type": "sql", "query": "SELECT 1", "expected": 1, "match": "regex"})


# --- the shop ---------------------------------------------------------------------------------


def test_shop_serves_catalog_and_records_a_purchase_until_reset(shop):
    assert isinstance(shop, Site)
    kettle = next(product for product in build_products() if product.name == "Urban Kettle")
    status, _, body = fetch(f"{shop.base_url}/search?q=kettle")
    assert status == 200 and "Urban Kettle" in body
    status, _, body = fetch(f"{shop.base_url}/product/{kettle.id}")
    assert status == 200 and format_price(kettle.price_cents) in body and '<label for="quantity">Quantity</label>' in body

    in_cart = {"type": "sql", "query": f"SELECT quantity FROM cart_items WHERE product_id = {kettle.id}", "expected": 2}
    assert shop.check_state(in_cart) == (False, "sql check failed: got None, expected exact 2")
    _, final_url, _ = fetch(f"{shop.base_url}/cart/add", {"product_id": kettle.id, "quantity": 2})
    assert final_url.endswith(f"/product/{kettle.id}?added=1")
    assert shop.check_state(in_cart)[0]
    _, final_url, body = fetch(f"{shop.base_url}/checkout", {"name": "Sam Lee", "address": "5 Pine Road", "city": "Portland",
                                                            "postcode": "97201", "shipping": "Express"})
    assert final_url.endswith("/orders/9?placed=1") and "your order has been placed" in body
    assert shop.check_state({"type": "sql", "query": "SELECT city FROM orders WHERE id = 9", "expected": "Portland"})[0]
    assert shop.check_state({"type": "sql", "query": f"SELECT stock FROM products WHERE id = {kettle.id}",
                             "expected": kettle.stock - 2})[0]

    shop.reset()
    assert shop.check_state({"type": "sql", "query": "SELECT count(*) FROM orders", "expected": 8})[0]
    assert not shop.check_state(in_cart)[0]
    assert "Your cart is empty." in fetch(f"{shop.base_url}/cart")[2]


def test_shop_rejects_bad_input_with_an_error_page(shop):
    status, _, body = fetch(f"{shop.base_url}/cart/add", {"product_id": 1, "quantity": "lots"})
    assert status == 400 and "quantity must be a whole number" in body
    out_of_stock = next(product for product in build_products() if product.stock == 0)
    status, _, body = fetch(f"{shop.base_url}/cart/add", {"product_id": out_of_stock.id, "quantity": 1})
    assert status == 400 and "in stock" in body
    assert fetch(f"{shop.base_url}/product/9999")[0] == 404
    assert fetch(f"{shop.base_url}/checkout", {"name": "x"})[0] == 400  # empty cart
    with pytest.raises(ValueError, match="sql"):
        shop.check_state({"type": "page", "page": "start"})


# --- Fossil -----------------------------------------------------------------------------------


def test_fossil_serves_the_demo_project_and_reset_restores_the_repository(fossil):
    status, _, body = fetch(f"{fossil.base_url}/timeline")
    assert status == 200 and "Add Markdown tables support" in body
    _, _, body = fetch(f"{fossil.base_url}/rptview/1")
    assert "Unicode titles are garbled" in body and "edit" in body  # --localauth: the browser may edit
    _, _, body = fetch(f"{fossil.base_url}/tktnew")
    assert '<label for="title">Title</label>' in body and 'id="severity"' in body
    assert "Planning the 0.5 release" in fetch(f"{fossil.base_url}/forum")[2]
    assert "python -m build --wheel" in fetch(f"{fossil.base_url}/wiki?name=ReleaseProcess")[2]

    closed = {"type": "sql", "query": "SELECT status FROM ticket WHERE title = 'Unicode titles are garbled'",
              "expected": "Closed"}
    assert not fossil.check_state(closed)[0]
    connection = sqlite3.connect(fossil.repository)  # stands in for an edit made through the web form
    connection.execute("UPDATE ticket SET status = 'Closed' WHERE title = 'Unicode titles are garbled'")
    connection.commit()
    connection.close()
    assert fossil.check_state(closed)[0]
    fossil.reset()
    assert not fossil.check_state(closed)[0]
    assert fetch(f"{fossil.base_url}/home")[0] == 200


# --- DokuWiki ---------------------------------------------------------------------------------


def test_dokuwiki_serves_seeded_pages_with_search_and_reset_restores_them(dokuwiki):
    status, _, body = fetch(f"{dokuwiki.base_url}/doku.php?id=projects:apollo")
    assert status == 200 and "120,000 EUR" in body and "Northwind Labs Wiki" in body
    _, _, body = fetch(f"{dokuwiki.base_url}/doku.php?do=search&q=RabbitMQ")
    assert "projects:hermes" in body

    check = {"type": "page", "page": "projects:orion", "must_include": ["Lena Fischer"]}
    assert dokuwiki.check_state(check) == (False, "page 'projects:orion' does not exist")
    assert dokuwiki.check_state({"type": "page", "page": "projects:orion", "exists": False})[0]
    path = page_file(dokuwiki.data_dir, "projects:orion")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("====== Project Orion ======\nLead: Lena Fischer\n")
    assert dokuwiki.check_state(check)[0]
    assert "Project Orion" in fetch(f"{dokuwiki.base_url}/doku.php?id=projects:orion")[2]
    assert not dokuwiki.check_state({**check, "must_exclude": ["orion"]})[0]

    dokuwiki.reset()
    assert not dokuwiki.check_state(check)[0]
    assert "This topic does not exist yet" in fetch(f"{dokuwiki.base_url}/doku.php?id=projects:orion")[2]
    with pytest.raises(ValueError, match="not a valid page id"):
        dokuwiki.check_state({"type": "page", "page": "../../etc"})


# --- the task files ---------------------------------------------------------------------------


def test_task_set_has_the_required_size_and_mix():
    train, test = list_tasks("weblocal", "train"), list_tasks("weblocal", "test")
    assert len(train) >= 60 and len(test) >= 20
    assert not {task.task_id for task in train} & {task.task_id for task in test}
    configs = task_files.load_configs()
    for site in task_files.SITE_NAMES:
        kinds = {config["category"] for config in configs if config["sites"] == [site]}
        assert kinds == {f"{site}-info", f"{site}-state", f"{site}-url"}
    for config in configs:
        types = config["eval"]["eval_types"]
        assert ("string_match" in types) == config["category"].endswith("-info")
        assert ("state_check" in types) == config["category"].endswith("-state") == config["require_reset"]


def test_no_state_task_is_already_done_on_the_fresh_snapshot(shop, fossil, dokuwiki):
    sites = {"shop": shop, "fossil": fossil, "dokuwiki": dokuwiki}
    for site in sites.values():
        site.reset()
    for config in task_files.load_configs():
        if "state_check" in config["eval"]["eval_types"]:
            site = sites[config["sites"][0]]
            results = [site.check_state(check)[0] for check in config["eval"]["state_check"]]
            assert not all(results), f"{config['task_id']} passes before anything was done"


def test_task_validation_names_the_problem(tmp_path, monkeypatch):
    good = task_files.load_configs(("shop",))[0]
    for broken, message in [({**good, "split": "dev"}, "split must be one of"),
                            ({**good, "sites": ["gitlab"]}, "sites must be"),
                            ({**good, "oracle": [["click", {"role": "link"}], ["stop", ""]]}, "needs a target"),
                            ({**good, "oracle": [["click", {"role": "link", "name": "x"}]]}, "ending with a stop"),
                            ({**good, "eval": {"eval_types": ["state_check"], "state_check": [{"type": "page"}]}},
                             "does not fit site")]:
        with pytest.raises(task_files.TaskFileError, match=message):
            task_files.validate_config(broken)
    monkeypatch.setattr(task_files, "DATA_DIR", tmp_path)
    (tmp_path / "tasks_shop.json").write_text(json.dumps([good, good]))
    task_files.load_configs.cache_clear()
    try:
        with pytest.raises(task_files.TaskFileError, match="appears twice"):
            task_files.load_configs(("shop",))
    finally:
        task_files.load_configs.cache_clear()


def test_env_options_are_checked():
    assert parse_sites("shop, fossil") == ("shop", "fossil")
    assert parse_sites(None) == task_files.SITE_NAMES
    with pytest.raises(ValueError, match="valid sites: fossil, dokuwiki, shop"):
        parse_sites("gitlab")
    with pytest.raises(ValueError, match="unknown option"):
        make_env("weblocal", site="shop")
    assert {task.data["sites"][0] for task in list_tasks("weblocal", "train", sites="dokuwiki")} == {"dokuwiki"}


def test_shipped_task_files_match_the_seed():
    from longhorizon.envs.web.apps.task_builder import build_all, render

    for site, configs in build_all().items():
        shipped = task_files.task_file(site).read_text(encoding="utf-8")
        assert shipped == render(configs), f"tasks_{site}.json is stale: run python -m longhorizon.envs.web.apps.task_builder"


def test_reset_restarts_a_server_that_died(shop):
    shop.process.kill()
    shop.process.wait()
    shop.reset()
    assert fetch(f"{shop.base_url}/")[0] == 200


def processes_mentioning(text: str) -> list[str]:
    found = []
    for process in psutil.process_iter(["pid", "cmdline"]):
        command = " ".join(process.info["cmdline"] or [])
        if text in command:
            found.append(f"{process.info['pid']} {command}")
    return found


def test_stopping_fossil_leaves_none_of_its_processes():
    # Fossil may fork a "backoffice" process after a request, which leaves the server's process
    # group (setsid); the server's watchdog adopts it and ends it with the server.
    site = FossilSite()
    site.start()
    try:
        workdir = str(site.workdir)
        for path in ("/", "/timeline", "/forum", "/wiki", "/dir"):
            assert fetch(site.base_url + path)[0] == 200
        assert processes_mentioning(workdir), "the server should be running"
    finally:
        site.stop()
    assert processes_mentioning(workdir) == []
