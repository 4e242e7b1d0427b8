"""Which items a compaction keeps: cuts only before a user turn or after a closed tool group."""

from __future__ import annotations

from typing import Any

from courier.conversation.selection import segments, select


def user(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


def assistant(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}


def call(call_id: str) -> dict[str, Any]:
    return {"type": "function_call", "call_id": call_id, "name": "f", "arguments": "{}"}


def output(call_id: str) -> dict[str, Any]:
    return {"type": "function_call_output", "call_id": call_id, "output": "ok"}


def texts(parts: list[list[dict[str, Any]]]) -> list[list[str]]:
    def label(item: dict[str, Any]) -> str:
        if item["type"] == "message":
            return str(item["content"][0]["text"])
        return f"{item['type']}:{item['call_id']}"

    return [[label(item) for item in part] for part in parts]


def test_turns_split_before_each_user_message() -> None:
    items = [user("u1"), assistant("a1"), user("u2"), assistant("a2")]
    assert texts(segments(items)) == [["u1", "a1"], ["u2", "a2"]]


def test_a_tool_group_ends_a_segment_once_its_last_call_is_answered() -> None:
    items = [user("u1"), call("c1"), call("c2"), output("c1"), output("c2"), assistant("done"), user("u2")]
    assert texts(segments(items)) == [
        ["u1", "function_call:c1", "function_call:c2", "function_call_output:c1", "function_call_output:c2"],
        ["done"],
        ["u2"],
    ]


def test_an_unfinished_tool_group_stays_whole_with_a_user_message_inside() -> None:
    items = [user("u1"), assistant("a1"), user("u2"), call("c1"), user("u3 while the call is open")]
    assert texts(segments(items)) == [["u1", "a1"], ["u2", "function_call:c1", "u3 while the call is open"]]


def test_keeps_the_latest_user_turn_and_what_fits_the_budget() -> None:
    parts = segments([user("u1"), assistant("a1"), user("u2"), assistant("a2"), user("u3"), assistant("a3")])
    chosen = select(parts, costs=[10, 10, 10], keep_tokens=20)
    assert (chosen.retained, chosen.summarized) == ((1, 2), (0,))
    tight = select(parts, costs=[10, 10, 10], keep_tokens=5)
    assert (tight.retained, tight.summarized) == ((2,), (0, 1))  # the latest user turn is kept even over budget


def test_whole_turns_only_a_turn_that_does_not_fit_stops_the_walk() -> None:
    parts = segments([user("u1"), user("u2"), user("u3"), user("u4")])
    chosen = select(parts, costs=[1, 50, 1, 1], keep_tokens=10)
    assert chosen.retained == (2, 3)  # u2 does not fit, so u1 (older) is not kept either


def test_keeps_the_most_recent_completed_tool_group_even_when_older() -> None:
    items = [
        user("u1"),
        call("c1"),
        output("c1"),
        assistant("a1"),
        user("u2"),
        assistant("a2"),
        user("u3"),
        assistant("a3"),
    ]
    parts = segments(items)
    assert texts(parts)[0] == ["u1", "function_call:c1", "function_call_output:c1"]
    chosen = select(parts, costs=[10] * len(parts), keep_tokens=10)
    assert chosen.retained == (0, 3)
    assert chosen.summarized == (1, 2)


def test_a_history_ending_inside_a_tool_group_keeps_the_group() -> None:
    parts = segments([user("u1"), assistant("a1"), user("u2"), call("c1"), call("c2"), output("c1")])
    chosen = select(parts, costs=[10, 10], keep_tokens=0)
    assert texts([parts[index] for index in chosen.retained]) == [
        ["u2", "function_call:c1", "function_call:c2", "function_call_output:c1"]
    ]
