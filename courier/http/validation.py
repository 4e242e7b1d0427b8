"""The one field read before a body's schema is checked: `model`, which picks the model (and so the context) the
rest of the body is checked for. Every other field is the schemas' (`http/schemas/`)."""

from __future__ import annotations

from typing import Any

from courier.http.errors import ApiError


def optional_str(body: dict[str, Any], key: str) -> str | None:
    value = body.get(key)
    if value is not None and not isinstance(value, str):
        raise ApiError.invalid(f"'{key}' must be a string", param=key)
    return value
