"""Anthropic's `system` and `messages` as the chat template's messages: a table of translations and refusals."""

from __future__ import annotations

from typing import Any

import pytest

from courier.conversation.chat_content import IMAGE_PART
from courier.http.anthropic.content import chat_messages
from courier.http.errors import ApiError
from courier.http.schemas import anthropic
from courier.http.schemas.validator import check
from courier.messages.media import ImageRef

PNG = "iVBORw0KGgo="
USER = {"role": "user", "content": "Hi"}


def test_system_blocks_join_in_order() -> None:
    """The billing header stays in the translation: the render leaves it out (`core/volatile_lines.py`)."""
    header = "x-anthropic-billing-header: cc_version=2.1.197.1c0; cc_entrypoint=sdk-cli;"
    system = [
        {"type": "text", "text": header},
        {"type": "text", "text": "You are an agent.", "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": "Be brief."},
    ]
    messages, images = chat_messages(system, [USER])
    assert messages == [{"role": "system", "content": f"{header}\nYou are an agent.\nBe brief."}, USER]
    assert images == ()


def test_a_tool_loop_renders_as_chat_messages_in_order() -> None:
    history: list[dict[str, Any]] = [
        {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
        {"role": "system", "content": "Tools may be slow."},  # Claude Code's mid-conversation system message
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "Call it.", "signature": "c2ln"},
                {"type": "redacted_thinking", "data": "opaque"},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "18 C"}]},
                {"type": "tool_result", "tool_use_id": "toolu_2", "content": "no such city", "is_error": True},
                {"type": "text", "text": "Thanks", "cache_control": {"type": "ephemeral"}},
            ],
        },
    ]
    messages, _ = chat_messages("Be kind.", history)
    call = {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    assert messages == [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "Weather?"},
        {"role": "system", "content": "Tools may be slow."},
        {"role": "assistant", "content": "Checking.", "tool_calls": [call], "reasoning_content": "Call it."},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "18 C"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: no such city"},
        {"role": "user", "content": "Thanks"},
    ]


def test_an_assistant_turn_of_only_calls_has_no_content() -> None:
    turn = {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}
    messages, _ = chat_messages(None, [USER, turn, {"role": "user", "content": "go on"}])
    assert messages[1]["content"] is None


def test_images_are_parts_and_refs_in_order() -> None:
    content = [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}},
        {"type": "text", "text": "and"},
        {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.png"}},
    ]
    messages, images = chat_messages(None, [{"role": "user", "content": content}])
    assert messages == [{"role": "user", "content": [IMAGE_PART, {"type": "text", "text": "and"}, IMAGE_PART]}]
    assert images == (
        ImageRef(url=f"data:image/png;base64,{PNG}", param="messages[0].content[0]"),
        ImageRef(url="https://example.com/cat.png", param="messages[0].content[2]"),
    )


REFUSED: list[tuple[Any, Any, str]] = [
    (None, [], "messages"),
    (None, "hi", "messages"),
    (3, [USER], "system"),
    ([{"type": "image"}], [USER], "system[0]"),
    (None, [{"role": "robot", "content": "hi"}], "messages[0].role"),
    (None, [{"role": "user", "content": 3}], "messages[0].content"),
    (None, [{"role": "user", "content": [{"type": "document", "source": {}}]}], "messages[0].content[0]"),
    (None, [{"role": "user", "content": [{"text": "no type"}]}], "messages[0].content[0]"),
    (None, [{"role": "user", "content": [{"type": "text", "text": 3}]}], "messages[0].content[0].text"),
    (
        None,
        [{"role": "user", "content": [{"type": "image", "source": {"type": "file"}}]}],
        "messages[0].content[0].source",
    ),
    (
        None,
        [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "ftp://x/y.png"}}]}],
        "messages[0].content[0]",
    ),
    (
        None,
        [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image"}]}]}],
        "messages[0].content[0].content[0].source",
    ),
    (
        None,
        [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "is_error": "yes"}]}],
        "messages[0].content[0].is_error",
    ),
    (None, [{"role": "user", "content": [{"type": "tool_result"}]}], "messages[0].content[0].tool_use_id"),
    (
        None,
        [USER, {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": []}]}, USER],
        "messages[1].content[0].input",
    ),
    (None, [USER, {"role": "assistant", "content": [{"type": "server_tool_use"}]}, USER], "messages[1].content[0]"),
    (None, [USER, {"role": "assistant", "content": "Sure, the answer is"}], "messages[1]"),  # a prefill
    (None, [{"role": "user", "content": []}], "messages[0].content"),
    (None, [USER, {"role": "assistant", "content": "Hi"}, {"role": "user", "content": []}], "messages[2].content"),
]


def test_an_assistant_message_with_no_block_is_taken() -> None:
    """A reply of only whitespace has no content block, and a client sends it back as it came."""
    messages, _ = chat_messages(None, [USER, {"role": "assistant", "content": []}, USER])
    assert [message["role"] for message in messages] == ["user", "assistant", "user"]


@pytest.mark.parametrize(("system", "messages", "param"), REFUSED)
def test_refusals_name_the_block(system: Any, messages: Any, param: str) -> None:
    """Through the schema the route checks first (`schemas/anthropic.py`), then the translation's own rules."""
    with pytest.raises(ApiError) as refused:
        check(anthropic.COUNT_TOKENS, {"model": "m", "system": system, "messages": messages})
        chat_messages(system, messages)
    assert (refused.value.status, refused.value.param) == (400, param)
