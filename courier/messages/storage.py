"""The storage actor's inbox: one message per storage operation, each applied to the backend on its thread.

Every message carries a reply stream for its result, or a `RequestFailed` when the
backend refuses (a record over the whole budget, an unknown pagination cursor) or
meets a fault (a damaged record, a database it cannot write). `writes` marks the
messages that change the database: a success of one tells the actor that storing
works again after a failing disk.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar, TypeVar

from courier.messages.base import Request
from courier.storage.records import (
    Chain,
    ItemPage,
    JsonObject,
    PageQuery,
    ResponseStorage,
    StoredConversation,
    StoredResponse,
)
from courier.storage.tenancy import scoped, unscoped

R = TypeVar("R")


@dataclass(frozen=True, slots=True, kw_only=True)
class StorageRequest(Request[R]):
    writes: ClassVar[bool] = False
    # Whose records these are (`storage/tenancy.py`): "" without API keys.
    tenant: str = ""

    def key(self, record_id: str) -> str:
        return scoped(self.tenant, record_id)

    @abstractmethod
    def apply(self, storage: ResponseStorage) -> R:
        """Run against the backend (on the storage thread) and return the reply."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SaveResponse(StorageRequest[None]):
    """Store a finished response; with a conversation, append its input and output items to it too."""

    writes: ClassVar[bool] = True

    response: StoredResponse
    conversation_items: Sequence[JsonObject] = ()

    def apply(self, storage: ResponseStorage) -> None:
        storage.save_response(_scoped_response(self.tenant, self.response), self.conversation_items)


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadResponse(StorageRequest[StoredResponse | None]):
    response_id: str

    def apply(self, storage: ResponseStorage) -> StoredResponse | None:
        stored = storage.load_response(self.key(self.response_id))
        return _unscoped_response(self.tenant, stored) if stored is not None else None


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadChain(StorageRequest[Chain | None]):
    """A response and its `previous_response_id` ancestors, to rebuild a new turn's context."""

    response_id: str

    def apply(self, storage: ResponseStorage) -> Chain | None:
        chain = storage.load_chain(self.key(self.response_id))
        if chain is None:
            return None
        missing = unscoped(self.tenant, chain.missing) if chain.missing is not None else None
        return Chain(responses=tuple(_unscoped_response(self.tenant, r) for r in chain.responses), missing=missing)


@dataclass(frozen=True, slots=True, kw_only=True)
class DeleteResponse(StorageRequest[bool]):
    writes: ClassVar[bool] = True

    response_id: str

    def apply(self, storage: ResponseStorage) -> bool:
        return storage.delete_response(self.key(self.response_id))


@dataclass(frozen=True, slots=True, kw_only=True)
class CreateConversation(StorageRequest[None]):
    writes: ClassVar[bool] = True

    conversation: StoredConversation
    items: Sequence[JsonObject] = ()

    def apply(self, storage: ResponseStorage) -> None:
        storage.create_conversation(replace(self.conversation, id=self.key(self.conversation.id)), self.items)


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadConversation(StorageRequest[StoredConversation | None]):
    conversation_id: str

    def apply(self, storage: ResponseStorage) -> StoredConversation | None:
        return _unscoped_conversation(self.tenant, storage.load_conversation(self.key(self.conversation_id)))


@dataclass(frozen=True, slots=True, kw_only=True)
class UpdateConversation(StorageRequest[StoredConversation | None]):
    writes: ClassVar[bool] = True

    conversation_id: str
    metadata: Mapping[str, str]

    def apply(self, storage: ResponseStorage) -> StoredConversation | None:
        updated = storage.update_conversation(self.key(self.conversation_id), self.metadata)
        return _unscoped_conversation(self.tenant, updated)


@dataclass(frozen=True, slots=True, kw_only=True)
class DeleteConversation(StorageRequest[bool]):
    writes: ClassVar[bool] = True

    conversation_id: str

    def apply(self, storage: ResponseStorage) -> bool:
        return storage.delete_conversation(self.key(self.conversation_id))


@dataclass(frozen=True, slots=True, kw_only=True)
class AppendConversationItems(StorageRequest[bool]):
    writes: ClassVar[bool] = True

    conversation_id: str
    items: Sequence[JsonObject]

    def apply(self, storage: ResponseStorage) -> bool:
        return storage.append_conversation_items(self.key(self.conversation_id), self.items)


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadConversationItems(StorageRequest[tuple[JsonObject, ...] | None]):
    """Every item of a conversation, in order: the context of its next turn."""

    conversation_id: str

    def apply(self, storage: ResponseStorage) -> tuple[JsonObject, ...] | None:
        return storage.conversation_items(self.key(self.conversation_id))


@dataclass(frozen=True, slots=True, kw_only=True)
class ListConversationItems(StorageRequest[ItemPage | None]):
    conversation_id: str
    page: PageQuery

    def apply(self, storage: ResponseStorage) -> ItemPage | None:
        return storage.list_conversation_items(self.key(self.conversation_id), self.page)


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadConversationItem(StorageRequest[JsonObject | None]):
    conversation_id: str
    item_id: str

    def apply(self, storage: ResponseStorage) -> JsonObject | None:
        return storage.load_conversation_item(self.key(self.conversation_id), self.item_id)


@dataclass(frozen=True, slots=True, kw_only=True)
class DeleteConversationItem(StorageRequest[bool | None]):
    writes: ClassVar[bool] = True

    conversation_id: str
    item_id: str

    def apply(self, storage: ResponseStorage) -> bool | None:
        return storage.delete_conversation_item(self.key(self.conversation_id), self.item_id)


StorageMessage = StorageRequest[Any]


def _scoped_response(tenant: str, response: StoredResponse) -> StoredResponse:
    return replace(
        response,
        id=scoped(tenant, response.id),
        previous_response_id=_maybe(scoped, tenant, response.previous_response_id),
        conversation_id=_maybe(scoped, tenant, response.conversation_id),
    )


def _unscoped_response(tenant: str, response: StoredResponse) -> StoredResponse:
    return replace(
        response,
        id=unscoped(tenant, response.id),
        previous_response_id=_maybe(unscoped, tenant, response.previous_response_id),
        conversation_id=_maybe(unscoped, tenant, response.conversation_id),
    )


def _unscoped_conversation(tenant: str, conversation: StoredConversation | None) -> StoredConversation | None:
    return replace(conversation, id=unscoped(tenant, conversation.id)) if conversation is not None else None


def _maybe(convert: Any, tenant: str, record_id: str | None) -> str | None:
    return convert(tenant, record_id) if record_id is not None else None
