"""A finished turn's outcome, stored before the client hears of it, then its conversation warmed up.

The response is saved (and its conversation extended) through the storage actor;
only then is the final object returned to be sent. After a kept answer, the next
turn is prepared while the server is idle: the turn's own render (`turn.Rendered`)
extended by the answer, so the history is never replayed again.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from courier.conversation.chat_render import extend_messages
from courier.conversation.replay import newest_capsule_index
from courier.conversation.response_object import Outcome, ResponseDraft, Status, failed_outcome, response_object
from courier.conversation.turn import Rendered, TurnServices
from courier.conversation.warm_up import warm_up_next_turn
from courier.messages.asking import Refused, call
from courier.messages.storage import AppendConversationItems, SaveResponse
from courier.storage.records import JsonObject, StoredResponse

logger = logging.getLogger(__name__)


async def record(
    services: TurnServices, draft: ResponseDraft, outcome: Outcome, rendered: Rendered | None
) -> JsonObject:
    """Store the response (and extend its conversation); then warm up the next turn over `rendered` (what the model
    was given) and the answer. Returns the final response object (failed if it could not be stored)."""
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
            await call(
                services.storage, lambda reply: SaveResponse(response=stored, conversation_items=appended, reply=reply)
            )
        elif appended and request.conversation_id is not None:
            conversation_id = request.conversation_id
            await call(
                services.storage,
                lambda reply: AppendConversationItems(conversation_id=conversation_id, items=appended, reply=reply),
            )
    except Refused as refused:
        logger.warning("response %s was not stored: %s", draft.id, refused.failure.message)
        return response_object(draft, failed_outcome(refused.failure, outcome.output))
    if kept and rendered is not None and request.cache_prompt and services.warm_up:
        answer = [item for item in outcome.output if item["type"] != "compaction"]
        messages = extend_messages(rendered.messages, answer)
        warm_up_next_turn(services.ingress, request.session, messages, request.template_tools)
    return final


def _new_input(items: Sequence[JsonObject]) -> Sequence[JsonObject]:
    """What a conversation gains from this input: from a replayed capsule on (what precedes it, it holds already)."""
    newest = newest_capsule_index(items)
    return items if newest is None else items[newest:]
