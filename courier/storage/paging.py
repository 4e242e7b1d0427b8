"""Cursor pagination over an ordered list of items, as OpenAI's list endpoints do it (`after`, `limit`, `order`)."""

from __future__ import annotations

from collections.abc import Sequence

from courier.storage.records import ItemPage, JsonObject, Order, PageQuery


class UnknownCursor(LookupError):
    """`after` names no item of the list."""


def page_of(items: Sequence[JsonObject], page: PageQuery) -> ItemPage:
    ordered = list(items) if page.order is Order.ASC else list(reversed(items))
    start = 0
    if page.after is not None:
        positions = [index for index, item in enumerate(ordered) if item.get("id") == page.after]
        if not positions:
            raise UnknownCursor(page.after)
        start = positions[0] + 1
    chosen = ordered[start : start + page.limit]
    return ItemPage(items=tuple(chosen), has_more=start + page.limit < len(ordered))
