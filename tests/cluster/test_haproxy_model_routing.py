"""Routing by model in a real HAProxy, as `courier cluster haproxy-config --replica-models` writes it (issue 33,
item 6), in front of small real backends that answer with their name (`tests/support/named_backends.py`).

Replica a serves qwen and embed, b serves llama and every claude-* name, c serves any model. A request naming a
model reaches only the replicas that serve it, and within them a conversation's key still reaches one replica and
a response id the replica that made it; a model no replica lists, or none named, may reach any replica; a replica
that is down gets nothing new for any of its models (its model backends track its one health check).
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from courier.cluster.front_process import unavailable_reason
from courier.cluster.haproxy_config import BACKEND, FrontOptions, haproxy_config, model_routes
from courier.cluster.replicas import parse_replicas, with_models
from courier.conversation.ids import new_response_id
from tests.support.haproxy import RunningHaproxy, running_haproxy
from tests.support.named_backends import NamedBackend, named_backends
from tests.support.ports import free_port

NAMES = ("a", "b", "c")
MODELS = ("a=qwen,embed", "b=llama,claude-*")
KEYS = tuple(f"conversation-{index}" for index in range(20))
CHECK_INTERVAL_S = 0.3
MAX_BODY = 1024**2
SERVED_BY = {"qwen": {"a", "c"}, "embed": {"a", "c"}, "llama": {"b", "c"}, "claude-sonnet-4": {"b", "c"}}

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=unavailable_reason() or "")


@dataclass
class Front:
    backends: dict[str, NamedBackend]
    haproxy: RunningHaproxy
    connection: http.client.HTTPConnection
    model_backends: dict[str, str]  # by model name

    def route(self, body: dict[str, Any]) -> str:
        self.connection.request(
            "POST", "/v1/responses", body=json.dumps(body), headers={"Content-Type": "application/json"}
        )
        response = self.connection.getresponse()
        payload = response.read()
        assert response.status == 200, (response.status, payload)
        backend: str = json.loads(payload)["backend"]
        return backend

    def owners(self, model: str | None) -> dict[str, str]:
        named = {"model": model} if model is not None else {}
        return {key: self.route({**named, "prompt_cache_key": key}) for key in KEYS}


@pytest.fixture(scope="module")
def front(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Front]:
    directory = tmp_path_factory.mktemp("model-front")
    port, socket_path = free_port(), directory / "admin.sock"
    with named_backends(*NAMES) as backends:
        replicas = with_models(parse_replicas([f"{name}=127.0.0.1:{backends[name].port}" for name in NAMES]), MODELS)
        options = FrontOptions(
            bind="127.0.0.1",
            port=port,
            max_body_bytes=MAX_BODY,  # the front reads whole bodies to find their model: each request pays for it
            check_interval_s=CHECK_INTERVAL_S,
            stats_socket=socket_path,
        )
        with running_haproxy(haproxy_config(replicas, options), directory, port, socket_path) as haproxy:
            haproxy.wait_for(BACKEND, lambda states: all(state.startswith("UP") for state in states.values()))
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            try:
                model_backends = {route.model: route.backend for route in model_routes(replicas)}
                yield Front(backends=backends, haproxy=haproxy, connection=connection, model_backends=model_backends)
            finally:
                connection.close()


@pytest.mark.parametrize("model", list(SERVED_BY))
def test_a_model_reaches_only_its_replicas_and_a_key_one_of_them(front: Front, model: str) -> None:
    owners = front.owners(model)
    assert set(owners.values()) == SERVED_BY[model]  # both serve it, and the keys spread over both
    assert front.owners(model) == owners


def test_a_model_no_replica_lists_or_none_named_may_reach_any(front: Front) -> None:
    assert set(front.owners("mistral").values()) == set(NAMES)
    assert set(front.owners(None).values()) == set(NAMES)


def test_a_response_id_reaches_its_replica_among_the_models(front: Front) -> None:
    for name in ("a", "c"):
        body = {"model": "qwen", "previous_response_id": new_response_id(name)}
        assert {front.route(body) for _ in range(3)} == {name}
    # b does not serve qwen: its response id routes like a key, among a and c.
    assert front.route({"model": "qwen", "previous_response_id": new_response_id("b")}) in SERVED_BY["qwen"]


def test_a_replica_down_gets_nothing_new_for_any_of_its_models(front: Front) -> None:
    owners = front.owners("qwen")
    front.backends["a"].ready.clear()  # /health 503, as a loading or draining replica answers
    try:
        front.haproxy.wait_for(BACKEND, lambda states: states["a"] == "DOWN")
        assert set(front.owners("qwen").values()) == {"c"}
        assert set(front.owners("embed").values()) == {"c"}
    finally:
        front.backends["a"].ready.set()
    front.haproxy.wait_for(BACKEND, lambda states: states["a"].startswith("UP"))
    front.haproxy.wait_for(front.model_backends["qwen"], lambda states: states["a"].startswith("UP"))
    assert front.owners("qwen") == owners
