"""Asking an actor for one answer from outside its inbox loop: the answer, or `Refused` with the typed failure.

Routes, a Responses turn and actors asking their neighbours all use `call`. A
`RequestFailed` reply raises `Refused` carrying it; an actor whose inbox is full
or that has stopped is refused as unavailable (503, `overloaded` or
`shutting_down`), so a caller never waits for inbox room and never hangs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar, cast

from anyio.streams.memory import MemoryObjectSendStream

from courier.core.failure_codes import FailureCode
from courier.messages.base import FailureKind, Request, RequestFailed
from courier.runtime.actor import ActorBusy, ActorStopped, ask
from courier.runtime.message import Message, ReplyStream

R = TypeVar("R")
M = TypeVar("M", bound=Message)

BUSY = RequestFailed(
    kind=FailureKind.UNAVAILABLE, message="the server is busy; retry shortly", code=FailureCode.OVERLOADED
)
STOPPED = RequestFailed(
    kind=FailureKind.UNAVAILABLE, message="the server is shutting down", code=FailureCode.SHUTTING_DOWN
)


class Refused(Exception):
    """A request ended in a typed failure; `http/` answers it with the failure's status and envelope."""

    def __init__(self, failure: RequestFailed) -> None:
        super().__init__(failure.message)
        self.failure = failure


async def call(outbox: MemoryObjectSendStream[M], build: Callable[[ReplyStream[R | RequestFailed]], Request[R]]) -> R:
    """Send `build(reply_stream)` (a message the outbox's actor handles) and return its answer; a failure, a full
    inbox or a stopped actor is `Refused`."""

    def message(reply: ReplyStream[R | RequestFailed]) -> M:
        return cast(M, build(reply))

    try:
        reply: R | RequestFailed = await ask(outbox, message)
    except ActorBusy:
        raise Refused(BUSY) from None
    except ActorStopped:
        raise Refused(STOPPED) from None
    if isinstance(reply, RequestFailed):
        raise Refused(reply)
    return reply
