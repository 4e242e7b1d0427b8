"""A body its schema refuses is a 400 whose `param` is the path of what failed, worded from the schema (or its
`x-error`): a table over the routes' own schemas, without a server."""

from __future__ import annotations

from typing import Any

import pytest

from courier.http.errors import ApiError
from courier.http.schemas import anthropic, chat, completions, embeddings, responses
from courier.http.schemas.shared import Schema
from courier.http.schemas.validator import check

USER = {"role": "user", "content": "hi"}
CHAT = chat.request(8)
# (schema, body, param, the start of the message after "'<param>' ")
REFUSED: list[tuple[Schema, dict[str, Any], str, str]] = [
    (CHAT, {}, "messages", "is required"),
    (CHAT, {"messages": [USER, USER, {"role": "user", "content": 3}]}, "messages[2].content", "must be a string"),
    (CHAT, {"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role", "must be one of system"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}, "messages[0].content[0]", "must"),
    (CHAT, {"messages": [USER], "temperature": 3}, "temperature", "must be in [0, 2]"),
    (CHAT, {"messages": [USER], "temperature": "hot"}, "temperature", "must be a number in [0, 2]"),
    (CHAT, {"messages": [USER], "n": 9}, "n", "must be an integer from 1 to 8"),
    (CHAT, {"messages": [USER], "top_k": 2.5}, "top_k", "must be an integer"),
    (CHAT, {"messages": [USER], "store": True}, "store", "true is not supported"),
    (CHAT, {"messages": [USER], "logit_bias": {"x": 1}}, "logit_bias", "must be an object of token ids"),
    (CHAT, {"messages": [USER], "tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0].function", ""),
    # A refused key's name is told before a failure in its value.
    (CHAT, {"messages": [USER], "chat_template_kwargs": {"messages": []}}, "chat_template_kwargs", "names must"),
    (CHAT, {"messages": [USER], "chat_template_kwargs": {"persona": {}}}, "chat_template_kwargs.persona", "must"),
    (completions.request(8), {"prompt": "x", "logprobs": 6}, "logprobs", "must be an integer from 0 to 5"),
    # A union's tag names the branch: a value no branch takes is told at the tag.
    (responses.REQUEST, {"tools": [{"type": "teleporter"}]}, "tools[0].type", "must be one of function"),
    (responses.REQUEST, {"input": [{"role": "robot", "content": "x"}]}, "input[0].role", "must be one of user"),
    (
        anthropic.MESSAGES,
        {"model": "m", "max_tokens": 1, "messages": [USER, {"role": "assistant", "content": [{"type": "tool_use"}]}]},
        "messages[1].content[0].id",
        "is required",
    ),
    (
        anthropic.MESSAGES,
        {"model": "m", "max_tokens": 1, "messages": [USER], "context_management": {"edits": [{"type": "clear_x"}]}},
        "context_management.edits[0]",
        'only clear_thinking_20251015 edits are supported, not "clear_x"',  # x-error's {type}: what was asked
    ),
    (embeddings.REQUEST, {"input": ["a", True]}, "input[1]", "must be a string or an array of token ids"),
    (embeddings.REQUEST, {"input": "a", "dimensions": 0}, "dimensions", "must be a positive integer"),
]


@pytest.mark.parametrize(("schema", "body", "param", "wording"), REFUSED, ids=[case[2] for case in REFUSED])
def test_a_refusal_names_the_path_of_what_failed(
    schema: Schema, body: dict[str, Any], param: str, wording: str
) -> None:
    with pytest.raises(ApiError) as refused:
        check(schema, body)
    assert (refused.value.status, refused.value.param) == (400, param)
    assert str(refused.value).startswith(f"'{param}' {wording}"), str(refused.value)


@pytest.mark.parametrize(
    ("schema", "body"),
    [
        (CHAT, {"messages": [USER], "top_k": 2.0, "n": None, "stop": "x"}),  # 2.0 is an integer; null is absent
        (completions.request(8), {"prompt": [1, 2, 3]}),
        (responses.REQUEST, {"input": "hi", "tools": [{"type": "web_search"}]}),
        (embeddings.REQUEST, {"input": [[1, 2], "x"]}),
    ],
)
def test_what_the_schema_takes_passes(schema: Schema, body: dict[str, Any]) -> None:
    check(schema, body)
