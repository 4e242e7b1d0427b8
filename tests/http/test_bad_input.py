"""Bad input across the API: each a 4xx in the OpenAI envelope, nothing lost, the server still serving."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.server import RunningServer, serving

MODEL = "tiny-llama"
MAX_BODY = 1024 * 1024


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path, cache_dir: Path) -> Iterator[RunningServer]:
    with serving(tiny_llama_dir, cache_dir, MODEL, "--max-body-bytes", str(MAX_BODY)) as running:
        yield running


def chat(content: str) -> bytes:
    return b'{"messages": [{"role": "user", "content": "' + content.encode() + b'"}]}'


DEEP = b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}"
NESTED = b'{"messages": [{"role": "user", "content": "hi"}], "metadata": ' + b'{"a": ' * 70 + b"1" + b"}" * 71

BAD: list[tuple[str, str, bytes, int]] = [
    ("malformed JSON", "/v1/chat/completions", b'{"messages": [', 400),
    ("not an object", "/v1/responses", b"[1, 2, 3]", 400),
    ("empty body", "/v1/completions", b"", 400),
    ("invalid UTF-8", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', 400),
    ("lone surrogate", "/v1/responses", b'{"input": "\\ud800"}', 400),
    ("deep nesting", "/v1/chat/completions", DEEP, 400),
    ("nested past the body's depth limit", "/v1/chat/completions", NESTED, 400),
    ("nested past the body's depth limit", "/tokenize", NESTED, 400),
    ("wrong type", "/v1/chat/completions", b'{"messages": "hi"}', 400),
    ("wrong type", "/v1/responses", b'{"input": 42}', 400),
    ("wrong type", "/v1/conversations", b'{"metadata": [1]}', 400),
    ("huge string", "/v1/chat/completions", chat("x" * (MAX_BODY + 10)), 413),
    ("prompt over the context", "/v1/completions", b'{"prompt": "' + b"word " * 20000 + b'"}', 400),
    (
        "negative limit",
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": -5}',
        400,
    ),
    ("huge limit", "/v1/completions", b'{"prompt": "hi", "max_tokens": 1000000000000}', 400),
    ("huge limit", "/v1/responses", b'{"input": "hi", "max_output_tokens": 99999999999}', 400),
    ("unknown role", "/v1/chat/completions", b'{"messages": [{"role": "wizard", "content": "hi"}]}', 400),
    ("unknown role", "/v1/responses", b'{"input": [{"role": "wizard", "content": "hi"}]}', 400),
    ("bad capsule", "/v1/responses", b'{"input": [{"type": "compaction", "encrypted_content": "%%%"}]}', 400),
    ("bad capsule", "/v1/responses/compact", b'{"input": [{"type": "compaction", "encrypted_content": 5}]}', 400),
    (
        "bad URL",
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "ftp://x/y"}}]}]}',
        400,
    ),
    (
        "bad URL",
        "/v1/responses",
        b'{"input": [{"role": "user", "content": [{"type": "input_image", "image_url": 7}]}]}',
        400,
    ),
    ("token ids out of range", "/v1/completions", b'{"prompt": [1, 99999999]}', 400),
    ("bad pagination", "/v1/conversations/conv_x/items?limit=-1", b"", 400),
]


@pytest.mark.parametrize(("case", "path", "body", "status"), BAD, ids=[f"{c}-{p}" for c, p, _, _ in BAD])
def test_bad_input_is_a_4xx_envelope(http: httpx.Client, case: str, path: str, body: bytes, status: int) -> None:
    method = "GET" if "?" in path else "POST"
    reply = http.request(method, path, content=body or None, headers={"Content-Type": "application/json"})
    assert reply.status_code == status, (case, reply.text[:300])
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["type"] == "invalid_request_error"


def test_nothing_is_lost_and_the_server_keeps_serving(http: httpx.Client) -> None:
    stored = http.post("/v1/responses", json={"model": MODEL, "input": "Keep me.", "max_output_tokens": 2}).json()
    for _, path, body, _ in BAD:
        http.request("GET" if "?" in path else "POST", path, content=body or None)
    assert http.get(f"/v1/responses/{stored['id']}").json() == stored
    again = http.post(
        "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    )
    assert again.status_code == 200
    assert http.get("/health").json()["scheduler"]["running"] == 0


# Tool-call arguments are JSON inside a string: nested past Python's recursion limit (1,000) they used to raise
# RecursionError in the chat render, on every turn of a conversation holding them. They are kept as the string they
# came as. (1,500 levels: this model's template has no tools, so the calls are rendered into the prompt as text, and
# the whole conversation must fit its 2,048-token context.)
DEEP_ARGUMENTS = "[" * 1500 + "]" * 1500


def test_deeply_nested_tool_arguments_are_served_as_the_string_they_are(http: httpx.Client) -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": DEEP_ARGUMENTS}}
    messages = [
        {"role": "user", "content": "Look it up."},
        {"role": "assistant", "content": "Looking.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "found"},
        {"role": "user", "content": "Thanks."},
    ]
    chat_reply = http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 2})
    assert chat_reply.status_code == 200, chat_reply.text[:300]
    items = [
        {"role": "user", "content": "Look it up."},
        {"role": "assistant", "content": "Looking."},  # this test model's template needs text beside a call
        {"type": "function_call", "call_id": "call_1", "name": "lookup", "arguments": DEEP_ARGUMENTS},
        {"type": "function_call_output", "call_id": "call_1", "output": "found"},
        {"role": "user", "content": "Thanks."},
    ]
    counted = http.post("/v1/responses/input_tokens", json={"model": MODEL, "input": items})
    assert counted.status_code == 200, counted.text[:300]
    answered = http.post("/v1/responses", json={"model": MODEL, "input": items, "max_output_tokens": 2})
    assert answered.status_code == 200, answered.text[:300]
    follow_up = {"model": MODEL, "previous_response_id": answered.json()["id"], "input": "And?", "max_output_tokens": 2}
    assert http.post("/v1/responses", json=follow_up).status_code == 200  # every later turn too
    assert http.get("/health").json()["status"] == "ok"
