"""GET /v1/models and /v1/models/{id} in Anthropic's shapes, for a request that sends `anthropic-version`.

Anthropic's SDKs send that header on every request (OpenAI's never do), so one path serves both: `models.list()`
reads `{data: [{type: "model", id, display_name, created_at, ...}], has_more, first_id, last_id}` and pages with
`after_id` / `before_id` / `limit` (1-1000, default 20); `lifecycle` filters by stage (every model here is
`active`). The names listed are the ones the OpenAI list shows (each servable model's id and exact aliases), in the
same order.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from werkzeug.datastructures import Headers, MultiDict

from courier.http.errors import ApiError

VERSION_HEADER = "anthropic-version"
DEFAULT_LIMIT = 20
MAX_LIMIT = 1000
LIFECYCLE = "active"
LIFECYCLES = ("active", "deprecated", "retired")


def wants_anthropic_shape(headers: Headers) -> bool:
    """Whether the request came from an Anthropic client (it names the API version it speaks)."""
    return bool(headers.get(VERSION_HEADER))


def model_info(name: str, created: int, context_length: int | None) -> dict[str, Any]:
    """One model as Anthropic's `ModelInfo`: its name as id and display name, its creation as an RFC 3339 time,
    and its window as `max_input_tokens` (and as `max_tokens`: a reply may fill what the prompt leaves) once known."""
    created_at = datetime.fromtimestamp(created, UTC).isoformat().replace("+00:00", "Z")
    shown: dict[str, Any] = {
        "type": "model",
        "id": name,
        "display_name": name,
        "created_at": created_at,
        "lifecycle": LIFECYCLE,
    }
    if context_length is not None:
        shown["max_input_tokens"] = context_length
        shown["max_tokens"] = context_length
    return shown


def model_page(models: Sequence[dict[str, Any]], args: MultiDict[str, str]) -> dict[str, Any]:
    """The page of `models` (in listing order) that `after_id` / `before_id` / `limit` / `lifecycle` ask for."""
    limit = _limit(args.get("limit"))
    lifecycles = args.getlist("lifecycle") + args.getlist("lifecycle[]")
    for value in lifecycles:
        if value not in LIFECYCLES:
            raise ApiError.invalid(f"'lifecycle' values must be among {', '.join(LIFECYCLES)}", param="lifecycle")
    chosen = list(models) if not lifecycles or LIFECYCLE in lifecycles else []
    after, before = args.get("after_id"), args.get("before_id")
    if after and before:
        raise ApiError.invalid("send at most one of 'after_id' and 'before_id'", param="before_id")
    ids = [model["id"] for model in chosen]
    if after:
        start = _position(ids, after, "after_id") + 1
        page, has_more = chosen[start : start + limit], start + limit < len(chosen)
    elif before:
        end = _position(ids, before, "before_id")
        page, has_more = chosen[max(0, end - limit) : end], end - limit > 0
    else:
        page, has_more = chosen[:limit], limit < len(chosen)
    return {
        "data": page,
        "has_more": has_more,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
    }


def _limit(raw: str | None) -> int:
    try:
        limit = DEFAULT_LIMIT if raw is None else int(raw)
    except ValueError:
        limit = 0
    if not 1 <= limit <= MAX_LIMIT:
        raise ApiError.invalid(f"'limit' must be an integer from 1 to {MAX_LIMIT}", param="limit")
    return limit


def _position(ids: list[str], cursor: str, param: str) -> int:
    if cursor not in ids:
        raise ApiError.invalid(f"'{param}' names no listed model: {cursor[:100]!r}", param=param)
    return ids.index(cursor)
