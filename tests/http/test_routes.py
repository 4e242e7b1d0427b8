"""The URL surface is the API: exactly these (method, path) pairs are served, each by one rule, `--api-prefix` or not.

Each route is declared once, without `/v1`, and `http/app.py` puts each family under `/v1`, beside it, or both; the
list below is the surface as it stood before that (issue 32), written out so that a route gained or lost is a red
test. The families served twice keep their error envelopes on both registrations.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from courier.settings import Settings
from tests.support.app import validating_app

SERVED = [
    ("GET", "/health"),
    ("GET", "/metrics"),
    ("GET", "/openapi.json"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("GET", "/v1/models"),
    ("GET", "/models"),
    ("GET", "/v1/models/<path:model_id>"),
    ("GET", "/models/<path:model_id>"),
    ("POST", "/v1/models/<path:model_id>/load"),
    ("POST", "/v1/models/<path:model_id>/unload"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/chat/completions"),
    ("POST", "/v1/completions"),
    ("POST", "/completions"),
    ("POST", "/v1/embeddings"),
    ("POST", "/embeddings"),
    ("POST", "/v1/responses"),
    ("POST", "/responses"),
    ("WEBSOCKET", "/v1/responses"),
    ("WEBSOCKET", "/responses"),
    ("POST", "/v1/responses/input_tokens"),
    ("POST", "/responses/input_tokens"),
    ("POST", "/v1/responses/compact"),
    ("POST", "/responses/compact"),
    ("GET", "/v1/responses/<response_id>"),
    ("GET", "/responses/<response_id>"),
    ("DELETE", "/v1/responses/<response_id>"),
    ("DELETE", "/responses/<response_id>"),
    ("POST", "/v1/responses/<response_id>/cancel"),
    ("POST", "/responses/<response_id>/cancel"),
    ("GET", "/v1/responses/<response_id>/input_items"),
    ("GET", "/responses/<response_id>/input_items"),
    ("POST", "/v1/conversations"),
    ("POST", "/conversations"),
    ("GET", "/v1/conversations/<conversation_id>"),
    ("GET", "/conversations/<conversation_id>"),
    ("POST", "/v1/conversations/<conversation_id>"),
    ("POST", "/conversations/<conversation_id>"),
    ("DELETE", "/v1/conversations/<conversation_id>"),
    ("DELETE", "/conversations/<conversation_id>"),
    ("GET", "/v1/conversations/<conversation_id>/items"),
    ("GET", "/conversations/<conversation_id>/items"),
    ("POST", "/v1/conversations/<conversation_id>/items"),
    ("POST", "/conversations/<conversation_id>/items"),
    ("GET", "/v1/conversations/<conversation_id>/items/<item_id>"),
    ("GET", "/conversations/<conversation_id>/items/<item_id>"),
    ("DELETE", "/v1/conversations/<conversation_id>/items/<item_id>"),
    ("DELETE", "/conversations/<conversation_id>/items/<item_id>"),
    ("POST", "/v1/messages"),
    ("POST", "/v1/messages/count_tokens"),
    ("GET", "/v1/cache/stats"),
    ("POST", "/v1/cache/reset"),
]
ANTHROPIC_VERSION = {"anthropic-version": "2023-06-01"}


@pytest.mark.parametrize("prefix", ["", "/courier"])
def test_exactly_the_api_s_routes_are_served_each_by_one_rule(prefix: str) -> None:
    with validating_app("tiny", replace(Settings(), api_prefix=prefix)) as client:
        served = [
            ("WEBSOCKET" if rule.websocket else method, rule.rule)
            for rule in client.app.url_map.iter_rules()
            for method in rule.methods or ()
            if method not in ("HEAD", "OPTIONS")  # Werkzeug adds them to every rule
        ]
    assert sorted(served) == sorted((method, f"{prefix}{path}") for method, path in SERVED)


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("method", "path"),
    [("GET", "/v1/models/nope"), ("GET", "/models/nope"), ("POST", "/v1/models/tiny/load")],
)
async def test_the_model_routes_answer_an_anthropic_client_in_its_envelope_with_or_without_v1(
    method: str, path: str
) -> None:
    with validating_app("tiny") as client:
        anthropic_reply = await client.open(path, method=method, headers=ANTHROPIC_VERSION, json={})
        openai_reply = await client.open(path, method=method, json={})
        anthropic_error, openai_error = await anthropic_reply.get_json(), await openai_reply.get_json()
    assert anthropic_reply.status_code == openai_reply.status_code >= 400
    assert anthropic_error["type"] == "error" and "type" in anthropic_error["error"]
    assert "type" not in openai_error and "code" in openai_error["error"]
