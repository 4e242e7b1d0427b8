"""The generated HAProxy configuration: what it must hold, and that HAProxy itself accepts it (`haproxy -c`)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from courier.cluster.front_process import unavailable_reason
from courier.cluster.haproxy_config import (
    BACKEND,
    COURIER_DEFAULTS,
    DEFAULT_ROUTE_BODY_BYTES,
    KEY_FIELDS,
    FrontOptions,
    haproxy_config,
)
from courier.cluster.replicas import ReplicaError, parse_replicas, with_models
from tests.support.haproxy import check_config

REPLICAS = parse_replicas(["10.0.0.1:8000", "gpu-b=10.0.0.2:8000", "[::1]:8002"])
WITH_MODELS = with_models(REPLICAS, ["r1=qwen,claude-*", "gpu-b=llama", "gpu-b=qwen"])
needs_haproxy = pytest.mark.skipif(unavailable_reason() is not None, reason=unavailable_reason() or "")


def lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]


def value(text: str, directive: str) -> str:
    [found] = [line.removeprefix(directive).strip() for line in lines(text) if line.startswith(directive + " ")]
    return found


def buffer_bytes(text: str) -> int:
    return int(value(text, "tune.bufsize"))


ROOM = 64 * 1024 + 1024  # the request line and headers, and the part HAProxy keeps back for rewrites


def test_the_buffer_holds_the_headers_and_the_body_bytes_routing_reads() -> None:
    text = haproxy_config(REPLICAS, FrontOptions())
    assert "option http-buffer-request" in lines(text)
    # Every replica serves every model: the first 2 MiB, whatever the body limit (each request pays for the size).
    assert buffer_bytes(text) == DEFAULT_ROUTE_BODY_BYTES + ROOM < COURIER_DEFAULTS.max_body_bytes
    assert buffer_bytes(haproxy_config(REPLICAS, FrontOptions(max_body_bytes=1024**2))) == 1024**2 + ROOM
    chosen = haproxy_config(REPLICAS, FrontOptions(route_body_bytes=100_000))
    assert buffer_bytes(chosen) % 16 == 0 and 100_000 + ROOM <= buffer_bytes(chosen) < 100_000 + ROOM + 16
    capped = FrontOptions(max_body_bytes=1024**2, route_body_bytes=8 * 1024**2)
    assert buffer_bytes(haproxy_config(REPLICAS, capped)) == 1024**2 + ROOM
    # Replicas serve different models: the model decides who can answer, so by default the whole body is read.
    assert buffer_bytes(haproxy_config(WITH_MODELS, FrontOptions())) >= COURIER_DEFAULTS.max_body_bytes + ROOM
    fewer = haproxy_config(WITH_MODELS, FrontOptions(route_body_bytes=1024**2))
    assert buffer_bytes(fewer) == 1024**2 + ROOM
    with pytest.raises(ValueError, match="positive number of body bytes"):
        FrontOptions(route_body_bytes=0)


def test_each_log_line_says_how_much_of_the_body_routing_read() -> None:
    text = haproxy_config(REPLICAS, FrontOptions())
    assert "http-request set-var(txn.courier_body_read) req.body_len" in lines(text)
    assert "http-request set-var(txn.courier_body_size) req.hdr(content-length)" in lines(text)
    assert value(text, "log-format").endswith(' body=%[var(txn.courier_body_read)]/%[var(txn.courier_body_size)]"')


def test_keys_are_hashed_on_a_consistent_ring_with_bounded_load() -> None:
    text = haproxy_config(REPLICAS, FrontOptions(balance_factor=125))
    assert value(text, "balance") == "hash var(txn.courier_key)"
    assert value(text, "hash-type") == "consistent"
    assert value(text, "hash-balance-factor") == "125"
    key_rules = [line for line in lines(text) if line.startswith("http-request set-var(txn.courier_key)")]
    read = [re.search(r"json_query\('\$\.([a-z_.]+)'\)", rule) for rule in key_rules]
    assert [match.group(1) for match in read if match] == list(KEY_FIELDS)
    assert KEY_FIELDS == ("prompt_cache_key", "conversation.id", "conversation", "user")
    assert key_rules[-1].startswith("http-request set-var(txn.courier_key) var(txn.courier_response)")
    assert all("unless { var(txn.courier_key) -m found }" in rule for rule in key_rules[1:])


def test_a_response_id_s_token_picks_its_replica_by_name() -> None:
    text = haproxy_config(REPLICAS, FrontOptions())
    assert [line for line in lines(text) if line.startswith("use-server")] == [
        f"use-server {name} if {{ var(txn.courier_replica) -m str {name} }}" for name in ("r1", "gpu-b", "r3")
    ]
    servers = [line for line in lines(text) if line.startswith("server ")]
    assert servers == [f"server {replica.name} {replica.haproxy_address} id {replica.ring_id}" for replica in REPLICAS]
    assert "previous_response_id" in text and "/responses/resp_" in text
    position = {line: index for index, line in enumerate(lines(text))}
    first_use_server = min(index for line, index in position.items() if line.startswith("use-server"))
    assert all(index < first_use_server for line, index in position.items() if line.startswith("http-request"))


def test_health_checks_expect_the_ready_answer_of_health() -> None:
    text = haproxy_config(REPLICAS, FrontOptions(api_prefix="/courier", check_interval_s=0.5))
    assert "option httpchk" in lines(text)
    assert value(text, "http-check send").startswith("meth GET uri /courier/health ver HTTP/1.1")
    assert value(text, "http-check expect") == "status 200"
    assert value(text, "default-server") == "check inter 500ms fall 2 rise 2"


def test_failures_are_retried_elsewhere_and_timeouts_outlast_courier_s() -> None:
    text = haproxy_config(REPLICAS, FrontOptions(request_timeout_s=900, body_timeout_s=30))
    assert value(text, "retry-on") == "conn-failure empty-response"
    assert value(text, "option redispatch") == "1"
    assert int(value(text, "retries")) >= 1
    for side in ("client", "server", "tunnel"):
        assert value(text, f"timeout {side}") == "930s"
    assert value(text, "timeout http-request") == "30s"
    assert "option http-no-delay" in lines(text)
    # Clients keep their connections; each request gets its own connection to a replica, so none reaches a
    # draining replica on a connection kept from before.
    assert "option http-server-close" in lines(text) and "option httpclose" not in lines(text)


def test_the_front_binds_where_asked_and_the_stats_socket_is_optional(tmp_path: Path) -> None:
    text = haproxy_config(REPLICAS, FrontOptions(bind="127.0.0.1", port=9000))
    assert value(text, "bind") == "127.0.0.1:9000"
    assert "stats socket" not in text
    with_socket = haproxy_config(REPLICAS, FrontOptions(stats_socket=tmp_path / "admin.sock"))
    assert value(with_socket, "stats socket") == f"{tmp_path / 'admin.sock'} mode 600 level admin"


@pytest.mark.parametrize("factor", [100, 50, 1, -150])
def test_a_balance_factor_is_above_100_or_0(factor: int) -> None:
    with pytest.raises(ValueError, match="above 100, or 0"):
        FrontOptions(balance_factor=factor)
    assert "hash-balance-factor 0" in haproxy_config(REPLICAS, FrontOptions(balance_factor=0))


@needs_haproxy
@pytest.mark.parametrize(
    "options",
    [
        FrontOptions(),
        FrontOptions(max_body_bytes=1024**2, balance_factor=125, api_prefix="/courier", check_interval_s=0.2),
        FrontOptions(bind="127.0.0.1", port=18080, request_timeout_s=3600, body_timeout_s=5),
    ],
    ids=["defaults", "small-body", "long-requests"],
)
def test_haproxy_accepts_it_without_warnings(options: FrontOptions, tmp_path: Path) -> None:
    for replicas in (REPLICAS, parse_replicas(["127.0.0.1:8000"]), WITH_MODELS):
        result = check_config(haproxy_config(replicas, options), tmp_path)
        assert result.returncode == 0, result.stdout + result.stderr
        assert "WARNING" not in result.stdout + result.stderr, result.stdout + result.stderr


@needs_haproxy
def test_haproxy_accepts_the_stats_socket(tmp_path: Path) -> None:
    result = check_config(haproxy_config(REPLICAS, FrontOptions(stats_socket=tmp_path / "admin.sock")), tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_without_replica_models_nothing_reads_the_model() -> None:
    assert "courier_model" not in haproxy_config(REPLICAS, FrontOptions())


def test_a_model_goes_to_the_replicas_serving_it_exact_names_before_prefixes() -> None:
    text = haproxy_config(WITH_MODELS, FrontOptions())
    rules = [line for line in lines(text) if line.startswith("use_backend")]
    assert rules == [
        f"use_backend {BACKEND}_model_1 if {{ var(txn.courier_model) -m str qwen }}",
        f"use_backend {BACKEND}_model_2 if {{ var(txn.courier_model) -m str llama }}",
        f"use_backend {BACKEND}_model_3 if {{ var(txn.courier_model) -m beg claude- }}",
    ]
    assert value(text, "default_backend") == BACKEND
    # r3 lists no model: it serves any, so it is in every model's backend; each server tracks its one health check.
    servers = {
        backend.split()[0]: [line.split()[1] for line in lines(backend) if line.startswith("server")]
        for backend in text.split("\nbackend ")[1:]
    }
    assert servers[f"{BACKEND}_model_1"] == ["r1", "gpu-b", "r3"]
    assert servers[f"{BACKEND}_model_2"] == ["gpu-b", "r3"]
    assert servers[f"{BACKEND}_model_3"] == ["r1", "r3"]
    model_1 = text.split(f"\nbackend {BACKEND}_model_1\n")[1]
    tracked = [line for line in lines(model_1) if line.startswith("server")]
    assert all(line.endswith(f"track {BACKEND}/{line.split()[1]}") for line in tracked), tracked


@pytest.mark.parametrize(
    ("specs", "says"),
    [(["nobody=qwen"], "no replica is named"), (["r1="], "NAME=MODEL"), (["r1=q w"], "not a model name")],
)
def test_replica_models_that_name_nothing_routable_are_refused(specs: list[str], says: str) -> None:
    with pytest.raises(ReplicaError, match=says):
        with_models(REPLICAS, specs)
