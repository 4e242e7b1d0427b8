"""Field checks for JSON request bodies; each failure names the offending `param`."""

from __future__ import annotations

from typing import Any

from courier.http.errors import ApiError


def optional_bool(body: dict[str, Any], key: str, default: bool) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError.invalid(f"'{key}' must be a boolean", param=key)
    return value


def optional_str(body: dict[str, Any], key: str) -> str | None:
    value = body.get(key)
    if value is not None and not isinstance(value, str):
        raise ApiError.invalid(f"'{key}' must be a string", param=key)
    return value


def object_list(body: dict[str, Any], key: str, *, required: bool) -> list[dict[str, Any]] | None:
    value = body.get(key)
    if value is None:
        if required:
            raise ApiError.invalid(f"'{key}' is required", param=key)
        return None
    if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
        raise ApiError.invalid(f"'{key}' must be a list of objects", param=key)
    return value


def token_list(body: dict[str, Any], key: str) -> list[int]:
    value = body.get(key)
    if value is None:
        raise ApiError.invalid(f"'{key}' is required", param=key)
    # bool is an int subclass: refuse it explicitly.
    if not isinstance(value, list) or not all(isinstance(item, int) and not isinstance(item, bool) for item in value):
        raise ApiError.invalid(f"'{key}' must be a list of integer token ids", param=key)
    return value
