"""The typed failure a request can end in, and the shape of a message that asks for an answer.

A `Request[R]` is answered on its own `reply` stream with an `R` or a
`RequestFailed`; `messages/asking.py` turns that into a return value or a
`Refused` exception for code outside the actors.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Generic, TypeVar

from courier.core.failure_codes import FailureCode
from courier.runtime.message import Message, ReplyStream

R = TypeVar("R")


class FailureKind(Enum):
    """Why a request failed, as a class of failure; `http/errors.py` turns each kind into a status code."""

    INVALID_REQUEST = "invalid_request"
    NOT_FOUND = "not_found"
    OVERLOADED = "overloaded"
    UNAVAILABLE = "unavailable"
    INTERNAL = "internal"
    # The model's own output was unusable (an empty or cut-off summary). Greedy, so the same request fails alike:
    # a 4xx, never a status the SDKs retry.
    UNUSABLE_OUTPUT = "unusable_output"
    TIMEOUT = "timeout"  # the request ran past its deadline


# The code of a failure that names none of its own.
CODE_OF_KIND = {
    FailureKind.INVALID_REQUEST: FailureCode.INVALID_REQUEST,
    FailureKind.NOT_FOUND: FailureCode.NOT_FOUND,
    FailureKind.OVERLOADED: FailureCode.QUEUE_FULL,
    FailureKind.UNAVAILABLE: FailureCode.SERVICE_UNAVAILABLE,
    FailureKind.INTERNAL: FailureCode.INTERNAL_ERROR,
    FailureKind.UNUSABLE_OUTPUT: FailureCode.COMPACTION_FAILED,
    FailureKind.TIMEOUT: FailureCode.DEADLINE_EXCEEDED,
}


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestFailed:
    """A per-request failure reply: the actor that sends it keeps serving."""

    kind: FailureKind
    message: str
    param: str | None = None
    code: FailureCode | None = None  # None: its kind's (`failure_code`)

    @property
    def failure_code(self) -> FailureCode:
        """The code the client is told: its own, or its kind's."""
        return self.code if self.code is not None else CODE_OF_KIND[self.kind]


@dataclass(frozen=True, slots=True, kw_only=True)
class Request(Message, Generic[R]):
    """A message answered with one `R`, or a `RequestFailed`, on its own reply stream."""

    reply: ReplyStream[R | RequestFailed]

    def failed(self, error: Exception, actor: str) -> RequestFailed:
        """What the asker is told when handling this raised unexpectedly (`runtime/faults.py`): a 500."""
        message = (
            f"internal error in the {actor.replace('_', ' ')} ({type(error).__name__}); "
            "the server logged it and keeps serving"
        )
        return RequestFailed(kind=FailureKind.INTERNAL, message=message, code=FailureCode.INTERNAL_ERROR)
