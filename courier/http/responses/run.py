"""Running one `/v1/responses` turn: the generation, whole or streamed, and its recorded outcome.

A streamed turn whose automatic compaction is due compacts inside the stream
(the compaction item's `output_item.added`, `response.compaction.compacting`,
`output_item.done`), then admits and streams the answer; a failure there ends the
stream with `response.failed`. The finished response is stored before the
client is told (`conversation/record.py`), and a store that fails is not a
success: a whole response answers the store's failure (503 `storage_unavailable`,
400 `storage_budget_exceeded`), a streamed one ends with `response.failed`
carrying it.

A streamed response announces its id (`response.created`) before it is generated.
A client that disconnects mid-stream closes the event generator, or cancels its
task while it waits; either way what was generated so far is recorded as a
`cancelled` response (its generation's own outcome if that had already ended),
shielded from the teardown and bounded in time, so the announced id can be read
back. A response whose recording had begun is never recorded twice.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from dataclasses import replace
from typing import cast

import anyio

from courier.conversation.items import new_id, text_part
from courier.conversation.record import Recorded, record
from courier.conversation.response_object import (
    TERMINAL_EVENTS,
    Outcome,
    ResponseDraft,
    Status,
    failed_outcome,
    finished_outcome,
    response_object,
)
from courier.conversation.turn import Plan, Rendered, Turn, TurnServices, admit_turn, compact
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

logger = logging.getLogger(__name__)

# How long recording a stream its client abandoned may hold up the request's teardown (one storage write).
ABANDONED_RECORD_TIMEOUT_S = 5.0


async def run_whole(context: AppContext, services: TurnServices, turn: Turn) -> JsonObject:
    """Generate, record and return the response object; a failed generation raises its error after recording, and
    so does a failed store."""
    in_progress = response_object(turn.draft, Outcome(status=Status.IN_PROGRESS))
    with context.responses.running(turn.draft.id, in_progress, services.tenant) as entry:
        assembler = OutputAssembler(context.state.tool_format, turn.request.template_tools, turn.request.output)
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
        recorded = await record(services, turn.draft, outcome, turn.rendered)
        entry.finish(recorded.response)
    if failure is not None:
        raise failure
    if recorded.failure is not None:
        raise Refused(recorded.failure)
    return recorded.response


async def run_streamed(
    context: AppContext, services: TurnServices, plan: Plan, turn: Turn | None, emit: EventWriter
) -> AsyncIterator[bytes]:
    """The full event sequence OpenAI clients expect, ending with the terminal event of the stored response.

    `turn` is None when an automatic compaction is due: it runs here, inside the stream. The stream may be closed, or
    its task cancelled, at any of its awaits or yields: that is a client that disconnected."""
    in_progress = response_object(plan.draft, Outcome(status=Status.IN_PROGRESS))
    with context.responses.running(plan.draft.id, in_progress, services.tenant) as entry:
        stream = _Stream(context, services, plan.draft, entry, emit)
        try:
            async with aclosing(stream.events(plan, turn, in_progress)) as events:
                async for chunk in events:
                    yield chunk
        except (GeneratorExit, anyio.get_cancelled_exc_class()):
            await stream.abandoned()
            raise


class _Stream:
    """One streamed turn: its events, and what it has produced so far, which is what an abandoned stream records."""

    def __init__(
        self,
        context: AppContext,
        services: TurnServices,
        draft: ResponseDraft,
        entry: InFlightResponse,
        emit: EventWriter,
    ) -> None:
        self._context = context
        self._services = services
        self._draft = draft
        self._entry = entry
        self._emit = emit
        self._prefix: list[JsonObject] = []  # the automatic compaction's item, once it is done
        self._message: _StreamedMessage | None = None
        self._generated: Outcome | None = None  # the generation's outcome, once it has ended
        self._recording = False  # its store has been sent: it must not be sent again

    async def events(self, plan: Plan, turn: Turn | None, in_progress: JsonObject) -> AsyncGenerator[bytes]:
        emit = self._emit
        yield emit("response.created", response=in_progress)
        yield emit("response.in_progress", response=in_progress)
        if turn is None:
            item_id = new_id("cmp")
            started = {"id": item_id, "type": "compaction", "encrypted_content": ""}
            yield emit("response.output_item.added", output_index=0, item=started)
            yield emit("response.compaction.compacting", item_id=item_id, output_index=0)
            try:
                compacted = await compact(self._services, plan)
                turn = await admit_turn(self._services, plan, compacted, compaction_id=item_id)
            except Refused as refused:
                failed = await self._record(failed_outcome(refused.failure, []), None)
                yield emit("response.failed", response=failed.response)
                return
            assert turn.compaction_item is not None
            self._prefix = [turn.compaction_item]
            yield emit("response.output_item.done", output_index=0, item=turn.compaction_item)
        assembler = OutputAssembler(self._context.state.tool_format, turn.request.template_tools, turn.request.output)
        message = self._message = _StreamedMessage(emit, len(self._prefix), assembler)
        async with aclosing(self._generation(turn, message)) as chunks:
            async for chunk in chunks:
                yield chunk
        assert self._generated is not None
        outcome = replace(self._generated, output=[*self._prefix, *self._generated.output])
        if message.opened:
            for chunk in message.close(self._generated.output[0]):
                yield chunk
        for index, item in enumerate(outcome.output):
            if item["type"] == "function_call":
                for chunk in _function_call_events(emit, index, item):
                    yield chunk
        final = (await self._record(outcome, turn.rendered)).response
        yield emit(TERMINAL_EVENTS[Status(final["status"])], response=final)

    async def abandoned(self) -> None:
        """The client left before the terminal event: record what exists, unless recording has begun already.

        Runs while the request's task is torn down (a cancellation, or the stream being closed), hence shielded,
        and bounded so a stuck store cannot hold the teardown."""
        if self._recording:
            return
        so_far = self._so_far()
        with anyio.move_on_after(ABANDONED_RECORD_TIMEOUT_S, shield=True):
            recorded = await self._record(so_far, None)
            if recorded.failure is None and self._draft.request.store:
                logger.info(
                    "response %s: the client disconnected mid-stream; stored as %s",
                    self._draft.id,
                    recorded.response["status"],
                )
            return
        logger.warning(
            "response %s: the client disconnected mid-stream and recording it took over %g s",
            self._draft.id,
            ABANDONED_RECORD_TIMEOUT_S,
        )

    async def _record(self, outcome: Outcome, rendered: Rendered | None) -> Recorded:
        self._recording = True
        recorded = await record(self._services, self._draft, outcome, rendered)
        self._entry.finish(recorded.response)
        return recorded

    def _so_far(self) -> Outcome:
        if self._generated is not None:
            return replace(self._generated, output=[*self._prefix, *self._generated.output])
        partial = self._message.partial() if self._message is not None else []
        return Outcome(status=Status.CANCELLED, output=[*self._prefix, *partial])

    async def _generation(self, turn: Turn, message: _StreamedMessage) -> AsyncGenerator[bytes]:
        """Text deltas as they are generated; the outcome (finished, cancelled or failed) goes to `_generated`."""
        assembler = message.assembler
        try:
            finished: GenerationFinished | None = None
            timeout_s = self._context.settings.request_timeout
            # Closed as soon as this stops reading, which takes the request out of the batch before anything else.
            events = cast(
                AsyncGenerator[TokensGenerated | GenerationFinished],
                generated_events(turn.admitted, timeout_s, self._entry.cancellation),
            )
            async with aclosing(events):
                async for event in events:
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
            self._generated = finished_outcome(finished, output + calls_output)
        except GenerationCancelled:
            self._generated = Outcome(status=Status.CANCELLED, output=message.partial())
        except Refused as refused:
            self._generated = failed_outcome(refused.failure, message.partial())


class _StreamedMessage:
    """The assistant message item of a stream: opened at its first text, closed once the generation ends."""

    def __init__(self, emit: EventWriter, output_index: int, assembler: OutputAssembler) -> None:
        self._emit = emit
        self._index = output_index
        self.assembler = assembler
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

    def partial(self) -> list[JsonObject]:
        """The message cut short by a cancellation, a failure or a disconnect (nothing if no text was streamed)."""
        return [self.assembler.message(self.id, status="incomplete")] if self.opened else []

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
