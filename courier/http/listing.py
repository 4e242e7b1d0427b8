"""OpenAI's cursor-paginated lists: reading `after` / `limit` / `order` and shaping `{object: "list", ...}`."""

from __future__ import annotations

from collections.abc import Mapping

from courier.http.errors import ApiError
from courier.storage.records import ItemPage, JsonObject, Order, PageQuery

DEFAULT_LIMIT = 20
MAX_LIMIT = 100


def page_query(args: Mapping[str, str]) -> PageQuery:
    raw_limit = args.get("limit")
    try:
        limit = DEFAULT_LIMIT if raw_limit is None else int(raw_limit)
    except ValueError:
        limit = 0
    if not 1 <= limit <= MAX_LIMIT:
        raise ApiError.invalid(f"'limit' must be an integer from 1 to {MAX_LIMIT}", param="limit")
    raw_order = args.get("order", Order.DESC.value)
    try:
        order = Order(raw_order)
    except ValueError:
        raise ApiError.invalid("'order' must be 'asc' or 'desc'", param="order") from None
    return PageQuery(after=args.get("after") or None, limit=limit, order=order)


def refuse_include(args: Mapping[str, str]) -> None:
    """`include` on a listing asks for data added to the stored items; items are returned as they were stored (an
    answer's logprobs are there when its turn asked for them), so nothing can be added and asking is refused."""
    if args.get("include"):
        raise ApiError.invalid(
            "'include' is not supported on item listings: items are returned as stored (an answer's logprobs are "
            "kept when its turn asked for them with top_logprobs or include)",
            param="include",
        )


def list_object(page: ItemPage) -> JsonObject:
    data = list(page.items)
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": page.has_more,
    }
