"""The storage actor's inbox: one message per storage operation, each applied to the backend on its thread.

Every message carries a reply stream for its result, or a `RequestFailed` when the
backend refuses (a record over the whole budget, an unknown pagination cursor).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

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

R = TypeVar("R")


@dataclass(frozen=True, slots=True, kw_only=True)
class StorageRequest(Request[R]):
    @abstractmethod
    def apply(self, storage: ResponseStorage) -> R:
        """Run against the backend (on the storage thread) and return the reply."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SaveResponse(StorageRequest[None]):
    """Store a finished response; with a conversation, append its input and output items to it too."""

    response: StoredResponse
    conversation_items: Sequence[JsonObject] = ()

    def apply(self, storage: ResponseStorage) -> None:
        storage.save_response(self.response, self.conversation_items)


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadResponse(StorageRequest[StoredResponse | None]):
    response_id: str

    def apply(self, storage: ResponseStorage) -> StoredResponse | None:
        return storage.load_response(self.response_id)


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadChain(StorageRequest[Chain | None]):
    """A response and its `previous_response_id` ancestors, to rebuild a new turn's context."""

    response_id: str

    def apply(self, storage: ResponseStorage) -> Chain | None:
        return storage.load_chain(self.response_id)


@dataclass(frozen=True, slots=True, kw_only=True)
class DeleteResponse(StorageRequest[bool]):
    response_id: str

    def apply(self, storage: ResponseStorage) -> bool:
        return storage.delete_response(self.response_id)


@dataclass(frozen=True, slots=True, kw_only=True)
class CreateConversation(StorageRequest[None]):
    conversation: StoredConversation
    items: Sequence[JsonObject] = ()

    def apply(self, storage: ResponseStorage) -> None:
        storage.create_conversation(self.conversation, self.items)


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadConversation(StorageRequest[StoredConversation | None]):
    conversation_id: str

    def apply(self, storage: ResponseStorage) -> StoredConversation | None:
        return storage.load_conversation(self.conversation_id)


@dataclass(frozen=True, slots=True, kw_only=True)
class UpdateConversation(StorageRequest[StoredConversation | None]):
    conversation_id: str
    metadata: Mapping[str, str]

    def apply(self, storage: ResponseStorage) -> StoredConversation | None:
        return storage.update_conversation(self.conversation_id, self.metadata)


@dataclass(frozen=True, slots=True, kw_only=True)
class DeleteConversation(StorageRequest[bool]):
    conversation_id: str

    def apply(self, storage: ResponseStorage) -> bool:
        return storage.delete_conversation(self.conversation_id)


@dataclass(frozen=True, slots=True, kw_only=True)
class AppendConversationItems(StorageRequest[bool]):
    conversation_id: str
    items: Sequence[JsonObject]

    def apply(self, storage: ResponseStorage) -> bool:
        return storage.append_conversation_items(self.conversation_id, self.items)


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadConversationItems(StorageRequest[tuple[JsonObject, ...] | None]):
    """Every item of a conversation, in order: the context of its next turn."""

    conversation_id: str

    def apply(self, storage: ResponseStorage) -> tuple[JsonObject, ...] | None:
        return storage.conversation_items(self.conversation_id)


@dataclass(frozen=True, slots=True, kw_only=True)
class ListConversationItems(StorageRequest[ItemPage | None]):
    conversation_id: str
    page: PageQuery

    def apply(self, storage: ResponseStorage) -> ItemPage | None:
        return storage.list_conversation_items(self.conversation_id, self.page)


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadConversationItem(StorageRequest[JsonObject | None]):
    conversation_id: str
    item_id: str

    def apply(self, storage: ResponseStorage) -> JsonObject | None:
        return storage.load_conversation_item(self.conversation_id, self.item_id)


@dataclass(frozen=True, slots=True, kw_only=True)
class DeleteConversationItem(StorageRequest[bool | None]):
    conversation_id: str
    item_id: str

    def apply(self, storage: ResponseStorage) -> bool | None:
        return storage.delete_conversation_item(self.conversation_id, self.item_id)


StorageMessage = StorageRequest[Any]
