"""Storage faults end to end, on a real server (tiny llama) and its SQLite file under `--data-dir`.

A damaged row is a 500 for the requests that read it and nothing else; a disk that
cannot take a write (the server's file size capped with `prlimit`) makes a stored
response a 503 `storage_unavailable`, never a 200, while unstored requests are
served, and storing resumes when the cap is lifted; a stream whose client leaves
mid-way is stored as `cancelled` under the id `response.created` announced.
"""

from __future__ import annotations

import re
import resource
import sqlite3
from collections.abc import Iterator
from contextlib import closing, contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest

from tests.support.server import RunningServer, running_server

MODEL = "tiny-llama"
DATABASE = "courier.sqlite3"  # under --data-dir
DISCONNECT_LOGGED_S = 60.0


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("storage-faults")


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path, cache_dir: Path, data_dir: Path) -> Iterator[RunningServer]:
    args = ["--model", str(tiny_llama_dir), "--cache-dir", str(cache_dir), "--served-model-name", MODEL]
    with running_server([*args, "--data-dir", str(data_dir)]) as running:
        yield running
        assert running.stop() == 0


def damage(data_dir: Path, sql: str, record_id: str) -> None:
    """Overwrite one row's JSON with bytes that do not parse, while the server runs (bit rot, a bad restore)."""
    with closing(sqlite3.connect(data_dir / DATABASE)) as db, db:
        assert db.execute(sql, (b'{"id": "rotten', record_id)).rowcount == 1


def create(http: httpx.Client, **body: Any) -> httpx.Response:
    return http.post("/v1/responses", json={"model": MODEL, "input": "Log the ship.", "max_output_tokens": 2, **body})


def test_a_damaged_record_fails_only_the_requests_that_read_it(
    client: openai.OpenAI, http: httpx.Client, server: RunningServer, data_dir: Path
) -> None:
    bad = client.responses.create(model=MODEL, input="The Aurora passed.", max_output_tokens=2)
    ok = client.responses.create(model=MODEL, input="The Borealis passed.", max_output_tokens=2)
    rotten = client.conversations.create(items=[{"role": "user", "content": "Start the log."}])
    sound = client.conversations.create(items=[{"role": "user", "content": "Start the log."}])
    rotten_item = client.conversations.items.list(rotten.id).data[0].id
    assert rotten_item is not None
    damage(data_dir, "UPDATE responses SET response = ? WHERE id = ?", bad.id)
    damage(data_dir, "UPDATE conversation_items SET item = ? WHERE id = ?", rotten_item)

    for _ in range(2):  # every read of it, not only the first
        reply = http.get(f"/v1/responses/{bad.id}")
        assert reply.status_code == 500, reply.text
        assert reply.json()["error"]["code"] == "stored_record_damaged"
        assert bad.id in reply.json()["error"]["message"]
    continued = create(http, previous_response_id=bad.id)
    assert (continued.status_code, continued.json()["error"]["code"]) == (500, "stored_record_damaged")
    in_rotten = create(http, conversation=rotten.id)
    assert (in_rotten.status_code, in_rotten.json()["error"]["code"]) == (500, "stored_record_damaged")
    assert http.get(f"/v1/conversations/{rotten.id}/items").status_code == 500
    server.wait_for(re.compile(rf"storage: the stored response '{bad.id}' is damaged"))

    assert http.get("/health").status_code == 200
    assert client.responses.retrieve(ok.id).model_dump() == ok.model_dump()
    assert create(http, previous_response_id=ok.id).status_code == 200
    assert create(http, conversation=sound.id).status_code == 200
    assert create(http).status_code == 200
    client.responses.delete(bad.id)  # the way out: the damaged record can be deleted
    assert http.get(f"/v1/responses/{bad.id}").status_code == 404


@contextmanager
def full_disk(server: RunningServer, data_dir: Path) -> Iterator[None]:
    """No file of the server's may grow past the write-ahead log's present size: its next write has no room."""
    _, hard = resource.prlimit(server.process.pid, resource.RLIMIT_FSIZE)
    wal = data_dir / f"{DATABASE}-wal"
    resource.prlimit(server.process.pid, resource.RLIMIT_FSIZE, (wal.stat().st_size, hard))
    try:
        yield
    finally:
        resource.prlimit(server.process.pid, resource.RLIMIT_FSIZE, (hard, hard))


def test_a_response_that_cannot_be_stored_is_a_503_and_storing_resumes(
    client: openai.OpenAI, http: httpx.Client, server: RunningServer, data_dir: Path
) -> None:
    before = client.responses.create(model=MODEL, input="Stored before.", max_output_tokens=2)
    with full_disk(server, data_dir):
        refused = create(http)
        assert refused.status_code == 503, refused.text
        error = refused.json()["error"]
        assert (error["code"], error["type"]) == ("storage_unavailable", "server_error")
        assert "storage is unavailable" in error["message"]
        assert refused.headers["Retry-After"]
        stream = client.responses.create(model=MODEL, input="Streamed.", max_output_tokens=2, stream=True)
        with stream:
            events: list[Any] = list(stream)
        assert events[-1].type == "response.failed"
        assert events[-1].response.error.code == "storage_unavailable"
        unstored = create(http, store=False)
        assert unstored.status_code == 200 and unstored.json()["status"] in ("completed", "incomplete")
        chat = http.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
        )
        assert chat.status_code == 200
        assert client.responses.retrieve(before.id).model_dump() == before.model_dump()  # reads still served
        assert http.get("/health").status_code == 200
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(events[0].response.id)  # announced, never stored: not there
    after = create(http)
    assert after.status_code == 200, after.text
    assert http.get(f"/v1/responses/{after.json()['id']}").json() == after.json()
    assert client.responses.retrieve(before.id).model_dump() == before.model_dump()
    server.wait_for(re.compile(r"storage: writes succeed again, after \d+ calls failed"))


def test_a_stream_whose_client_disconnects_is_stored_as_cancelled(http: httpx.Client, server: RunningServer) -> None:
    conversation = http.post("/v1/conversations", json={}).json()["id"]
    body = {
        "model": MODEL,
        "input": "Tell me everything.",
        "max_output_tokens": 1500,
        "temperature": 0,
        "stream": True,
        "conversation": conversation,
    }
    response_id = ""
    received = ""
    with server.http() as leaving, leaving.stream("POST", "/v1/responses", json=body) as stream:
        for line in stream.iter_lines():
            if not line.startswith("data: "):
                continue
            event = orjson.loads(line.removeprefix("data: "))
            if event["type"] == "response.created":
                response_id = event["response"]["id"]
            if event["type"] == "response.output_text.delta" and event["delta"]:
                received = event["delta"]
                break  # leaving the block closes the connection mid-stream
    assert response_id and received
    server.wait_for(
        re.compile(rf"response {response_id}: the client disconnected mid-stream; stored as cancelled"),
        timeout=DISCONNECT_LOGGED_S,
    )
    stored = http.get(f"/v1/responses/{response_id}")
    assert stored.status_code == 200, stored.text
    cancelled = stored.json()
    assert cancelled["status"] == "cancelled"
    message = cancelled["output"][0]
    assert (message["type"], message["status"]) == ("message", "incomplete")
    assert message["content"][0]["text"].startswith(received)  # what was streamed, and what followed it
    # What exists is in its conversation too: the input, then the cut-short answer.
    items = http.get(f"/v1/conversations/{conversation}/items", params={"order": "asc"}).json()["data"]
    assert [(item["type"], item.get("role")) for item in items] == [("message", "user"), ("message", "assistant")]
    assert items[1]["content"][0]["text"] == message["content"][0]["text"]
    assert http.get("/health").status_code == 200
