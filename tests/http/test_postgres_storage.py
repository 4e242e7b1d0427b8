"""Stored responses in PostgreSQL, end to end: a real server (tiny llama) with `--storage postgresql://...`.

Responses, chains and conversations are stored and read back through the API, text
holding a NUL character included; with the database stopped, what needs storage is a
503 `storage_unavailable` with `Retry-After` while everything else is served, at once
for readers already waiting (the breaker opens); once it is back the same server
stores again, its probe having reconnected by itself. A server started
while the database is down is ready all the same, and reaches (and migrates) it once
it is up. The password never reaches the log.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import psycopg
import pytest

from courier.storage.postgres_connection import POOL_MAX_SIZE
from courier.storage.postgres_schema import SCHEMA_VERSION
from tests.support.polling import attempts
from tests.support.postgres_cluster import PASSWORD, PostgresCluster
from tests.support.server import RunningServer, running_server

MODEL = "tiny-llama"
REACH_TIMEOUT_S = 30.0
READERS = 8  # twice the pool: half hold its connections, half wait for one
OUTAGE_ANSWER_S = 2.0  # the most a reader waits for its 503 once the database stops


@pytest.fixture(scope="module")
def database_url(postgres_cluster: PostgresCluster) -> str:
    return postgres_cluster.fresh_url()


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path, cache_dir: Path, database_url: str) -> Iterator[RunningServer]:
    args = ["--model", str(tiny_llama_dir), "--cache-dir", str(cache_dir), "--served-model-name", MODEL]
    with running_server([*args, "--storage", database_url]) as running:
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
    after = stored_once_reached(http)  # the same server, no restart: its probe reconnected
    assert http.get(f"/v1/responses/{after.json()['id']}").json() == after.json()
    assert client.responses.retrieve(before.id).model_dump() == before.model_dump()
    server.wait_for(re.compile(r"storage: writes succeed again, after \d+ calls failed"), 10)


def stored_once_reached(http: httpx.Client) -> httpx.Response:
    """A stored response, created as soon as the breaker's probe has reached the database again (bounded)."""
    deadline = time.monotonic() + REACH_TIMEOUT_S
    while (stored := create(http)).status_code == 503:
        assert stored.json()["error"]["code"] == "storage_unavailable", stored.text
        assert time.monotonic() < deadline, "storing did not resume"
    assert stored.status_code == 200, stored.text
    return stored


def test_readers_waiting_when_the_database_stops_get_their_503_at_once_and_storing_resumes_by_itself(
    http: httpx.Client, server: RunningServer, postgres_cluster: PostgresCluster, database_url: str
) -> None:
    stored = create(http).json()
    answers: list[tuple[httpx.Response, float]] = []

    def read() -> None:
        with server.http() as reader:
            reply = reader.get(f"/v1/responses/{stored['id']}")
        answers.append((reply, time.monotonic()))

    blocker = psycopg.connect(database_url)  # ended by the database stopping
    blocker.execute("LOCK TABLE responses IN ACCESS EXCLUSIVE MODE")  # readers take every connection and wait
    readers = [threading.Thread(target=read) for _ in range(READERS)]
    for reader in readers:
        reader.start()
    for _ in attempts(REACH_TIMEOUT_S):
        if postgres_cluster.waiting_on_lock(database_url, "responses", POOL_MAX_SIZE):
            break
    else:
        raise AssertionError("the readers never reached the database")
    up = False
    stopped = time.monotonic()
    # At once: a fast stop cuts the lock holder's session first, and a reader granted the lock then may finish its
    # query before its own session is cut (a 200, seen once in CI).
    postgres_cluster.stop(mode="immediate")
    try:
        for reader in readers:
            reader.join(REACH_TIMEOUT_S)
        assert len(answers) == READERS
        for reply, answered in answers:
            assert reply.status_code == 503, reply.text
            assert reply.json()["error"]["code"] == "storage_unavailable"
            assert int(reply.headers["Retry-After"]) > 0
            assert answered - stopped < OUTAGE_ANSWER_S  # not ACQUIRE_TIMEOUT_S per reader in turn
        started = time.monotonic()
        later = http.get(f"/v1/responses/{stored['id']}")
        assert later.status_code == 503 and time.monotonic() - started < OUTAGE_ANSWER_S / 2  # the breaker is open
        breaker = re.findall(r'^courier_storage_breaker_state\{state="(\w+)"\} 1\.0$', http.get("/metrics").text, re.M)
        assert breaker in (["open"], ["probing"])
        assert create(http, store=False).status_code == 200  # what needs no storage is served as ever
        postgres_cluster.start()
        up = True
    finally:
        blocker.close()
        if not up:
            postgres_cluster.start()
    after = stored_once_reached(http)
    assert http.get(f"/v1/responses/{after.json()['id']}").json() == after.json()
    assert http.get(f"/v1/responses/{stored['id']}").json() == stored
    assert 'courier_storage_breaker_state{state="closed"} 1.0' in http.get("/metrics").text
    server.wait_for(re.compile(r"storage: the database answers again after"), 10)


def test_text_holding_a_nul_character_is_stored_and_read_back(http: httpx.Client) -> None:
    conversation = http.post("/v1/conversations", json={"items": [{"role": "user", "content": "one\u0000two"}]})
    assert conversation.status_code == 200, conversation.text
    created = create(http, input="three\u0000four", conversation=conversation.json()["id"])
    assert created.status_code == 200, created.text
    inputs = http.get(f"/v1/responses/{created.json()['id']}/input_items").json()["data"]
    assert inputs[0]["content"][0]["text"] == "three\x00four"
    items = http.get(f"/v1/conversations/{conversation.json()['id']}/items", params={"order": "asc"}).json()["data"]
    assert [item["content"][0]["text"] for item in items[:2]] == ["one\x00two", "three\x00four"]


def test_a_server_started_while_the_database_is_down_serves_and_reaches_it_once_up(
    tiny_llama_dir: Path, cache_dir: Path, postgres_cluster: PostgresCluster
) -> None:
    url = postgres_cluster.fresh_url()
    args = ["--model", str(tiny_llama_dir), "--cache-dir", str(cache_dir), "--served-model-name", MODEL]
    postgres_cluster.stop()
    up = False
    try:
        with running_server([*args, "--storage", url]) as late, late.http() as http:  # ready without its database
            warning = re.compile(r"response store postgresql://courier@127\.0\.0\.1:\d+/postgres cannot be reached")
            assert any(warning.search(line) and "retrying" in line for line in late.lines)
            health = http.get("/health")  # ready: completions need no storage
            assert (health.status_code, health.json()["status"]) == (200, "ok")
            chat = http.post(
                "/v1/chat/completions",
                json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
            )
            assert chat.status_code == 200, chat.text
            assert create(http, store=False).status_code == 200
            for refused in (create(http), http.get("/v1/responses/resp_1"), http.post("/v1/conversations", json={})):
                assert refused.status_code == 503, refused.text
                assert refused.json()["error"]["code"] == "storage_unavailable"
                assert int(refused.headers["Retry-After"]) > 0

            postgres_cluster.start()
            up = True
            deadline = time.monotonic() + REACH_TIMEOUT_S
            while (stored := create(http)).status_code == 503:  # until the next call tries (at most a second)
                assert time.monotonic() < deadline, late.log()[-3000:]
            assert stored.status_code == 200, stored.text
            assert http.get(f"/v1/responses/{stored.json()['id']}").json() == stored.json()
            late.wait_for(re.compile(rf"applied {SCHEMA_VERSION} schema migrations"), 10)
            assert late.stop() == 0
            assert PASSWORD not in late.log()
    finally:
        if not up:
            postgres_cluster.start()


def test_a_login_the_database_refuses_stops_start_up(
    tiny_llama_dir: Path, cache_dir: Path, postgres_cluster: PostgresCluster
) -> None:
    wrong = postgres_cluster.fresh_url().replace(PASSWORD, "not-the-password")
    args = ["--model", str(tiny_llama_dir), "--cache-dir", str(cache_dir), "--storage", wrong]
    with running_server(args, wait_ready=False) as refused:  # a misconfiguration, not an outage: no retrying
        assert refused.wait_exit() == 1
    assert re.search(
        r"cannot open the response store postgresql://courier@127\.0\.0\.1:\d+/postgres: .*password", refused.log()
    )
    assert "not-the-password" not in refused.log()
