"""Asking an actor from a route: a busy or stopped actor becomes a retryable 503."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from anyio.streams.memory import MemoryObjectSendStream

from courier.http.errors import ApiError
from courier.messages.base import Message, RequestFailed
from courier.runtime.actor import ActorBusy, ActorStopped, ask

M = TypeVar("M", bound=Message)
R = TypeVar("R")


async def ask_actor(
    outbox: MemoryObjectSendStream[M],
    build: Callable[[MemoryObjectSendStream[R | RequestFailed]], M],
    expected: type[R],
) -> R:
    """Ask, and return the reply if it is an `expected`; a `RequestFailed` raises its ApiError."""
    try:
        reply = await ask(outbox, build)
    except ActorBusy:
        raise ApiError.unavailable("the server is busy; retry shortly", code="overloaded") from None
    except ActorStopped:
        raise ApiError.unavailable("the server is shutting down", code="shutting_down") from None
    if isinstance(reply, RequestFailed):
        raise ApiError.from_failure(reply)
    if not isinstance(reply, expected):
        raise TypeError(f"expected {expected.__name__}, got {type(reply).__name__}")
    return reply
