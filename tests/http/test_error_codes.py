"""No error envelope carries `code: null` (issue 30, item 2): every status and failure kind has a code, every code
is documented in docs/api.md's Errors table or beside the refusal it names, and the answers a real server gives to
the requests that used to carry a null code have one."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

from courier.core.failure_codes import FailureCode
from courier.http.errors import CODE_BY_STATUS, ApiError, default_code
from courier.messages.base import CODE_OF_KIND, FailureKind, RequestFailed
from tests.support.server import TINY_MODEL, RunningServer

API_DOC = Path(__file__).resolve().parents[2] / "docs" / "api.md"
MODEL = TINY_MODEL


def errors_table() -> dict[int, str]:
    """docs/api.md's Errors table: each status and its row's text."""
    section = API_DOC.read_text().split("## Errors", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| (\d{3}) \| [^|]+ \| (.+) \|$", section, flags=re.MULTILINE)
    return {int(status): text for status, text in rows}


def test_every_status_of_the_errors_table_has_a_default_code_named_in_its_row() -> None:
    table = errors_table()
    assert set(table) == set(CODE_BY_STATUS)
    for status, text in table.items():
        assert f"`{CODE_BY_STATUS[status]}`" in text or f"code: {CODE_BY_STATUS[status]}`" in text, status


def test_every_code_is_documented() -> None:
    doc = API_DOC.read_text()
    undocumented = [code.value for code in FailureCode if not re.search(rf"[` ]{code.value}`", doc)]
    assert not undocumented


@pytest.mark.parametrize("status", [*CODE_BY_STATUS, 402, 415, 431, 502])
def test_an_error_raised_without_a_code_carries_its_statuss(status: int) -> None:
    body = ApiError(status, "refused").body()["error"]
    assert body["code"] == default_code(status) and body["code"] is not None
    assert ApiError(status, "refused").anthropic_body()["error"]["code"] is not None


@pytest.mark.parametrize("kind", list(FailureKind))
def test_a_failure_without_a_code_answers_its_kinds(kind: FailureKind) -> None:
    failure = RequestFailed(kind=kind, message="failed")
    assert kind in CODE_OF_KIND
    assert ApiError.from_failure(failure).body()["error"]["code"] == CODE_OF_KIND[kind]
    assert RequestFailed(kind=kind, message="failed", code=FailureCode.OVERLOADED).failure_code == "overloaded"


@pytest.fixture(scope="module")
def server(tiny_server: RunningServer) -> RunningServer:
    return tiny_server  # the session's shared default server (tests/conftest.py)


NUL_FILE_URL = "file:///tmp/a\x00.png"


@pytest.mark.parametrize(
    ("path", "body", "status", "code"),
    [
        # A text model given an image whose URL cannot even be read: that it takes no images is what matters.
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": NUL_FILE_URL}}]}]},
            400,
            "model_not_multimodal",
        ),
        (
            "/v1/responses",
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": NUL_FILE_URL}]}]},
            400,
            "model_not_multimodal",
        ),
        ("/v1/chat/completions", {"messages": "not a list"}, 400, "invalid_request"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "top_p": 7}, 400, "invalid_request"),
        ("/v1/responses", {"input": "Hi", "tool_choice": "sometimes"}, 400, "invalid_request"),
    ],
    ids=["chat-image-on-text-model", "responses-image-on-text-model", "messages", "top_p", "tool_choice"],
)
def test_refusals_that_carried_a_null_code_name_one(
    http: httpx.Client, path: str, body: dict[str, object], status: int, code: str
) -> None:
    reply = http.post(path, json={"model": MODEL, **body})
    assert reply.status_code == status, reply.text
    assert reply.json()["error"]["code"] == code, reply.text


def test_a_wrong_method_names_its_code(http: httpx.Client) -> None:
    reply = http.get("/v1/chat/completions")
    assert reply.status_code == 405
    assert reply.json()["error"]["code"] == "method_not_allowed"
