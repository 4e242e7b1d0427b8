"""One `/v1/responses` call: its context, admission, the generation (whole or streamed) and its record.

Order of work: the context is rebuilt from storage (a `previous_response_id`
chain or a conversation's items), rendered through the same chat translation as
every turn, and admitted by the ingress like a chat request (so it shares the
prompt cache). The finished response is stored before the client is answered, so
anything acknowledged survives a restart; then the next turn is warmed up.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import suppress
from dataclasses import dataclass

from anyio import BrokenResourceError, ClosedResourceError, WouldBlock

from courier.http.cancellation import GenerationCancelled
from courier.http.context import AppContext
from courier.http.errors import ApiError
from courier.http.generation import admit_prompt, generated_events
from courier.http.responses.events import EventWriter
from courier.http.responses.in_flight import InFlightResponse
from courier.http.responses.items import chat_messages, new_id, text_part
from courier.http.responses.objects import (
    TERMINAL_EVENTS,
    Outcome,
    ResponseDraft,
    Status,
    logprob_objects,
    response_object,
    usage_object,
)
from courier.http.responses.output import OutputAssembler
from courier.http.responses.request import ResponsesRequest
from courier.http.storage_calls import ask_storage
from courier.messages.base import RequestId
from courier.messages.generation import FinishReason, GenerationFinished, TokensGenerated
from courier.messages.ingress import Admitted, ChatPrompt, WarmUpConversation
from courier.messages.storage import AppendConversationItems, LoadChain, LoadConversationItems, SaveResponse
from courier.storage.records import JsonObject, StoredResponse

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class Turn:
    request: ResponsesRequest
    draft: ResponseDraft
    history: Sequence[JsonObject]  # the items before this request's input (chain or conversation)
    admitted: Admitted


async def context_items(context: AppContext, request: ResponsesRequest) -> list[JsonObject]:
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


def turn_messages(request: ResponsesRequest, history: Sequence[JsonObject]) -> list[JsonObject]:
    return chat_messages(request.instructions, [*history, *request.input_items])


async def start_turn(context: AppContext, request: ResponsesRequest) -> Turn:
    context.require_ready()
    context.require_model(request.model)
    history = await context_items(context, request)
    draft = ResponseDraft(request=request, model=context.state.model_id)
    prompt = ChatPrompt(messages=turn_messages(request, history), tools=request.template_tools)
    admitted = await admit_prompt(
        context,
        prompt,
        request.sampling,
        RequestId(draft.id),
        session=request.session,
        cache_prompt=request.cache_prompt,
    )
    return Turn(request=request, draft=draft, history=history, admitted=admitted)


async def run_whole(context: AppContext, turn: Turn) -> JsonObject:
    """Generate, record and return the response object; a failed generation raises its error after recording."""
    in_progress = response_object(turn.draft, Outcome(status=Status.IN_PROGRESS))
    with context.responses.running(turn.draft.id, in_progress) as entry:
        assembler = OutputAssembler(context.state.tool_format, turn.request.template_tools)
        failure: ApiError | None = None
        try:
            finished = await _generate(context, turn, entry, assembler)
            _, calls = assembler.finish()
            outcome = _finished_outcome(finished, assembler.output_items(calls))
        except GenerationCancelled:
            outcome = Outcome(status=Status.CANCELLED, output=_partial_output(assembler))
        except ApiError as error:
            failure = error
            outcome = _failed_outcome(error, _partial_output(assembler))
        final = await _record(context, turn, outcome)
        entry.finish(final)
    if failure is not None:
        raise failure
    return final


async def run_streamed(context: AppContext, turn: Turn, emit: EventWriter) -> AsyncIterator[bytes]:
    """The full event sequence OpenAI clients expect, ending with the terminal event of the stored response."""
    draft = turn.draft
    in_progress = response_object(draft, Outcome(status=Status.IN_PROGRESS))
    with context.responses.running(draft.id, in_progress) as entry:
        yield emit("response.created", response=in_progress)
        yield emit("response.in_progress", response=in_progress)
        message = _StreamedMessage(emit)
        result: list[Outcome] = []
        async for chunk in _streamed_output(context, turn, entry, message, result):
            yield chunk
        outcome = result[0]
        if message.opened:
            for chunk in message.close(outcome.output[0]):
                yield chunk
        for index, item in enumerate(outcome.output):
            if item["type"] == "function_call":
                for chunk in _function_call_events(emit, index, item):
                    yield chunk
        final = await _record(context, turn, outcome)
        entry.finish(final)
        yield emit(TERMINAL_EVENTS[Status(final["status"])], response=final)


async def _streamed_output(
    context: AppContext, turn: Turn, entry: InFlightResponse, message: _StreamedMessage, result: list[Outcome]
) -> AsyncIterator[bytes]:
    """Text deltas as they are generated; appends the outcome (finished, cancelled or failed) to `result`."""
    assembler = OutputAssembler(context.state.tool_format, turn.request.template_tools)
    try:
        finished: GenerationFinished | None = None
        async for event in generated_events(turn.admitted, context.settings.request_timeout, entry.cancellation):
            if isinstance(event, GenerationFinished):
                finished = event
                continue
            text = assembler.feed(event)
            if text or event.logprobs:
                for chunk in message.delta(text, logprob_objects(event.logprobs)):
                    yield chunk
        rest, calls = assembler.finish()
        if rest or not calls:
            for chunk in message.delta(rest, []):
                yield chunk
        if finished is None:
            raise ApiError(500, "the generation ended without a result", code="generation_failed")
        output = [assembler.message(message.id)] if message.opened else []
        calls_output = [item for item in assembler.output_items(calls) if item["type"] == "function_call"]
        result.append(_finished_outcome(finished, output + calls_output))
    except GenerationCancelled:
        result.append(Outcome(status=Status.CANCELLED, output=message.partial(assembler)))
    except ApiError as error:
        result.append(_failed_outcome(error, message.partial(assembler)))


class _StreamedMessage:
    """The assistant message item of a stream: opened at its first text, closed once the generation ends."""

    def __init__(self, emit: EventWriter) -> None:
        self._emit = emit
        self.id = new_id("msg")
        self.opened = False

    def delta(self, text: str, logprobs: list[JsonObject]) -> list[bytes]:
        chunks = [] if self.opened else self._open()
        chunks.append(
            self._emit(
                "response.output_text.delta",
                item_id=self.id,
                output_index=0,
                content_index=0,
                delta=text,
                logprobs=logprobs,
            )
        )
        return chunks

    def partial(self, assembler: OutputAssembler) -> list[JsonObject]:
        """The message cut short by a cancellation or a failure (nothing if no text was streamed)."""
        return [assembler.message(self.id, status="incomplete")] if self.opened else []

    def close(self, item: JsonObject) -> list[bytes]:
        part = item["content"][0]
        where = {"item_id": self.id, "output_index": 0, "content_index": 0}
        return [
            self._emit("response.output_text.done", **where, text=part["text"], logprobs=part["logprobs"]),
            self._emit("response.content_part.done", **where, part=part),
            self._emit("response.output_item.done", output_index=0, item=item),
        ]

    def _open(self) -> list[bytes]:
        self.opened = True
        item = {"id": self.id, "type": "message", "role": "assistant", "status": "in_progress", "content": []}
        part = text_part("output_text", "")
        return [
            self._emit("response.output_item.added", output_index=0, item=item),
            self._emit("response.content_part.added", item_id=self.id, output_index=0, content_index=0, part=part),
        ]


def _function_call_events(emit: EventWriter, index: int, item: JsonObject) -> list[bytes]:
    started = {**item, "status": "in_progress", "arguments": ""}
    where = {"item_id": item["id"], "output_index": index}
    return [
        emit("response.output_item.added", output_index=index, item=started),
        emit("response.function_call_arguments.delta", **where, delta=item["arguments"]),
        emit("response.function_call_arguments.done", **where, name=item["name"], arguments=item["arguments"]),
        emit("response.output_item.done", output_index=index, item=item),
    ]


async def _generate(
    context: AppContext, turn: Turn, entry: InFlightResponse, assembler: OutputAssembler
) -> GenerationFinished:
    async for event in generated_events(turn.admitted, context.settings.request_timeout, entry.cancellation):
        if isinstance(event, TokensGenerated):
            assembler.feed(event)
        else:
            return event
    raise ApiError(500, "the generation ended without a result", code="generation_failed")


def _finished_outcome(finished: GenerationFinished, output: Sequence[JsonObject]) -> Outcome:
    cut = finished.reason is FinishReason.LENGTH
    return Outcome(
        status=Status.INCOMPLETE if cut else Status.COMPLETED,
        output=output,
        usage=usage_object(finished),
        incomplete_reason="max_output_tokens" if cut else None,
    )


def _failed_outcome(error: ApiError, output: Sequence[JsonObject]) -> Outcome:
    return Outcome(
        status=Status.FAILED,
        output=output,
        error={"code": error.code or "server_error", "message": error.message},
    )


def _partial_output(assembler: OutputAssembler) -> list[JsonObject]:
    return [assembler.message(status="incomplete")] if assembler.text else []


async def _record(context: AppContext, turn: Turn, outcome: Outcome) -> JsonObject:
    """Store the response (and extend its conversation) before anyone is told it exists; then warm up."""
    request, draft = turn.request, turn.draft
    final = response_object(draft, outcome)
    kept = outcome.status in (Status.COMPLETED, Status.INCOMPLETE)
    appended = [*request.input_items, *outcome.output] if request.conversation_id and kept else []
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
        return response_object(draft, _failed_outcome(error, outcome.output))
    if kept:
        _warm_up_next_turn(context, turn, outcome.output)
    return final


def _warm_up_next_turn(context: AppContext, turn: Turn, output: Sequence[JsonObject]) -> None:
    """Ask for the conversation, reply included, to be prefilled while the server is idle (may be dropped)."""
    request = turn.request
    if not request.cache_prompt or context.outboxes.snapshot_store is None:
        return
    messages = chat_messages(request.instructions, [*turn.history, *request.input_items, *output])
    warm_up = WarmUpConversation(session=request.session, messages=messages, tools=request.template_tools)
    with suppress(WouldBlock, BrokenResourceError, ClosedResourceError):
        context.outboxes.ingress.send_nowait(warm_up)


def conversation_not_found(conversation_id: str) -> ApiError:
    return ApiError(404, f"Conversation with id '{conversation_id}' not found.", param="conversation", code="not_found")
