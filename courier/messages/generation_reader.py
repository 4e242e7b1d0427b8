"""Reading one admitted generation's events: the deadline, cancellation, and every way it can end.

`generated_events` yields text events until the terminal `GenerationFinished`,
honouring a `Cancellation` (`events_or_idle` also says when none came for a while, for a stream's keep-alives);
a failure is `Refused` with its typed failure (504 when
the deadline came before the first token, 503 when the server cut it while shutting
down, else 500), a cancellation `GenerationCancelled`. The scheduler ends a
generation at its deadline (`AdmitGeneration.deadline`), keeping what it wrote as a
length cut; the reader's own deadline, `ENGINE_GRACE_S` later, only catches an
engine that stopped answering. It always
closes the event stream on the way out, which is what takes an abandoned or
cancelled request out of the batch. `collect` gathers a whole generation. Used by
every route that generates and by the compactor's summary alike.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass

import anyio

from courier.core.failure_codes import FailureCode
from courier.engine.generation import GenerationFailed, GenerationFinished, TokenLogprob, TokensGenerated
from courier.messages.asking import Refused
from courier.messages.base import FailureKind, RequestFailed
from courier.messages.ingress import Admitted

ENDED_WITHOUT_RESULT = "the generation ended without a result"
ABANDON_POLL_S = 0.25
# The scheduler ends a generation at its deadline, between two steps: the reader waits this much longer before it
# gives up on the engine itself (a step on a CPU can take seconds).
ENGINE_GRACE_S = 30.0


class GenerationCancelled(Exception):
    """The generation was cancelled on request (it has left the batch)."""


class Cancellation:
    """A request to stop one generation from another task (`POST /v1/responses/{id}/cancel`), or, with
    `abandoned`, whenever nobody waits for its result any more (checked every `ABANDON_POLL_S`).

    The task reading the generation's events watches its wait for the next event; `request` cancels that wait,
    and the reader raises `GenerationCancelled` and closes the event stream.
    """

    def __init__(self, abandoned: Callable[[], bool] | None = None) -> None:
        self._requested = False
        self._waiting: anyio.CancelScope | None = None
        self._abandoned = abandoned

    @property
    def requested(self) -> bool:
        return self._requested or (self._abandoned is not None and self._abandoned())

    @property
    def polled(self) -> bool:
        return self._abandoned is not None

    def request(self) -> None:
        self._requested = True
        if self._waiting is not None:
            self._waiting.cancel()

    def watch(self, scope: anyio.CancelScope | None) -> None:
        """The scope of the wait for the next event (None once it is over): cancelling interrupts it."""
        self._waiting = scope


@dataclass(frozen=True, slots=True, kw_only=True)
class Collected:
    text: str
    logprobs: list[TokenLogprob]
    finished: GenerationFinished


@dataclass(frozen=True, slots=True)
class Idle:
    """No event came for the `idle_s` asked for (the request is queued, or prefilling a long prompt): a stream's cue
    to send a keep-alive."""

    seconds: float


async def generated_events(
    admitted: Admitted,
    timeout_s: float,
    cancellation: Cancellation | None = None,
    *,
    grace_s: float = ENGINE_GRACE_S,
) -> AsyncIterator[TokensGenerated | GenerationFinished]:
    """Events until `GenerationFinished` (the last of them, for a request of several samples); a failure, or no
    finish by `timeout_s` + `grace_s`, raises `Refused`, a cancellation `GenerationCancelled`. A caller that keeps
    nothing of a reply cut at its deadline (the compactor's summary) waits no grace."""
    async with aclosing(events_or_idle(admitted, timeout_s, cancellation, grace_s=grace_s)) as events:
        async for event in events:
            assert not isinstance(event, Idle), "asked for no idle_s"
            yield event


async def events_or_idle(
    admitted: Admitted,
    timeout_s: float,
    cancellation: Cancellation | None = None,
    *,
    grace_s: float = ENGINE_GRACE_S,
    idle_s: float | None = None,
) -> AsyncGenerator[TokensGenerated | GenerationFinished | Idle, None]:
    """`generated_events`, with an `Idle` each time `idle_s` seconds pass without an event (None: never)."""
    deadline = time.monotonic() + timeout_s + grace_s
    unfinished = admitted.choices
    last_event = time.monotonic()
    with admitted.events as events:
        while True:
            if cancellation is not None and cancellation.requested:
                raise GenerationCancelled
            event = None
            with anyio.move_on_after(_wait(deadline, cancellation, idle_s)) as scope:
                if cancellation is not None:
                    cancellation.watch(scope)
                event = await _next_event(events)
            if cancellation is not None:
                cancellation.watch(None)
                if event is None and cancellation.requested:
                    raise GenerationCancelled
            if event is None and time.monotonic() < deadline:
                idle = time.monotonic() - last_event
                if idle_s is not None and idle >= idle_s:
                    last_event = time.monotonic()
                    yield Idle(idle)
                continue  # a poll for abandonment, not the deadline
            if event is None:
                message = f"the request did not finish within {timeout_s:g} s"
                raise Refused(
                    RequestFailed(kind=FailureKind.TIMEOUT, message=message, code=FailureCode.DEADLINE_EXCEEDED)
                )
            if isinstance(event, GenerationFailed):
                raise Refused(_failure(event))
            last_event = time.monotonic()
            yield event
            if isinstance(event, GenerationFinished):
                unfinished -= 1
                if not unfinished:
                    return


async def collect(admitted: Admitted, timeout_s: float, cancellation: Cancellation | None = None) -> Collected:
    texts: list[str] = []
    logprobs: list[TokenLogprob] = []
    async for event in generated_events(admitted, timeout_s, cancellation):
        if isinstance(event, TokensGenerated):
            texts.append(event.text)
            logprobs.extend(event.logprobs)
        else:
            return Collected(text="".join(texts), logprobs=logprobs, finished=event)
    raise Refused(ended_without_result())


def _wait(deadline: float, cancellation: Cancellation | None, idle_s: float | None) -> float:
    """How long to wait for the next event: until the deadline, or the next poll for abandonment or idleness."""
    wait = max(0.0, deadline - time.monotonic())
    if cancellation is not None and cancellation.polled:
        wait = min(wait, ABANDON_POLL_S)
    return wait if idle_s is None else min(wait, idle_s)


def ended_without_result() -> RequestFailed:
    """The failure of a generation whose events stopped before its (last) finish."""
    return _failure(GenerationFailed(message=ENDED_WITHOUT_RESULT))


def _failure(event: GenerationFailed) -> RequestFailed:
    kinds = {FailureCode.SHUTTING_DOWN: FailureKind.UNAVAILABLE, FailureCode.DEADLINE_EXCEEDED: FailureKind.TIMEOUT}
    return RequestFailed(kind=kinds.get(event.code, FailureKind.INTERNAL), message=event.message, code=event.code)


async def _next_event(
    events: anyio.abc.ObjectReceiveStream[TokensGenerated | GenerationFinished | GenerationFailed],
) -> TokensGenerated | GenerationFinished | GenerationFailed:
    try:
        return await events.receive()
    except anyio.EndOfStream:
        return GenerationFailed(message=ENDED_WITHOUT_RESULT)
