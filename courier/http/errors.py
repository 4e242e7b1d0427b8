"""Errors with the right status, in the envelope of the API the route speaks.

OpenAI's `{"error": {"message", "type", "param", "code"}}` on its routes; Anthropic's
`{"type": "error", "error": {"type", "message"}}` on the Messages API (`/v1/messages`), where the `type` follows
the status as Anthropic's does (and Courier's `code` and `param` ride along, for clients that read them). The
status is the same in either envelope: this is the only place that chooses HTTP status codes for failures.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum
from typing import Any

import orjson
from quart import Response

from courier.core.failure_codes import FailureCode
from courier.http.request_id import current_request_id
from courier.messages.base import FailureKind, RequestFailed

INVALID_REQUEST = "invalid_request_error"
NOT_FOUND = "not_found_error"
SERVER_ERROR = "server_error"
RETRY_AFTER_SECONDS = 5

_STATUS_BY_FAILURE = {
    FailureKind.INVALID_REQUEST: 400,
    FailureKind.NOT_FOUND: 404,
    FailureKind.OVERLOADED: 429,
    FailureKind.UNAVAILABLE: 503,
    FailureKind.INTERNAL: 500,
    FailureKind.UNUSABLE_OUTPUT: 422,
    FailureKind.TIMEOUT: 504,
}
# The code of an error raised without one of its own: every envelope names a code (docs/api.md, "Errors").
CODE_BY_STATUS = {
    400: FailureCode.INVALID_REQUEST,
    401: FailureCode.INVALID_API_KEY,
    403: FailureCode.INSUFFICIENT_PERMISSIONS,
    404: FailureCode.NOT_FOUND,
    405: FailureCode.METHOD_NOT_ALLOWED,
    408: FailureCode.BODY_TIMEOUT,
    413: FailureCode.REQUEST_TOO_LARGE,
    422: FailureCode.COMPACTION_FAILED,
    429: FailureCode.QUEUE_FULL,
    500: FailureCode.INTERNAL_ERROR,
    503: FailureCode.SERVICE_UNAVAILABLE,
    504: FailureCode.DEADLINE_EXCEEDED,
}
_TYPE_BY_STATUS = {
    404: NOT_FOUND,
    429: "rate_limit_error",
    500: SERVER_ERROR,
    503: SERVER_ERROR,
    504: SERVER_ERROR,
}


# Anthropic's error types by status (docs.anthropic.com, "Errors"); another 4xx is invalid_request_error, another
# 5xx api_error. Anthropic answers an overload 529; Courier keeps its 503, the standard status proxies know.
_ANTHROPIC_TYPE_BY_STATUS = {
    400: INVALID_REQUEST,
    401: "authentication_error",
    403: "permission_error",
    404: NOT_FOUND,
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
}
# Anthropic's wording for a prompt past the window; agents look for it (Claude Code offers to compact).
PROMPT_TOO_LONG = "prompt is too long"


class Envelope(Enum):
    """Whose error shape a route answers in."""

    OPENAI = "openai"
    ANTHROPIC = "anthropic"


def default_code(status: int) -> FailureCode:
    """The code of an error of `status` that names none: the status's, else its class's (4xx, 5xx)."""
    fallback = FailureCode.INTERNAL_ERROR if status >= 500 else FailureCode.INVALID_REQUEST
    return CODE_BY_STATUS.get(status, fallback)


class ApiError(Exception):
    """Raised anywhere in a route; the app answers it in the envelope of the route's API."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: FailureCode | None = None,
        error_type: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code if code is not None else default_code(status)
        self.error_type = error_type or _TYPE_BY_STATUS.get(status, INVALID_REQUEST)
        self.headers = dict(headers or {})

    @classmethod
    def invalid(cls, message: str, param: str | None = None, code: FailureCode | None = None) -> ApiError:
        return cls(400, message, param=param, code=code)

    @classmethod
    def unavailable(cls, message: str, code: FailureCode = FailureCode.SERVICE_UNAVAILABLE) -> ApiError:
        return cls(503, message, code=code, headers={"Retry-After": str(RETRY_AFTER_SECONDS)})

    @classmethod
    def from_failure(cls, failure: RequestFailed) -> ApiError:
        status = _STATUS_BY_FAILURE[failure.kind]
        headers = {"Retry-After": str(RETRY_AFTER_SECONDS)} if status in (429, 503) else None
        return cls(status, failure.message, param=failure.param, code=failure.failure_code, headers=headers)

    def body(self) -> dict[str, dict[str, str | None]]:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict[str, Any]:
        fallback = "api_error" if self.status >= 500 else INVALID_REQUEST
        message = self.message
        if self.code is FailureCode.CONTEXT_LENGTH_EXCEEDED:
            message = f"{PROMPT_TOO_LONG}: {message}"
        error = {
            "type": _ANTHROPIC_TYPE_BY_STATUS.get(self.status, fallback),
            "message": message,
            "code": self.code,
            "param": self.param,
        }
        return {"type": "error", "error": error, "request_id": current_request_id()}

    def response(self, envelope: Envelope = Envelope.OPENAI) -> Response:
        body = self.anthropic_body() if envelope is Envelope.ANTHROPIC else self.body()
        return Response(
            orjson.dumps(body),
            status=self.status,
            headers=self.headers,
            content_type="application/json",
        )
