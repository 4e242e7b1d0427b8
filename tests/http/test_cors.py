"""CORS for browser UIs (`--cors-allow-origins`): the policy's table, the ASGI layer in-process, and a real server.

The server runs with API keys, so the tests show a preflight answered without one, and the headers on every kind
of answer a page may need to read: JSON, an SSE stream, an error envelope (401, 404), the openai client's calls.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from courier.http.cors import CorsMiddleware, CorsPolicy, with_vary_origin
from tests.support.server import RunningServer, running_server

MODEL = "tiny"
KEY = "sk-browser-ui"
UI = "https://ui.example"
LOCAL_UI = "http://localhost:3000"
STRANGER = "https://evil.example"
CORS_HEADERS = (
    "access-control-allow-origin",
    "access-control-allow-methods",
    "access-control-allow-headers",
    "access-control-max-age",
    "access-control-expose-headers",
)


# -- the policy ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("setting", "origin", "allowed"),
    [
        (None, UI, None),
        ("", UI, None),
        (f"{UI}, {LOCAL_UI}/", UI, UI),
        (f"{UI}, {LOCAL_UI}/", LOCAL_UI, LOCAL_UI),  # a trailing slash in the setting is no part of an origin
        (f"{UI},{LOCAL_UI}", STRANGER, None),
        (f"{UI},{LOCAL_UI}", "https://UI.example", "https://UI.example"),  # scheme and host match in any case
        (UI, "https://ui.example:8443", None),  # another port is another origin
        (UI, None, None),
        ("*", STRANGER, "*"),
        (f"{UI},*", "null", "*"),
    ],
)
def test_which_origins_are_allowed(setting: str | None, origin: str | None, allowed: str | None) -> None:
    policy = CorsPolicy.from_setting(setting)
    assert (policy.allowed(origin) if policy is not None else None) == allowed


def test_entries_that_are_no_origin_are_dropped(caplog: pytest.LogCaptureFixture) -> None:
    policy = CorsPolicy.from_setting("ui.example, https://ui.example/app, https://ok.example")
    assert policy == CorsPolicy(origins=frozenset({"https://ok.example"}))
    assert "ui.example" in caplog.text and "https://ui.example/app" in caplog.text
    assert CorsPolicy.from_setting("localhost:3000") is None  # nothing usable: no CORS at all


def test_a_preflight_allows_authorization_content_type_and_what_is_asked() -> None:
    policy = CorsPolicy(origins=frozenset({UI}))
    headers = dict(policy.preflight_headers(UI, "x-stainless-os, Content-Type, bad header, authorization") or [])
    assert headers[b"access-control-allow-headers"] == b"Authorization, Content-Type, x-stainless-os"
    assert headers[b"access-control-allow-methods"] == b"GET, POST, DELETE, OPTIONS"
    assert headers[b"access-control-max-age"] == b"600"
    assert policy.preflight_headers(STRANGER, None) is None


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ([], [(b"vary", b"Origin")]),
        ([(b"vary", b"Accept-Encoding")], [(b"vary", b"Accept-Encoding, Origin")]),
        ([(b"vary", b"origin")], [(b"vary", b"origin")]),
        ([(b"vary", b"*")], [(b"vary", b"*")]),
    ],
)
def test_vary_gains_origin_once(headers: list[tuple[bytes, bytes]], expected: list[tuple[bytes, bytes]]) -> None:
    assert with_vary_origin(headers) == expected


# -- the ASGI layer, in-process ----------------------------------------------------------------------------------


async def app_answering_401(scope: dict[str, Any], receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 401, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": b'{"error": {}}'})


async def call(policy: CorsPolicy, method: str, headers: dict[str, str]) -> list[dict[str, Any]]:
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": method,
        "path": "/v1/models",
        "headers": [(name.encode(), value.encode()) for name, value in headers.items()],
    }
    await CorsMiddleware(app_answering_401, policy)(scope, None, send)
    return sent


@pytest.mark.anyio
async def test_any_origin_is_answered_with_a_star_and_no_vary() -> None:
    policy = CorsPolicy(origins=frozenset(), any_origin=True)
    start, _ = await call(policy, "GET", {"origin": STRANGER})
    assert start["status"] == 401  # the app's own answer, with the headers added
    headers = dict(start["headers"])
    assert headers[b"access-control-allow-origin"] == b"*"
    assert b"vary" not in headers
    preflight, body = await call(policy, "OPTIONS", {"origin": STRANGER, "access-control-request-method": "POST"})
    assert preflight["status"] == 204 and body == {"type": "http.response.body", "body": b""}


@pytest.mark.anyio
async def test_an_options_request_that_is_no_preflight_goes_to_the_app() -> None:
    start, _ = await call(CorsPolicy(origins=frozenset({UI})), "OPTIONS", {"origin": UI})
    assert start["status"] == 401


# -- a real server ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path, cache_dir: Path) -> Iterator[RunningServer]:
    args = ["--model", str(tiny_llama_dir), "--cache-dir", str(cache_dir), "--api-key", KEY]
    env = {"COURIER_SERVED_MODEL_NAME": MODEL, "COURIER_CORS_ALLOW_ORIGINS": f"{UI}, {LOCAL_UI}"}
    with running_server(args, env=env) as running:
        yield running
        assert running.stop() == 0


def authorized(origin: str | None = UI) -> dict[str, str]:
    headers = {"Authorization": f"Bearer {KEY}"}
    return headers | ({"Origin": origin} if origin else {})


def assert_cors(response: httpx.Response, origin: str) -> None:
    assert response.headers["access-control-allow-origin"] == origin
    assert "Origin" in [part.strip() for part in response.headers["vary"].split(",")]
    assert response.headers["access-control-expose-headers"] == "Retry-After, x-request-id, request-id"


def assert_no_cors(response: httpx.Response) -> None:
    assert not [name for name in CORS_HEADERS if name in response.headers]


def test_a_preflight_is_answered_without_a_key(http: httpx.Client) -> None:
    asked = {
        "Origin": UI,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type, x-stainless-retry-count",
    }
    reply = http.options("/v1/chat/completions", headers=asked)
    assert reply.status_code == 204, reply.text
    assert reply.content == b""
    assert reply.headers["access-control-allow-origin"] == UI
    assert set(reply.headers["access-control-allow-methods"].split(", ")) >= {"GET", "POST", "DELETE", "OPTIONS"}
    allowed = {name.lower() for name in reply.headers["access-control-allow-headers"].split(", ")}
    assert allowed >= {"authorization", "content-type", "x-stainless-retry-count"}
    assert int(reply.headers["access-control-max-age"]) > 0
    assert "Origin" in reply.headers["vary"]


def test_a_preflight_from_another_origin_gets_no_cors_headers(http: httpx.Client) -> None:
    reply = http.options("/v1/chat/completions", headers={"Origin": STRANGER, "Access-Control-Request-Method": "POST"})
    assert reply.status_code == 401  # not answered as a preflight: the app asks for a key, as for any request
    assert_no_cors(reply)


@pytest.mark.parametrize("origin", [UI, LOCAL_UI])
def test_json_answers_carry_the_listed_origin(http: httpx.Client, origin: str) -> None:
    reply = http.get("/v1/models", headers=authorized(origin))
    assert reply.status_code == 200
    assert_cors(reply, origin)


def test_error_envelopes_carry_it_too(http: httpx.Client) -> None:
    unauthorized = http.get("/v1/models", headers={"Origin": UI})
    assert unauthorized.status_code == 401
    assert unauthorized.json()["error"]["code"] == "invalid_api_key"
    assert_cors(unauthorized, UI)
    unknown = http.get("/v1/nowhere", headers=authorized())
    assert unknown.status_code == 404
    assert_cors(unknown, UI)
    bad = http.post("/v1/chat/completions", headers=authorized(), content=b"{not json")
    assert bad.status_code == 400
    assert_cors(bad, UI)


def test_an_sse_stream_carries_it(http: httpx.Client) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=body, headers=authorized()) as reply:
        assert reply.status_code == 200
        assert reply.headers["content-type"].startswith("text/event-stream")
        assert_cors(reply, UI)
        lines = [line for line in reply.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"


def test_the_openai_client_from_a_page_sees_the_headers(server: RunningServer) -> None:
    with openai.OpenAI(
        base_url=f"{server.base_url}/v1", api_key=KEY, max_retries=0, default_headers={"Origin": UI}
    ) as client:
        raw = client.responses.with_raw_response.create(model=MODEL, input="Hi", max_output_tokens=2)
    assert raw.headers["access-control-allow-origin"] == UI
    assert raw.parse().status in ("completed", "incomplete")


def test_other_origins_and_no_origin_get_no_cors_headers(http: httpx.Client) -> None:
    assert_no_cors(http.get("/v1/models", headers=authorized(STRANGER)))
    assert_no_cors(http.get("/v1/models", headers=authorized(None)))
    assert_no_cors(http.get("/v1/nowhere", headers={"Origin": STRANGER}))
