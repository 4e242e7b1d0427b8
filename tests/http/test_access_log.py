"""The access log and request ids: a line per HTTP request, and an id on each response, through the ASGI application
Hypercorn serves (`create_app`), in-process.

Requests reach the app over httpx's ASGI transport, so every layer a served request passes (the request span, the
access log, the routes) runs; no actor reads the context's inboxes, so a request that gets past validation is 503.
The line of a request served end to end, with keys, is checked on a real server in test_api_keys.py (with the id the
openai SDK reports), an Anthropic error's id in anthropic/test_models.py.
"""

from __future__ import annotations

import logging
import re
from collections.abc import AsyncIterator, MutableMapping
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from courier.http.access_log import AccessLogMiddleware
from courier.http.app import create_app
from courier.http.auth import ApiKeys
from courier.http.context import AppContext
from courier.runtime import trace_attributes
from courier.settings import Settings
from courier.status.http_requests import HttpRequestCounts
from tests.support.app import ready_context

MODEL = "tiny-llama"
KEY = "sk-courier-access"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"
CHAT = "/v1/chat/completions"

pytestmark = pytest.mark.anyio


def access_lines(caplog: pytest.LogCaptureFixture, level: int = logging.INFO) -> list[str]:
    logged = (record for record in caplog.records if record.name == "courier.access" and record.levelno == level)
    return [record.getMessage() for record in logged]


def fields(line: str) -> dict[str, str]:
    """A logfmt line's fields, quoted values unescaped."""
    found = re.findall(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)', line)
    return {key: unquoted(value) for key, value in found}


def unquoted(value: str) -> str:
    return value[1:-1].replace('\\"', '"').replace("\\\\", "\\") if value.startswith('"') else value


@asynccontextmanager
async def serving(context: AppContext) -> AsyncIterator[httpx.AsyncClient]:
    """A client of the ASGI application Hypercorn would serve for `context`."""
    transport = httpx.ASGITransport(app=create_app(context))
    async with httpx.AsyncClient(transport=transport, base_url="http://courier.test") as http:
        yield http


@pytest.fixture
async def client(caplog: pytest.LogCaptureFixture) -> AsyncIterator[httpx.AsyncClient]:
    caplog.set_level(logging.DEBUG, logger="courier.access")
    with ready_context(MODEL) as context:
        async with serving(context) as http:
            yield http


async def test_a_refused_request_is_logged_with_its_error_and_trace(
    client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "presence_penalty": 9}
    refused = await client.post(CHAT, json=body, headers={"traceparent": TRACEPARENT})
    assert refused.status_code == 400
    [line] = access_lines(caplog)
    logged = fields(line)
    assert (logged["method"], logged["path"], logged["status"]) == ("POST", CHAT, "400")
    assert int(logged["bytes"]) == len(refused.content) and int(logged["ms"]) >= 0
    assert logged["trace"] == TRACE_ID  # the request's span: the line and the trace are found by one another
    error = refused.json()["error"]
    assert (logged["error"], logged["param"]) == (error["code"], "presence_penalty")
    assert logged["message"] == error["message"]
    assert "tenant" not in logged and "complete" not in logged  # no keys: no tenant; the answer was sent whole
    assert "Hi" not in line  # never the prompt


async def test_a_request_past_validation_names_its_model(
    client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    answered = await client.post(CHAT, json=body)
    assert answered.status_code == 503  # no actor behind the app (see the module's docstring)
    logged = fields(access_lines(caplog)[-1])
    assert (logged["status"], logged["model"]) == ("503", MODEL)


async def test_probes_are_logged_at_debug_only(client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture) -> None:
    assert (await client.get("/health")).status_code == 200
    assert (await client.get("/metrics")).status_code == 200
    assert access_lines(caplog) == []
    assert [fields(line)["path"] for line in access_lines(caplog, logging.DEBUG)] == ["/health", "/metrics"]


async def test_a_hostile_path_stays_one_escaped_line(
    client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    path = '/v1/no such "route"\nstatus=200\u2028\U000e0001'
    quoted = path.replace(" ", "%20").replace("\n", "%0A").replace('"', "%22")
    quoted = quoted.replace("\u2028", "%E2%80%A8").replace("\U000e0001", "%F3%A0%80%81")
    assert (await client.get(quoted)).status_code == 404
    [line] = access_lines(caplog)
    assert "\n" not in line and "\u2028" not in line
    logged = fields(line)
    escaped = path.replace("\n", "\\x0a").replace("\u2028", "\\u2028").replace("\U000e0001", "\\U000e0001")
    assert (logged["path"], logged["status"]) == (escaped, "404")


async def test_with_keys_a_caller_is_its_tenant_never_its_key(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="courier.access")
    keys = ApiKeys([KEY])
    with ready_context(MODEL, api_keys=keys) as context:
        async with serving(context) as http:
            assert (await http.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"})).status_code == 200
            assert (await http.get("/v1/models", headers={"Authorization": "Bearer sk-nobody"})).status_code == 401
    known, unknown = (fields(line) for line in access_lines(caplog))
    assert known["tenant"] == keys.caller(f"Bearer {KEY}").tenant
    assert (unknown["status"], unknown["error"]) == ("401", "invalid_api_key") and "tenant" not in unknown
    assert all(KEY not in line and "sk-nobody" not in line for line in access_lines(caplog))


async def test_no_access_log_writes_no_line(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="courier.access")
    with ready_context(MODEL, Settings(access_log=False)) as context:
        async with serving(context) as http:
            assert (await http.get("/v1/models")).status_code == 200
    assert access_lines(caplog) == [] and access_lines(caplog, logging.DEBUG) == []


async def test_a_response_never_finished_says_so(caplog: pytest.LogCaptureFixture) -> None:
    """A stream whose application ends before its last byte (its client gone): `complete=false`, the bytes sent."""
    caplog.set_level(logging.INFO, logger="courier.access")

    async def cut_stream(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True})

    sent: list[MutableMapping[str, Any]] = []

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message)

    async def receive() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    scope = {"type": "http", "method": "POST", "path": CHAT, "headers": []}
    counts = HttpRequestCounts()
    await AccessLogMiddleware(cut_stream, quiet_paths=(), counts=counts, write_lines=True)(scope, receive, send)
    assert len(sent) == 2  # passed on as they came
    logged = fields(access_lines(caplog)[-1])
    assert (logged["status"], logged["bytes"], logged["complete"]) == ("200", "10", "false")
    assert counts.counts == {("unmatched", "POST", "200"): 1}  # no route noted: this app is no Quart app


REQUEST_ID = re.compile(r"req_[0-9a-f]{24}")


async def test_each_response_carries_its_request_id_under_both_names(
    client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    answers = [await client.get("/v1/models"), await client.post(CHAT, json={"model": MODEL})]
    ids = [answer.headers["x-request-id"] for answer in answers]
    assert [answer.headers["request-id"] for answer in answers] == ids  # OpenAI's SDKs read one, Anthropic's the other
    assert all(REQUEST_ID.fullmatch(request_id) for request_id in ids) and ids[0] != ids[1]
    assert [fields(line)["id"] for line in access_lines(caplog)] == ids


@pytest.mark.parametrize(
    ("given", "kept"),
    [("haproxy-0a1b:42.7", True), ("x" * 128, True), ("x" * 129, False), ("two words", False), ("", False)],
)
async def test_a_fronts_request_id_is_kept_and_any_other_value_replaced(
    client: httpx.AsyncClient, given: str, kept: bool
) -> None:
    answered = await client.get("/v1/models", headers={"X-Request-Id": given})
    request_id = answered.headers["x-request-id"]
    assert request_id == given if kept else REQUEST_ID.fullmatch(request_id)


async def test_an_anthropic_error_body_names_its_request(client: httpx.AsyncClient) -> None:
    refused = await client.post("/v1/messages", json={"model": MODEL, "max_tokens": 0, "messages": []})
    assert refused.status_code == 400
    assert refused.json()["request_id"] == refused.headers["request-id"]


async def test_the_request_span_carries_the_id(client: httpx.AsyncClient, span_exporter: InMemorySpanExporter) -> None:
    request_id = (await client.get("/v1/models")).headers["x-request-id"]
    [span] = [span for span in span_exporter.get_finished_spans() if span.name == "GET /v1/models"]
    assert span.attributes is not None and span.attributes[trace_attributes.REQUEST_ID] == request_id


async def test_every_request_is_counted_by_route_template_method_and_status(caplog: pytest.LogCaptureFixture) -> None:
    """Counted for /metrics with the lines off too; a route is its template, never the path a client made up."""
    with ready_context(MODEL, Settings(access_log=False)) as context:
        async with serving(context) as http:
            await http.get("/v1/responses/resp_one")
            await http.get("/v1/responses/resp_two")
            await http.post(CHAT, json={"model": MODEL, "messages": []})
            await http.request("BREW", "/v1/models")
            await http.get("/v1/no/such/route/resp_three")
            exposition = (await http.get("/metrics")).text
    counted = context.state.http_requests.counts
    assert counted[("/v1/responses/<response_id>", "GET", "503")] == 2  # no storage actor behind this app
    assert counted[("/v1/chat/completions", "POST", "400")] == 1
    assert counted[("unmatched", "other", "405")] == 1  # a method no route has, and one no HTTP client uses
    assert counted[("unmatched", "GET", "404")] == 1
    assert not any("resp_" in route for route, _, _ in counted)
    sample = 'courier_http_requests_total{method="GET",route="/v1/responses/<response_id>",status="503"} 2.0'
    assert sample in exposition
    assert access_lines(caplog) == []


async def test_of_several_request_ids_the_last_is_kept(client: httpx.AsyncClient) -> None:
    """A front appends its own X-Request-Id after any the client sent (HAProxy's unique-id-header does)."""
    headers = [("X-Request-Id", "client-chosen"), ("X-Request-Id", "front-7")]
    assert (await client.get("/v1/models", headers=headers)).headers["x-request-id"] == "front-7"
    headers = [("X-Request-Id", "client-chosen"), ("X-Request-Id", "not sane")]
    assert REQUEST_ID.fullmatch((await client.get("/v1/models", headers=headers)).headers["x-request-id"])


async def test_a_preflight_answered_by_the_cors_layer_is_counted_as_one(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="courier.access")
    with ready_context(MODEL, Settings(cors_allow_origins="*")) as context:
        async with serving(context) as http:
            preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST"}
            answered = await http.options(CHAT, headers=preflight)
    assert answered.status_code == 204 and REQUEST_ID.fullmatch(answered.headers["x-request-id"])
    assert context.state.http_requests.counts == {("preflight", "OPTIONS", "204"): 1}
    assert fields(access_lines(caplog)[-1])["id"] == answered.headers["x-request-id"]
