"""The Messages API's part of /openapi.json agrees with its validators: each body, accepted or refused by both."""

from __future__ import annotations

from typing import Any

import httpx
import jsonschema_rs
import pytest

from courier.http.openapi import openapi_document
from tests.http.anthropic.conftest import MODEL

USER = [{"role": "user", "content": "hi"}]
TOOL = {"name": "f", "input_schema": {"type": "object"}}
# (path, body, the param a refusal names; None: accepted).
AGREEMENT: list[tuple[str, dict[str, Any], str | None]] = [
    ("/v1/messages", {"max_tokens": 2, "messages": USER}, None),
    ("/v1/messages", {"max_tokens": 2, "messages": USER, "system": [{"type": "text", "text": "Be brief."}]}, None),
    ("/v1/messages", {"messages": USER}, "max_tokens"),
    ("/v1/messages", {"max_tokens": 0, "messages": USER}, "max_tokens"),
    ("/v1/messages", {"max_tokens": 2, "messages": []}, "messages"),
    ("/v1/messages", {"max_tokens": 2, "messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
    ("/v1/messages", {"max_tokens": 2, "messages": USER, "temperature": 1.5}, "temperature"),
    ("/v1/messages", {"max_tokens": 2, "messages": USER, "top_k": -1}, "top_k"),
    ("/v1/messages", {"max_tokens": 2, "messages": USER, "stop_sequences": ["a"] * 33}, "stop_sequences"),
    ("/v1/messages", {"max_tokens": 2, "messages": USER, "tools": [TOOL], "tool_choice": {"type": "any"}}, None),
    (
        "/v1/messages",
        {"max_tokens": 2, "messages": USER, "tools": [TOOL], "tool_choice": {"type": "some"}},
        "tool_choice",
    ),
    ("/v1/messages", {"max_tokens": 2, "messages": USER, "tools": [{"name": "f"}]}, "tools[0].input_schema"),
    ("/v1/messages", {"max_tokens": 2, "messages": USER, "thinking": {"type": "adaptive"}}, None),
    ("/v1/messages", {"max_tokens": 2, "messages": USER, "thinking": {"type": "enabled"}}, "thinking.budget_tokens"),
    (
        "/v1/messages",
        {"max_tokens": 2, "messages": USER, "thinking": {"type": "adaptive", "display": "brief"}},
        "thinking.display",
    ),
    ("/v1/messages", {"max_tokens": 2, "messages": USER, "output_config": {"effort": "loud"}}, "output_config.effort"),
    ("/v1/messages", {"max_tokens": 2, "messages": USER, "mcp_servers": [{"url": "x"}]}, "mcp_servers"),
    (
        "/v1/messages",
        {
            "max_tokens": 2,
            "messages": USER,
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        },
        None,
    ),
    ("/v1/messages/count_tokens", {"messages": USER}, None),
    ("/v1/messages/count_tokens", {"messages": USER, "tools": [TOOL]}, None),
    ("/v1/messages/count_tokens", {"messages": "hi"}, "messages"),
]


def _schema(path: str) -> dict[str, Any]:
    schema: dict[str, Any] = openapi_document()["paths"][path]["post"]["requestBody"]["content"]["application/json"][
        "schema"
    ]
    return schema


@pytest.mark.parametrize(("path", "body", "refused_param"), AGREEMENT)
def test_the_document_and_the_validators_agree(
    keyed_http: httpx.Client, path: str, body: dict[str, Any], refused_param: str | None
) -> None:
    sent = {"model": MODEL, **body}
    assert jsonschema_rs.validator_for(_schema(path)).is_valid(sent) == (refused_param is None)
    reply = keyed_http.post(path, json=sent)
    if refused_param is None:
        assert reply.status_code == 200, reply.text
    else:
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["param"] == refused_param


def test_errors_are_documented_in_anthropics_envelope() -> None:
    document = openapi_document()
    operation = document["paths"]["/v1/messages"]["post"]
    assert operation["responses"]["400"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/AnthropicError"
    }
    envelope = {"type": "error", "error": {"type": "invalid_request_error", "message": "no"}, "request_id": None}
    assert jsonschema_rs.validator_for(document["components"]["schemas"]["AnthropicError"]).is_valid(envelope)
