"""A finished turn's outcome, stored before the client hears of it, then its conversation warmed up.

The response is saved (and its conversation extended) through the storage actor;
only then is the final object returned to be sent. A store that fails (a full
disk, a record over the whole budget) is reported with the object, which is then
the failed response carrying that error: the caller answers it with the failure's
status, or ends its stream with `response.failed`, so a client is never told of a
response that is not there. After a kept answer, the next turn is prepared while
the server is idle: the turn's own render (`turn.Rendered`) extended by the answer,
so the history is never replayed again.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from courier.conversation.chat_render import extend_messages
from courier.conversation.replay import newest_capsule_index
from courier.conversation.response_object import Outcome, ResponseDraft, Status, failed_outcome, response_object
from courier.conversation.turn import Rendered, TurnServices
from courier.conversation.warm_up import warm_up_next_turn
from courier.messages.asking import Refused, call
from courier.messages.base import RequestFailed
from courier.messages.storage import AppendConversationItems, SaveResponse
from courier.storage.records import JsonObject, StoredResponse

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class Recorded:
    """The final response object, and why it could not be stored (None when it was, or was not to be)."""

    response: JsonObject
    failure: RequestFailed | None = None


async def record(services: TurnServices, draft: ResponseDraft, outcome: Outcome, rendered: Rendered | None) -> Recorded:
    """Store the response (and extend its conversation); then warm up the next turn over `rendered` (what the model
    was given) and the answer. A store that fails makes the response a failed one carrying the store's error."""
    request = draft.request
    final = response_object(draft, outcome)
    kept = outcome.status in (Status.COMPLETED, Status.INCOMPLETE)
    # A cancelled turn (cancelled on request, or its stream's client gone) leaves what exists in its conversation.
    appends = kept or outcome.status is Status.CANCELLED
    appended = [*_new_input(request.input_items), *outcome.output] if request.conversation_id and appends else []
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
                services.storage,
                lambda reply: SaveResponse(
                    response=stored, conversation_items=appended, tenant=services.tenant, reply=reply
                ),
            )
        elif appended and request.conversation_id is not None:
            conversation_id = request.conversation_id
            await call(
                services.storage,
                lambda reply: AppendConversationItems(
                    conversation_id=conversation_id, items=appended, tenant=services.tenant, reply=reply
                ),
            )
    except Refused as refused:
        logger.warning("response %s was not stored: %s", draft.id, refused.failure.message)
        return Recorded(
            response=response_object(draft, failed_outcome(refused.failure, outcome.output)), failure=refused.failure
        )
    if kept and rendered is not None and request.cache_prompt and services.warm_up:
        answer = [item for item in outcome.output if item["type"] != "compaction"]
        messages = extend_messages(rendered.messages, answer)
        warm_up_next_turn(
            services.ingress,
            request.session,
            messages,
            request.template_tools,
            services.tenant,
            options=request.template_options,
        )
    return Recorded(response=final)


def _new_input(items: Sequence[JsonObject]) -> Sequence[JsonObject]:
    """What a conversation gains from this input: from a replayed capsule on (what precedes it, it holds already)."""
    newest = newest_capsule_index(items)
    return items if newest is None else items[newest:]
