"""One `/v1/responses` turn, prepared: its history loaded, rendered once, counted, compacted when due, admitted.

The history comes from storage (every hop of a `previous_response_id` chain in one
recursive query, or a conversation's items). `render` replays any compaction capsule
in it (decoded and, with a server key, checked once) and translates the items into
the chat template's messages through the one translation every turn uses, so a
stored chain's prompt is an exact prefix of its next turn's. That one render serves
the threshold count, the admission and, once the answer is recorded, the next turn's
warm-up (`record.py`); the count tokenizes it as admission would, so admission takes
those tokens rather than rendering the template again. With `context_management`, a context at or over its
`compact_threshold` (or one that would not fit with the requested output) is
compacted by the compactor first; the answer is then generated from the compacted
context the compactor returns, with `max_output_tokens` capped at what remains.
Admission is the ingress's, as for chat, so Responses turns share the prompt cache
and the batch. Failures are `Refused` with a typed failure (`http/` picks the status).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from anyio.streams.memory import MemoryObjectSendStream

from courier.conversation.capsule import CapsuleCodec, CapsuleError
from courier.conversation.chat_render import chat_messages
from courier.conversation.ids import new_response_id
from courier.conversation.image_refs import image_refs
from courier.conversation.images import ImageAdmission
from courier.conversation.replay import expand
from courier.conversation.request import ResponsesRequest
from courier.conversation.response_object import ResponseDraft
from courier.conversation.selection import DEFAULT_KEEP_FRACTION, MAX_DEFAULT_KEEP_TOKENS
from courier.core.failure_codes import FailureCode
from courier.engine.generation import RequestId
from courier.messages.asking import Refused, call
from courier.messages.base import FailureKind, RequestFailed
from courier.messages.compactor import CompactHistory, CompactionResult, CompactorMessage
from courier.messages.ingress import AdmitGeneration, Admitted, ChatPrompt, IngressMessage
from courier.messages.media import FetchMemo, ImageRef
from courier.messages.storage import LoadChain, LoadConversationItems, StorageMessage
from courier.messages.token_counter import MessageNames, TokenCounterMessage, TokenizeChat, TokenizeResult
from courier.storage.records import JsonObject

# The summary budget of an automatic compaction (an explicit one takes the request's `max_output_tokens`).
AUTO_COMPACTION_SUMMARY_TOKENS = 1024


@dataclass(frozen=True, slots=True, kw_only=True)
class TurnServices:
    """The actors a turn talks to, and what it needs to know of the served model."""

    storage: MemoryObjectSendStream[StorageMessage]
    token_counter: MemoryObjectSendStream[TokenCounterMessage]
    compactor: MemoryObjectSendStream[CompactorMessage]
    ingress: MemoryObjectSendStream[IngressMessage]
    images: ImageAdmission
    capsules: CapsuleCodec
    model_id: str
    context_length: int
    warm_up: bool  # the prompt cache is on: a recorded turn asks for its next turn to be prepared
    tenant: str = ""  # the caller's (its API key's): whose stored records and prompt-cache state the turn uses
    replica_id: str | None = None  # `--replica-id`: the routing token this turn's response id carries
    deadline: float | None = None  # `time.monotonic()` by which the turn's generation ends (--request-timeout)
    # The last response a Responses WebSocket connection made, by id, with its whole history (what its chain would
    # load): Codex continues a `store: false` response on the same connection by its id, as OpenAI's server does.
    connection_last: tuple[str, tuple[JsonObject, ...]] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Rendered:
    """A context as the model is shown it, rendered once."""

    shown: tuple[JsonObject, ...]  # the items, any compaction capsule replayed
    messages: list[JsonObject]  # the chat template's messages
    images: tuple[ImageRef, ...]  # the image parts, each named where the request sent it


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    request: ResponsesRequest
    draft: ResponseDraft
    items: list[JsonObject]  # the history then this request's input, as stored and sent (capsules unexpanded)
    rendered: Rendered
    counted: TokenizeResult | None  # the threshold count's tokens, which admission takes as they are
    compaction_due: bool
    # The turn's images, read once for its count, its compaction and its admission alike.
    memo: FetchMemo = field(default_factory=FetchMemo)


@dataclass(frozen=True, slots=True, kw_only=True)
class Turn:
    request: ResponsesRequest
    draft: ResponseDraft
    rendered: Rendered  # what the model was given (the compacted context after a compaction)
    admitted: Admitted
    compaction_item: JsonObject | None = None  # an automatic compaction's, first in the output


def render(capsules: CapsuleCodec, request: ResponsesRequest, items: Sequence[JsonObject]) -> Rendered:
    """`items` as the model is shown them: the one place a turn's capsule is decoded."""
    return rendered_from(request, replayed(capsules, items, request.instructions))


def replayed(capsules: CapsuleCodec, items: Sequence[JsonObject], instructions: str | None) -> list[JsonObject]:
    """`items` with their newest compaction capsule replayed; a capsule that cannot be used is `Refused` (400)."""
    try:
        return expand(items, capsules, instructions)
    except CapsuleError as error:
        failure = RequestFailed(
            kind=FailureKind.INVALID_REQUEST,
            message=f"compaction item: {error}",
            param="input",
            code=FailureCode.INVALID_COMPACTION_ITEM,
        )
        raise Refused(failure) from None


def rendered_from(request: ResponsesRequest, shown: Sequence[JsonObject]) -> Rendered:
    """The render of items already replayed (a compaction's context)."""
    return Rendered(
        shown=tuple(shown),
        messages=chat_messages(request.instructions, shown),
        images=image_refs(shown, request.input_items),
    )


async def history_items(services: TurnServices, request: ResponsesRequest) -> list[JsonObject]:
    """The items a new turn continues: every hop of its `previous_response_id` chain, or its conversation's."""
    if request.previous_response_id is not None:
        response_id = request.previous_response_id
        if services.connection_last is not None and services.connection_last[0] == response_id:
            return list(services.connection_last[1])  # this connection's last response, stored or not
        chain = await call(
            services.storage, lambda reply: LoadChain(response_id=response_id, tenant=services.tenant, reply=reply)
        )
        if chain is None:
            raise Refused(_previous_not_found(f"Previous response with id '{response_id}' not found."))
        if chain.missing is not None:
            raise Refused(
                _previous_not_found(
                    f"The history of '{response_id}' is incomplete: its ancestor '{chain.missing}' is no longer stored."
                )
            )
        items: list[JsonObject] = []
        for stored in chain.responses:
            items += [*stored.input_items, *stored.response["output"]]
        return items
    if request.conversation_id is not None:
        conversation_id = request.conversation_id
        stored_items = await call(
            services.storage,
            lambda reply: LoadConversationItems(conversation_id=conversation_id, tenant=services.tenant, reply=reply),
        )
        if stored_items is None:
            raise Refused(conversation_not_found(conversation_id))
        return list(stored_items)
    return []


async def count_tokens(
    services: TurnServices, request: ResponsesRequest, rendered: Rendered, memo: FetchMemo | None = None
) -> int:
    """What a turn over `rendered` prefills: the count `/v1/responses/input_tokens` reports (a vision model's images
    counted as the image tokens they expand to, so they are read)."""
    return len((await _tokenized(services, request, rendered, memo or FetchMemo(), for_admission=False)).tokens)


async def _tokenized(
    services: TurnServices, request: ResponsesRequest, rendered: Rendered, memo: FetchMemo, *, for_admission: bool
) -> TokenizeResult:
    """`rendered` through the chat template and the tokenizer, as admission renders it; `for_admission` also asks for
    the history boundary a cached prompt needs, so admission can take this render as it is."""
    images = await services.images.admit_for_count(rendered.images, memo)
    return await call(
        services.token_counter,
        lambda reply: TokenizeChat(
            messages=rendered.messages,
            tools=request.template_tools,
            add_generation_prompt=True,
            reply=reply,
            with_history_boundary=for_admission and request.cache_prompt,
            images=images,
            max_tokens=services.context_length,
            names=MessageNames.CONVERSATION,
            options=request.template_options,
            reuse_scope=services.tenant if request.cache_prompt else None,
        ),
    )


async def plan_turn(services: TurnServices, request: ResponsesRequest) -> Plan:
    items = [*await history_items(services, request), *request.input_items]
    rendered = render(services.capsules, request, items)
    due = False
    memo = FetchMemo()
    counted = None
    if request.compact_threshold is not None:
        counted = await _tokenized(services, request, rendered, memo, for_admission=True)
        tokens = len(counted.tokens)
        wanted = request.max_output_tokens or 1
        due = tokens >= request.compact_threshold or tokens + wanted > services.context_length
    due = due or request.compaction_requested
    draft = ResponseDraft(request=request, model=services.model_id, id=new_response_id(services.replica_id))
    return Plan(
        request=request, draft=draft, items=items, rendered=rendered, counted=counted, compaction_due=due, memo=memo
    )


async def compact(services: TurnServices, plan: Plan) -> CompactionResult:
    request = plan.request
    return await call(
        services.compactor,
        lambda reply: CompactHistory(
            context=plan.rendered.shown,
            request_items=request.input_items,
            instructions=request.instructions,
            tools=request.template_tools,
            keep_tokens=_auto_keep_tokens(services.context_length, request),
            max_output_tokens=AUTO_COMPACTION_SUMMARY_TOKENS,
            session=request.session,
            reply=reply,
            memo=plan.memo,
            tenant=services.tenant,
            summarize_all=request.compaction_requested,
        ),
    )


async def admit_turn(
    services: TurnServices, plan: Plan, compaction: CompactionResult | None = None, compaction_id: str | None = None
) -> Turn:
    request = plan.request
    rendered, tokens = plan.rendered, plan.counted
    compaction_item = None
    if compaction is not None:
        compaction_item = {**compaction.compaction_item, "id": compaction_id or compaction.compaction_item["id"]}
        rendered, tokens = rendered_from(request, compaction.context), None
    prompt = ChatPrompt(
        messages=rendered.messages,
        tools=request.template_tools,
        images=rendered.images,
        rendered=tokens,
        options=request.template_options,
        names=MessageNames.CONVERSATION,
    )
    admitted = await call(
        services.ingress,
        lambda reply: AdmitGeneration(
            request_id=RequestId(plan.draft.id),
            prompt=prompt,
            sampling=request.sampling,
            reply=reply,
            session=request.session,
            cache_prompt=request.cache_prompt,
            # A compacted turn generates what the context leaves, up to max_output_tokens, rather than failing.
            fit_to_context=compaction is not None,
            memo=plan.memo,
            tenant=services.tenant,
            deadline=services.deadline,
        ),
    )
    return Turn(
        request=request, draft=plan.draft, rendered=rendered, admitted=admitted, compaction_item=compaction_item
    )


async def start_turn(services: TurnServices, plan: Plan) -> Turn:
    """Compact if due, then admit: everything a whole (non-streamed) response needs before generating."""
    compaction = await compact(services, plan) if plan.compaction_due else None
    return await admit_turn(services, plan, compaction)


def _auto_keep_tokens(context_length: int, request: ResponsesRequest) -> int:
    """Keep at most half the threshold verbatim, so the compacted context lands well under it."""
    default = min(context_length // DEFAULT_KEEP_FRACTION, MAX_DEFAULT_KEEP_TOKENS)
    threshold = request.compact_threshold or context_length
    return max(1, min(default, threshold // 2))


def _previous_not_found(message: str) -> RequestFailed:
    return RequestFailed(
        kind=FailureKind.NOT_FOUND,
        message=message,
        param="previous_response_id",
        code=FailureCode.PREVIOUS_RESPONSE_NOT_FOUND,
    )


def conversation_not_found(conversation_id: str) -> RequestFailed:
    return RequestFailed(
        kind=FailureKind.NOT_FOUND,
        message=f"Conversation with id '{conversation_id}' not found.",
        param="conversation",
        code=FailureCode.NOT_FOUND,
    )
