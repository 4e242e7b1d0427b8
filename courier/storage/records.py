"""What the Responses API stores, and the interface any storage backend implements.

Two backends implement the `ResponseStorage` protocol: SQLite (`courier.storage.sqlite`),
the embedded default, and PostgreSQL (`courier.storage.postgres`), which several
replicas can share. Items and response objects are stored as the JSON objects the API
serves, so what a client reads back is what it was sent, byte for byte, from either
backend: PostgreSQL keeps them as `json`, text it checks but never rewrites (records
stored before its schema version 2, as JSONB, come back as JSONB printed them).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol

JsonObject = dict[str, Any]

# A previous_response_id chain longer than this is refused rather than walked.
MAX_CHAIN_HOPS = 10_000


@dataclass(frozen=True, slots=True, kw_only=True)
class StoredResponse:
    """One response: the request's own input items (not its ancestors') and the response object served."""

    id: str
    created_at: float
    previous_response_id: str | None
    conversation_id: str | None
    input_items: tuple[JsonObject, ...]
    response: JsonObject


@dataclass(frozen=True, slots=True, kw_only=True)
class StoredConversation:
    id: str
    created_at: int
    metadata: Mapping[str, str]


class Order(Enum):
    ASC = "asc"
    DESC = "desc"


@dataclass(frozen=True, slots=True, kw_only=True)
class PageQuery:
    after: str | None
    limit: int
    order: Order


@dataclass(frozen=True, slots=True, kw_only=True)
class ItemPage:
    items: tuple[JsonObject, ...]
    has_more: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class Chain:
    """A response and its ancestors, oldest first; `missing` names an ancestor no longer stored."""

    responses: tuple[StoredResponse, ...]
    missing: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class StorageLimits:
    """The store's budgets, and each tenant's (`tenant_budget.py`): None is as much as the whole store."""

    max_bytes: int
    max_entries: int
    ttl_s: float
    tenant_max_bytes: int | None = None
    tenant_max_entries: int | None = None

    @property
    def tenant_bytes(self) -> int:
        return min(self.max_bytes, self.tenant_max_bytes or self.max_bytes)

    @property
    def tenant_entries(self) -> int:
        return min(self.max_entries, self.tenant_max_entries or self.max_entries)


class StorageRefused(Exception):
    """A record larger than its tenant's byte budget, or one its tenant has no room for once all its own other
    records are evicted: it is not stored, and no other tenant's record is evicted for it."""


class UnstorableRecord(Exception):
    """A record the backend cannot hold at all, such as an id with a NUL character in PostgreSQL (whose text holds
    none): it is not stored, nothing is changed, and sending it again cannot help. The message says why."""


class DamagedRecord(Exception):
    """One stored record cannot be read back: its JSON does not parse, or is not the shape the server wrote.

    Bit rot or a bad restore damages records one at a time, so the fault is that record's alone: only requests
    that read it fail (the storage actor answers them with a 500), and everything else is served as before.
    """

    def __init__(self, record: str, reason: str) -> None:
        super().__init__(f"the stored {record} is damaged: {reason}")
        self.record = record  # what was read, with its id: "response 'resp_1'"
        self.reason = reason


class StorageUnavailable(Exception):
    """The database cannot be read or written right now (a full disk, an I/O error); nothing was changed.

    A failed write is rolled back and the backend stays usable, so storing resumes by itself once the disk has
    room again. The storage actor answers it with a 503, and keeps serving.
    """


class StorageUnreachable(StorageUnavailable):
    """The database cannot be reached at all: no connection could be made, or the one in use broke (PostgreSQL
    stopped, restarting, or out of the network). Nothing was changed. Unlike a slow or full database, later calls
    would only wait to fail the same way, so the storage actor's breaker opens: it refuses calls at once until its
    probe (`ResponseStorage.reach`) connects again.
    """


class ResponseStorage(Protocol):
    """Synchronous, called from up to `max_concurrent_calls` threads at once (SQLite: one, so every call is
    serialized; PostgreSQL: its pool's size, each call on a connection of its own).

    Faults are typed and local to the call that meets them: a read of a damaged record raises `DamagedRecord`
    (other records stay readable), and any call the database cannot serve right now raises `StorageUnavailable`
    having changed nothing. A record over the whole byte budget raises `StorageRefused`, and one the backend
    cannot hold at all `UnstorableRecord`. Whatever a call acknowledged (returned from) stays stored.
    """

    @property
    def max_concurrent_calls(self) -> int:
        """How many calls may run at once, each on a thread of its own."""

    def reach(self) -> None:
        """Return once the database can be reached, else raise `StorageUnreachable` (the breaker's probe)."""

    def save_response(self, response: StoredResponse, conversation_items: Sequence[JsonObject]) -> None:
        """Store a response and, when it belongs to a conversation, append `conversation_items` to it, atomically."""

    def load_response(self, response_id: str) -> StoredResponse | None: ...

    def load_chain(self, response_id: str) -> Chain | None:
        """`response_id` and every ancestor through `previous_response_id`; None when it is not stored."""

    def delete_response(self, response_id: str) -> bool: ...

    def create_conversation(self, conversation: StoredConversation, items: Sequence[JsonObject]) -> None: ...

    def load_conversation(self, conversation_id: str) -> StoredConversation | None: ...

    def update_conversation(self, conversation_id: str, metadata: Mapping[str, str]) -> StoredConversation | None: ...

    def delete_conversation(self, conversation_id: str) -> bool: ...

    def append_conversation_items(self, conversation_id: str, items: Sequence[JsonObject]) -> bool: ...

    def conversation_items(self, conversation_id: str) -> tuple[JsonObject, ...] | None:
        """Every item of the conversation in order (the context a new turn renders)."""

    def list_conversation_items(self, conversation_id: str, page: PageQuery) -> ItemPage | None: ...

    def load_conversation_item(self, conversation_id: str, item_id: str) -> JsonObject | None: ...

    def delete_conversation_item(self, conversation_id: str, item_id: str) -> bool | None:
        """True if deleted, False if the item is unknown, None if the conversation is."""

    def sweep(self, now: float) -> int:
        """Remove responses and conversations unused for longer than the TTL; returns how many."""

    def close(self) -> None: ...
