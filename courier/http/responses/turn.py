"""Preparing one `/v1/responses` turn: its context, an automatic compaction when due, and admission.

The context is rebuilt from storage (a `previous_response_id` chain or a
conversation's items) and rendered through the one chat translation every turn
uses, after replaying any compaction capsule in it. With `context_management`, a
context at or over its `compact_threshold` (or one that would not fit with the
requested output) is compacted by the compactor first; the answer is then
generated from the compacted context, with `max_output_tokens` capped at what
remains. Admission is the ingress's, as for chat, so Responses turns share the
prompt cache and the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from courier.conversation.capsule import CapsuleError
from courier.conversation.chat_render import chat_messages
from courier.conversation.image_refs import image_refs
from courier.conversation.replay import expand
from courier.conversation.selection import DEFAULT_KEEP_FRACTION, MAX_DEFAULT_KEEP_TOKENS
from courier.http.asking import ask_actor
from courier.http.context import AppContext
from courier.http.errors import ApiError
from courier.http.generation import admit_prompt
from courier.http.responses.objects import ResponseDraft
from courier.http.responses.request import ResponsesRequest
from courier.http.storage_calls import ask_storage
from courier.media.images import FetchedImage
from courier.messages.base import RequestId
from courier.messages.compactor import CompactHistory, CompactionResult
from courier.messages.ingress import Admitted, ChatPrompt
from courier.messages.media import FetchImages, FetchMemo, ImageRef, ImagesFetched, over_image_cap
from courier.messages.storage import LoadChain, LoadConversationItems
from courier.messages.token_counter import TokenizeChat, TokenizeResult
from courier.storage.records import JsonObject

# The summary budget of an automatic compaction (an explicit one takes the request's `max_output_tokens`).
AUTO_COMPACTION_SUMMARY_TOKENS = 1024


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    request: ResponsesRequest
    draft: ResponseDraft
    items: list[JsonObject]  # the history then this request's input, as stored and sent (capsules unexpanded)
    compaction_due: bool
    # The turn's images, read once for its count, its compaction and its admission alike.
    memo: FetchMemo = field(default_factory=FetchMemo)


@dataclass(frozen=True, slots=True, kw_only=True)
class Turn:
    request: ResponsesRequest
    draft: ResponseDraft
    items: Sequence[JsonObject]  # what the model was given (the compacted context after a compaction)
    admitted: Admitted
    compaction_item: JsonObject | None = None  # an automatic compaction's, first in the output


async def history_items(context: AppContext, request: ResponsesRequest) -> list[JsonObject]:
    """The items a new turn continues: every hop of its `previous_response_id` chain, or its conversation's."""
    if request.previous_response_id is not None:
        response_id = request.previous_response_id
        chain = await ask_storage(context, lambda reply: LoadChain(response_id=response_id, reply=reply))
        if chain is None:
            raise ApiError(
                404,
                f"Previous response with id '{response_id}' not found.",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        if chain.missing is not None:
            message = (
                f"The history of '{response_id}' is incomplete: its ancestor '{chain.missing}' is no longer stored."
            )
            raise ApiError(404, message, param="previous_response_id", code="previous_response_not_found")
        items: list[JsonObject] = []
        for stored in chain.responses:
            items += [*stored.input_items, *stored.response["output"]]
        return items
    if request.conversation_id is not None:
        conversation_id = request.conversation_id
        stored_items = await ask_storage(
            context, lambda reply: LoadConversationItems(conversation_id=conversation_id, reply=reply)
        )
        if stored_items is None:
            raise conversation_not_found(conversation_id)
        return list(stored_items)
    return []


def replayed_items(context: AppContext, request: ResponsesRequest, items: Sequence[JsonObject]) -> list[JsonObject]:
    """The items the model is shown: any compaction capsule replayed."""
    try:
        return expand(items, context.capsules, request.instructions)
    except CapsuleError as error:
        raise ApiError.invalid(f"compaction item: {error}", param="input", code="invalid_compaction_item") from None


def context_messages(context: AppContext, request: ResponsesRequest, items: Sequence[JsonObject]) -> list[JsonObject]:
    """The chat messages the model is shown for `items`."""
    return chat_messages(request.instructions, replayed_items(context, request, items))


async def count_tokens(
    context: AppContext, request: ResponsesRequest, items: Sequence[JsonObject], memo: FetchMemo | None = None
) -> int:
    """What a turn over `items` prefills: the render `/v1/responses/input_tokens` reports (a vision model's
    images counted as the image tokens they expand to, so they are fetched)."""
    shown = replayed_items(context, request, items)
    messages = chat_messages(request.instructions, shown)
    images = await _images_to_count(context, image_refs(shown, request.input_items), memo or FetchMemo())
    counted = await ask_actor(
        context.outboxes.token_counter,
        lambda reply: TokenizeChat(
            messages=messages, tools=request.template_tools, add_generation_prompt=True, reply=reply, images=images
        ),
        TokenizeResult,
    )
    return len(counted.tokens)


async def _images_to_count(
    context: AppContext, refs: tuple[ImageRef, ...], memo: FetchMemo
) -> tuple[FetchedImage, ...]:
    """The images a count must see: none for a text-only model (its template shows their text only)."""
    model, fetcher = context.state.model, context.outboxes.media_fetcher
    if not refs or model is None or not model.accepts_images or fetcher is None:
        return ()
    over = over_image_cap(refs, context.settings.max_images)
    if over is not None:
        raise ApiError.from_failure(over)
    fetched = await ask_actor(fetcher, lambda reply: FetchImages(images=refs, memo=memo, reply=reply), ImagesFetched)
    return fetched.images


async def plan_turn(context: AppContext, request: ResponsesRequest) -> Plan:
    context.require_ready()
    context.require_model(request.model)
    items = [*await history_items(context, request), *request.input_items]
    due = False
    memo = FetchMemo()
    if request.compact_threshold is not None:
        tokens = await count_tokens(context, request, items, memo)
        wanted = request.max_output_tokens or 1
        due = tokens >= request.compact_threshold or tokens + wanted > context.context_length
    draft = ResponseDraft(request=request, model=context.state.model_id)
    return Plan(request=request, draft=draft, items=items, compaction_due=due, memo=memo)


async def compact(context: AppContext, plan: Plan) -> CompactionResult:
    request = plan.request
    return await ask_actor(
        context.outboxes.compactor,
        lambda reply: CompactHistory(
            items=plan.items,
            instructions=request.instructions,
            tools=request.template_tools,
            keep_tokens=_auto_keep_tokens(context, request),
            max_output_tokens=AUTO_COMPACTION_SUMMARY_TOKENS,
            session=request.session,
            reply=reply,
            memo=plan.memo,
        ),
        CompactionResult,
    )


async def admit_turn(
    context: AppContext, plan: Plan, compaction: CompactionResult | None = None, compaction_id: str | None = None
) -> Turn:
    request = plan.request
    items: Sequence[JsonObject] = plan.items
    compaction_item = None
    if compaction is not None:
        compaction_item = {**compaction.compaction_item, "id": compaction_id or compaction.compaction_item["id"]}
        items = [*compaction.output[:-1], compaction_item]
    shown = replayed_items(context, request, items)
    prompt = ChatPrompt(
        messages=chat_messages(request.instructions, shown),
        tools=request.template_tools,
        images=image_refs(shown, request.input_items),
    )
    admitted = await admit_prompt(
        context,
        prompt,
        request.sampling,
        RequestId(plan.draft.id),
        session=request.session,
        cache_prompt=request.cache_prompt,
        # A compacted turn generates what the context leaves, up to max_output_tokens, rather than failing.
        fit_to_context=compaction is not None,
        memo=plan.memo,
    )
    return Turn(request=request, draft=plan.draft, items=items, admitted=admitted, compaction_item=compaction_item)


async def start_turn(context: AppContext, plan: Plan) -> Turn:
    """Compact if due, then admit: everything a whole (non-streamed) response needs before generating."""
    compaction = await compact(context, plan) if plan.compaction_due else None
    return await admit_turn(context, plan, compaction)


def _auto_keep_tokens(context: AppContext, request: ResponsesRequest) -> int:
    """Keep at most half the threshold verbatim, so the compacted context lands well under it."""
    default = min(context.context_length // DEFAULT_KEEP_FRACTION, MAX_DEFAULT_KEEP_TOKENS)
    threshold = request.compact_threshold or context.context_length
    return max(1, min(default, threshold // 2))


def conversation_not_found(conversation_id: str) -> ApiError:
    return ApiError(404, f"Conversation with id '{conversation_id}' not found.", param="conversation", code="not_found")
