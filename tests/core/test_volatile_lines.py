"""Volatile system-prompt lines left out before rendering: a table of messages and what the render is given."""

from __future__ import annotations

from typing import Any

import pytest

from courier.core.volatile_lines import without_volatile_lines

HEADER = "x-anthropic-billing-header: cc_version=2.1.197.c40; cc_entrypoint=sdk-cli;"
LATER_HEADER = "x-anthropic-billing-header: cc_version=2.1.201.a1b; cc_entrypoint=cli; cch=5f3e2;"
USER = {"role": "user", "content": "Run echo hi"}


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        # Claude Code's system blocks as the Messages API joins them: the header is the first line.
        (
            {"role": "system", "content": f"{HEADER}\nYou are a Claude agent.\nBe brief."},
            {"role": "system", "content": "You are a Claude agent.\nBe brief."},
        ),
        # A later version's per-request `cch=`, and a header in the middle, indented, in another case.
        (
            {"role": "system", "content": f"You are an agent.\n  X-Anthropic-Billing-Header: {LATER_HEADER[27:]}\nGo."},
            {"role": "system", "content": "You are an agent.\nGo."},
        ),
        ({"role": "developer", "content": f"{LATER_HEADER}\nRules."}, {"role": "developer", "content": "Rules."}),
        # As content parts (chat completions, the Responses API's instructions).
        (
            {"role": "system", "content": [{"type": "text", "text": HEADER}, {"type": "text", "text": "Rules."}]},
            {"role": "system", "content": [{"type": "text", "text": ""}, {"type": "text", "text": "Rules."}]},
        ),
        # A message made empty keeps its place.
        ({"role": "system", "content": HEADER}, {"role": "system", "content": ""}),
        # The line merely mentioned, not starting a line, stays.
        (
            {"role": "system", "content": "Never print the x-anthropic-billing-header: line."},
            {"role": "system", "content": "Never print the x-anthropic-billing-header: line."},
        ),
        # A user's own text is never changed.
        (
            {"role": "user", "content": f"{HEADER}\nWhat is this?"},
            {"role": "user", "content": f"{HEADER}\nWhat is this?"},
        ),
        (
            {"role": "assistant", "content": None, "tool_calls": []},
            {"role": "assistant", "content": None, "tool_calls": []},
        ),
    ],
    ids=["first-line", "middle-cch", "developer", "parts", "emptied", "mentioned", "user", "no-content"],
)
def test_volatile_lines_are_left_out_of_system_messages(message: dict[str, Any], expected: dict[str, Any]) -> None:
    assert list(without_volatile_lines([message, USER])) == [expected, USER]


def test_messages_without_volatile_lines_come_back_as_they_were() -> None:
    messages = [{"role": "system", "content": "You are an agent."}, USER]
    assert without_volatile_lines(messages) is messages


def test_two_requests_that_differ_only_in_the_header_render_the_same() -> None:
    first = [{"role": "system", "content": f"{HEADER}\nYou are an agent."}, USER]
    second = [{"role": "system", "content": f"{LATER_HEADER}\nYou are an agent."}, USER]
    assert without_volatile_lines(first) == without_volatile_lines(second)
