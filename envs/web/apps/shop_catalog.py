"""The shop's catalog and seed data: categories, products and past orders, built the same way every time."""

from __future__ import annotations

import random
import sqlite3
from dataclasses import dataclass
from pathlib import Path

CATALOG_SEED = 2024
CUSTOMER_NAME = "Alex Morgan"

# (slug, display name, product nouns with a base price in cents)
CATEGORIES: tuple[tuple[str, str, tuple[tuple[str, int], ...]], ...] = (
    ("kitchen", "Kitchen", (("Kettle", 3400), ("Teapot", 2200), ("Chef Knife", 4900), ("Cutting Board", 1800),
                            ("Mixing Bowl", 1500), ("Frying Pan", 3900), ("Coffee Grinder", 5600),
                            ("Toaster", 4200), ("Spice Rack", 2600), ("Salad Spinner", 1900))),
    ("garden", "Garden", (("Watering Can", 1700), ("Pruning Shears", 2400), ("Planter", 2100), ("Garden Hose", 3300),
                          ("Bird Feeder", 1600), ("Rake", 2000), ("Seed Tray", 900), ("Trowel", 1100),
                          ("Compost Bin", 5400), ("Hammock", 6900))),
    ("electronics", "Electronics", (("Headphones", 7900), ("Desk Lamp", 3600), ("Power Bank", 2900),
                                    ("Bluetooth Speaker", 5900), ("Webcam", 4500), ("Keyboard", 6400),
                                    ("Mouse", 2500), ("USB Hub", 1900), ("Smart Plug", 1500), ("Radio", 3900))),
    ("books", "Books", (("Atlas", 3500), ("Cookbook", 2800), ("Field Guide", 2200), ("Notebook", 900),
                        ("Sketchbook", 1400), ("Puzzle Book", 1200), ("Travel Journal", 1600),
                        ("Poetry Collection", 1900), ("History Primer", 2400), ("Star Chart", 1300))),
    ("toys", "Toys", (("Kite", 2100), ("Puzzle", 1800), ("Building Blocks", 3900), ("Yo-Yo", 600),
                      ("Board Game", 3200), ("Teddy Bear", 2500), ("Spinning Top", 800), ("Train Set", 7400),
                      ("Jump Rope", 700), ("Marble Run", 4600))),
    ("outdoor", "Outdoor", (("Tent", 12900), ("Sleeping Bag", 6900), ("Backpack", 5900), ("Water Bottle", 1500),
                            ("Camping Stove", 4800), ("Headlamp", 2300), ("Trekking Poles", 4400),
                            ("Picnic Blanket", 2700), ("Compass", 1600), ("Cooler Box", 5200))),
)
STYLES = ("Alpine", "Classic", "Coastal", "Compact", "Deluxe", "Nordic", "Rustic", "Urban", "Vintage", "Summit",
          "Meadow", "Harbor")
COLORS = ("black", "blue", "green", "grey", "orange", "red", "white", "yellow")
ORDER_STATUSES = ("Pending", "Processing", "Shipped", "Delivered", "Cancelled")
SHIPPING_METHODS = (("Standard", 495), ("Express", 1295))


@dataclass(frozen=True)
class Product:
    id: int
    sku: str
    name: str
    category: str
    price_cents: int
    stock: int
    rating: float
    color: str
    description: str


@dataclass(frozen=True)
class SeedOrder:
    id: int
    placed_at: str
    status: str
    shipping: str
    lines: tuple[tuple[int, int], ...]
    """(product id, quantity)"""


def build_products() -> list[Product]:
    rng = random.Random(CATALOG_SEED)
    products: list[Product] = []
    for category_slug, category_name, nouns in CATEGORIES:
        styles = rng.sample(STYLES, len(nouns))
        for (noun, base_price), style in zip(nouns, styles):
            product_id = len(products) + 1
            price = base_price + rng.randrange(0, 10) * 100 - 1  # prices end in .99
            stock = rng.choice((0, 2, 3, 5, 8, 12, 15, 20, 25, 40))
            rating = rng.randrange(25, 51) / 10
            color = rng.choice(COLORS)
            description = (f"A {color} {noun.lower()} from our {style} line, part of the {category_name.lower()} "
                           f"range. Rated {rating:.1f} out of 5 by our customers.")
            products.append(Product(product_id, f"{category_slug[:3].upper()}-{1000 + product_id}",
                                    f"{style} {noun}", category_slug, price, stock, rating, color, description))
    return products


def build_orders(products: list[Product]) -> list[SeedOrder]:
    rng = random.Random(CATALOG_SEED + 1)
    statuses = ("Delivered", "Delivered", "Shipped", "Cancelled", "Delivered", "Processing", "Shipped", "Pending")
    orders = []
    for index, status in enumerate(statuses):
        chosen = rng.sample(products, rng.randrange(1, 4))
        lines = tuple((product.id, rng.randrange(1, 4)) for product in chosen)
        placed_at = f"2024-{index + 2:02d}-{rng.randrange(1, 28):02d}"
        orders.append(SeedOrder(index + 1, placed_at, status, SHIPPING_METHODS[index % 2][0], lines))
    return orders


def order_total(order: SeedOrder, products: list[Product]) -> int:
    by_id = {product.id: product for product in products}
    shipping = dict(SHIPPING_METHODS)[order.shipping]
    return sum(by_id[product_id].price_cents * quantity for product_id, quantity in order.lines) + shipping


SCHEMA = """
CREATE TABLE categories (slug TEXT PRIMARY KEY, name TEXT NOT NULL, position INTEGER NOT NULL);
CREATE TABLE products (id INTEGER PRIMARY KEY, sku TEXT UNIQUE NOT NULL, name TEXT NOT NULL,
  category TEXT NOT NULL REFERENCES categories(slug), price_cents INTEGER NOT NULL, stock INTEGER NOT NULL,
  rating REAL NOT NULL, color TEXT NOT NULL, description TEXT NOT NULL);
CREATE TABLE cart_items (product_id INTEGER PRIMARY KEY REFERENCES products(id), quantity INTEGER NOT NULL);
CREATE TABLE orders (id INTEGER PRIMARY KEY, placed_at TEXT NOT NULL, status TEXT NOT NULL,
  customer_name TEXT NOT NULL, address TEXT NOT NULL, city TEXT NOT NULL, postcode TEXT NOT NULL,
  shipping TEXT NOT NULL, total_cents INTEGER NOT NULL);
CREATE TABLE order_items (order_id INTEGER NOT NULL REFERENCES orders(id), product_id INTEGER NOT NULL
  REFERENCES products(id), quantity INTEGER NOT NULL, price_cents INTEGER NOT NULL);
CREATE TABLE wishlist (product_id INTEGER PRIMARY KEY REFERENCES products(id));
"""


def write_seed_database(path: Path) -> None:
    """Create the shop's SQLite database at `path` (replacing any file there) with the seed data."""
    path.unlink(missing_ok=True)
    products = build_products()
    connection = sqlite3.connect(path)
    try:
        connection.executescript(SCHEMA)
        for position, (slug, name, _) in enumerate(CATEGORIES):
            connection.execute("INSERT INTO categories VALUES (?, ?, ?)", (slug, name, position))
        connection.executemany(
            "INSERT INTO products VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            [(p.id, p.sku, p.name, p.category, p.price_cents, p.stock, p.rating, p.color, p.description)
             for p in products])
        by_id = {product.id: product for product in products}
        for order in build_orders(products):
            connection.execute(
                "INSERT INTO orders VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (order.id, order.placed_at, order.status, CUSTOMER_NAME, "12 Elm Street", "Springfield", "40213",
                 order.shipping, order_total(order, products)))
            connection.executemany(
                "INSERT INTO order_items VALUES (?, ?, ?, ?)",
                [(order.id, product_id, quantity, by_id[product_id].price_cents) for product_id, quantity in order.lines])
        connection.commit()
    finally:
        connection.close()


def format_price(cents: int) -> str:
    return f"${cents // 100}.{cents % 100:02d}"
