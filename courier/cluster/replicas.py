"""The replicas a front sends to: each one's name (its `--replica-id`) and address (`NAME=HOST:PORT`, `HOST:PORT`).

A replica given without a name is named by its position, `r1`, `r2`, ... (`default_replica_id`): the
same name a launcher passes as that replica's `--replica-id`, so the token in a response id is the
name of the front's server for the replica that minted it. Each replica also gets a numeric id
derived from its name (`ring_id`): HAProxy places a server on its consistent-hash ring by that id,
so the ring follows the names, not the order of the flags; a replica added, removed or listed in
another order moves only the keys it takes or gives up.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, replace

from courier.settings.parsers import parse_replica_id

# A model name the front can match on: no spaces, quotes or braces an HAProxy ACL would read as syntax.
_MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]*\*?")
_HOST = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?|\[[0-9A-Fa-f:.]+\]")
# HAProxy server ids are positive; a ring id stays below 2**31 so any build reads it as an int.
_RING_IDS = 2**31 - 1


class ReplicaError(ValueError):
    """A `--replica` value that names no replica, or replicas that clash."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Replica:
    name: str  # the replica's --replica-id, and its server's name in the front
    host: str  # a host name, an IPv4 address, or an IPv6 address in brackets
    port: int
    # The model names it serves, as requests name them (a name ending in * matches any it begins); empty: any model.
    models: tuple[str, ...] = ()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def haproxy_address(self) -> str:
        """The address as an HAProxy `server` line takes it: an IPv6 address unbracketed, behind `ipv6@`."""
        if self.host.startswith("["):
            return f"ipv6@{self.host[1:-1]}:{self.port}"
        return self.address

    @property
    def ring_id(self) -> int:
        """Where the front's hash ring places this replica: a function of its name only."""
        return zlib.crc32(self.name.encode()) % _RING_IDS + 1


def default_replica_id(position: int) -> str:
    """The name of the replica given without one at `position` (1-based) among the `--replica` values."""
    return f"r{position}"


def parse_replica(text: str, position: int) -> Replica:
    """`NAME=HOST:PORT` or `HOST:PORT` (named `default_replica_id(position)`)."""
    name_text, equals, address = text.strip().rpartition("=")
    if equals:
        try:
            name = parse_replica_id(name_text)
        except ValueError as error:
            raise ReplicaError(str(error)) from None
        if name is None:
            raise ReplicaError(f"a replica's name goes before '=': {text!r}")
    else:
        name = default_replica_id(position)
    host, colon, port_text = address.rpartition(":")
    if not colon or _HOST.fullmatch(host) is None or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ReplicaError(f"expected NAME=HOST:PORT or HOST:PORT (port 1-65535), not {text!r}")
    return Replica(name=name, host=host, port=int(port_text))


def parse_replicas(texts: Sequence[str]) -> tuple[Replica, ...]:
    """Every `--replica` value, in order; two replicas with one name, address or ring id are refused."""
    if not texts:
        raise ReplicaError("name at least one replica (--replica HOST:PORT)")
    replicas = tuple(parse_replica(text, position) for position, text in enumerate(texts, start=1))
    for attribute in ("name", "address", "ring_id"):
        seen: dict[object, Replica] = {}
        for replica in replicas:
            value = getattr(replica, attribute)
            if value in seen:
                raise ReplicaError(f"replicas {seen[value].name} and {replica.name} share the {attribute} {value}")
            seen[value] = replica
    return replicas


def with_models(replicas: Sequence[Replica], specs: Sequence[str]) -> tuple[Replica, ...]:
    """`--replica-models NAME=MODEL[,MODEL...]` given to the replicas it names (one not named serves any model)."""
    models: dict[str, tuple[str, ...]] = {}
    by_name = {replica.name: replica for replica in replicas}
    for spec in specs:
        name, equals, listed = spec.strip().partition("=")
        names = tuple(model.strip() for model in listed.split(",") if model.strip())
        if not equals or not names:
            raise ReplicaError(f"expected NAME=MODEL[,MODEL...], not {spec!r}")
        if name not in by_name:
            raise ReplicaError(f"--replica-models {spec}: no replica is named {name!r}")
        bad = next((model for model in names if _MODEL_NAME.fullmatch(model) is None), None)
        if bad is not None:
            raise ReplicaError(
                f"{bad!r} is not a model name the front can route on (letters, digits, ._:/@+-, a * last)"
            )
        models[name] = models.get(name, ()) + names
    return tuple(replace(replica, models=models.get(replica.name, ())) for replica in replicas)
