"""JSON inside strings: parsed within a depth limit, else left a string; depth measured without recursion."""

from __future__ import annotations

from typing import Any

import pytest

from courier.core.json_text import MAX_DEPTH, json_object, nesting_depth
from courier.core.tools.calls import json_arguments


def nested(levels: int) -> str:
    return '{"a": ' * levels + "1" + "}" * levels


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{"city": "Paris"}', {"city": "Paris"}),
        (nested(MAX_DEPTH), "parsed"),
        (nested(MAX_DEPTH + 1), None),
        ("[" * 5000 + "]" * 5000, None),  # json.loads raises RecursionError on this
        ('{"a": ' * 2000 + "1" + "}" * 2000, None),  # past orjson's own limit too
        ("[1, 2]", None),  # JSON, but not an object
        ("not json", None),
        ("", None),
        ('{"a": 1', None),
    ],
    ids=[
        "object",
        "at the limit",
        "one past the limit",
        "deep list",
        "past orjson's limit",
        "a list",
        "text",
        "empty",
        "truncated",
    ],
)
def test_json_object(text: str, expected: Any) -> None:
    parsed = json_object(text)
    if expected == "parsed":
        assert parsed is not None and nesting_depth(parsed) == MAX_DEPTH
    else:
        assert parsed == expected


@pytest.mark.parametrize(
    ("value", "depth"),
    [(1, 0), ("text", 0), ({}, 1), ([], 1), ({"a": [1, {"b": 2}]}, 3), ([[[[]]]], 4)],
)
def test_nesting_depth(value: Any, depth: int) -> None:
    assert nesting_depth(value) == depth


def test_a_deep_value_is_measured_without_recursion() -> None:
    value: Any = 1
    for _ in range(100_000):  # far past the interpreter's recursion limit
        value = [value]
    assert nesting_depth(value) == MAX_DEPTH + 1  # stops as soon as it is over the limit


def test_tool_arguments_too_deep_stay_the_string_they_came_as() -> None:
    deep = "[" * 5000 + "]" * 5000
    assert json_arguments(deep) == deep
    assert json_arguments('{"city": "Paris"}') == {"city": "Paris"}
    assert json_arguments({"city": "Paris"}) == {"city": "Paris"}
