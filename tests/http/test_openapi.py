"""/openapi.json agrees with the routes, and its request bodies (the schemas every body is validated with,
`courier/http/schemas/`) give the verdicts the server gives, end to end."""

from __future__ import annotations

import re
from typing import Any

import anyio
import httpx
import jsonschema_rs
import pytest

from courier.conversation.capsule import CapsuleCodec
from courier.http.app import create_quart_app
from courier.http.context import AppContext, Outboxes
from courier.http.openapi import openapi_document
from courier.platform.blas import BlasReport
from courier.settings import Settings
from courier.status.metrics import CourierMetrics
from courier.status.scheduler_stats import SchedulerStats
from courier.status.service_state import ServiceState
from tests.support.server import TINY_MODEL, RunningServer

MODEL = TINY_MODEL


@pytest.fixture(scope="module")
def server(tiny_server: RunningServer) -> RunningServer:
    return tiny_server  # the session's shared default server (tests/conftest.py)


def test_the_served_document_is_openapi_3_1(http: httpx.Client) -> None:
    document = http.get("/openapi.json").json()
    assert document == openapi_document()
    assert document["openapi"].startswith("3.1")


def test_every_route_is_documented_and_every_documented_route_is_served() -> None:
    served: set[tuple[str, str]] = set()
    for rule in _app_rules():
        path = re.sub(r"<(?:\w+:)?(\w+)>", r"{\1}", rule[0])
        if not path.startswith("/v1/") and f"/v1{path}" in openapi_document()["paths"]:
            path = f"/v1{path}"  # an alias served without /v1
        served |= {(path, method) for method in rule[1]}
    documented = {(path, method.upper()) for path, item in openapi_document()["paths"].items() for method in item}
    assert served == documented


def _app_rules() -> list[tuple[str, set[str]]]:
    """The app's routes, from the app itself (no server needed)."""
    send, receive = anyio.create_memory_object_stream[Any](1)
    state = ServiceState(
        blas=BlasReport(library="r", path=None, optimized=False, detail=""),
        model_id=MODEL,
        scheduler=SchedulerStats(max_batch=1, max_queue=1),
    )
    outboxes = Outboxes(token_counter=send, ingress=send, storage=send, compactor=send)
    context = AppContext(
        settings=Settings(),
        state=state,
        outboxes=outboxes,
        metrics=CourierMetrics(state),
        capsules=CapsuleCodec(None, 1024),
    )
    rules = [
        (rule.rule, set(rule.methods or ()) - {"HEAD", "OPTIONS"})
        for rule in create_quart_app(context).url_map.iter_rules()
    ]
    send.close()
    receive.close()
    return rules


def _schema(path: str, method: str = "post") -> dict[str, Any]:
    schema: dict[str, Any] = openapi_document()["paths"][path][method]["requestBody"]["content"]["application/json"][
        "schema"
    ]
    return schema


CHAT = [{"role": "user", "content": "hi"}]
# (path, body, accepted): the document's verdict and the server's must agree; a refusal names the field.
AGREEMENT: list[tuple[str, dict[str, Any], str | None]] = [
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 2}, None),
    ("/v1/chat/completions", {"messages": [], "max_tokens": 2}, "messages"),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 0}, "max_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "temperature": 2.5}, "temperature"),
    ("/v1/chat/completions", {"messages": CHAT, "top_p": 0}, "top_p"),
    ("/v1/chat/completions", {"messages": CHAT, "n": 0}, "n"),
    ("/v1/chat/completions", {"messages": CHAT, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"messages": CHAT, "tool_choice": "sometimes"}, "tool_choice"),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "response_format": {"type": "json_object"}}, None),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "yaml"}}, "response_format.type"),
    (
        "/v1/chat/completions",
        {"messages": CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        "response_format.json_schema.schema",
    ),
    ("/v1/completions", {"prompt": "Once", "max_tokens": 2}, None),
    ("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 2}, None),
    ("/v1/completions", {"prompt": "Once", "logprobs": 6}, "logprobs"),
    ("/v1/completions", {"prompt": "Once", "best_of": 2}, "best_of"),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 2}, None),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ("/v1/responses", {"input": "hi", "background": True}, "background"),
    ("/v1/responses", {"input": "hi", "truncation": "auto"}, "truncation"),
    ("/v1/responses", {"input": "hi", "metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    ("/v1/responses", {"input": "hi", "tools": [{"type": "teleporter"}]}, "tools[0].type"),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 2, "tools": [{"type": "web_search"}]}, None),
    ("/v1/responses", {"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 2, "text": {"format": {"type": "json_object"}}}, None),
    ("/v1/responses", {"input": "hi", "text": {"format": {"type": "json_schema"}}}, "text.format.schema"),
    ("/v1/responses", {"input": "hi", "tool_choice": {"type": "function"}}, "tool_choice"),
    ("/v1/responses/compact", {"input": "hi", "max_output_tokens": 16385}, "max_output_tokens"),
    ("/v1/responses/compact", {"input": "hi", "keep_tokens": 0}, "keep_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "store": True}, "store"),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "store": False, "service_tier": "auto"}, None),
    ("/v1/chat/completions", {"messages": CHAT, "service_tier": "priority"}, "service_tier"),
    ("/v1/chat/completions", {"messages": CHAT, "modalities": ["text", "audio"]}, "modalities"),
    (
        "/v1/chat/completions",
        {
            "max_tokens": 2,
            "messages": [
                *CHAT,
                {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "function": {"name": "f"}}]},
                {"role": "tool", "tool_call_id": "c", "content": "done"},
            ],
        },
        None,
    ),
    ("/v1/completions", {"prompt": "Once", "suffix": "the end"}, "suffix"),
    ("/v1/responses", {"input": "hi", "include": ["everything"]}, "include[0]"),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 2, "include": ["message.output_text.logprobs"]}, None),
    ("/v1/responses", {"input": "hi", "prompt_cache_retention": "24h"}, "prompt_cache_retention"),
    ("/v1/responses/compact", {"input": "hi", "stream": True}, "stream"),
    ("/v1/conversations", {"items": "hello"}, None),
    ("/v1/conversations", {"metadata": {"k": "v"}}, None),
    ("/v1/conversations", {"metadata": {"k": 1}}, "metadata.k"),
    ("/detokenize", {"tokens": [1, 2]}, None),
    ("/detokenize", {"tokens": "12"}, "tokens"),
]


@pytest.mark.parametrize(("path", "body", "refused_param"), AGREEMENT)
def test_the_document_and_the_validators_agree(
    http: httpx.Client, path: str, body: dict[str, Any], refused_param: str | None
) -> None:
    documented_valid = jsonschema_rs.validator_for(_schema(path)).is_valid({"model": MODEL, **body})
    reply = http.post(path, json={"model": MODEL, **body})
    assert documented_valid == (refused_param is None)
    if refused_param is None:
        assert reply.status_code == 200, reply.text
    else:
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["param"] == refused_param
