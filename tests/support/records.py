"""Stored records for storage tests: a message item and a response holding one input and one output item."""

from __future__ import annotations

from courier.storage.records import JsonObject, StoredResponse


def item(item_id: str, text: str = "hello") -> JsonObject:
    return {"id": item_id, "type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


def response(response_id: str, previous: str | None = None, conversation: str | None = None) -> StoredResponse:
    return StoredResponse(
        id=response_id,
        created_at=1.0,
        previous_response_id=previous,
        conversation_id=conversation,
        input_items=(item(f"in_{response_id}"),),
        response={"id": response_id, "object": "response", "output": [item(f"out_{response_id}")]},
    )
