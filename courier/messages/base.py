"""What every message carries, and the typed failure a request can end in.

Messages are frozen, slotted, keyword-only dataclasses. Each one captures the
sender's trace context when it is built, so the receiving actor's span joins the
request's trace without any code at the call site.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import NewType, TypeAlias, TypeVar

from anyio.streams.memory import MemoryObjectSendStream

from courier.runtime.tracing import TraceCarrier, current_carrier

RequestId = NewType("RequestId", str)
Reply = TypeVar("Reply")
ReplyStream: TypeAlias = MemoryObjectSendStream[Reply]


@dataclass(frozen=True, slots=True, kw_only=True)
class Message:
    trace: TraceCarrier = field(default_factory=current_carrier)


class FailureKind(Enum):
    """Why a request failed; `http/` turns each kind into a status code."""

    INVALID_REQUEST = "invalid_request"
    OVERLOADED = "overloaded"
    UNAVAILABLE = "unavailable"
    INTERNAL = "internal"
    UPSTREAM = "upstream"  # the model's own output was unusable (an empty or cut-off summary)


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestFailed:
    """A per-request failure reply: the actor that sends it keeps serving."""

    kind: FailureKind
    message: str
    param: str | None = None
    code: str | None = None
