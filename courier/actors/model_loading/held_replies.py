"""The model registry's replies: those held until a model's load or unload ends, and the failures it answers with.

A reply is sent without waiting; a lease whose asker has gone is given back at once, so a model is never held by a
request no one reads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
from anyio.streams.memory import MemoryObjectSendStream

from courier.core.failure_codes import FailureCode
from courier.messages.base import FailureKind, RequestFailed
from courier.messages.model_registry import LoadResult, ModelLease
from courier.model.catalog import ModelCatalog
from courier.runtime.tracing import TraceCarrier


@dataclass(slots=True)
class HeldReplies:
    """Replies held until a model's load ends: a request's lease (`keep_alive` resolved) or an operator's answer;
    and an operator's unloads, until its unload ends."""

    leases: list[tuple[MemoryObjectSendStream[Any], float]] = field(default_factory=list)
    operators: list[MemoryObjectSendStream[Any]] = field(default_factory=list)
    unloads: list[MemoryObjectSendStream[Any]] = field(default_factory=list)
    trace: TraceCarrier = field(default_factory=dict)  # the first asker's: the load's span joins its trace

    def want_load(self) -> bool:
        """Someone waits for the model to load."""
        return bool(self.leases or self.operators)

    def loaded(self, lease: Callable[[float], ModelLease], result: LoadResult) -> None:
        """The model loaded: each request gets its lease (`lease(keep_alive)`), each operator `result`."""
        for reply, keep_alive in self.leases:
            answer(reply, lease(keep_alive), close=True)
        for reply in self.operators:
            answer(reply, result, close=True)
        self.leases.clear()
        self.operators.clear()

    def fail(self, failure: RequestFailed) -> None:
        """The model will not load: everyone waiting for it gets `failure`."""
        for reply in (*(reply for reply, _ in self.leases), *self.operators):
            answer(reply, failure, close=True)
        self.leases.clear()
        self.operators.clear()

    def unloaded(self, result: LoadResult) -> None:
        for reply in self.unloads:
            answer(reply, result, close=True)
        self.unloads.clear()


def answer(reply: MemoryObjectSendStream[Any], value: Any, close: bool = False) -> None:
    """Send one reply; a lease whose asker has gone is given back at once."""
    try:
        reply.send_nowait(value)
    except (anyio.WouldBlock, anyio.ClosedResourceError, anyio.BrokenResourceError):
        if isinstance(value, ModelLease):
            value.release()
    finally:
        if close:
            reply.close()


def not_found(name: str, catalog: ModelCatalog) -> RequestFailed:
    served = [model.model_id for model in catalog.models]
    shown = ", ".join(f"'{model_id}'" for model_id in served[:8]) + (", ..." if len(served) > 8 else "")
    return RequestFailed(
        kind=FailureKind.NOT_FOUND,
        message=f"The model '{name}' does not exist; this server serves {shown}",
        param="model",
        code=FailureCode.MODEL_NOT_FOUND,
    )


def not_loaded(model_id: str) -> RequestFailed:
    message = f"the model '{model_id}' is not loaded"
    return RequestFailed(kind=FailureKind.UNAVAILABLE, message=message, code=FailureCode.MODEL_NOT_LOADED)


def load_failed(model_id: str, reason: str) -> RequestFailed:
    return RequestFailed(
        kind=FailureKind.UNAVAILABLE,
        message=f"the model '{model_id}' could not be loaded: {reason}",
        param="model",
        code=FailureCode.MODEL_LOAD_FAILED,
    )


def too_large(model_id: str, reason: str) -> RequestFailed:
    return RequestFailed(
        kind=FailureKind.UNAVAILABLE,
        message=f"the model '{model_id}' cannot be loaded within --models-memory-bytes: {reason}",
        param="model",
        code=FailureCode.MODEL_TOO_LARGE,
    )
