"""Fields of a body its schema has checked (`http/schemas/`), read with their defaults: null is absent, and an
integer may come as 2.0 (JSON Schema's integers), so it is read with `int()`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def flag(body: Mapping[str, Any], key: str, default: bool) -> bool:
    value = body.get(key)
    return default if value is None else bool(value)


def whole(body: Mapping[str, Any], key: str, default: int) -> int:
    value = body.get(key)
    return default if value is None else int(value)


def optional_whole(body: Mapping[str, Any], key: str) -> int | None:
    value = body.get(key)
    return None if value is None else int(value)


def real(body: Mapping[str, Any], key: str, default: float) -> float:
    value = body.get(key)
    return default if value is None else float(value)


def text(body: Mapping[str, Any], key: str) -> str | None:
    """A string field; an empty one is as good as absent."""
    value = body.get(key)
    return value or None
