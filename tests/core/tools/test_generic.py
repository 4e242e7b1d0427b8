"""Generic tool mode's rendering of tool results: `<tool_response>` blocks in one user message, as text while they
hold only text, as parts (each image's placeholder inside its block) when one holds an image."""

from __future__ import annotations

from typing import Any

import pytest

from courier.core.tools.generic import render

IMAGE = {"type": "image"}
CALL = {"role": "assistant", "content": None, "tool_calls": [{"id": "a", "function": {"name": "f", "arguments": {}}}]}


def text(value: str) -> dict[str, Any]:
    return {"type": "text", "text": value}


@pytest.mark.parametrize(
    ("results", "expected"),
    [
        (["one"], "<tool_response>\none\n</tool_response>"),
        (["one", "two"], "<tool_response>\none\n</tool_response>\n<tool_response>\ntwo\n</tool_response>"),
        ([[text("shot:"), IMAGE]], [text("<tool_response>\nshot:"), IMAGE, text("\n</tool_response>")]),
        (
            ["one", [IMAGE]],
            [text("<tool_response>\none\n</tool_response>\n<tool_response>\n"), IMAGE, text("\n</tool_response>")],
        ),
        (
            [[IMAGE], "two"],
            [text("<tool_response>\n"), IMAGE, text("\n</tool_response>\n<tool_response>\ntwo\n</tool_response>")],
        ),
    ],
)
def test_tool_results_render_as_one_user_message(results: list[Any], expected: Any) -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "go"}, CALL]
    messages += [{"role": "tool", "tool_call_id": "a", "content": result} for result in results]
    rendered = render(messages, None)
    assert rendered[-1] == {"role": "user", "content": expected}
