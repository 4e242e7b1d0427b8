"""Reading one message's generation: the reply's parts as they come (through `http/reply.py`, the reasoning split
and tool-call parsing chat and the Responses API share), its thinking budget, and how it ended.

`MessageRun.parts` yields each piece of reasoning and text as it is read (and an `Idle` whenever the stream would
be silent for `idle_s`, the cue for a keep-alive); once it is exhausted, `outcome` says what ended the reply: the
calls it made, its `stop_reason` and `stop_sequence`, and its usage.

Which stop sequence ended a reply is not among the engine's events (it reports a stop, the string taken out), so
when a request has stop sequences and its reply stopped, the reply's tokens are detokenized once more and the stop
sequence found after the text it sent.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from dataclasses import dataclass

from courier.core.failure_codes import FailureCode
from courier.core.tools.calls import ToolCall
from courier.engine.generation import FinishReason, GenerationFinished, TokensGenerated
from courier.http.anthropic import thinking_budget
from courier.http.anthropic.message import Usage, stop_reason
from courier.http.anthropic.request import MessagesRequest
from courier.http.context import AppContext
from courier.http.reply import ReplyAssembler, ReplyDelta, reply_parsing
from courier.messages.asking import Refused, call
from courier.messages.generation_reader import Idle, ended_without_result, events_or_idle
from courier.messages.ingress import Admitted
from courier.messages.token_counter import Detokenize


@dataclass(frozen=True, slots=True, kw_only=True)
class Outcome:
    calls: list[ToolCall]
    stop_reason: str
    stop_sequence: str | None
    usage: Usage


@dataclass(slots=True)
class _Generation:
    """What one generation wrote: its tokens (end-of-sequence tokens aside) and its raw text."""

    admitted: Admitted
    token_ids: list[int]
    texts: list[str]
    finished: GenerationFinished | None = None


class MessageRun:
    def __init__(
        self, context: AppContext, request: MessagesRequest, admitted: Admitted, tenant: str, deadline: float
    ) -> None:
        self._context = context
        self._request = request
        self._tenant = tenant  # read before a stream begins: a continuation is admitted for it
        self._deadline = deadline  # the whole message's (`time.monotonic()`), a continuation's too
        generation = request.generation
        self.reply = ReplyAssembler(reply_parsing(context.state, admitted, generation.tools, generation.output))
        self._first = _Generation(admitted, [], [])
        self._closing: tuple[int, ...] = ()  # the tokens that closed a reasoning block over its budget
        self._outcome: Outcome | None = None

    @property
    def prompt_tokens(self) -> int:
        return self._first.admitted.prompt_tokens

    @property
    def outcome(self) -> Outcome:
        assert self._outcome is not None, "read `parts` to the end first"
        return self._outcome

    async def parts(self, idle_s: float | None = None) -> AsyncGenerator[ReplyDelta | Idle, None]:
        first = self._first
        last = first
        async with aclosing(self._read(first, idle_s, budget=self._budget())) as reading:
            async for part in reading:
                yield part
        if first.finished is None:  # its reasoning reached the budget: the block is closed, the answer follows
            text, self._closing = await thinking_budget.closing_tokens(self._context)
            yield self.reply.feed(TokensGenerated(text=text, token_ids=self._closing))
            written = (*first.token_ids, *self._closing)
            room = first.admitted.max_tokens - len(written)
            admitted = await thinking_budget.continuation(
                self._context, self._request, written, room, tenant=self._tenant, deadline=self._deadline
            )
            if admitted is not None:
                last = _Generation(admitted, [], [])
                try:
                    async with aclosing(self._read(last, idle_s, budget=None)) as reading:
                        async for part in reading:
                            yield part
                except Refused as refused:
                    if refused.failure.code is not FailureCode.DEADLINE_EXCEEDED:
                        raise
                    # The deadline came before the answer's first token: the message has written its thinking,
                    # and work done is not thrown away at a deadline. It ends cut there, as any reply its
                    # deadline cuts.
                    last.finished = GenerationFinished(
                        reason=FinishReason.LENGTH,
                        prompt_tokens=admitted.prompt_tokens,
                        completion_tokens=0,
                        deadline=True,
                    )
        rest, calls = self.reply.finish(cut=self._cut(last))
        if rest.reasoning or rest.content:
            yield rest
        stop_sequence = await self._stop_sequence(last, calls)
        self._outcome = Outcome(
            calls=calls,
            stop_reason=stop_reason(
                cut=self._cut(last), calls=calls, stop_sequence=stop_sequence, window_capped=self._window_capped(last)
            ),
            stop_sequence=stop_sequence,
            usage=self._usage(last),
        )

    def _budget(self) -> int | None:
        budget = self._request.thinking.budget_tokens
        if budget is None or not thinking_budget.enforced(self._context, self._request):
            return None
        return budget

    async def _read(
        self, generation: _Generation, idle_s: float | None, *, budget: int | None
    ) -> AsyncGenerator[ReplyDelta | Idle, None]:
        """Feed one generation's events into the reply; with a `budget`, stop reading (leaving `finished` None) once
        the reasoning block has spent it without closing."""
        timeout = max(0.0, self._deadline - time.monotonic())  # what is left of the message's own
        events = events_or_idle(generation.admitted, timeout, idle_s=idle_s)
        async with aclosing(events):
            async for event in events:
                if isinstance(event, Idle):
                    yield event
                    continue
                if isinstance(event, GenerationFinished):
                    generation.finished = event
                    return
                generation.token_ids.extend(event.token_ids)
                generation.texts.append(event.text)
                yield self.reply.feed(event)
                if budget is not None and self.reply.reasoning_tokens >= budget and not self.reply.reasoning_closed:
                    return
        raise Refused(ended_without_result())  # the events ended before a finish

    def _window_capped(self, last: _Generation) -> bool:
        """The context left less room than the request's `max_tokens` (which admission capped to fit), and the
        reply was cut there, not at its deadline (`--request-timeout` cuts a reply as a length cut too)."""
        capped = self._first.admitted.max_tokens < self._request.generation.sampling.max_tokens
        return capped and not (last.finished is not None and last.finished.deadline)

    def _cut(self, last: _Generation) -> bool:
        return last.finished is None or last.finished.reason is FinishReason.LENGTH

    async def _stop_sequence(self, last: _Generation, calls: Sequence[ToolCall]) -> str | None:
        stops = self._request.generation.sampling.stop
        finished = last.finished
        if not stops or calls or finished is None or finished.reason is not FinishReason.STOP:
            return None
        tokens = tuple(last.token_ids)
        decoded = await call(self._context.outboxes.token_counter, lambda reply: Detokenize(tokens=tokens, reply=reply))
        return reached_stop(decoded.text, "".join(last.texts), stops)

    def _usage(self, last: _Generation) -> Usage:
        first = self._first
        finished = last.finished
        if last is first:
            output = finished.completion_tokens if finished is not None else len(first.token_ids)
        else:
            written = len(first.token_ids) + len(self._closing)
            output = written + (finished.completion_tokens if finished is not None else 0)
        return Usage(
            prompt_tokens=first.admitted.prompt_tokens,
            output_tokens=output,
            # A continuation's own hit covers the prompt the first generation prefilled: not what the cache served
            # the message, which the first generation, left before it finished, never reported.
            cached_tokens=finished.cached_tokens if finished is not None and last is first else 0,
            thinking_tokens=self.reply.reasoning_tokens,
        )


def reached_stop(decoded: str, sent: str, stops: Sequence[str]) -> str | None:
    """The stop sequence a reply stopped at: the one found earliest in its decoded tokens past the text it sent
    (None: an end-of-sequence token ended it)."""
    start = len(sent) if decoded.startswith(sent) else 0
    found = [(index, stop) for stop in stops if (index := decoded.find(stop, start)) >= 0]
    return min(found)[1] if found else None
