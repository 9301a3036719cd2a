"""Pricing helpers for the Fernbrook Garden Supplies web shop.

Original code written for the Page-EntroKV task set (CC0). It is a plausible
but fictional module: no real shop uses these numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

VAT_RATE = 0.2
CURRENCY = "GBP"
FREE_SHIPPING_THRESHOLD = 85.0
MAX_ITEMS_PER_ORDER = 250
BULKY_CATEGORIES = ("compost", "paving", "timber", "water_butt")


@dataclass
class Item:
    """One line of an order."""

    sku: str
    name: str
    unit_price: float
    quantity: int = 1
    weight_kg: float = 0.0
    category: str = "general"

    def line_total(self) -> float:
        """Price of the line before discounts and VAT."""
        return round(self.unit_price * self.quantity, 2)

    def total_weight(self) -> float:
        return self.weight_kg * self.quantity


@dataclass
class Customer:
    """A shop customer and their loyalty tier."""

    customer_id: str
    name: str
    tier: str = "standard"
    country: str = "GB"
    orders_this_year: int = 0


@dataclass
class Order:
    """A basket ready for checkout."""

    customer: Customer
    items: list[Item] = field(default_factory=list)
    voucher_code: str | None = None
    express: bool = False

    def add(self, item: Item) -> None:
        if self.item_count() + item.quantity > MAX_ITEMS_PER_ORDER:
            raise ValueError("order has too many items")
        self.items.append(item)

    def item_count(self) -> int:
        return sum(item.quantity for item in self.items)

    def subtotal(self) -> float:
        return round(sum(item.line_total() for item in self.items), 2)

    def total_weight(self) -> float:
        return sum(item.total_weight() for item in self.items)

    def has_bulky_items(self) -> bool:
        return any(item.category in BULKY_CATEGORIES for item in self.items)


def round_price(value: float) -> float:
    """Round half up to whole pence, as the till software does."""
    return math.floor(value * 100 + 0.5) / 100


def loyalty_discount(tier: str) -> float:
    """Fraction taken off the subtotal for a loyalty tier."""
    if tier == "bronze":
        return 0.03
    if tier == "silver":
        return 0.07
    if tier == "gold":
        return 0.12
    if tier == "staff":
        return 0.25
    return 0.0


def voucher_discount(code: str | None, subtotal: float) -> float:
    """Money taken off by a voucher code; unknown codes give nothing."""
    if not code:
        return 0.0
    code = code.strip().upper()
    if code == "SPRINGSOW":
        return min(5.0, subtotal)
    if code == "WELCOME10":
        return round_price(subtotal * 0.10)
    if code == "BIGDIG" and subtotal >= 150:
        return 20.0
    return 0.0


def compute_shipping_fee(weight_kg: float, express: bool = False) -> float:
    """Shipping fee in pounds for a parcel of the given weight.

    Heavy parcels go by pallet courier at a flat rate; express adds a
    surcharge to every band except the pallet one.
    """
    if weight_kg < 0:
        raise ValueError("weight cannot be negative")
    if weight_kg <= 2:
        fee = 3.95
    elif weight_kg <= 5:
        fee = 6.5
    elif weight_kg <= 10:
        fee = 9.75
    elif weight_kg <= 20:
        fee = 14.2
    else:
        return 41.0
    if express:
        fee += 4.5
    return fee


def remote_area_surcharge(postcode: str) -> float:
    """Extra charge for island and highland postcodes."""
    prefix = "".join(ch for ch in postcode.upper() if ch.isalpha())[:2]
    if prefix in {"HS", "ZE", "KW"}:
        return 12.0
    if prefix in {"IV", "PA", "PH"}:
        return 6.0
    return 0.0


def shipping_for_order(order: Order, postcode: str) -> float:
    """Shipping for a whole order, with the free-shipping rule applied."""
    if order.subtotal() >= FREE_SHIPPING_THRESHOLD and not order.has_bulky_items():
        base = 0.0
    else:
        base = compute_shipping_fee(order.total_weight(), order.express)
    return round_price(base + remote_area_surcharge(postcode))


def vat_for(amount: float, country: str) -> float:
    """VAT owed on an amount; exports outside GB are zero-rated."""
    if country != "GB":
        return 0.0
    return round_price(amount * VAT_RATE)


def price_breakdown(order: Order, postcode: str) -> dict[str, float]:
    """Every figure shown on the checkout page."""
    subtotal = order.subtotal()
    loyalty = round_price(subtotal * loyalty_discount(order.customer.tier))
    voucher = voucher_discount(order.voucher_code, subtotal - loyalty)
    goods = max(0.0, subtotal - loyalty - voucher)
    shipping = shipping_for_order(order, postcode)
    vat = vat_for(goods + shipping, order.customer.country)
    return {
        "subtotal": subtotal,
        "loyalty_discount": loyalty,
        "voucher_discount": voucher,
        "shipping": shipping,
        "vat": vat,
        "total": round_price(goods + shipping + vat),
    }


def next_tier(customer: Customer) -> str:
    """The tier a customer earns from the number of orders this year."""
    if customer.tier == "staff":
        return "staff"
    if customer.orders_this_year >= 24:
        return "gold"
    if customer.orders_this_year >= 12:
        return "silver"
    if customer.orders_this_year >= 4:
        return "bronze"
    return "standard"


def bulk_unit_price(unit_price: float, quantity: int) -> float:
    """Unit price after the quantity break for seeds and small items."""
    if quantity >= 100:
        return round_price(unit_price * 0.8)
    if quantity >= 50:
        return round_price(unit_price * 0.9)
    return unit_price


def gift_wrap_fee(items: list[Item]) -> float:
    """Gift wrapping costs per item, except for bulky items, which cannot be wrapped."""
    fee = 0.0
    for item in items:
        if item.category in BULKY_CATEGORIES:
            continue
        fee += 1.75 * item.quantity
    return round_price(fee)


def split_into_parcels(order: Order, max_parcel_kg: float = 18.0) -> list[list[Item]]:
    """Greedy packing of items into parcels no heavier than max_parcel_kg."""
    parcels: list[list[Item]] = []
    current: list[Item] = []
    current_weight = 0.0
    for item in sorted(order.items, key=lambda it: -it.weight_kg):
        for _ in range(item.quantity):
            if current and current_weight + item.weight_kg > max_parcel_kg:
                parcels.append(current)
                current, current_weight = [], 0.0
            current.append(Item(item.sku, item.name, item.unit_price, 1, item.weight_kg))
            current_weight += item.weight_kg
    if current:
        parcels.append(current)
    return parcels


def format_money(value: float) -> str:
    """Format an amount for display, e.g. 12.5 -> '£12.50'."""
    return f"£{value:,.2f}"


def receipt_lines(order: Order, postcode: str) -> list[str]:
    """Plain-text receipt lines for the confirmation email."""
    lines = [f"Order for {order.customer.name}"]
    for item in order.items:
        lines.append(f"{item.quantity} x {item.name}: {format_money(item.line_total())}")
    for key, value in price_breakdown(order, postcode).items():
        lines.append(f"{key.replace('_', ' ')}: {format_money(value)}")
    return lines
