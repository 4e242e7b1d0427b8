"""JSON carried inside strings (tool-call arguments): parsed with a depth limit, or left as the string it came as.

A client or a model can put anything in a string field; parsing it must never raise
past its caller (`json.loads` raises `RecursionError` on a few thousand nested
brackets) nor hand a template or a parser a structure deep enough to exhaust the
interpreter's stack. Text that is not JSON, not an object, or nested deeper than
`MAX_DEPTH` levels stays a string.
"""

from __future__ import annotations

from typing import Any

import orjson

# Deeper than any real tool call's arguments, far from the interpreter's recursion limit.
MAX_DEPTH = 64


def json_object(text: str) -> dict[str, Any] | None:
    """`text` parsed as a JSON object within `MAX_DEPTH` levels, or None."""
    try:
        parsed = orjson.loads(text)
    except orjson.JSONDecodeError:  # also orjson's own depth limit (1024)
        return None
    if not isinstance(parsed, dict) or nesting_depth(parsed) > MAX_DEPTH:
        return None
    return parsed


def nesting_depth(value: Any) -> int:
    """How many containers deep `value` goes (a scalar: 0), walked without recursion."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, depth + 1)
        if deepest > MAX_DEPTH:
            return deepest  # deep enough to refuse: no need to walk the rest
        stack.extend((child, depth + 1) for child in children)
    return deepest
