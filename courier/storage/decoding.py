"""Reading stored rows back into records, checking each is the shape the server wrote.

A row is trusted no further than its bytes: bit rot or a bad restore can leave JSON
that does not parse, or parses into something else (a list where the response object
was, an item without its id). Every read goes through here, so such a row becomes a
`DamagedRecord` naming it, raised for the request that reads it, rather than a
`KeyError` deep inside a turn or a value served as if it were the record. Pure: no
database, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson

from courier.storage.records import DamagedRecord, JsonObject, StoredConversation, StoredResponse
from courier.storage.tenancy import SEPARATOR


def stored_response(row: Sequence[Any]) -> StoredResponse:
    """(id, created_at, previous_response_id, conversation_id, input_items, response) -> the record."""
    response_id, created_at, previous_id, conversation_id, input_blob, response_blob = row
    record = f"response '{response_id}'"
    if not isinstance(created_at, int | float):
        raise DamagedRecord(record, f"created_at holds {type(created_at).__name__}, not a time")
    if not _optional_text(previous_id) or not _optional_text(conversation_id):
        raise DamagedRecord(record, "its previous_response_id or conversation_id is not text")
    input_items = _json(input_blob, record, "input_items")
    if not _item_list(input_items):
        raise DamagedRecord(record, "input_items is not a list of items")
    response = _json(response_blob, record, "response")
    if not isinstance(response, dict) or not _stored_under(response.get("id"), response_id):
        raise DamagedRecord(record, "response is not the response object stored under this id")
    if not _item_list(response.get("output")):
        raise DamagedRecord(record, "response.output is not a list of items")
    return StoredResponse(
        id=response_id,
        created_at=created_at,
        previous_response_id=previous_id,
        conversation_id=conversation_id,
        input_items=tuple(input_items),
        response=response,
    )


def stored_conversation(row: Sequence[Any]) -> StoredConversation:
    """(id, created_at, metadata) -> the record."""
    conversation_id, created_at, metadata_blob = row
    record = f"conversation '{conversation_id}'"
    if not isinstance(created_at, int):
        raise DamagedRecord(record, f"created_at holds {type(created_at).__name__}, not a time")
    metadata = _json(metadata_blob, record, "metadata")
    if not isinstance(metadata, dict) or not all(isinstance(value, str) for value in metadata.values()):
        raise DamagedRecord(record, "metadata is not an object of strings")
    return StoredConversation(id=conversation_id, created_at=created_at, metadata=metadata)


def conversation_item(conversation_id: str, item_id: str, blob: Any) -> JsonObject:
    """One stored item of a conversation (its row's id and blob)."""
    record = f"item '{item_id}' of conversation '{conversation_id}'"
    item = _json(blob, record, "item")
    if not _is_item(item) or item["id"] != item_id:
        raise DamagedRecord(record, "it is not the item stored under this id")
    result: JsonObject = item
    return result


def _json(blob: Any, record: str, column: str) -> Any:
    if not isinstance(blob, bytes | str):  # NULL, or a number where the JSON was
        raise DamagedRecord(record, f"{column} holds {type(blob).__name__}, not JSON")
    try:
        return orjson.loads(blob)
    except orjson.JSONDecodeError as error:
        raise DamagedRecord(record, f"{column} is not valid JSON ({error})") from None


def _item_list(value: Any) -> bool:
    return isinstance(value, list) and all(_is_item(item) for item in value)


def _is_item(value: Any) -> bool:
    return isinstance(value, dict) and isinstance(value.get("id"), str) and isinstance(value.get("type"), str)


def _optional_text(value: Any) -> bool:
    return value is None or isinstance(value, str)


def _stored_under(public_id: Any, key: str) -> bool:
    """Whether a record whose own id is `public_id` belongs under `key` (its id, or a tenant's `tenant/id`)."""
    return isinstance(public_id, str) and (key == public_id or key.endswith(SEPARATOR + public_id))
