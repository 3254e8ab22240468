"""Inventory helpers for a small shop: items, stock levels, reorder rules and reports."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Item:
    sku: str
    name: str
    price: float
    quantity: int = 0
    reorder_level: int = 5
    tags: list[str] = field(default_factory=list)


def compute_total(items: list[Item]) -> float:
    """Total value of the stock on hand."""
    total = 0.0
    for item in items:
        total += item.price * item.quantity
    return round(total, 2)


def needs_reorder(item: Item) -> bool:
    return item.quantity <= item.reorder_level


def reorder_list(items: list[Item]) -> list[str]:
    """SKUs of the items that should be ordered again, cheapest first."""
    low = [item for item in items if needs_reorder(item)]
    low.sort(key=lambda item: item.price)
    return [item.sku for item in low]


def apply_discount(items: list[Item], tag: str, percent: float) -> None:
    if not 0 <= percent <= 100:
        raise ValueError("percent must be between 0 and 100")
    for item in items:
        if tag in item.tags:
            item.price = round(item.price * (1 - percent / 100), 2)


def report(items: list[Item]) -> str:
    lines = ["SKU      NAME                 QTY    PRICE"]
    for item in sorted(items, key=lambda item: item.sku):
        lines.append(f"{item.sku:<8} {item.name:<20} {item.quantity:>4} {item.price:>8.2f}")
    lines.append(f"total stock value: {compute_total(items):.2f}")
    return "\n".join(lines)


def restock(items: list[Item], sku: str, amount: int) -> Item:
    for item in items:
        if item.sku == sku:
            item.quantity += amount
            return item
    raise KeyError(sku)


def most_valuable(items: list[Item], count: int = 3) -> list[Item]:
    """The items holding the most stock value, highest first."""
    ranked = sorted(items, key=lambda item: item.price * item.quantity, reverse=True)
    return ranked[:count]


def share_of_total(items: list[Item], sku: str) -> float:
    total = compute_total(items)
    if total == 0:
        return 0.0
    for item in items:
        if item.sku == sku:
            return item.price * item.quantity / total
    raise KeyError(sku)
