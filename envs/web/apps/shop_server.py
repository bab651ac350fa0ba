"""The shop web application: catalog, search, cart, checkout, order history and an admin view.

Run as its own process by ShopSite: `python -m longhorizon.envs.web.apps.shop_server --db PATH --port P`.
Every request opens the SQLite file afresh, so the site can restore its snapshot by replacing the
file between episodes. Pages use plain HTML forms with labels and real buttons, so the browser's
accessibility tree names every control.
"""

from __future__ import annotations

import argparse
import html
import sqlite3
import sys
from datetime import date
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, quote, urlsplit

from longhorizon.envs.web.apps.shop_catalog import (
    CUSTOMER_NAME, ORDER_STATUSES, SHIPPING_METHODS, format_price,
)

SHOP_NAME = "Demo Shop"
SORT_ORDERS = {"name": "name", "price_asc": "price_cents, name", "price_desc": "price_cents DESC, name",
               "rating": "rating DESC, name"}
SORT_LABELS = {"name": "Name", "price_asc": "Price: low to high", "price_desc": "Price: high to low",
               "rating": "Best rated"}


def escape(value: object) -> str:
    return html.escape(str(value), quote=True)


class HttpError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class Redirect(Exception):
    def __init__(self, location: str):
        super().__init__(location)
        self.location = location


class ShopApp:
    """Turns (method, path, query, form) into (title, body HTML), or raises Redirect / HttpError."""

    def __init__(self, db_path: Path):
        self.db_path = db_path

    def connect(self) -> sqlite3.Connection:
        connection = sqlite3.connect(self.db_path, timeout=10)
        connection.row_factory = sqlite3.Row
        return connection

    def handle(self, method: str, path: str, query: dict[str, str], form: dict[str, str]) -> tuple[str, str]:
        parts = [part for part in path.split("/") if part]
        db = self.connect()
        try:
            if method == "GET":
                return self.get(db, parts, query)
            if method != "POST":
                raise HttpError(405, "method not allowed")
            try:
                self.post(db, parts, form)
            except Redirect:
                db.commit()  # a successful action ends in a redirect (post/redirect/get)
                raise
            raise HttpError(404, "page not found")
        finally:
            db.close()

    # --- pages -------------------------------------------------------------------------------

    def get(self, db: sqlite3.Connection, parts: list[str], query: dict[str, str]) -> tuple[str, str]:
        match parts:
            case []:
                return self.home(db)
            case ["category", slug]:
                return self.category(db, slug, query.get("sort", "name"))
            case ["search"]:
                return self.search(db, query.get("q", ""))
            case ["product", product_id]:
                return self.product(db, self.int_id(product_id), query.get("added"))
            case ["cart"]:
                return self.cart(db)
            case ["checkout"]:
                return self.checkout(db)
            case ["wishlist"]:
                return self.wishlist(db)
            case ["orders"]:
                return self.orders(db)
            case ["orders", order_id]:
                return self.order(db, self.int_id(order_id), query.get("placed"))
            case ["admin"]:
                return "Admin", ('<h1>Admin</h1><ul><li><a href="/admin/products">Manage products</a></li>'
                                 '<li><a href="/admin/orders">Manage orders</a></li></ul>')
            case ["admin", "products"]:
                return self.admin_products(db)
            case ["admin", "products", product_id]:
                return self.admin_product(db, self.int_id(product_id), query.get("saved"))
            case ["admin", "orders"]:
                return self.admin_orders(db)
            case ["admin", "orders", order_id]:
                return self.admin_order(db, self.int_id(order_id), query.get("saved"))
        raise HttpError(404, "page not found")

    @staticmethod
    def int_id(text: str) -> int:
        if not text.isdigit():
            raise HttpError(404, "page not found")
        return int(text)

    def product_list(self, rows: list[sqlite3.Row]) -> str:
        if not rows:
            return "<p>No products found.</p>"
        items = "".join(
            f'<li><a href="/product/{row["id"]}">{escape(row["name"])}</a> - {format_price(row["price_cents"])}'
            f'{" (out of stock)" if row["stock"] == 0 else ""}</li>' for row in rows)
        return f'<ul class="products">{items}</ul>'

    def home(self, db: sqlite3.Connection) -> tuple[str, str]:
        categories = db.execute("SELECT slug, name FROM categories ORDER BY position").fetchall()
        links = "".join(f'<li><a href="/category/{row["slug"]}">{escape(row["name"])}</a></li>' for row in categories)
        top = db.execute("SELECT * FROM products ORDER BY rating DESC, name LIMIT 5").fetchall()
        return "Home", (f"<h1>Welcome to {SHOP_NAME}</h1><h2>Categories</h2><ul>{links}</ul>"
                        f"<h2>Top rated</h2>{self.product_list(top)}")

    def category(self, db: sqlite3.Connection, slug: str, sort: str) -> tuple[str, str]:
        category = db.execute("SELECT * FROM categories WHERE slug = ?", (slug,)).fetchone()
        if category is None:
            raise HttpError(404, "no such category")
        if sort not in SORT_ORDERS:
            sort = "name"
        rows = db.execute(f"SELECT * FROM products WHERE category = ? ORDER BY {SORT_ORDERS[sort]}", (slug,)).fetchall()
        options = "".join(f'<option value="{key}"{" selected" if key == sort else ""}>{label}</option>'
                          for key, label in SORT_LABELS.items())
        form = (f'<form method="get" action="/category/{slug}"><label for="sort">Sort by</label> '
                f'<select id="sort" name="sort">{options}</select> <button type="submit">Apply</button></form>')
        return category["name"], f"<h1>{escape(category['name'])}</h1>{form}{self.product_list(rows)}"

    def search(self, db: sqlite3.Connection, text: str) -> tuple[str, str]:
        words = text.split()
        rows: list[sqlite3.Row] = []
        if words:
            clause = " AND ".join("(name LIKE ? OR description LIKE ? OR sku LIKE ?)" for _ in words)
            arguments = [value for word in words for value in (f"%{word}%",) * 3]
            rows = db.execute(f"SELECT * FROM products WHERE {clause} ORDER BY name", arguments).fetchall()
        return f"Search: {text}", (f"<h1>Search results for \u201c{escape(text)}\u201d</h1>"
                                   f"<p>{len(rows)} products found.</p>{self.product_list(rows)}")

    def product(self, db: sqlite3.Connection, product_id: int, added: str | None) -> tuple[str, str]:
        row = db.execute("SELECT p.*, c.name AS category_name FROM products p JOIN categories c ON c.slug = p.category "
                         "WHERE p.id = ?", (product_id,)).fetchone()
        if row is None:
            raise HttpError(404, "no such product")
        notice = '<p role="status">Added to your cart.</p>' if added else ""
        stock = f"{row['stock']} in stock" if row["stock"] else "Out of stock"
        buy = ("<p>This product cannot be ordered right now.</p>" if row["stock"] == 0 else
               f'<form method="post" action="/cart/add"><input type="hidden" name="product_id" value="{row["id"]}">'
               f'<label for="quantity">Quantity</label> <input id="quantity" name="quantity" type="number" min="1" '
               f'max="{row["stock"]}" value="1"> <button type="submit">Add to cart</button></form>')
        wish = (f'<form method="post" action="/wishlist/add"><input type="hidden" name="product_id" value="{row["id"]}">'
                f'<button type="submit">Add to wishlist</button></form>')
        return row["name"], (
            f"{notice}<h1>{escape(row['name'])}</h1>"
            f'<p>Category: <a href="/category/{row["category"]}">{escape(row["category_name"])}</a></p>'
            f"<dl><dt>Price</dt><dd>{format_price(row['price_cents'])}</dd><dt>SKU</dt><dd>{escape(row['sku'])}</dd>"
            f"<dt>Color</dt><dd>{escape(row['color'])}</dd><dt>Rating</dt><dd>{row['rating']:.1f} out of 5</dd>"
            f"<dt>Availability</dt><dd>{stock}</dd></dl><p>{escape(row['description'])}</p>{buy}{wish}")

    def cart_rows(self, db: sqlite3.Connection) -> list[sqlite3.Row]:
        return db.execute("SELECT p.*, c.quantity FROM cart_items c JOIN products p ON p.id = c.product_id "
                          "ORDER BY p.name").fetchall()

    def cart(self, db: sqlite3.Connection) -> tuple[str, str]:
        rows = self.cart_rows(db)
        if not rows:
            return "Cart", '<h1>Your cart</h1><p>Your cart is empty.</p><p><a href="/">Continue shopping</a></p>'
        lines = "".join(
            f'<tr><td><a href="/product/{row["id"]}">{escape(row["name"])}</a></td><td>{format_price(row["price_cents"])}</td>'
            f'<td><form method="post" action="/cart/update"><input type="hidden" name="product_id" value="{row["id"]}">'
            f'<label for="qty-{row["id"]}">Quantity of {escape(row["name"])}</label> '
            f'<input id="qty-{row["id"]}" name="quantity" type="number" min="0" value="{row["quantity"]}"> '
            f'<button type="submit">Update {escape(row["name"])}</button></form></td>'
            f'<td><form method="post" action="/cart/remove"><input type="hidden" name="product_id" value="{row["id"]}">'
            f'<button type="submit">Remove {escape(row["name"])}</button></form></td></tr>' for row in rows)
        total = sum(row["price_cents"] * row["quantity"] for row in rows)
        return "Cart", (f"<h1>Your cart</h1><table><thead><tr><th>Product</th><th>Price</th><th>Quantity</th>"
                        f"<th>Remove</th></tr></thead><tbody>{lines}</tbody></table>"
                        f"<p>Subtotal: {format_price(total)}</p><p><a href=\"/checkout\">Proceed to checkout</a></p>")

    def checkout(self, db: sqlite3.Connection) -> tuple[str, str]:
        rows = self.cart_rows(db)
        if not rows:
            return "Checkout", '<h1>Checkout</h1><p>Your cart is empty.</p>'
        total = sum(row["price_cents"] * row["quantity"] for row in rows)
        options = "".join(f'<option value="{name}">{name} ({format_price(cost)})</option>'
                          for name, cost in SHIPPING_METHODS)
        fields = "".join(
            f'<p><label for="{key}">{label}</label> <input id="{key}" name="{key}" type="text" value="{escape(value)}" '
            f'required></p>' for key, label, value in (("name", "Full name", CUSTOMER_NAME),
                                                       ("address", "Street address", ""), ("city", "City", ""),
                                                       ("postcode", "Postcode", "")))
        return "Checkout", (f"<h1>Checkout</h1><p>{len(rows)} products, subtotal {format_price(total)}.</p>"
                            f'<form method="post" action="/checkout">{fields}<p><label for="shipping">Shipping method'
                            f'</label> <select id="shipping" name="shipping">{options}</select></p>'
                            f'<button type="submit">Place order</button></form>')

    def wishlist(self, db: sqlite3.Connection) -> tuple[str, str]:
        rows = db.execute("SELECT p.* FROM wishlist w JOIN products p ON p.id = w.product_id ORDER BY p.name").fetchall()
        return "Wishlist", f"<h1>Your wishlist</h1>{self.product_list(rows) if rows else '<p>Your wishlist is empty.</p>'}"

    def orders(self, db: sqlite3.Connection) -> tuple[str, str]:
        rows = db.execute("SELECT * FROM orders ORDER BY id DESC").fetchall()
        lines = "".join(f'<tr><td><a href="/orders/{row["id"]}">Order #{row["id"]}</a></td><td>{row["placed_at"]}</td>'
                        f'<td>{row["status"]}</td><td>{format_price(row["total_cents"])}</td></tr>' for row in rows)
        return "My orders", (f"<h1>My orders</h1><table><thead><tr><th>Order</th><th>Date</th><th>Status</th>"
                             f"<th>Total</th></tr></thead><tbody>{lines}</tbody></table>")

    def order_detail(self, db: sqlite3.Connection, order_id: int) -> tuple[sqlite3.Row, str]:
        order = db.execute("SELECT * FROM orders WHERE id = ?", (order_id,)).fetchone()
        if order is None:
            raise HttpError(404, "no such order")
        items = db.execute("SELECT i.quantity, i.price_cents, p.name, p.id FROM order_items i JOIN products p "
                           "ON p.id = i.product_id WHERE i.order_id = ? ORDER BY p.name", (order_id,)).fetchall()
        lines = "".join(f'<tr><td><a href="/product/{item["id"]}">{escape(item["name"])}</a></td><td>{item["quantity"]}</td>'
                        f'<td>{format_price(item["price_cents"])}</td></tr>' for item in items)
        body = (f"<dl><dt>Date</dt><dd>{order['placed_at']}</dd><dt>Status</dt><dd>{order['status']}</dd>"
                f"<dt>Ship to</dt><dd>{escape(order['customer_name'])}, {escape(order['address'])}, "
                f"{escape(order['city'])} {escape(order['postcode'])}</dd><dt>Shipping</dt><dd>{order['shipping']}</dd>"
                f"<dt>Total</dt><dd>{format_price(order['total_cents'])}</dd></dl><table><thead><tr><th>Product</th>"
                f"<th>Quantity</th><th>Unit price</th></tr></thead><tbody>{lines}</tbody></table>")
        return order, body

    def order(self, db: sqlite3.Connection, order_id: int, placed: str | None) -> tuple[str, str]:
        order, body = self.order_detail(db, order_id)
        notice = '<p role="status">Thank you, your order has been placed.</p>' if placed else ""
        cancel = (f'<form method="post" action="/orders/{order_id}/cancel"><button type="submit">Cancel order</button>'
                  f"</form>" if order["status"] == "Pending" else "")
        return f"Order #{order_id}", f"{notice}<h1>Order #{order_id}</h1>{body}{cancel}"

    def admin_products(self, db: sqlite3.Connection) -> tuple[str, str]:
        rows = db.execute("SELECT * FROM products ORDER BY id").fetchall()
        lines = "".join(f'<tr><td>{escape(row["sku"])}</td><td><a href="/admin/products/{row["id"]}">{escape(row["name"])}'
                        f'</a></td><td>{format_price(row["price_cents"])}</td><td>{row["stock"]}</td></tr>' for row in rows)
        return "Admin: products", (f'<h1>Products</h1><p><a href="/admin">Back to admin</a></p><table><thead><tr>'
                                   f"<th>SKU</th><th>Name</th><th>Price</th><th>Stock</th></tr></thead>"
                                   f"<tbody>{lines}</tbody></table>")

    def admin_product(self, db: sqlite3.Connection, product_id: int, saved: str | None) -> tuple[str, str]:
        row = db.execute("SELECT * FROM products WHERE id = ?", (product_id,)).fetchone()
        if row is None:
            raise HttpError(404, "no such product")
        notice = '<p role="status">Product saved.</p>' if saved else ""
        price = f"{row['price_cents'] // 100}.{row['price_cents'] % 100:02d}"
        return f"Admin: {row['name']}", (
            f"{notice}<h1>Edit {escape(row['name'])}</h1>"
            f'<form method="post" action="/admin/products/{product_id}">'
            f'<p><label for="name">Product name</label> <input id="name" name="name" type="text" value="{escape(row["name"])}"></p>'
            f'<p><label for="price">Price in dollars</label> <input id="price" name="price" type="text" value="{price}"></p>'
            f'<p><label for="stock">Stock</label> <input id="stock" name="stock" type="number" min="0" value="{row["stock"]}"></p>'
            f'<button type="submit">Save product</button></form><p><a href="/admin/products">Back to products</a></p>')

    def admin_orders(self, db: sqlite3.Connection) -> tuple[str, str]:
        rows = db.execute("SELECT * FROM orders ORDER BY id DESC").fetchall()
        lines = "".join(f'<tr><td><a href="/admin/orders/{row["id"]}">Order #{row["id"]}</a></td><td>{row["placed_at"]}'
                        f'</td><td>{escape(row["customer_name"])}</td><td>{row["status"]}</td>'
                        f'<td>{format_price(row["total_cents"])}</td></tr>' for row in rows)
        return "Admin: orders", (f'<h1>Orders</h1><p><a href="/admin">Back to admin</a></p><table><thead><tr>'
                                 f"<th>Order</th><th>Date</th><th>Customer</th><th>Status</th><th>Total</th></tr>"
                                 f"</thead><tbody>{lines}</tbody></table>")

    def admin_order(self, db: sqlite3.Connection, order_id: int, saved: str | None) -> tuple[str, str]:
        order, body = self.order_detail(db, order_id)
        notice = '<p role="status">Order status updated.</p>' if saved else ""
        options = "".join(f'<option{" selected" if status == order["status"] else ""}>{status}</option>'
                          for status in ORDER_STATUSES)
        return f"Admin: order #{order_id}", (
            f"{notice}<h1>Order #{order_id}</h1>{body}<form method=\"post\" action=\"/admin/orders/{order_id}\">"
            f'<label for="status">Order status</label> <select id="status" name="status">{options}</select> '
            f'<button type="submit">Update status</button></form><p><a href="/admin/orders">Back to orders</a></p>')

    # --- actions -----------------------------------------------------------------------------

    def post(self, db: sqlite3.Connection, parts: list[str], form: dict[str, str]) -> None:
        match parts:
            case ["cart", "add"]:
                product_id, quantity = self.form_int(form, "product_id"), self.form_int(form, "quantity", minimum=1)
                product = self.existing_product(db, product_id)
                current = db.execute("SELECT quantity FROM cart_items WHERE product_id = ?", (product_id,)).fetchone()
                wanted = quantity + (current["quantity"] if current else 0)
                if wanted > product["stock"]:
                    raise HttpError(400, f"only {product['stock']} of {product['name']} in stock")
                db.execute("INSERT OR REPLACE INTO cart_items VALUES (?, ?)", (product_id, wanted))
                raise Redirect(f"/product/{product_id}?added=1")
            case ["cart", "update"]:
                product_id, quantity = self.form_int(form, "product_id"), self.form_int(form, "quantity")
                product = self.existing_product(db, product_id)
                if quantity > product["stock"]:
                    raise HttpError(400, f"only {product['stock']} of {product['name']} in stock")
                if quantity == 0:
                    db.execute("DELETE FROM cart_items WHERE product_id = ?", (product_id,))
                else:
                    db.execute("UPDATE cart_items SET quantity = ? WHERE product_id = ?", (quantity, product_id))
                raise Redirect("/cart")
            case ["cart", "remove"]:
                db.execute("DELETE FROM cart_items WHERE product_id = ?", (self.form_int(form, "product_id"),))
                raise Redirect("/cart")
            case ["wishlist", "add"]:
                product_id = self.form_int(form, "product_id")
                self.existing_product(db, product_id)
                db.execute("INSERT OR IGNORE INTO wishlist VALUES (?)", (product_id,))
                raise Redirect("/wishlist")
            case ["checkout"]:
                self.place_order(db, form)
            case ["orders", order_id, "cancel"]:
                changed = db.execute("UPDATE orders SET status = 'Cancelled' WHERE id = ? AND status = 'Pending'",
                                     (self.int_id(order_id),)).rowcount
                if not changed:
                    raise HttpError(400, "only a pending order can be cancelled")
                raise Redirect(f"/orders/{order_id}")
            case ["admin", "products", product_id]:
                product_id_number = self.int_id(product_id)
                self.existing_product(db, product_id_number)
                name = form.get("name", "").strip()
                if not name:
                    raise HttpError(400, "the product name must not be empty")
                db.execute("UPDATE products SET name = ?, price_cents = ?, stock = ? WHERE id = ?",
                           (name, self.form_price(form), self.form_int(form, "stock"), product_id_number))
                raise Redirect(f"/admin/products/{product_id_number}?saved=1")
            case ["admin", "orders", order_id]:
                status = form.get("status", "")
                if status not in ORDER_STATUSES:
                    raise HttpError(400, f"unknown status {status!r}")
                if not db.execute("UPDATE orders SET status = ? WHERE id = ?", (status, self.int_id(order_id))).rowcount:
                    raise HttpError(404, "no such order")
                raise Redirect(f"/admin/orders/{order_id}?saved=1")
        raise HttpError(404, "page not found")

    def place_order(self, db: sqlite3.Connection, form: dict[str, str]) -> None:
        rows = self.cart_rows(db)
        if not rows:
            raise HttpError(400, "your cart is empty")
        values = {key: form.get(key, "").strip() for key in ("name", "address", "city", "postcode")}
        missing = [key for key, value in values.items() if not value]
        if missing:
            raise HttpError(400, f"please fill in: {', '.join(missing)}")
        shipping_costs = dict(SHIPPING_METHODS)
        shipping = form.get("shipping", "")
        if shipping not in shipping_costs:
            raise HttpError(400, f"unknown shipping method {shipping!r}")
        for row in rows:
            if row["quantity"] > row["stock"]:
                raise HttpError(400, f"only {row['stock']} of {row['name']} in stock")
        total = sum(row["price_cents"] * row["quantity"] for row in rows) + shipping_costs[shipping]
        cursor = db.execute("INSERT INTO orders (placed_at, status, customer_name, address, city, postcode, shipping, "
                            "total_cents) VALUES (?, 'Pending', ?, ?, ?, ?, ?, ?)",
                            (date.today().isoformat(), values["name"], values["address"], values["city"],
                             values["postcode"], shipping, total))
        order_id = cursor.lastrowid
        for row in rows:
            db.execute("INSERT INTO order_items VALUES (?, ?, ?, ?)", (order_id, row["id"], row["quantity"], row["price_cents"]))
            db.execute("UPDATE products SET stock = stock - ? WHERE id = ?", (row["quantity"], row["id"]))
        db.execute("DELETE FROM cart_items")
        raise Redirect(f"/orders/{order_id}?placed=1")

    @staticmethod
    def existing_product(db: sqlite3.Connection, product_id: int) -> sqlite3.Row:
        row = db.execute("SELECT * FROM products WHERE id = ?", (product_id,)).fetchone()
        if row is None:
            raise HttpError(404, "no such product")
        return row

    @staticmethod
    def form_int(form: dict[str, str], key: str, minimum: int = 0) -> int:
        text = form.get(key, "").strip()
        if not text.isdigit() or int(text) < minimum:
            raise HttpError(400, f"{key} must be a whole number of at least {minimum}")
        return int(text)

    @staticmethod
    def form_price(form: dict[str, str]) -> int:
        text = form.get("price", "").strip().lstrip("$")
        try:
            cents = round(float(text) * 100)
        except ValueError:
            raise HttpError(400, "the price must be a number such as 12.99") from None
        if cents < 0:
            raise HttpError(400, "the price must not be negative")
        return cents


def page(title: str, body: str) -> str:
    nav = ('<nav aria-label="Main"><a href="/">Home</a> | <a href="/cart">Cart</a> | <a href="/wishlist">Wishlist</a> | '
           '<a href="/orders">My orders</a> | <a href="/admin">Admin</a></nav>'
           '<form role="search" method="get" action="/search"><label for="q">Search products</label> '
           '<input id="q" name="q" type="search"> <button type="submit">Search</button></form>')
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{escape(title)} - {SHOP_NAME}</title>'
            f"</head><body><header>{nav}</header><main>{body}</main></body></html>")


def make_handler(app: ShopApp) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.respond("GET", {})

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length).decode("utf-8", errors="replace")
            self.respond("POST", {key: values[-1] for key, values in parse_qs(body, keep_blank_values=True).items()})

        def respond(self, method: str, form: dict[str, str]) -> None:
            url = urlsplit(self.path)
            query = {key: values[-1] for key, values in parse_qs(url.query).items()}
            try:
                title, body = app.handle(method, url.path, query, form)
                status = 200
            except Redirect as redirect:
                self.send_response(303)
                self.send_header("Location", quote(redirect.location, safe="/?=&"))
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            except HttpError as error:
                status, title = error.status, "Error"
                body = f'<h1>Error</h1><p role="alert">{escape(error)}</p><p><a href="/">Back to the shop</a></p>'
            data = page(title, body).encode("utf-8")
            self.send_response(status)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: object) -> None:
            pass  # quiet: the site's log file is for errors

    return Handler


class _ShopServer(ThreadingHTTPServer):
    # socketserver's listen backlog of 5 drops the connections of many episodes loading pages at
    # once, and TCP resends them seconds later (envs/web/miniwob.py's page server, measured).
    request_queue_size = 1024
    daemon_threads = True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shop_server", description="Serve the demo shop.")
    parser.add_argument("--db", required=True, type=Path, help="the shop's SQLite database")
    parser.add_argument("--port", required=True, type=int)
    args = parser.parse_args(argv)
    if not args.db.exists():
        print(f"no database at {args.db}", file=sys.stderr)
        return 2
    server = _ShopServer(("127.0.0.1", args.port), make_handler(ShopApp(args.db)))
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
