"""Builds the weblocal task files (data/tasks_<site>.json) from the apps' seed data.

Answers, product ids and ticket positions are read from the same seed the sites are built from, so
the tasks stay true when the seed changes: edit the seed, then run

    python -m longhorizon.envs.web.apps.task_builder

and check the result with `python -m longhorizon.envs.web.apps.verify_oracles`. Every fourth task of
each site (by position) is a test task. Plans name targets as the pages' accessibility tree shows
them (see envs/web/policies.py for the plan format).
"""

from __future__ import annotations

import json
from typing import Any

from longhorizon.envs.web.apps.serving import DATA_DIR
from longhorizon.envs.web.apps.shop_catalog import CATEGORIES, build_orders, build_products, format_price, order_total

SHOP, FOSSIL, DOKUWIKI = "__SHOP__", "__FOSSIL__", "__DOKUWIKI__"
TEST_EVERY = 4
DONE = ["stop", "done"]

Plan = list[list[Any]]
Config = dict[str, Any]


# --- building blocks ----------------------------------------------------------------------------


def target(role: str, name: str, **options: Any) -> dict[str, Any]:
    return {"role": role, "name": name, **options}


def click(role: str, name: str, **options: Any) -> list[Any]:
    return ["click", target(role, name, **options)]


def fill(role: str, name: str, text: str) -> list[Any]:
    return ["fill", target(role, name), text]


def select(name: str, option: str) -> list[Any]:
    return ["select_option", target("combobox", name), option]


def answer_eval(answers: list[str]) -> dict[str, Any]:
    return {"eval_types": ["string_match"], "reference_answers": {"must_include": answers}, "reference_url": "",
            "url_note": "", "program_html": [], "state_check": []}


def state_eval(checks: list[dict[str, Any]], url: str = "") -> dict[str, Any]:
    return {"eval_types": ["state_check"] + (["url_match"] if url else []), "reference_answers": None,
            "reference_url": url, "url_note": "GOLD in PRED" if url else "", "program_html": [], "state_check": checks}


def url_eval(url: str) -> dict[str, Any]:
    return {"eval_types": ["url_match"], "reference_answers": None, "reference_url": url, "url_note": "GOLD in PRED",
            "program_html": [], "state_check": []}


def sql(query: str, expected: Any) -> dict[str, Any]:
    return {"type": "sql", "query": query, "expected": expected}


def sql_text(text: str) -> str:
    return text.replace("'", "''")


def task(site: str, kind: str, intent: str, start_url: str, evaluation: dict[str, Any], plan: Plan) -> Config:
    return {"sites": [site], "category": f"{site}-{kind}", "require_reset": kind == "state", "intent": intent,
            "start_url": start_url, "eval": evaluation, "oracle": plan}


# --- the shop -----------------------------------------------------------------------------------


def open_product(name: str) -> Plan:
    """Search for the last word of a product's name and open its page."""
    return [fill("searchbox", "Search products", name.split()[-1]), click("button", "Search"), click("link", name)]


def build_shop_tasks() -> list[Config]:
    products = build_products()
    by_name = {product.name: product for product in products}
    orders = {order.id: order for order in build_orders(products)}
    tasks: list[Config] = []

    def info(intent: str, answers: list[str], plan: Plan, answer: str | None = None) -> None:
        tasks.append(task("shop", "info", intent, f"{SHOP}/", answer_eval(answers),
                          plan + [["stop", answer if answer is not None else answers[0]]]))

    def state(intent: str, start: str, checks: list[dict[str, Any]], url: str, plan: Plan) -> None:
        tasks.append(task("shop", "state", intent, f"{SHOP}{start}", state_eval(checks, url), plan + [DONE]))

    questions = {"price": "What does the {} cost in the shop?", "stock": "How many units of the {} are in stock?",
                 "rating": "What is the customer rating of the {} (out of 5)?", "sku": "What is the SKU of the {}?",
                 "color": "What color is the {}?"}
    for name, field in [("Urban Kettle", "price"), ("Summit Chef Knife", "price"), ("Alpine Watering Can", "price"),
                        ("Deluxe Pruning Shears", "stock"), ("Harbor Coffee Grinder", "rating"),
                        ("Vintage Salad Spinner", "sku"), ("Nordic Frying Pan", "color")]:
        product = by_name[name]
        value = {"price": format_price(product.price_cents), "stock": str(product.stock),
                 "rating": f"{product.rating:.1f}", "sku": product.sku, "color": product.color}[field]
        info(questions[field].format(name), [value], open_product(name))
    for slug, category_name, _ in CATEGORIES[2:5]:
        cheapest = min((p for p in products if p.category == slug), key=lambda p: (p.price_cents, p.name))
        info(f"Which product is the cheapest in the {category_name} category?", [cheapest.name],
             [click("link", category_name), select("Sort by", "price_asc"), click("button", "Apply")])
    for order_id, field in [(3, "status"), (7, "total"), (5, "status"), (2, "total")]:
        order = orders[order_id]
        if field == "status":
            intent, value = f"What is the status of my order #{order_id}?", order.status
        else:
            intent, value = f"What was the total of my order #{order_id}?", format_price(order_total(order, products))
        info(intent, [value], [click("link", "My orders"), click("link", f"Order #{order_id}")])
    out_of_stock = sorted(p.name for p in products if p.category == "kitchen" and p.stock == 0)
    info("Which product in the Kitchen category is out of stock?", out_of_stock, [click("link", "Kitchen")],
         answer=", ".join(out_of_stock))

    for name, quantity in [("Coastal Teapot", 2), ("Alpine Watering Can", 3), ("Deluxe Cutting Board", 1),
                           ("Meadow Toaster", 2)]:
        product = by_name[name]
        state(f"Add {quantity} of the {name} to the cart.", "/",
              [sql(f"SELECT quantity FROM cart_items WHERE product_id = {product.id}", quantity),
               sql("SELECT count(*) FROM cart_items", 1)], f"{SHOP}/product/{product.id}",
              open_product(name) + [fill("spinbutton", "Quantity", str(quantity)), click("button", "Add to cart")])
    # The seed has 8 orders, so the order placed in an episode is number 9.
    for name, city, postcode, shipping in [("Classic Spice Rack", "Portland", "97201", "Express"),
                                           ("Urban Kettle", "Denver", "80202", "Standard")]:
        product = by_name[name]
        state(f"Buy one {name} and have it sent with {shipping} shipping to 5 Pine Road, {city}, postcode {postcode}.",
              "/", [sql("SELECT count(*) FROM orders o JOIN order_items i ON i.order_id = o.id "
                        f"WHERE i.product_id = {product.id} AND i.quantity = 1 AND o.city = '{city}' "
                        f"AND o.postcode = '{postcode}' AND o.shipping = '{shipping}' "
                        "AND o.address LIKE '%5 Pine Road%'", 1)], f"{SHOP}/orders/9",
              open_product(name) + [click("button", "Add to cart"), click("link", "Cart"),
                                    click("link", "Proceed to checkout"), fill("textbox", "Street address", "5 Pine Road"),
                                    fill("textbox", "City", city), fill("textbox", "Postcode", postcode),
                                    select("Shipping method", shipping), click("button", "Place order")])
    for product in ([p for p in products if p.category == "toys"][0], [p for p in products if p.category == "outdoor"][5]):
        state(f"Put the {product.name} on my wishlist.", "/",
              [sql(f"SELECT count(*) FROM wishlist WHERE product_id = {product.id}", 1)], f"{SHOP}/wishlist",
              open_product(product.name) + [click("button", "Add to wishlist")])
    for name, price in [("Nordic Frying Pan", "39.99"), ("Deluxe Pruning Shears", "24.50")]:
        product = by_name[name]
        state(f"As the shop admin, change the price of the {name} to ${price}.", "/admin",
              [sql(f"SELECT price_cents FROM products WHERE id = {product.id}", round(float(price) * 100))],
              f"{SHOP}/admin/products/{product.id}",
              [click("link", "Manage products"), click("link", name), fill("textbox", "Price in dollars", price),
               click("button", "Save product")])
    product = by_name["Harbor Coffee Grinder"]
    state(f"As the shop admin, set the stock of the {product.name} to 30.", "/admin",
          [sql(f"SELECT stock FROM products WHERE id = {product.id}", 30)], f"{SHOP}/admin/products/{product.id}",
          [click("link", "Manage products"), click("link", product.name), fill("spinbutton", "Stock", "30"),
           click("button", "Save product")])
    state("As the shop admin, mark order #6 as Shipped.", "/admin",
          [sql("SELECT status FROM orders WHERE id = 6", "Shipped")], f"{SHOP}/admin/orders/6",
          [click("link", "Manage orders"), click("link", "Order #6"), select("Order status", "Shipped"),
           click("button", "Update status")])
    state("Cancel my order that is still pending.", "/",
          [sql("SELECT group_concat(entry) FROM (SELECT id || ':' || status AS entry FROM orders "
               "WHERE status IN ('Pending', 'Cancelled') ORDER BY id)", "4:Cancelled,8:Cancelled")],
          f"{SHOP}/orders/8", [click("link", "My orders"), click("link", "Order #8"), click("button", "Cancel order")])
    product = by_name["Vintage Salad Spinner"]
    state(f"As the shop admin, rename the {product.name} to 'Vintage Salad Spinner XL'.", "/admin",
          [sql(f"SELECT name FROM products WHERE id = {product.id}", "Vintage Salad Spinner XL")], "",
          [click("link", "Manage products"), click("link", product.name),
           fill("textbox", "Product name", "Vintage Salad Spinner XL"), click("button", "Save product")])

    product = by_name["Nordic Frying Pan"]
    tasks.append(task("shop", "url", f"Open the product page of the {product.name}.", f"{SHOP}/",
                      url_eval(f"{SHOP}/product/{product.id}"), open_product(product.name) + [["stop", ""]]))
    tasks.append(task("shop", "url", "Show the Toys category sorted by price from low to high.", f"{SHOP}/",
                      url_eval(f"{SHOP}/category/toys?sort=price_asc"),
                      [click("link", "Toys"), select("Sort by", "price_asc"), click("button", "Apply"), ["stop", ""]]))
    tasks.append(task("shop", "url", "Open the details of my order #3.", f"{SHOP}/", url_eval(f"{SHOP}/orders/3"),
                      [click("link", "My orders"), click("link", "Order #3"), ["stop", ""]]))
    return tasks


# --- Fossil -------------------------------------------------------------------------------------


def build_fossil_tasks() -> list[Config]:
    seed = json.loads((DATA_DIR / "fossil_seed.json").read_text(encoding="utf-8"))
    tickets = {ticket["title"]: ticket for ticket in seed["tickets"]}
    # The ticket report lists tickets sorted by title (data/fossil_report.sql), one "edit" link per row.
    sorted_titles = sorted(tickets)
    tasks: list[Config] = []

    def edit_ticket(title: str) -> Plan:
        return [["goto", f"{FOSSIL}/rptview/1"], click("link", "edit", nth=sorted_titles.index(title))]

    def info(intent: str, answer: str, plan: Plan) -> None:
        tasks.append(task("fossil", "info", intent, f"{FOSSIL}/home", answer_eval([answer]), plan + [["stop", answer]]))

    def state(intent: str, checks: list[dict[str, Any]], plan: Plan) -> None:
        # Fossil shows the ticket after a successful submit.
        tasks.append(task("fossil", "state", intent, f"{FOSSIL}/home", state_eval(checks, f"{FOSSIL}/tktview/"),
                          plan + [DONE]))

    def ticket_field(title: str, expression: str, expected: Any) -> dict[str, Any]:
        return sql(f"SELECT {expression} FROM ticket WHERE title = '{sql_text(title)}'", expected)

    timeline, all_tickets = [click("link", "Timeline")], [click("link", "Tickets"), click("link", "All Tickets")]
    info("Who made the check-in 'Add Markdown tables support'? Give the user name.", "bob", timeline)
    info("Which developer changed the default serve port? Give the user name.", "alice", timeline)
    info("What is the value of __version__ in pagesmith/__init__.py on the latest check-in?", "0.4.1",
         [["goto", f"{FOSSIL}/file?name=pagesmith/__init__.py&ci=tip"]])
    info("What is the default port of the serve command in pagesmith/cli.py on the latest check-in?", "8090",
         [["goto", f"{FOSSIL}/file?name=pagesmith/cli.py&ci=tip"]])
    for title, field in [("Crash when a page has no title", "severity"), ("Tables lose their header row", "priority"),
                         ("Add an RSS feed", "subsystem"), ("Build fails on Python 3.8", "status")]:
        info(f"What is the {field} of the ticket '{title}'?", tickets[title][field], all_tickets)
    open_count = sum(1 for ticket in seed["tickets"] if ticket["status"] == "Open")
    info("How many tickets have the status Open?", str(open_count), all_tickets)
    info("According to the wiki page ReleaseProcess, which command builds the wheel?", "python -m build --wheel",
         [["goto", f"{FOSSIL}/wiki?name=ReleaseProcess"]])
    info("According to the CodingStyle wiki page, how many characters may a line have at most?", "100",
         [["goto", f"{FOSSIL}/wiki?name=CodingStyle"]])
    info("According to the Roadmap wiki page, which version will bring image thumbnails?", "0.6",
         [["goto", f"{FOSSIL}/wiki?name=Roadmap"]])
    info("Who is the project lead named on the wiki's Home page?", "Alice Chen", [["goto", f"{FOSSIL}/wiki?name=Home"]])
    info("On the forum, what is the target date of the 0.5 release?", "June 7",
         [click("link", "Forum"), click("link", "Planning the 0.5 release")])
    info("According to the forum, which option of pagesmith build changes the output folder?", "--output",
         [click("link", "Forum"), click("link", "How do I change the output folder?")])
    info("Which tag marks the release check-in of the project?", "v0.4.1", [click("link", "Tags")])

    submit = [click("button", "Preview"), click("button", "Submit")]
    title = "Unicode titles are garbled"
    state(f"Close the ticket '{title}' with the resolution Fixed.",
          [ticket_field(title, "status || '/' || resolution", "Closed/Fixed")],
          edit_ticket(title) + [select("Status", "Closed"), select("Resolution", "Fixed")] + submit)
    for intent, title, field, value in [
        ("Raise the priority of the ticket 'Add an RSS feed' to High.", "Add an RSS feed", "Priority", "High"),
        ("Change the severity of the ticket 'Tables lose their header row' to Critical.",
         "Tables lose their header row", "Severity", "Critical"),
        ("Reopen the ticket 'Build fails on Python 3.8' (set its status to Open).", "Build fails on Python 3.8",
         "Status", "Open"),
        ("Move the ticket 'Document the front matter fields' to the status Review.", "Document the front matter fields",
         "Status", "Review"),
    ]:
        state(intent, [ticket_field(title, field.lower(), value)], edit_ticket(title) + [select(field, value)] + submit)
    title = "Crash when a page has no title"
    state(f"Add the remark 'Fixed in 0.4.2' to the ticket '{title}'.",
          [sql("SELECT count(*) FROM ticketchng c JOIN ticket t ON t.tkt_id = c.tkt_id "
               f"WHERE t.title = '{sql_text(title)}' AND c.icomment LIKE '%Fixed in 0.4.2%'", 1)],
          edit_ticket(title) + [fill("textbox", "Remark", "Fixed in 0.4.2")] + submit)
    title = "Image thumbnails"
    state(f"Move the ticket '{title}' from the render subsystem to the feeds subsystem.",
          [ticket_field(title, "subsystem", "feeds")], edit_ticket(title) + [select("Subsystem", "feeds")] + submit)
    for title, ticket_type, severity, subsystem in [("Sitemap generation", "Feature_Request", "Minor", "render"),
                                                    ("Broken links in the footer", "Code_Defect", "Important", "render"),
                                                    ("Explain the serve command", "Documentation", "Cosmetic", "docs")]:
        state(f"File a new ticket titled '{title}' of type {ticket_type} with severity {severity} in the {subsystem} "
              "subsystem.",
              [sql(f"SELECT count(*) FROM ticket WHERE title = '{sql_text(title)}' AND type = '{ticket_type}' "
                   f"AND severity = '{severity}' AND subsystem = '{subsystem}'", 1)],
              [click("link", "Tickets"), click("link", "New ticket"), fill("textbox", "Title", title),
               select("Type", ticket_type), select("Severity", severity), select("Subsystem", subsystem),
               fill("textbox", "Description", f"{title}.")] + submit)

    tasks.append(task("fossil", "url", "Open the wiki page that describes the release process.", f"{FOSSIL}/home",
                      url_eval(f"{FOSSIL}/wiki?name=ReleaseProcess"),
                      [click("link", "Wiki"), click("link", "List of All Wiki Pages"), click("link", "ReleaseProcess"),
                       ["stop", ""]]))
    tasks.append(task("fossil", "url", "Open the report that lists all tickets.", f"{FOSSIL}/home",
                      url_eval(f"{FOSSIL}/rptview/1"), all_tickets + [["stop", ""]]))
    return tasks


# --- DokuWiki -----------------------------------------------------------------------------------


def seed_page(page_id: str) -> str:
    return (DATA_DIR / "dokuwiki_pages" / (page_id.replace(":", "/") + ".txt")).read_text(encoding="utf-8")


def seed_page_edited(page_id: str, old: str, new: str) -> str:
    text = seed_page(page_id)
    if old not in text:
        raise ValueError(f"seed page {page_id} has no {old!r}")
    return text.replace(old, new)


def build_dokuwiki_tasks() -> list[Config]:
    start = f"{DOKUWIKI}/doku.php?id=start"
    tasks: list[Config] = []

    def view(page_id: str) -> str:
        return f"{DOKUWIKI}/doku.php?id={page_id}"

    def info(intent: str, answer: str, page_id: str) -> None:
        tasks.append(task("dokuwiki", "info", intent, start, answer_eval([answer]),
                          [["goto", view(page_id)], ["stop", answer]]))

    def state(intent: str, page_id: str, new_text: str, check: dict[str, Any], check_url: bool = True) -> None:
        plan = [["goto", f"{view(page_id)}&do=edit"], fill("textbox", "Page text", new_text), click("button", "Save"), DONE]
        tasks.append(task("dokuwiki", "state", intent, start,
                          state_eval([{"type": "page", "page": page_id, **check}], view(page_id) if check_url else ""),
                          plan))

    info("What is Lena Fischer's phone extension?", "4459", "team:members")
    info("In which room does the Head of Engineering sit?", "Room 214", "team:members")
    info("What is the budget of Project Apollo?", "120,000 EUR", "projects:apollo")
    info("Who leads Project Hermes?", "Marcus Webb", "projects:hermes")
    info("Which message broker was chosen for Project Hermes?", "RabbitMQ", "projects:hermes")
    info("By how many percent did Project Zephyr cut query times?", "40", "projects:zephyr")
    info("What is the daily meal allowance when travelling abroad?", "58 EUR", "policies:travel")
    info("How much may a hotel cost per night under the travel policy?", "150 EUR", "policies:travel")
    info("How many days of paid holiday do full-time staff get per year?", "28", "policies:holidays")
    info("Which port does the VPN server use?", "51820", "howto:vpn")
    info("What is the name of the printer on the second floor?", "PR-2F-03", "howto:printer")
    info("On which date will the summer party be held?", "21 June", "meetings:2024-05-06")
    info("Which laptop model do new starters get this year?", "Thinkpad T14 Gen 4", "team:onboarding")

    state("Project Apollo is finished: set its status on the wiki to Completed.", "projects:apollo",
          seed_page_edited("projects:apollo", "| Status | In progress |", "| Status | Completed |"),
          {"must_include": ["| Status | Completed |", "Priya Natarajan"], "must_exclude": ["| Status | In progress |"]})
    state("Add Nina Park to the team members table: QA Engineer, Room 310, extension 4520.", "team:members",
          seed_page("team:members").rstrip("\n") + "\n| Nina Park | QA Engineer | Room 310 | 4520 |\n",
          {"must_include": ["Nina Park", "QA Engineer", "Room 310", "4520", "Priya Natarajan"]})
    state("The hotel limit in the travel policy is now 170 EUR per night; update the page.", "policies:travel",
          seed_page_edited("policies:travel", "150 EUR", "170 EUR"),
          {"must_include": ["170 EUR per night", "58 EUR"], "must_exclude": ["150 EUR"]})
    state("Staff now get 30 days of paid holiday per year; update the holiday policy.", "policies:holidays",
          seed_page_edited("policies:holidays", "**28 days**", "**30 days**"),
          {"must_include": ["30 days"], "must_exclude": ["28 days"]})
    state("Move the deadline of Project Hermes to 2025-01-31 on its wiki page.", "projects:hermes",
          seed_page_edited("projects:hermes", "2024-12-15", "2025-01-31"),
          {"must_include": ["2025-01-31", "RabbitMQ"], "must_exclude": ["2024-12-15"]})
    old_row, new_row = "| Grace Liu | Data Scientist | Room 219 | 4463 |", "| Grace Liu | Data Scientist | Room 219 | 4470 |"
    state("Grace Liu's extension changed to 4470; update the team members page.", "team:members",
          seed_page_edited("team:members", old_row, new_row),
          {"must_include": [new_row, "Lena Fischer"], "must_exclude": ["4463"]})
    state("Add an action item to the notes of the 6 May 2024 all-hands: Lena Fischer designs the party invitation.",
          "meetings:2024-05-06",
          seed_page("meetings:2024-05-06").rstrip("\n") + "\n  * Lena Fischer designs the party invitation.\n",
          {"must_include": ["Lena Fischer designs the party invitation", "Samuel Adeyemi books the venue"]})
    state("Create the wiki page projects:orion for the new Project Orion, led by Lena Fischer.", "projects:orion",
          "====== Project Orion ======\n\n^ Field ^ Value ^\n| Lead | Lena Fischer |\n| Status | Planning |\n",
          {"must_include": ["Project Orion", "Lena Fischer"]})
    state("Create the page meetings:2024-06-03 with the notes 'All-hands meeting, 3 June 2024. Chair: Priya Natarajan.'",
          "meetings:2024-06-03", "====== All-hands meeting, 3 June 2024 ======\n\nChair: Priya Natarajan.\n",
          {"must_include": ["3 June 2024", "Chair: Priya Natarajan"]})
    # DokuWiki deletes a page that is saved empty and then shows no page, so only the file is checked.
    state("The printers page is obsolete: delete it.", "howto:printer", "", {"exists": False}, check_url=False)

    tasks.append(task("dokuwiki", "url", "Open the travel policy page of the wiki.", start,
                      url_eval(view("policies:travel")), [click("link", "Travel"), ["stop", ""]]))
    tasks.append(task("dokuwiki", "url", "Show the old revisions of the Project Apollo page.", start,
                      url_eval(f"{view('projects:apollo')}&do=revisions"),
                      [click("link", "Apollo"), click("link", "Old revisions [o]"), ["stop", ""]]))
    tasks.append(task("dokuwiki", "url", "Open the VPN setup guide.", start, url_eval(view("howto:vpn")),
                      [click("link", "VPN setup"), ["stop", ""]]))
    return tasks


# --- the files ----------------------------------------------------------------------------------


def build_all() -> dict[str, list[Config]]:
    """Task configs per site, with task ids and splits."""
    result = {}
    for site, configs in (("shop", build_shop_tasks()), ("fossil", build_fossil_tasks()),
                          ("dokuwiki", build_dokuwiki_tasks())):
        result[site] = [{"task_id": f"{site}-{index:03d}",
                         "split": "test" if index % TEST_EVERY == TEST_EVERY - 1 else "train", **config}
                        for index, config in enumerate(configs)]
    return result


def render(configs: list[Config]) -> str:
    return json.dumps(configs, indent=1, ensure_ascii=False) + "\n"


def main() -> int:
    for site, configs in build_all().items():
        (DATA_DIR / f"tasks_{site}.json").write_text(render(configs), encoding="utf-8")
        kinds = {kind: sum(config["category"].endswith(kind) for config in configs) for kind in ("info", "state", "url")}
        tests = sum(config["split"] == "test" for config in configs)
        print(f"{site}: {len(configs)} tasks ({len(configs) - tests} train, {tests} test), {kinds}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
