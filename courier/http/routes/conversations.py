"""The Conversations API: conversations with metadata, and their items (which Responses turns append to)."""

from __future__ import annotations

import time

from quart import Blueprint, request

from courier.conversation.ids import new_id
from courier.conversation.turn import conversation_not_found
from courier.core.failure_codes import FailureCode
from courier.http.context import AppContext
from courier.http.errors import ApiError
from courier.http.json_body import read_json_object
from courier.http.listing import list_object, page_query, refuse_include
from courier.http.responses.items import input_items, unsealed
from courier.http.schemas import responses as schema
from courier.http.schemas.validator import check
from courier.messages.asking import Refused, call
from courier.messages.storage import (
    AppendConversationItems,
    CreateConversation,
    DeleteConversation,
    DeleteConversationItem,
    ListConversationItems,
    LoadConversation,
    LoadConversationItem,
    UpdateConversation,
)
from courier.storage.records import ItemPage, JsonObject, StoredConversation


def blueprint(context: AppContext) -> Blueprint:
    routes = Blueprint("conversations", __name__)
    storage = context.outboxes.storage

    @routes.post("/conversations")
    async def create_conversation() -> JsonObject:
        body = await read_json_object()
        check(schema.CONVERSATION, body)
        sent = body.get("items")
        items = unsealed(context.seal, input_items(sent, "items") if sent is not None else [], "items")
        metadata = dict(body.get("metadata") or {})
        conversation = StoredConversation(id=new_id("conv"), created_at=int(time.time()), metadata=metadata)
        await call(
            storage,
            lambda reply: CreateConversation(
                tenant=context.caller().tenant, conversation=conversation, items=items, reply=reply
            ),
        )
        return _conversation_object(conversation)

    @routes.get("/conversations/<conversation_id>")
    async def retrieve_conversation(conversation_id: str) -> JsonObject:
        return _conversation_object(await _conversation(context, conversation_id))

    @routes.post("/conversations/<conversation_id>")
    async def update_conversation(conversation_id: str) -> JsonObject:
        body = await read_json_object()
        check(schema.CONVERSATION_UPDATE, body)
        metadata = dict(body["metadata"] or {})
        updated = await call(
            storage,
            lambda reply: UpdateConversation(
                tenant=context.caller().tenant, conversation_id=conversation_id, metadata=metadata, reply=reply
            ),
        )
        if updated is None:
            raise Refused(conversation_not_found(conversation_id))
        return _conversation_object(updated)

    @routes.delete("/conversations/<conversation_id>")
    async def delete_conversation(conversation_id: str) -> JsonObject:
        if not await call(
            storage,
            lambda reply: DeleteConversation(
                tenant=context.caller().tenant, conversation_id=conversation_id, reply=reply
            ),
        ):
            raise Refused(conversation_not_found(conversation_id))
        return {"id": conversation_id, "object": "conversation.deleted", "deleted": True}

    @routes.get("/conversations/<conversation_id>/items")
    async def list_items(conversation_id: str) -> JsonObject:
        refuse_include(request.args)
        query = page_query(request.args)
        page = await call(
            storage,
            lambda reply: ListConversationItems(
                tenant=context.caller().tenant, conversation_id=conversation_id, page=query, reply=reply
            ),
        )
        if page is None:
            raise Refused(conversation_not_found(conversation_id))
        return list_object(page)

    @routes.post("/conversations/<conversation_id>/items")
    async def add_items(conversation_id: str) -> JsonObject:
        refuse_include(request.args)
        body = await read_json_object()
        check(schema.CONVERSATION_ITEMS, body)
        items = unsealed(context.seal, input_items(body["items"], "items"), "items")
        if not await call(
            storage,
            lambda reply: AppendConversationItems(
                tenant=context.caller().tenant, conversation_id=conversation_id, items=items, reply=reply
            ),
        ):
            raise Refused(conversation_not_found(conversation_id))
        return list_object(ItemPage(items=tuple(items), has_more=False))

    @routes.get("/conversations/<conversation_id>/items/<item_id>")
    async def retrieve_item(conversation_id: str, item_id: str) -> JsonObject:
        item = await call(
            storage,
            lambda reply: LoadConversationItem(
                tenant=context.caller().tenant, conversation_id=conversation_id, item_id=item_id, reply=reply
            ),
        )
        if item is None:
            await _conversation(context, conversation_id)  # an unknown conversation is named as such
            raise _item_not_found(item_id)
        return item

    @routes.delete("/conversations/<conversation_id>/items/<item_id>")
    async def delete_item(conversation_id: str, item_id: str) -> JsonObject:
        deleted = await call(
            storage,
            lambda reply: DeleteConversationItem(
                tenant=context.caller().tenant, conversation_id=conversation_id, item_id=item_id, reply=reply
            ),
        )
        if deleted is None:
            raise Refused(conversation_not_found(conversation_id))
        if not deleted:
            raise _item_not_found(item_id)
        return _conversation_object(await _conversation(context, conversation_id))

    return routes


async def _conversation(context: AppContext, conversation_id: str) -> StoredConversation:
    conversation = await call(
        context.outboxes.storage,
        lambda reply: LoadConversation(tenant=context.caller().tenant, conversation_id=conversation_id, reply=reply),
    )
    if conversation is None:
        raise Refused(conversation_not_found(conversation_id))
    return conversation


def _conversation_object(conversation: StoredConversation) -> JsonObject:
    return {
        "id": conversation.id,
        "object": "conversation",
        "created_at": conversation.created_at,
        "metadata": dict(conversation.metadata),
    }


def _item_not_found(item_id: str) -> ApiError:
    return ApiError(404, f"Item with id '{item_id}' not found.", param="item_id", code=FailureCode.NOT_FOUND)
