"""`--replica` values: names (a replica's --replica-id, or r<position>), addresses, and ring ids that follow names."""

from __future__ import annotations

import pytest

from courier.cluster.replicas import Replica, ReplicaError, parse_replica, parse_replicas


@pytest.mark.parametrize(
    ("text", "position", "expected"),
    [
        ("10.0.0.1:8000", 1, Replica(name="r1", host="10.0.0.1", port=8000)),
        ("gpu-a=10.0.0.2:8001", 2, Replica(name="gpu-a", host="10.0.0.2", port=8001)),
        ("courier-3.internal:80", 3, Replica(name="r3", host="courier-3.internal", port=80)),
        ("b=[::1]:9000", 4, Replica(name="b", host="[::1]", port=9000)),
    ],
)
def test_parse_replica(text: str, position: int, expected: Replica) -> None:
    assert parse_replica(text, position) == expected


@pytest.mark.parametrize(
    "text", ["10.0.0.1", "10.0.0.1:0", "10.0.0.1:65536", "10.0.0.1:http", ":8000", "Bad=h:1", "=h:1", "a b:1", "::1:80"]
)
def test_parse_replica_refuses(text: str) -> None:
    with pytest.raises(ReplicaError):
        parse_replica(text, 1)


def test_haproxy_addresses_take_ipv6_unbracketed() -> None:
    assert parse_replica("[::1]:9000", 1).haproxy_address == "ipv6@::1:9000"
    assert parse_replica("h:9000", 1).haproxy_address == "h:9000"


def test_an_unnamed_replica_is_named_by_its_position_among_all() -> None:
    names = [replica.name for replica in parse_replicas(["h:1", "b=h:2", "h:3"])]
    assert names == ["r1", "b", "r3"]


def test_ring_ids_follow_names_not_order() -> None:
    first = {replica.name: replica.ring_id for replica in parse_replicas(["a=h:1", "b=h:2", "c=h:3"])}
    reordered = {replica.name: replica.ring_id for replica in parse_replicas(["c=h:3", "a=h:1"])}
    assert reordered == {"a": first["a"], "c": first["c"]}
    assert all(0 < ring_id < 2**31 for ring_id in first.values())


@pytest.mark.parametrize(
    ("texts", "clash"),
    [(["a=h:1", "a=h:2"], "name"), (["a=h:1", "b=h:1"], "address"), (["r2=h:1", "h:2"], "name"), ([], "at least")],
)
def test_clashing_replicas_are_refused(texts: list[str], clash: str) -> None:
    with pytest.raises(ReplicaError, match=clash):
        parse_replicas(texts)
