"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the right status.

This is the only place that chooses HTTP status codes for failures.
"""

from __future__ import annotations

from collections.abc import Mapping

import orjson
from quart import Response

from courier.core.failure_codes import FailureCode
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
_TYPE_BY_STATUS = {
    404: NOT_FOUND,
    429: "rate_limit_error",
    500: SERVER_ERROR,
    503: SERVER_ERROR,
    504: SERVER_ERROR,
}


class ApiError(Exception):
    """Raised anywhere in a route; the app answers it with the OpenAI envelope."""

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
        self.code = code
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
        return cls(status, failure.message, param=failure.param, code=failure.code, headers=headers)

    def body(self) -> dict[str, dict[str, str | None]]:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}

    def response(self) -> Response:
        return Response(
            orjson.dumps(self.body()),
            status=self.status,
            headers=self.headers,
            content_type="application/json",
        )
