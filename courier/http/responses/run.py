"""Running one `/v1/responses` turn: the generation, whole or streamed, and its recorded outcome.

A streamed turn whose automatic compaction is due compacts inside the stream
(the compaction item's `output_item.added`, `response.compaction.compacting`,
`output_item.done`), then admits and streams the answer; a failure there ends the
stream with `response.failed`. The finished response is stored before the
client is told (`conversation/record.py`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace

from courier.conversation.items import new_id, text_part
from courier.conversation.record import record
from courier.conversation.response_object import (
    TERMINAL_EVENTS,
    Outcome,
    Status,
    failed_outcome,
    finished_outcome,
    response_object,
)
from courier.conversation.turn import Plan, Turn, TurnServices, admit_turn, compact
from courier.core.failure_codes import FailureCode
from courier.engine.generation import GenerationFinished, TokensGenerated
from courier.http.context import AppContext
from courier.http.responses.events import EventWriter
from courier.http.responses.in_flight import InFlightResponse
from courier.http.responses.output import OutputAssembler, logprob_objects
from courier.messages.asking import Refused
from courier.messages.base import FailureKind, RequestFailed
from courier.messages.generation_reader import ENDED_WITHOUT_RESULT, GenerationCancelled, generated_events
from courier.storage.records import JsonObject


async def run_whole(context: AppContext, services: TurnServices, turn: Turn) -> JsonObject:
    """Generate, record and return the response object; a failed generation raises its error after recording."""
    in_progress = response_object(turn.draft, Outcome(status=Status.IN_PROGRESS))
    with context.responses.running(turn.draft.id, in_progress) as entry:
        assembler = OutputAssembler(context.state.tool_format, turn.request.template_tools)
        failure: Refused | None = None
        prefix = [turn.compaction_item] if turn.compaction_item else []
        try:
            finished = await _generate(context, turn, entry, assembler)
            _, calls = assembler.finish()
            outcome = finished_outcome(finished, [*prefix, *assembler.output_items(calls)])
        except GenerationCancelled:
            outcome = Outcome(status=Status.CANCELLED, output=[*prefix, *_partial_output(assembler)])
        except Refused as refused:
            failure = refused
            outcome = failed_outcome(refused.failure, [*prefix, *_partial_output(assembler)])
        final = await record(services, turn.draft, outcome, turn.rendered)
        entry.finish(final)
    if failure is not None:
        raise failure
    return final


async def run_streamed(
    context: AppContext, services: TurnServices, plan: Plan, turn: Turn | None, emit: EventWriter
) -> AsyncIterator[bytes]:
    """The full event sequence OpenAI clients expect, ending with the terminal event of the stored response.

    `turn` is None when an automatic compaction is due: it runs here, inside the stream."""
    draft = plan.draft
    in_progress = response_object(draft, Outcome(status=Status.IN_PROGRESS))
    with context.responses.running(draft.id, in_progress) as entry:
        yield emit("response.created", response=in_progress)
        yield emit("response.in_progress", response=in_progress)
        prefix: list[JsonObject] = []
        if turn is None:
            item_id = new_id("cmp")
            started = {"id": item_id, "type": "compaction", "encrypted_content": ""}
            yield emit("response.output_item.added", output_index=0, item=started)
            yield emit("response.compaction.compacting", item_id=item_id, output_index=0)
            try:
                turn = await admit_turn(services, plan, await compact(services, plan), compaction_id=item_id)
            except Refused as refused:
                final = await record(services, draft, failed_outcome(refused.failure, []), None)
                entry.finish(final)
                yield emit("response.failed", response=final)
                return
            assert turn.compaction_item is not None
            prefix = [turn.compaction_item]
            yield emit("response.output_item.done", output_index=0, item=turn.compaction_item)
        message = _StreamedMessage(emit, output_index=len(prefix))
        result: list[Outcome] = []
        async for chunk in _streamed_output(context, turn, entry, message, result):
            yield chunk
        outcome = result[0]
        output = [*prefix, *outcome.output]
        if message.opened:
            for chunk in message.close(outcome.output[0]):
                yield chunk
        for index, item in enumerate(output):
            if item["type"] == "function_call":
                for chunk in _function_call_events(emit, index, item):
                    yield chunk
        final = await record(services, draft, replace(outcome, output=output), turn.rendered)
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
            raise Refused(_ended_without_result())
        output = [assembler.message(message.id)] if message.opened else []
        calls_output = [item for item in assembler.output_items(calls) if item["type"] == "function_call"]
        result.append(finished_outcome(finished, output + calls_output))
    except GenerationCancelled:
        result.append(Outcome(status=Status.CANCELLED, output=message.partial(assembler)))
    except Refused as refused:
        result.append(failed_outcome(refused.failure, message.partial(assembler)))


class _StreamedMessage:
    """The assistant message item of a stream: opened at its first text, closed once the generation ends."""

    def __init__(self, emit: EventWriter, output_index: int) -> None:
        self._emit = emit
        self._index = output_index
        self.id = new_id("msg")
        self.opened = False

    def delta(self, text: str, logprobs: list[JsonObject]) -> list[bytes]:
        chunks = [] if self.opened else self._open()
        chunks.append(
            self._emit(
                "response.output_text.delta",
                item_id=self.id,
                output_index=self._index,
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
        where = {"item_id": self.id, "output_index": self._index, "content_index": 0}
        return [
            self._emit("response.output_text.done", **where, text=part["text"], logprobs=part["logprobs"]),
            self._emit("response.content_part.done", **where, part=part),
            self._emit("response.output_item.done", output_index=self._index, item=item),
        ]

    def _open(self) -> list[bytes]:
        self.opened = True
        item = {"id": self.id, "type": "message", "role": "assistant", "status": "in_progress", "content": []}
        part = text_part("output_text", "")
        return [
            self._emit("response.output_item.added", output_index=self._index, item=item),
            self._emit(
                "response.content_part.added", item_id=self.id, output_index=self._index, content_index=0, part=part
            ),
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
    raise Refused(_ended_without_result())


def _ended_without_result() -> RequestFailed:
    return RequestFailed(kind=FailureKind.INTERNAL, message=ENDED_WITHOUT_RESULT, code=FailureCode.GENERATION_FAILED)


def _partial_output(assembler: OutputAssembler) -> list[JsonObject]:
    return [assembler.message(status="incomplete")] if assembler.text else []
