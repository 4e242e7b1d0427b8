"""The id format: plain ids as before, and the routing token a replica's response ids carry in a fixed place."""

from __future__ import annotations

import re

import pytest

from courier.conversation.ids import new_id, new_response_id, replica_of

HEX = "[0-9a-f]{32}"


def test_without_a_replica_ids_are_as_before() -> None:
    assert re.fullmatch(f"resp_{HEX}", new_response_id())
    assert re.fullmatch(f"msg_{HEX}", new_id("msg"))
    assert replica_of(new_response_id()) is None


@pytest.mark.parametrize("replica", ["r1", "gpu-a", "a" * 16, "0"])
def test_a_replica_s_response_id_carries_its_token_between_the_underscore_and_the_dot(replica: str) -> None:
    identifier = new_response_id(replica)
    assert re.fullmatch(f"resp_{re.escape(replica)}[.]{HEX}", identifier)
    assert replica_of(identifier) == replica
    assert new_response_id(replica) != identifier


@pytest.mark.parametrize(
    "identifier",
    [
        "resp_abc",
        "resp_.0123",
        "resp_r1.",
        "resp_R1.0123",
        "resp_r_1.0123",
        "resp_" + "a" * 17 + ".0123",
        "r1.0123",
        "",
    ],
)
def test_an_id_without_a_well_formed_token_names_no_replica(identifier: str) -> None:
    assert replica_of(identifier) is None
