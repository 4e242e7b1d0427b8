"""Asking the storage actor from a route: a refusal becomes its OpenAI error, a busy actor a retryable 503."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from courier.http.context import AppContext
from courier.http.errors import ApiError
from courier.messages.base import ReplyStream, RequestFailed
from courier.messages.storage import StorageRequest
from courier.runtime.actor import ActorBusy, ActorStopped, ask

R = TypeVar("R")


async def ask_storage(context: AppContext, build: Callable[[ReplyStream[R | RequestFailed]], StorageRequest[R]]) -> R:
    try:
        reply = await ask(context.outboxes.storage, build)
    except ActorBusy:
        raise ApiError.unavailable("the storage is busy; retry shortly", code="overloaded") from None
    except ActorStopped:
        raise ApiError.unavailable("the server is shutting down", code="shutting_down") from None
    if isinstance(reply, RequestFailed):
        raise ApiError.from_failure(reply)
    return reply
