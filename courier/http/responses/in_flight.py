"""Responses being generated right now: what `GET` shows for them and what `cancel` reaches.

An entry lives from admission until its final object exists (stored or not); the
route that runs the response removes it on every path out, so the registry is
bounded by the scheduler's own limits (running plus queued requests).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import anyio

from courier.messages.generation_reader import Cancellation
from courier.storage.records import JsonObject


@dataclass(slots=True, kw_only=True)
class InFlightResponse:
    snapshot: JsonObject  # the response object as it stands (status in_progress until final)
    tenant: str  # whose it is (an API key's; "" without keys)
    cancellation: Cancellation = field(default_factory=Cancellation)
    finished: anyio.Event = field(default_factory=anyio.Event)

    def finish(self, final: JsonObject) -> None:
        self.snapshot = final
        self.finished.set()


class InFlightResponses:
    def __init__(self) -> None:
        self._entries: dict[str, InFlightResponse] = {}

    def get(self, response_id: str, tenant: str) -> InFlightResponse | None:
        """The response being generated under this id for `tenant` (another tenant's is not there for it)."""
        entry = self._entries.get(response_id)
        return entry if entry is not None and entry.tenant == tenant else None

    @contextmanager
    def running(self, response_id: str, snapshot: JsonObject, tenant: str) -> Iterator[InFlightResponse]:
        entry = InFlightResponse(snapshot=snapshot, tenant=tenant)
        self._entries[response_id] = entry
        try:
            yield entry
        finally:
            del self._entries[response_id]
            entry.finished.set()
