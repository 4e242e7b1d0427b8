"""The whole stack, as `courier cluster up` runs it: a private PostgreSQL, 3 replicas of a tiny model, an HAProxy front.

Every replica names itself in the `X-Courier-Replica` header, so each test knows who answered;
each replica's own `/v1/cache/stats` says whether the turns it served were cache hits. Tests
that kill or drain a replica start it again before they end, and wait until the front routes to
it, so the next test finds the cluster whole.
"""

from __future__ import annotations

import re
import signal
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest

from courier.cluster import front_process, local_postgres
from courier.cluster.local_cluster import ClusterPlan, LocalCluster
from courier.cluster.replica_process import ReplicaProcess
from courier.conversation.ids import replica_of
from tests.support.polling import attempts
from tests.support.server import forked_replica, server_environment

pytestmark = pytest.mark.skipif(
    bool(reason := local_postgres.unavailable_reason() or front_process.unavailable_reason()), reason=reason or ""
)

MODEL = "tiny-llama"
REPLICAS = 3
HEADER = "x-courier-replica"
READY_TIMEOUT_S = 120.0
POLL_S = 0.01
# Greedy on the tiny model this runs to max_tokens (tests/server/test_supervisor.py): in flight when a signal lands.
GO_ON = "Go on forever."
# courier/cluster/haproxy_config.py UNIQUE_ID_FORMAT: addresses and ports, time, counter and pid, in hex.
FRONT_REQUEST_ID = re.compile(r"[0-9A-F]+:[0-9A-F]+_[0-9A-F]+:[0-9A-F]+_[0-9A-F]+_[0-9A-F]+:[0-9A-F]+")


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir: Path, cache_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    environ = server_environment({"COURIER_DATA_DIR": str(tmp_path_factory.mktemp("cluster-data"))})
    serve = ("--model", str(tiny_llama_dir), "--cache-dir", str(cache_dir), "--served-model-name", MODEL)
    plan = ClusterPlan(replicas=REPLICAS, port=0, serve_args=serve)
    with LocalCluster(plan, tmp_path_factory.mktemp("cluster"), environ, starter=forked_replica) as running:
        yield running


@pytest.fixture
def front(cluster: LocalCluster) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0, timeout=120) as front:
        yield front


def replica_client(replica: ReplicaProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{replica.url}/v1", api_key="unused", max_retries=0, timeout=120)


def cache_hits(cluster: LocalCluster) -> dict[str, int]:
    return {name: httpx.get(f"{r.url}/v1/cache/stats").json()["snapshot_hits"] for name, r in cluster.replicas.items()}


def chat_turn(front: openai.OpenAI, history: list[dict[str, str]], text: str, **key: str) -> tuple[str, int]:
    """One turn of a chat conversation (its reply appended to `history`): who served it, and its cached tokens."""
    history.append({"role": "user", "content": text})
    raw = front.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=history,  # type: ignore[arg-type]
        max_tokens=4,
        temperature=0,
        extra_body=key,  # prompt_cache_key or user
    )
    completion = raw.parse()
    history.append({"role": "assistant", "content": completion.choices[0].message.content or ""})
    assert completion.usage is not None and completion.usage.prompt_tokens_details is not None
    return raw.headers[HEADER], completion.usage.prompt_tokens_details.cached_tokens or 0


def response_turn(front: openai.OpenAI, text: str, **continuation: Any) -> tuple[str, int, str]:
    """One Responses turn: who served it, its cached tokens, its id."""
    raw = front.responses.with_raw_response.create(
        model=MODEL, input=text, max_output_tokens=4, temperature=0, **continuation
    )
    response = raw.parse()
    assert response.usage is not None
    return raw.headers[HEADER], response.usage.input_tokens_details.cached_tokens, response.id


def owner_of_key(front: openai.OpenAI, key: str) -> str:
    return chat_turn(front, [], "Whose key is this?", prompt_cache_key=key)[0]


def wait_until_refused(replica: ReplicaProcess) -> None:
    """Until a connection to the replica is refused (a draining Courier closes its listener), or the test times out."""
    while True:
        try:
            socket.create_connection(("127.0.0.1", replica.port), timeout=2).close()
        except ConnectionRefusedError:
            return
        assert replica.is_running(), "the replica exited before it was seen draining"
        time.sleep(POLL_S)


@contextmanager
def restarted_after(cluster: LocalCluster, name: str) -> Iterator[ReplicaProcess]:
    """The block stops `name` somehow; afterwards it is started again and back in the front's ring."""
    replica = cluster.replicas[name]
    try:
        yield replica
    finally:
        replica.wait(60)
        replica.start()
        replica.wait_ready(READY_TIMEOUT_S)
        assert cluster.front is not None
        cluster.front.wait_until_up({name}, READY_TIMEOUT_S)


def test_conversations_of_each_kind_stay_each_on_one_replica_and_turns_after_the_first_hit_its_cache(
    cluster: LocalCluster, front: openai.OpenAI
) -> None:
    """Eight conversations, two of each way to continue one, three turns each (on 3 replicas, eight first turns
    all landing on one replica by chance is about one in 2,000; the keyed ones route the same every run)."""
    hits_before = cache_hits(cluster)
    served: dict[str, list[str]] = {}
    turns_after_first: dict[str, int] = dict.fromkeys(cluster.replicas, 0)
    for number in range(8):
        name = f"conversation-{number}"
        kind = ("prompt_cache_key", "user", "conversation", "previous_response_id")[number % 4]
        history: list[dict[str, str]] = []
        conversation = front.conversations.create().id if kind == "conversation" else None
        previous: str | None = None
        for turn in range(3):
            text = f"Turn {turn} of {name}: tell me about harbour number {number}."
            if kind in ("prompt_cache_key", "user"):
                replica, cached = chat_turn(front, history, text, **{kind: name})
            else:
                continuation = {"conversation": conversation} if conversation else {"previous_response_id": previous}
                replica, cached, previous = response_turn(front, text, **continuation)
                assert replica_of(previous) == replica
            served.setdefault(name, []).append(replica)
            if turn:
                assert cached > 0, f"{name} turn {turn} on {replica} reused nothing"
                turns_after_first[replica] += 1
    hits_after = cache_hits(cluster)
    assert all(len(set(replicas)) == 1 for replicas in served.values()), served
    assert len({replicas[0] for replicas in served.values()}) > 1, "every conversation went to one replica"
    for name, turns in turns_after_first.items():
        assert hits_after[name] - hits_before[name] >= turns, (name, hits_before, hits_after, turns_after_first)


def test_the_fronts_request_id_is_the_replicas_and_both_logs_name_it(
    cluster: LocalCluster, front: openai.OpenAI
) -> None:
    raw = front.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Which id?"}],
        max_tokens=2,
        extra_headers={"X-Request-Id": "client-chosen"},  # the front's replaces it
    )
    request_id = raw.headers["x-request-id"]
    assert FRONT_REQUEST_ID.fullmatch(request_id), request_id  # HAProxy's unique id, kept by the replica
    assert raw.headers["request-id"] == request_id
    replica = cluster.replicas[raw.headers[HEADER]]
    assert cluster.front is not None
    for log in (cluster.front.log_path, replica.log_path):
        for _ in attempts():  # each writes its line once the response has gone out
            if f"id={request_id}" in log.read_text():
                break
        assert f"id={request_id}" in log.read_text(), log.read_text()[-4000:]
        assert "client-chosen" not in log.read_text()


def test_a_chain_continued_by_previous_response_id_alone_stays_on_its_replica(front: openai.OpenAI) -> None:
    replica, _, previous = response_turn(front, "Start a chain with no other key.")
    for turn in range(4):
        served, cached, previous = response_turn(front, f"Link {turn}.", previous_response_id=previous)
        assert (served, replica_of(previous)) == (replica, replica)
        assert cached > 0
    retrieved = front.responses.with_raw_response.retrieve(previous)
    assert retrieved.headers[HEADER] == replica and retrieved.parse().id == previous


def test_a_conversation_appended_from_two_replicas_at_once_keeps_every_turn_whole(
    cluster: LocalCluster, front: openai.OpenAI
) -> None:
    conversation = front.conversations.create().id
    writers = {name: replica_client(cluster.replicas[name]) for name in ("r1", "r2")}
    start = threading.Barrier(len(writers))

    def write(name: str) -> list[tuple[str, str]]:
        start.wait()
        written = []
        for turn in range(4):
            text = f"{name} says {turn}"
            response = writers[name].responses.create(
                model=MODEL, input=text, conversation=conversation, max_output_tokens=3, temperature=0
            )
            written.append((text, response.output[0].id or ""))
        return written

    with ThreadPoolExecutor(len(writers)) as pool:
        written = dict(zip(writers, pool.map(write, writers), strict=True))
    for writer in writers.values():
        writer.close()
    items = [item.model_dump() for item in front.conversations.items.list(conversation, order="asc", limit=100)]
    assert len(items) == 2 * sum(len(turns) for turns in written.values())
    # Each turn is its input then its output, side by side: two replicas' appends never interleave.
    pairs = [(items[i]["content"][0]["text"], items[i + 1]["id"]) for i in range(0, len(items), 2)]
    assert [item["role"] for item in items] == ["user", "assistant"] * (len(items) // 2)
    for name, turns in written.items():
        assert [pair for pair in pairs if pair[0].startswith(name)] == turns  # in the order that writer wrote them


def test_a_key_after_a_200_kb_body_is_still_routed_by_key(cluster: LocalCluster, front: openai.OpenAI) -> None:
    key = "key-after-a-large-body"
    owner = owner_of_key(front, key)
    start = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    # JSON's insignificant whitespace: the key sits 200 KB into a body the replica serves as usual.
    body = start[:-1] + b"," + b" " * 200_000 + b'"prompt_cache_key": "' + key.encode() + b'"}'
    answer = httpx.post(
        f"{cluster.url}/v1/chat/completions", content=body, headers={"Content-Type": "application/json"}, timeout=60
    )
    assert answer.status_code == 200, answer.text
    assert answer.headers[HEADER] == owner


def test_kill_9_of_an_idle_owner_loses_nothing_and_its_keys_come_back(
    cluster: LocalCluster, front: openai.OpenAI
) -> None:
    key = "killed-while-idle"
    owner, _, first = response_turn(front, "A conversation about lighthouses.", prompt_cache_key=key)
    _, _, second = response_turn(front, "Go on.", prompt_cache_key=key, previous_response_id=first)
    with restarted_after(cluster, owner) as replica:
        replica.signal(signal.SIGKILL)
        assert replica.wait(30) == -signal.SIGKILL
        served, _, third = response_turn(front, "And then?", prompt_cache_key=key, previous_response_id=second)
        assert served != owner and replica_of(third) == served
        chain = [front.responses.retrieve(acknowledged) for acknowledged in (first, second, third)]
        assert [response.previous_response_id for response in chain] == [None, first, second]
        tokens = [response.usage.input_tokens for response in chain if response.usage is not None]
        assert tokens == sorted(tokens) and len(set(tokens)) == 3  # each turn read the whole chain before it
    assert owner_of_key(front, key) == owner


def test_kill_9_mid_stream_leaves_no_partial_record_and_the_chain_goes_on(
    cluster: LocalCluster, front: openai.OpenAI
) -> None:
    key = "killed-mid-stream"
    owner, _, acknowledged = response_turn(front, "A conversation about tides.", prompt_cache_key=key)
    events: list[dict[str, Any]] = []
    with restarted_after(cluster, owner) as replica:
        with front.responses.with_streaming_response.create(
            model=MODEL,
            input=GO_ON,
            prompt_cache_key=key,
            previous_response_id=acknowledged,
            max_output_tokens=1500,
            temperature=0,
            stream=True,
        ) as raw:
            assert raw.headers[HEADER] == owner
            # The stream is cut: its replica is gone (the client's transport error, from httpx or the SDK's own fork,
            # whether the front closes the connection or resets it).
            with pytest.raises(Exception, match=r"incomplete chunked read|peer closed|reset by peer"):
                for line in raw.iter_lines():
                    if line.startswith("data: "):
                        events.append(orjson.loads(line.removeprefix("data: ")))
                        if events[-1]["type"] == "response.output_text.delta" and replica.is_running():
                            replica.signal(signal.SIGKILL)
        assert [event["type"] for event in events[:2]] == ["response.created", "response.in_progress"]
        assert "response.completed" not in {event["type"] for event in events}
        with pytest.raises(openai.NotFoundError):
            front.responses.retrieve(events[0]["response"]["id"])
        served, _, after = response_turn(front, "Again.", prompt_cache_key=key, previous_response_id=acknowledged)
        assert served != owner and front.responses.retrieve(after).previous_response_id == acknowledged


def test_sigterm_drains_its_replica_with_no_client_error(cluster: LocalCluster, front: openai.OpenAI) -> None:
    key = "drained"
    owner = owner_of_key(front, key)
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": GO_ON}],
        "max_tokens": 300,
        "temperature": 0,
        "stream": True,
        "prompt_cache_key": key,
    }
    finished: list[str] = []
    with restarted_after(cluster, owner) as replica, httpx.Client(base_url=cluster.url, timeout=120) as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as stream:
            assert stream.headers[HEADER] == owner
            lines = stream.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            replica.signal(signal.SIGTERM)
            wait_until_refused(replica)  # it has begun draining: its listener is closed
            # While it drains, the same key's new requests are answered by the others.
            served, _ = chat_turn(front, [], "A new request during the drain.", prompt_cache_key=key)
            assert served != owner
            finished = [line for line in lines if line.startswith("data: ")]
        assert replica.wait(60) == 0
    assert finished[-1] == "data: [DONE]"
    assert orjson.loads(finished[-2].removeprefix("data: "))["choices"][0]["finish_reason"] == "length"
