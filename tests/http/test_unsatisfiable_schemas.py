"""Schemas a grammar cannot follow, through a real server (tiny random-weight llama): a constrained reply that
stops is valid; one whose grammar cannot be followed is refused before generation (400 naming the parameter) when
its first steps show it, and otherwise ends marked cut, never a `finish_reason: "stop"` with `{` or `{"`.

The three schemas of issue 30 (item 7) each made llguidance fail on the reply's first token while compiling had
passed: a `$ref` that requires itself (no finite instance), `anyOf` nested 8 x 8 x 8 over distinct objects, and an
object of 2,000 properties (tests/support/hostile_grammars.py, which bench/hostile_grammars.py sends too).
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.support.hostile_grammars import PROPERTIES_2000, UNSATISFIABLE
from tests.support.server import TINY_MODEL, RunningServer

MODEL = TINY_MODEL
MESSAGES = [{"role": "user", "content": "Reply with JSON."}]
# Its first steps pass (the probe stops at the integers); the reply meets the 2,000 properties after four digits.
DEEP = {
    "type": "object",
    "properties": {
        "a": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 4, "maxItems": 4},
        "b": PROPERTIES_2000,
    },
    "required": ["a", "b"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server(tiny_server: RunningServer) -> RunningServer:
    return tiny_server  # the session's shared default server (tests/conftest.py)


def chat_body(schema: Any, **fields: Any) -> dict[str, Any]:
    response_format = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    return {"model": MODEL, "messages": MESSAGES, "response_format": response_format, "max_tokens": 64, **fields}


def responses_body(schema: Any, **fields: Any) -> dict[str, Any]:
    text = {"format": {"type": "json_schema", "name": "x", "schema": schema}}
    return {"model": MODEL, "input": "Reply with JSON.", "text": text, "max_output_tokens": 64, **fields}


REQUESTS: list[tuple[str, str, Any, str]] = [
    ("chat", "/v1/chat/completions", chat_body, "response_format.json_schema.schema"),
    (
        "chat streamed",
        "/v1/chat/completions",
        lambda s: chat_body(s, stream=True),
        "response_format.json_schema.schema",
    ),
    ("responses", "/v1/responses", responses_body, "text.format.schema"),
    ("responses streamed", "/v1/responses", lambda s: responses_body(s, stream=True), "text.format.schema"),
]


@pytest.mark.parametrize("schema", UNSATISFIABLE.values(), ids=UNSATISFIABLE.keys())
@pytest.mark.parametrize(("path", "body", "param"), [r[1:] for r in REQUESTS], ids=[r[0] for r in REQUESTS])
def test_a_schema_generation_cannot_follow_is_a_400_naming_its_param(
    http: httpx.Client, schema: dict[str, Any], path: str, body: Any, param: str
) -> None:
    reply = http.post(path, json=body(schema))
    assert reply.status_code == 400, reply.text[:500]
    error = reply.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param)
    assert "cannot be followed" in error["message"] and "first steps" in error["message"], error["message"]
    assert http.get("/health").json()["scheduler"]["running"] == 0


def test_a_grammar_that_fails_mid_reply_ends_it_cut_not_stopped(http: httpx.Client) -> None:
    for seed in range(3):
        reply = http.post("/v1/chat/completions", json=chat_body(DEEP, temperature=1.0, seed=seed))
        assert reply.status_code == 200, reply.text
        (choice,) = reply.json()["choices"]
        content = choice["message"]["content"]
        assert choice["finish_reason"] == "length", choice
        assert content.startswith('{"a": ['), content  # cut where the grammar failed, before "b" or in it
        assert reply.json()["usage"]["completion_tokens"] < 64
        with pytest.raises(json.JSONDecodeError):
            json.loads(content)


def test_a_grammar_that_fails_mid_reply_is_an_incomplete_response(http: httpx.Client) -> None:
    response = http.post("/v1/responses", json=responses_body(DEEP, temperature=0)).json()
    assert (response["status"], response["incomplete_details"]) == ("incomplete", {"reason": "max_output_tokens"})
    streamed = http.post("/v1/chat/completions", json=chat_body(DEEP, temperature=0, stream=True))
    events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    finishes = [choice["finish_reason"] for event in events for choice in event["choices"] if choice["finish_reason"]]
    assert finishes == ["length"]
