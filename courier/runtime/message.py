"""What every actor message carries: the sender's trace context, captured when the message is built.

So the receiving actor's span joins the request's trace without any code at the
call site. A message that expects an answer also has a `reply` stream (see
`runtime/actor.py`), and may define `failed(error, actor)`: the answer its asker
gets when handling it raised unexpectedly (without it the stream is just closed).
The vocabulary itself lives in `courier/messages/`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, TypeAlias, TypeVar, runtime_checkable

from anyio.streams.memory import MemoryObjectSendStream

from courier.runtime.tracing import TraceCarrier, current_carrier

Reply = TypeVar("Reply")
ReplyStream: TypeAlias = MemoryObjectSendStream[Reply]


@dataclass(frozen=True, slots=True, kw_only=True)
class Message:
    trace: TraceCarrier = field(default_factory=current_carrier)


@runtime_checkable
class Discardable(Protocol):
    """A reply that holds a resource (an admitted generation's event stream): when nobody receives it (its asker
    was cancelled, a client that went away), `discard` releases what it holds, so the work behind it stops."""

    def discard(self) -> None: ...
