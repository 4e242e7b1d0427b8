"""A finished turn's outcome, stored before the client hears of it, then its conversation warmed up."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from contextlib import suppress

from anyio import BrokenResourceError, ClosedResourceError, WouldBlock

from courier.conversation.replay import newest_capsule_index
from courier.http.context import AppContext
from courier.http.errors import ApiError
from courier.http.responses.objects import Outcome, ResponseDraft, Status, response_object, usage_object
from courier.http.responses.turn import context_messages
from courier.http.storage_calls import ask_storage
from courier.messages.generation import FinishReason, GenerationFinished
from courier.messages.ingress import WarmUpConversation
from courier.messages.storage import AppendConversationItems, SaveResponse
from courier.storage.records import JsonObject, StoredResponse

logger = logging.getLogger(__name__)


def finished_outcome(finished: GenerationFinished, output: Sequence[JsonObject]) -> Outcome:
    cut = finished.reason is FinishReason.LENGTH
    return Outcome(
        status=Status.INCOMPLETE if cut else Status.COMPLETED,
        output=output,
        usage=usage_object(finished),
        incomplete_reason="max_output_tokens" if cut else None,
    )


def failed_outcome(error: ApiError, output: Sequence[JsonObject]) -> Outcome:
    return Outcome(
        status=Status.FAILED, output=output, error={"code": error.code or "server_error", "message": error.message}
    )


async def record(
    context: AppContext, draft: ResponseDraft, outcome: Outcome, model_items: Sequence[JsonObject] | None
) -> JsonObject:
    """Store the response (and extend its conversation); then warm up the next turn over `model_items` (what the
    model was given) and the answer. Returns the final response object (failed if it could not be stored)."""
    request = draft.request
    final = response_object(draft, outcome)
    kept = outcome.status in (Status.COMPLETED, Status.INCOMPLETE)
    appended = [*_new_input(request.input_items), *outcome.output] if request.conversation_id and kept else []
    try:
        if request.store:
            stored = StoredResponse(
                id=draft.id,
                created_at=draft.created_at,
                previous_response_id=request.previous_response_id,
                conversation_id=request.conversation_id,
                input_items=request.input_items,
                response=final,
            )
            await ask_storage(
                context, lambda reply: SaveResponse(response=stored, conversation_items=appended, reply=reply)
            )
        elif appended and request.conversation_id is not None:
            conversation_id = request.conversation_id
            await ask_storage(
                context,
                lambda reply: AppendConversationItems(conversation_id=conversation_id, items=appended, reply=reply),
            )
    except ApiError as error:
        logger.warning("response %s was not stored: %s", draft.id, error.message)
        return response_object(draft, failed_outcome(error, outcome.output))
    if kept and model_items is not None:
        answer = [item for item in outcome.output if item["type"] != "compaction"]
        _warm_up_next_turn(context, draft, [*model_items, *answer])
    return final


def _new_input(items: Sequence[JsonObject]) -> Sequence[JsonObject]:
    """What a conversation gains from this input: from a replayed capsule on (what precedes it, it holds already)."""
    newest = newest_capsule_index(items)
    return items if newest is None else items[newest:]


def _warm_up_next_turn(context: AppContext, draft: ResponseDraft, items: Sequence[JsonObject]) -> None:
    """Ask for the conversation, reply included, to be prefilled while the server is idle (may be dropped)."""
    request = draft.request
    if not request.cache_prompt or context.outboxes.snapshot_store is None:
        return
    try:
        messages = context_messages(context, request, items)
    except ApiError:
        return
    warm_up = WarmUpConversation(session=request.session, messages=messages, tools=request.template_tools)
    with suppress(WouldBlock, BrokenResourceError, ClosedResourceError):
        context.outboxes.ingress.send_nowait(warm_up)
