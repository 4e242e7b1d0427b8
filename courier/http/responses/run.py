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
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, replace

import anyio

from courier.conversation.ids import new_id
from courier.conversation.items import text_part
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
from courier.engine.generation import FinishReason, GenerationFinished, TokenLogprob
from courier.http.context import AppContext
from courier.http.model_leases import hold_generation
from courier.http.reply import ReplyParsing, assemble, reply_parsing
from courier.http.responses.events import EventWriter
from courier.http.responses.in_flight import InFlightResponse
from courier.http.responses.output import ItemShapes, OutputAssembler, logprob_objects
from courier.http.responses.tools import responses_tools
from courier.http.sse import SSE_KEEPALIVE
from courier.messages.asking import Refused
from courier.messages.compactor import CompactionResult
from courier.messages.generation_reader import GenerationCancelled, Idle, ended_without_result, events_or_idle
from courier.storage.records import JsonObject

logger = logging.getLogger(__name__)

# How long recording a stream its client abandoned may hold up the request's teardown (one storage write).
ABANDONED_RECORD_TIMEOUT_S = 5.0


def held(turn: Turn) -> Turn:
    """`turn`, its generation's events closed when the request being handled ends, however it ends."""
    hold_generation(turn.admitted)
    return turn


async def run_whole(context: AppContext, services: TurnServices, turn: Turn) -> JsonObject:
    """Generate, record and return the response object; a failed generation raises its error after recording, and
    so does a failed store."""
    in_progress = response_object(turn.draft, Outcome(status=Status.IN_PROGRESS))
    with context.responses.running(turn.draft.id, in_progress, services.tenant) as entry:
        assembler = _assembler(context, turn)
        failure: Refused | None = None
        prefix = [turn.compaction_item] if turn.compaction_item else []
        try:
            (finished,) = await assemble(
                turn.admitted, context.settings.request_timeout, [assembler], entry.cancellation
            )
            _, calls = assembler.finish(cut=finished.reason is FinishReason.LENGTH)
            output = [*prefix, *assembler.output_items(calls)]
            outcome = finished_outcome(finished, output, assembler.reasoning_tokens)
        except GenerationCancelled:
            outcome = Outcome(status=Status.CANCELLED, output=[*prefix, *assembler.partial()])
        except Refused as refused:
            failure = refused
            outcome = failed_outcome(refused.failure, [*prefix, *assembler.partial()])
        recorded = await record(services, turn.draft, outcome, turn.rendered)
        entry.finish(recorded.response)
    if failure is not None:
        raise failure
    if recorded.failure is not None:
        raise Refused(recorded.failure)
    return recorded.response


async def run_compaction(context: AppContext, services: TurnServices, plan: Plan) -> JsonObject:
    """A turn whose input asked for a compaction (`compaction_trigger`): the response holds exactly one compaction
    item, and nothing is generated after it. A failed compaction raises its error (nothing is replaced)."""
    compacted = await compact(services, plan)
    outcome = Outcome(status=Status.COMPLETED, output=[compacted.compaction_item], usage=compacted.usage)
    recorded = await record(services, plan.draft, outcome, None)
    if recorded.failure is not None:
        raise Refused(recorded.failure)
    return recorded.response


async def run_streamed(
    context: AppContext,
    services: TurnServices,
    plan: Plan,
    turn: Turn | None,
    emit: EventWriter,
    *,
    keepalive_s: float | None = None,
) -> AsyncGenerator[bytes]:
    """The full event sequence OpenAI clients expect, ending with the terminal event of the stored response.

    `turn` is None when an automatic compaction is due: it runs here, inside the stream. The stream may be closed, or
    its task cancelled, at any of its awaits or yields: that is a client that disconnected. With `keepalive_s` (server-
    sent events), an SSE comment is sent whenever the generation is silent that long (queued, or a long prefill)."""
    in_progress = response_object(plan.draft, Outcome(status=Status.IN_PROGRESS))
    with context.responses.running(plan.draft.id, in_progress, services.tenant) as entry:
        stream = _Stream(context, services, plan.draft, entry, emit, keepalive_s=keepalive_s)
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
        *,
        keepalive_s: float | None = None,
    ) -> None:
        self._context = context
        self._keepalive_s = keepalive_s
        self._services = services
        self._draft = draft
        self._entry = entry
        self._emit = emit
        self._prefix: list[JsonObject] = []  # the automatic compaction's item, once it is done
        self._items: _StreamedItems | None = None
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
                compacted = await self._compacted(plan)
                if compacted is None:  # cancelled while it compacted: nothing was replaced, nothing generated
                    final = (await self._record(Outcome(status=Status.CANCELLED, output=[]), None)).response
                    yield emit(TERMINAL_EVENTS[Status(final["status"])], response=final)
                    return
                if plan.request.compaction_requested:  # the compaction is the whole answer
                    item = {**compacted.compaction_item, "id": item_id}
                    yield emit("response.output_item.done", output_index=0, item=item)
                    done = Outcome(status=Status.COMPLETED, output=[item], usage=compacted.usage)
                    final = (await self._record(done, None)).response
                    yield emit(TERMINAL_EVENTS[Status(final["status"])], response=final)
                    return
                turn = held(await admit_turn(self._services, plan, compacted, compaction_id=item_id))
            except Refused as refused:
                failed = await self._record(failed_outcome(refused.failure, []), None)
                yield emit("response.failed", response=failed.response)
                return
            assert turn.compaction_item is not None
            self._prefix = [turn.compaction_item]
            yield emit("response.output_item.done", output_index=0, item=turn.compaction_item)
        items = self._items = _StreamedItems(emit, len(self._prefix), _assembler(self._context, turn))
        async with aclosing(self._generation(turn, items)) as chunks:
            async for chunk in chunks:
                yield chunk
        assert self._generated is not None
        outcome = replace(self._generated, output=[*self._prefix, *self._generated.output])
        for chunk in items.close(self._generated.output):
            yield chunk
        for index, item in enumerate(outcome.output):
            if item["type"] in CALL_ITEMS:
                for chunk in _call_events(emit, index, item):
                    yield chunk
        final = (await self._record(outcome, turn.rendered)).response
        yield emit(TERMINAL_EVENTS[Status(final["status"])], response=final)

    async def _compacted(self, plan: Plan) -> CompactionResult | None:
        """The automatic compaction, or None when a cancel (`POST /v1/responses/{id}/cancel`) came first: its wait
        is cancelled, and the compactor, with nobody waiting, takes the summary out of the batch."""
        cancellation = self._entry.cancellation
        if cancellation.requested:
            return None
        with anyio.CancelScope() as scope:
            cancellation.watch(scope)
            try:
                return await compact(self._services, plan)
            finally:
                cancellation.watch(None)
        return None

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
        partial = self._items.partial() if self._items is not None else []
        return Outcome(status=Status.CANCELLED, output=[*self._prefix, *partial])

    async def _generation(self, turn: Turn, items: _StreamedItems) -> AsyncGenerator[bytes]:
        """Reasoning and text deltas as they are generated; the outcome (finished, cancelled or failed) goes to
        `_generated`."""
        assembler = items.assembler
        try:
            finished: GenerationFinished | None = None
            timeout_s = self._context.settings.request_timeout
            # Closed as soon as this stops reading, which takes the request out of the batch before anything else.
            events = events_or_idle(turn.admitted, timeout_s, self._entry.cancellation, idle_s=self._keepalive_s)
            async with aclosing(events):
                async for event in events:
                    if isinstance(event, Idle):
                        yield SSE_KEEPALIVE  # a comment the openai client's responses.stream() skips
                        continue
                    if isinstance(event, GenerationFinished):
                        finished = event
                        continue
                    delta = assembler.feed(event)
                    for chunk in items.delta(delta.reasoning, delta.content, delta.logprobs):
                        yield chunk
            cut = finished is not None and finished.reason is FinishReason.LENGTH
            rest, calls = assembler.finish(cut=cut)
            for chunk in items.delta(rest.reasoning, rest.content, rest.logprobs, message=not calls):
                yield chunk
            if finished is None:
                raise Refused(ended_without_result())
            calls_output = [item for item in assembler.output_items(calls) if item["type"] in CALL_ITEMS]
            output = items.finished() + calls_output
            self._generated = finished_outcome(finished, output, assembler.reasoning_tokens)
        except GenerationCancelled:
            self._generated = Outcome(status=Status.CANCELLED, output=items.partial())
        except Refused as refused:
            self._generated = failed_outcome(refused.failure, items.partial())


class _StreamedItems:
    """The reasoning item and the assistant message item of a stream, in that order: each opened at its first
    text; the reasoning closed when the answer begins, the message once the generation ends."""

    def __init__(self, emit: EventWriter, first_index: int, assembler: OutputAssembler) -> None:
        self._emit = emit
        self.assembler = assembler
        self._reasoning = _StreamedItem(emit, _REASONING, summary=assembler.shapes.summary)
        self._message = _StreamedItem(emit, _MESSAGE)
        self._next_index = first_index

    def delta(
        self, reasoning: str, content: str, logprobs: Sequence[TokenLogprob], *, message: bool = False
    ) -> list[bytes]:
        """`message`: open the message item even without text (a reply that is neither calls nor reasoning)."""
        chunks: list[bytes] = []
        if reasoning:
            chunks += self._open(self._reasoning) + self._reasoning.delta(reasoning, [])
        wants_message = message and not self._reasoning.opened and not self._message.opened
        if content or logprobs or wants_message:
            if self._reasoning.opened and not self._reasoning.closed:
                chunks += self._reasoning.close(self.assembler.reasoning_item(self._reasoning.id))
            chunks += self._open(self._message) + self._message.delta(content, logprob_objects(logprobs))
        return chunks

    def finished(self) -> list[JsonObject]:
        """The complete items, as the response's output holds them."""
        items = [self.assembler.reasoning_item(self._reasoning.id)] if self._reasoning.opened else []
        return items + ([self.assembler.message(self._message.id)] if self._message.opened else [])

    def close(self, output: Sequence[JsonObject]) -> list[bytes]:
        """The closing events of the items still open (`output`: the generation's items, these among them)."""
        chunks: list[bytes] = []
        for item in output:
            streamed = {self._reasoning.id: self._reasoning, self._message.id: self._message}.get(item["id"])
            if streamed is not None and streamed.opened and not streamed.closed:
                chunks += streamed.close(item)
        return chunks

    def partial(self) -> list[JsonObject]:
        """What a cancellation, a failure or a disconnect cut short (nothing of an item that never opened)."""
        items = []
        if self._reasoning.opened:
            status = "completed" if self._reasoning.closed else "incomplete"
            items.append(self.assembler.reasoning_item(self._reasoning.id, status))
        if self._message.opened:
            items.append(self.assembler.message(self._message.id, status="incomplete"))
        return items

    def _open(self, item: _StreamedItem) -> list[bytes]:
        if item.opened:
            return []
        self._next_index += 1
        return item.open(self._next_index - 1)


@dataclass(frozen=True, slots=True, kw_only=True)
class _ItemKind:
    """How one kind of streamed item is announced: its id prefix, its first shape, its part and its events."""

    id_prefix: str
    started: JsonObject
    part: JsonObject
    delta_event: str
    done_event: str
    with_logprobs: bool


_MESSAGE = _ItemKind(
    id_prefix="msg",
    started={"type": "message", "role": "assistant", "status": "in_progress", "content": []},
    part=text_part("output_text", ""),
    delta_event="response.output_text.delta",
    done_event="response.output_text.done",
    with_logprobs=True,
)
_REASONING = _ItemKind(
    id_prefix="rs",
    started={"type": "reasoning", "status": "in_progress", "summary": [], "content": [], "encrypted_content": None},
    part={"type": "reasoning_text", "text": ""},
    delta_event="response.reasoning_text.delta",
    done_event="response.reasoning_text.done",
    with_logprobs=False,
)


class _StreamedItem:
    """One item of a stream, with one content part (and, for reasoning whose summary was asked for, one summary
    part beside it): opened, its deltas, closed."""

    def __init__(self, emit: EventWriter, kind: _ItemKind, *, summary: bool = False) -> None:
        self._emit = emit
        self._kind = kind
        self._summary = summary
        self.id = new_id(kind.id_prefix)
        self._index = -1
        self.opened = False
        self.closed = False

    def open(self, output_index: int) -> list[bytes]:
        self.opened = True
        self._index = output_index
        item = {"id": self.id, **self._kind.started}
        chunks = [
            self._emit("response.output_item.added", output_index=self._index, item=item),
            self._emit("response.content_part.added", **self._where(), part=self._kind.part),
        ]
        if self._summary:
            part = {"type": "summary_text", "text": ""}
            chunks.append(self._emit("response.reasoning_summary_part.added", **self._in_summary(), part=part))
        return chunks

    def delta(self, text: str, logprobs: list[JsonObject]) -> list[bytes]:
        extra = {"logprobs": logprobs} if self._kind.with_logprobs else {}
        chunks = [self._emit(self._kind.delta_event, **self._where(), delta=text, **extra)]
        if self._summary:
            chunks.append(self._emit("response.reasoning_summary_text.delta", **self._in_summary(), delta=text))
        return chunks

    def close(self, item: JsonObject) -> list[bytes]:
        self.closed = True
        part = item["content"][0]
        extra = {"logprobs": part["logprobs"]} if self._kind.with_logprobs else {}
        chunks = [
            self._emit(self._kind.done_event, **self._where(), text=part["text"], **extra),
            self._emit("response.content_part.done", **self._where(), part=part),
        ]
        if self._summary:
            summary = item["summary"][0]
            chunks.append(
                self._emit("response.reasoning_summary_text.done", **self._in_summary(), text=summary["text"])
            )
            chunks.append(self._emit("response.reasoning_summary_part.done", **self._in_summary(), part=summary))
        return [*chunks, self._emit("response.output_item.done", output_index=self._index, item=item)]

    def _where(self) -> dict[str, object]:
        return {"item_id": self.id, "output_index": self._index, "content_index": 0}

    def _in_summary(self) -> dict[str, object]:
        return {"item_id": self.id, "output_index": self._index, "summary_index": 0}


CALL_ITEMS = ("function_call", "custom_tool_call")


def _call_events(emit: EventWriter, index: int, item: JsonObject) -> list[bytes]:
    """A complete call's events: a function's arguments, or a custom tool's input, in one delta."""
    where = {"item_id": item["id"], "output_index": index}
    if item["type"] == "custom_tool_call":
        started = {**item, "status": "in_progress", "input": ""}
        middle = [
            emit("response.custom_tool_call_input.delta", **where, delta=item["input"]),
            emit("response.custom_tool_call_input.done", **where, input=item["input"]),
        ]
    else:
        started = {**item, "status": "in_progress", "arguments": ""}
        middle = [
            emit("response.function_call_arguments.delta", **where, delta=item["arguments"]),
            emit("response.function_call_arguments.done", **where, name=item["name"], arguments=item["arguments"]),
        ]
    return [
        emit("response.output_item.added", output_index=index, item=started),
        *middle,
        emit("response.output_item.done", output_index=index, item=item),
    ]


def _parsing(context: AppContext, turn: Turn) -> ReplyParsing:
    return reply_parsing(context.state, turn.admitted, turn.request.template_tools, turn.request.output)


def _assembler(context: AppContext, turn: Turn) -> OutputAssembler:
    """The reply's reader, shaping items as the request asked (its tools' call items, summaries, seals)."""
    request = turn.request
    shapes = ItemShapes(
        tools=responses_tools(list(request.tools)),
        summary=request.reasoning_summary is not None,
        seal=context.seal if request.seal_reasoning else None,
    )
    return OutputAssembler(_parsing(context, turn), shapes)
