"""The ids Courier mints, and the routing token a replica's response ids carry.

An id is `<prefix>_<32 hex>` (`msg_…`, `conv_…`, `resp_…`). A server started with
`--replica-id r2` mints its response ids as `resp_r2.<32 hex>`: the token sits between
the first `_` and the first `.`, both fixed, and is drawn from `[a-z0-9-]`, so a front
reads it with two string cuts and no JSON or id knowledge beyond this. Everything else
treats an id as one opaque string (storage keys, chains, path parameters), so routed and
plain ids live side by side. Only response ids carry the token: they are what a client
continues from (`previous_response_id`) and what `GET`, `DELETE` and `cancel` name, and
an in-flight response lives on one replica. A conversation id needs none: it is itself
a stable key the front hashes on.
"""

from __future__ import annotations

import uuid

from courier.settings.parsers import REPLICA_ID_PATTERN

RESPONSE_PREFIX = "resp"
TOKEN_SEPARATOR = "."


def new_id(prefix: str, replica: str | None = None) -> str:
    """A fresh id; with `replica`, the routing token goes in before the random part."""
    random_part = uuid.uuid4().hex
    return f"{prefix}_{replica}{TOKEN_SEPARATOR}{random_part}" if replica else f"{prefix}_{random_part}"


def new_response_id(replica: str | None = None) -> str:
    return new_id(RESPONSE_PREFIX, replica)


def replica_of(identifier: str) -> str | None:
    """The replica a routed id names (`resp_r2.9f…` -> "r2"); None for an id that carries no token."""
    _, underscore, rest = identifier.partition("_")
    token, dot, random_part = rest.partition(TOKEN_SEPARATOR)
    if not (underscore and dot and random_part) or REPLICA_ID_PATTERN.fullmatch(token) is None:
        return None
    return token
