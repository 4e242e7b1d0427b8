"""Image parts are admitted (or refused) before any byte is fetched: a counting HTTP server sees nothing."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tests.support.media_server import MediaServer, media_server
from tests.support.server import RunningServer, serving

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def media() -> Iterator[MediaServer]:
    with media_server() as running:
        yield running


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("trace") / "spans.jsonl"


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path, cache_dir: Path, trace_file: Path) -> Iterator[RunningServer]:
    with serving(tiny_llama_dir, cache_dir, MODEL, "--max-images", "3", "--trace-file", str(trace_file)) as running:
        yield running
    a_refused_request_traces_admission_and_no_fetch(trace_file)  # the server stopped: its spans are flushed


def image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def test_a_text_only_model_refuses_an_image_naming_itself_and_the_part(http: httpx.Client, media: MediaServer) -> None:
    content = [{"type": "text", "text": "What is in this picture?"}, image_part(media.url("/image.png"))]
    reply = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": content}]})
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == "messages[0].content[1]"
    assert error["code"] == "model_not_multimodal"
    assert MODEL in error["message"] and "messages[0].content[1]" in error["message"]
    assert sum(media.requests.values()) == 0


def test_responses_image_parts_are_refused_the_same_way(http: httpx.Client, media: MediaServer) -> None:
    item = {
        "role": "user",
        "content": [
            {"type": "input_text", "text": "Describe it."},
            {"type": "input_image", "image_url": media.url("/image.png")},
        ],
    }
    for path in ("/v1/responses", "/v1/responses/compact"):
        history = [item, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "?"}]
        body = {"model": MODEL, "input": history, "keep_tokens": 1}  # compaction summarizes the image's turn
        reply = http.post(path, json=body)
        assert reply.status_code == 400, (path, reply.text)
        assert reply.json()["error"]["param"] == "input[0].content[1]"
    assert sum(media.requests.values()) == 0


def test_too_many_images_are_refused_before_the_model_is_even_asked(http: httpx.Client, media: MediaServer) -> None:
    content = [image_part(media.url(f"/image.png?n={index}")) for index in range(4)]
    reply = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": content}]})
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "messages[0].content[3]"
    assert "at most 3" in reply.json()["error"]["message"]
    assert sum(media.requests.values()) == 0


@pytest.mark.parametrize(
    ("part", "param"),
    [
        ({"type": "image_url", "image_url": {}}, "messages[0].content[0]"),
        ({"type": "image_url"}, "messages[0].content[0]"),
        ({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}, "messages[0].content[0]"),
    ],
)
def test_malformed_media_parts_are_400s(http: httpx.Client, part: dict[str, Any], param: str) -> None:
    reply = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": [part]}]})
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == param


MALFORMED_URLS = [
    ("http://[::1/x.png", "not a valid URL"),
    ("http://a..b/x.png", "not a valid name"),
    (f"http://{'a' * 64}.example/x.png", "not a valid name"),
    ("http://user:secret@example.com/x.png", "credentials"),
    ("http://127.1/x.png", "not a valid IPv4 address"),
    ("file:///cat\x00.png", "NUL"),
    ("data:image/svg+xml,<svg/>", "data:image/<type>;base64"),
    ("data:image/png;base64,not base64!", "not valid base64"),
    ("ftp://example.com/x.png", "not ftp"),
    ("x.png", "no scheme"),
]


@pytest.mark.parametrize(("url", "reason"), MALFORMED_URLS)
def test_a_malformed_image_url_is_refused_while_the_body_is_validated(
    http: httpx.Client, media: MediaServer, url: str, reason: str
) -> None:
    """Before the model is even asked (so a text-only model answers the same): a 400 naming the part."""
    content = [{"type": "text", "text": "Look."}, image_part(url)]
    chat = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": content}]})
    assert chat.status_code == 400, chat.text
    assert chat.json()["error"]["param"] == "messages[0].content[1]"
    assert reason in chat.json()["error"]["message"]
    image = {"type": "input_image", "image_url": url}
    history = [
        {"role": "user", "content": "Hi."},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": [{"type": "input_text", "text": "Look."}, image]},
    ]
    for path in ("/v1/responses", "/v1/responses/compact", "/v1/responses/input_tokens"):
        reply = http.post(path, json={"model": MODEL, "input": history, "keep_tokens": 1})
        assert reply.status_code == 400, (path, reply.text)
        assert reply.json()["error"]["param"] == "input[2].content[1]", path
        assert reason in reply.json()["error"]["message"], path
    assert sum(media.requests.values()) == 0


def a_refused_request_traces_admission_and_no_fetch(trace_file: Path) -> None:
    """Checked when the module's tests are done and its server stopped (stopping flushes the spans)."""
    spans = [orjson.loads(line) for line in trace_file.read_text().splitlines()]
    by_id = {span["context"]["span_id"]: span for span in spans}
    names = [span["name"] for span in spans]
    assert names.count("ingress.AdmitGeneration") >= 3
    assert not any(name.startswith("media_fetcher.") for name in names)
    # Refused before the prompt was even rendered: no render under any admission.
    renders = [span for span in spans if span["name"] == "token_counter.TokenizeChat"]
    assert all(by_id[span["parent_id"]]["name"] != "ingress.AdmitGeneration" for span in renders)
