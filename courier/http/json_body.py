"""Reads a request body as one JSON object: the body limit already enforced by Quart, the nesting depth here.

A body nested deeper than `core/json_text.MAX_DEPTH` levels is refused before any
of it is used: no real request comes close, and templates and parsers downstream
recurse over what they are given.
"""

from __future__ import annotations

from typing import Any

import orjson
from quart import request

from courier.core.failure_codes import FailureCode
from courier.core.json_text import MAX_DEPTH, nesting_depth
from courier.http.errors import ApiError


async def read_json_object() -> dict[str, Any]:
    raw = await request.get_data(cache=False)
    if not raw:
        raise ApiError.invalid("the request body is empty; send a JSON object")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as error:
        raise ApiError.invalid(f"the request body is not valid JSON: {error}", code=FailureCode.INVALID_JSON) from None
    if not isinstance(body, dict):
        raise ApiError.invalid(f"the request body must be a JSON object, not {type(body).__name__}")
    if nesting_depth(body) > MAX_DEPTH:
        raise ApiError.invalid(
            f"the request body is nested more than {MAX_DEPTH} levels deep", code=FailureCode.INVALID_JSON
        )
    return body
