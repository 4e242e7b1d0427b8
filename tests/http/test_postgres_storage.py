"""Stored responses in PostgreSQL, end to end: a real server (tiny llama) with `--storage postgresql://...`.

Responses, chains and conversations are stored and read back through the API; with
the database stopped, what needs storage is a 503 `storage_unavailable` with
`Retry-After` while everything else is served; once it is back the same server
stores again, having reconnected by itself. The password never reaches the log.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.support.postgres_cluster import PASSWORD, PostgresCluster
from tests.support.server import RunningServer, running_server

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path, cache_dir: Path, postgres_cluster: PostgresCluster) -> Iterator[RunningServer]:
    args = ["--model", str(tiny_llama_dir), "--cache-dir", str(cache_dir), "--served-model-name", MODEL]
    with running_server([*args, "--storage", postgres_cluster.fresh_url()]) as running:
        yield running
        assert running.stop() == 0
        assert PASSWORD not in running.log()


def create(http: httpx.Client, **body: Any) -> httpx.Response:
    return http.post("/v1/responses", json={"model": MODEL, "input": "Log the ship.", "max_output_tokens": 2, **body})


def test_responses_chains_and_conversations_are_stored_in_postgres(
    client: openai.OpenAI, http: httpx.Client, server: RunningServer
) -> None:
    opened = re.compile(r"response store postgresql://courier@127\.0\.0\.1:\d+/postgres: 0 records")
    assert any(opened.search(line) for line in server.lines)  # logged before ready: named, without the password
    first = client.responses.create(model=MODEL, input="The Aurora passed.", max_output_tokens=2)
    second = client.responses.create(model=MODEL, input="And then?", max_output_tokens=2, previous_response_id=first.id)
    assert client.responses.retrieve(first.id).model_dump() == first.model_dump()
    assert client.responses.retrieve(second.id).previous_response_id == first.id
    inputs = http.get(f"/v1/responses/{second.id}/input_items", params={"order": "asc"}).json()["data"]
    assert [item["content"][0]["text"] for item in inputs] == ["And then?"]
    conversation = client.conversations.create(items=[{"role": "user", "content": "Start the log."}])
    assert create(http, conversation=conversation.id).status_code == 200
    items = client.conversations.items.list(conversation.id, order="asc").data
    assert [item.role for item in items] == ["user", "user", "assistant"]  # type: ignore[union-attr]


def test_a_stopped_database_fails_only_what_needs_it_and_the_server_reconnects(
    client: openai.OpenAI, http: httpx.Client, server: RunningServer, postgres_cluster: PostgresCluster
) -> None:
    before = client.responses.create(model=MODEL, input="Stored before.", max_output_tokens=2)
    with postgres_cluster.stopped():
        refused = create(http)
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "storage_unavailable"
        assert int(refused.headers["Retry-After"]) > 0
        unstored = create(http, store=False)
        assert unstored.status_code == 200, unstored.text
        chat = http.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
        )
        assert chat.status_code == 200
        assert http.get("/health").status_code == 200
    after = create(http)  # the same server, no restart: its pool reconnected
    assert after.status_code == 200, after.text
    assert http.get(f"/v1/responses/{after.json()['id']}").json() == after.json()
    assert client.responses.retrieve(before.id).model_dump() == before.model_dump()
    server.wait_for(re.compile(r"storage: writes succeed again, after \d+ calls failed"), 10)
