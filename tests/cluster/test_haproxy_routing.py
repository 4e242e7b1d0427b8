"""The generated configuration in a real HAProxy, in front of small real backends that answer with their name.

No model and no Courier server here: the backends (`tests/support/named_backends.py`) stand in
for replicas, so what is tested is the front's routing as `courier cluster haproxy-config` writes
it. A conversation's key (`prompt_cache_key`, then `conversation`, then `user`) always reaches
one replica, wherever it sits in a body up to `--max-body-bytes`; a response id reaches the
replica its token names, in a body or a path; a replica that is down (stopped, or answering
`/health` 503 as a loading or draining Courier does) gets nothing new, and only its own keys move; the
ring follows the replicas' names, not the order they are listed in.
"""

from __future__ import annotations

import http.client
import json
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from courier.cluster.front_process import unavailable_reason
from courier.cluster.haproxy_config import BACKEND, FrontOptions, haproxy_config
from courier.cluster.replicas import parse_replicas
from courier.conversation.ids import new_response_id
from tests.support.haproxy import RunningHaproxy, running_haproxy
from tests.support.named_backends import NamedBackend, named_backends
from tests.support.polling import attempts
from tests.support.ports import free_port

NAMES = ("a", "b", "c")
MAX_BODY = 1024**2
ROUTED_BYTES = 512 * 1024  # what the front reads of a body to route it: less than a body may be
KEYS = tuple(f"conversation-{index}" for index in range(20))
CHECK_INTERVAL_S = 0.3  # a stopped or unready backend is marked down within about two of these

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=unavailable_reason() or "")


@dataclass
class Front:
    backends: dict[str, NamedBackend]
    haproxy: RunningHaproxy
    connection: http.client.HTTPConnection  # one client connection, kept alive: each request is routed on its own

    def answer(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"} if data is not None else {}
        self.connection.request(method, path, body=data, headers=headers)
        response = self.connection.getresponse()
        payload = response.read()
        assert response.status == 200, (response.status, payload)
        answer: dict[str, Any] = json.loads(payload)
        return answer

    def route(self, body: dict[str, Any], path: str = "/v1/responses") -> str:
        """The backend a POST of `body` reaches."""
        backend: str = self.answer("POST", path, body)["backend"]
        return backend

    def owners(self) -> dict[str, str]:
        return {key: self.route({"prompt_cache_key": key, "input": "hi"}) for key in KEYS}

    def wait_until(self, name: str, status: str) -> None:
        self.haproxy.wait_for(BACKEND, lambda states: states[name] == status)


@contextmanager
def started_front(directory: Path, check_interval_s: float = CHECK_INTERVAL_S) -> Iterator[Front]:
    """A front for fresh backends `NAMES`."""
    with named_backends(*NAMES) as backends, front_for(backends, NAMES, directory, check_interval_s) as front:
        yield front


@contextmanager
def front_for(
    backends: dict[str, NamedBackend],
    order: Sequence[str],
    directory: Path,
    check_interval_s: float = CHECK_INTERVAL_S,
    balance_factor: int = FrontOptions().balance_factor,
) -> Iterator[Front]:
    """A front whose replicas are `backends`, listed in `order`."""
    directory.mkdir(parents=True, exist_ok=True)
    port, socket_path = free_port(), directory / "admin.sock"
    replicas = parse_replicas([f"{name}=127.0.0.1:{backends[name].port}" for name in order])
    options = FrontOptions(
        bind="127.0.0.1",
        port=port,
        max_body_bytes=MAX_BODY,
        route_body_bytes=ROUTED_BYTES,
        check_interval_s=check_interval_s,
        balance_factor=balance_factor,
        stats_socket=socket_path,
    )
    with running_haproxy(haproxy_config(replicas, options), directory, port, socket_path) as haproxy:
        # A server is UP from the start ("UP 1/2" until its first check passes), and gets requests.
        haproxy.wait_for(BACKEND, lambda states: all(state.startswith("UP") for state in states.values()))
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        try:
            yield Front(backends=backends, haproxy=haproxy, connection=connection)
        finally:
            connection.close()


@pytest.fixture(scope="module")
def front(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Front]:
    with started_front(tmp_path_factory.mktemp("front")) as front:
        yield front


@pytest.fixture(scope="module")
def owners(front: Front) -> dict[str, str]:
    return front.owners()


def test_a_key_always_reaches_one_replica_and_keys_spread(front: Front, owners: dict[str, str]) -> None:
    assert front.owners() == owners == front.owners()
    assert len(set(owners.values())) >= 2, owners


def test_conversation_and_user_are_keys_too_after_prompt_cache_key(front: Front, owners: dict[str, str]) -> None:
    key = KEYS[0]
    for body in ({"conversation": key}, {"conversation": {"id": key}}, {"user": key}):
        assert front.route(body) == owners[key], body
    other = next(candidate for candidate in KEYS if owners[candidate] != owners[key])
    assert front.route({"user": other, "conversation": other, "prompt_cache_key": key}) == owners[key]
    assert front.route({"user": other, "conversation": key}) == owners[key]


@pytest.mark.parametrize("filler", [200_000, ROUTED_BYTES - 4096], ids=["200KB", "routed-bytes"])
def test_a_key_after_a_large_body_still_routes(front: Front, owners: dict[str, str], filler: int) -> None:
    for key in KEYS[:6]:
        answer = front.answer("POST", "/v1/responses", {"input": "x" * filler, "prompt_cache_key": key})
        assert answer["backend"] == owners[key], key
        assert answer["body_bytes"] > filler


def test_a_key_past_the_bytes_routing_reads_goes_round_robin_and_the_log_says_so(front: Front) -> None:
    """The front reads the first ROUTED_BYTES of a body: a key after them is not seen. Such a request is still
    answered, by the replicas in turn, and its log line says how much of the body routing read (`body=READ/SIZE`,
    SIZE its Content-Length)."""
    body = {"input": "x" * (ROUTED_BYTES + 100_000), "prompt_cache_key": KEYS[0]}
    size = len(json.dumps(body).encode())
    assert size < MAX_BODY
    assert len({front.route(body) for _ in range(6)}) >= 2
    small = {"prompt_cache_key": KEYS[0], "input": "a small body"}
    front.route(small)
    small_size = len(json.dumps(small).encode())
    read: list[str] = []
    for _ in attempts():
        log = front.haproxy.log.read_text()
        read = re.findall(rf" body=(\d+)/{size}\b", log)
        if len(read) == 6 and f" body={small_size}/{small_size}" in log:
            break
    assert len(read) == 6 and all(int(count) < size for count in read), read
    assert f" body={small_size}/{small_size}" in front.haproxy.log.read_text()


@pytest.mark.parametrize("name", NAMES)
def test_a_response_id_reaches_the_replica_that_made_it(front: Front, owners: dict[str, str], name: str) -> None:
    response_id = new_response_id(name)
    elsewhere = next(key for key in KEYS if owners[key] != name)
    assert front.route({"previous_response_id": response_id, "prompt_cache_key": elsewhere, "input": "hi"}) == name
    for method, path in [
        ("GET", f"/v1/responses/{response_id}"),
        ("DELETE", f"/v1/responses/{response_id}"),
        ("POST", f"/v1/responses/{response_id}/cancel"),
        ("GET", f"/v1/responses/{response_id}/input_items?limit=5"),
        ("GET", f"/courier/v1/responses/{response_id}"),
        ("GET", f"/responses/{response_id}"),
    ]:
        assert front.answer(method, path)["backend"] == name, path


def test_an_id_without_a_live_token_routes_like_a_key(front: Front, owners: dict[str, str]) -> None:
    for response_id in (new_response_id(), new_response_id("gone")):
        first = front.answer("GET", f"/v1/responses/{response_id}")["backend"]
        assert [front.answer("GET", f"/v1/responses/{response_id}")["backend"] for _ in range(3)] == [first] * 3
    key = KEYS[1]
    assert front.route({"prompt_cache_key": key}, path="/v1/responses/input_tokens") == owners[key]


def test_requests_without_a_key_spread(front: Front) -> None:
    reached = [front.route({"input": "hi"}) for _ in range(30)]
    reached += [front.answer("GET", "/v1/models")["backend"] for _ in range(30)]
    assert set(reached) == set(NAMES)


def test_a_stream_s_events_pass_as_they_come(front: Front) -> None:
    front.connection.request("GET", "/stream")
    response = front.connection.getresponse()
    assert response.status == 200
    received = b""
    while b"first" not in received:  # the backend holds the rest until released: a buffering front would hang here
        chunk = response.read1(1024)
        assert chunk, received
        received += chunk
    name = received.split(b"data: ")[1].split()[0].decode()
    front.backends[name].release.set()
    assert (received + response.read()).endswith(b"data: second\n\n")


def test_a_replica_not_ready_gets_nothing_new_until_it_is(front: Front, owners: dict[str, str]) -> None:
    drained = front.backends["c"]
    drained.ready.clear()  # /health 503, as a loading or draining replica answers
    try:
        front.wait_until("c", "DOWN")
        assert "c" not in {front.route({"input": "hi"}) for _ in range(20)}
        assert front.route({"previous_response_id": new_response_id("c")}) in ("a", "b")
        moved = front.owners()
        assert all(moved[key] == owner for key, owner in owners.items() if owner != "c")
        assert all(moved[key] != "c" for key in KEYS)
    finally:
        drained.ready.set()
    front.wait_until("c", "UP")
    assert front.route({"previous_response_id": new_response_id("c")}) == "c"
    assert front.owners() == owners


def test_a_stopped_replica_s_requests_go_elsewhere_before_any_check_notices(tmp_path: Path) -> None:
    with started_front(tmp_path, check_interval_s=60) as front:  # no check fails twice within the test
        before = front.owners()
        assert "b" in before.values()
        front.backends["b"].stop()
        # Still UP to the front: each request tries b, fails to connect, and is sent on to another replica.
        assert front.route({"previous_response_id": new_response_id("b"), "input": "hi"}) in ("a", "c")
        after = front.owners()
        assert front.owners() == after  # a retried key goes to one neighbour of b on the ring, every time
        assert front.haproxy.server_states(BACKEND)["b"].startswith("UP")
    assert {key: owner for key, owner in after.items() if before[key] != "b"} == {
        key: owner for key, owner in before.items() if owner != "b"
    }
    assert all(after[key] in ("a", "c") for key in KEYS if before[key] == "b")


def test_a_stopped_replica_is_marked_down_and_only_its_keys_move(tmp_path: Path) -> None:
    with started_front(tmp_path) as front:
        before = front.owners()
        front.backends["b"].stop()
        front.wait_until("b", "DOWN")
        assert front.route({"previous_response_id": new_response_id("b"), "input": "hi"}) in ("a", "c")
        after = front.owners()
    assert all(after[key] == owner for key, owner in before.items() if owner != "b")
    assert all(after[key] in ("a", "c") for key in KEYS)


def test_the_ring_follows_names_not_the_order_of_the_flags(tmp_path: Path) -> None:
    with named_backends(*NAMES) as backends:
        with front_for(backends, ("a", "b", "c"), tmp_path / "first") as front:
            first = front.owners()
        with front_for(backends, ("c", "a", "b"), tmp_path / "reordered") as front:
            assert front.owners() == first
        with front_for(backends, ("c", "a"), tmp_path / "without-b") as front:
            without_b = front.owners()
    assert all(without_b[key] == owner for key, owner in first.items() if owner != "b")


@pytest.mark.parametrize("factor", [150, 300, 0])
def test_a_busy_owner_passes_a_key_on_while_load_is_bounded(tmp_path: Path, factor: int) -> None:
    """Bounded load is counted in requests in flight: with three replicas and factor 150, an owner serving one
    request while the others serve none is already over the bound; at the default 300, or with no bound (0),
    the key stays."""
    key = KEYS[0]
    with named_backends(*NAMES) as backends, front_for(backends, NAMES, tmp_path, 60, factor) as front:
        owner = front.route({"prompt_cache_key": key})
        held = http.client.HTTPConnection("127.0.0.1", front.haproxy.port, timeout=10)
        try:
            held.request("GET", "/stream", body=json.dumps({"prompt_cache_key": key}))
            stream = held.getresponse()
            holder = stream.read1(1024).split()[1].decode()  # b"data: NAME first"
            next_turn = front.route({"prompt_cache_key": key})
        finally:
            for backend in backends.values():
                backend.release.set()
            held.close()
    if factor == 150:
        assert next_turn != holder
    else:
        assert holder == next_turn == owner
