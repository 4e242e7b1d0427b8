"""Faults: an unexpected exception while an actor handles one message.

A fault fails that message's request only: the actor base logs it once with the
trace id, marks the handler's span, counts it per actor, answers the asker (with
what the message's `failed(error, actor)` returns: a 500 `internal_error` for our
`Request`s; a message without it just has its reply stream closed) and goes on
serving. Only a `BrokenInvariant` (the process cannot go on: the MLX thread is gone,
the database cannot be used at all) or a cancellation stops the actor, and with it
the server, loudly.
"""

from __future__ import annotations

from collections import Counter


class BrokenInvariant(Exception):
    """Raised where the whole process cannot go on; it stops the actor and the server instead of one request."""


class FaultCounter:
    """Faults per actor since start-up, for `/metrics` (`courier_request_faults_total{actor=...}`)."""

    def __init__(self) -> None:
        self._by_actor: Counter[str] = Counter()

    def add(self, actor: str) -> None:
        self._by_actor[actor] += 1

    def by_actor(self) -> dict[str, int]:
        return dict(self._by_actor)
