"""Server-sent events responses: OpenAI's `data:` lines, `[DONE]`, and errors mid-stream.

Once the first byte is sent the status is 200 for good, so a failure after that
is sent as one `data: {"error": ...}` event (the OpenAI client raises it) and the
stream ends without `[DONE]`.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable

from quart import Response

from courier.http.errors import ApiError
from courier.http.generation import SSE_DONE, sse
from courier.messages.asking import Refused

logger = logging.getLogger(__name__)


def chat_error_event(error: ApiError) -> bytes:
    return sse(error.body())


def event_stream_response(
    events: AsyncIterator[bytes],
    *,
    done: bytes | None = SSE_DONE,
    error_event: Callable[[ApiError], bytes] = chat_error_event,
) -> Response:
    """`done`: the closing line after the last event (Chat Completions' `[DONE]`; the Responses API has none);
    `error_event`: how a failure after the first byte is told to the client."""
    response = Response(_with_errors(events, done, error_event), content_type="text/event-stream")
    response.headers["Cache-Control"] = "no-cache"
    response.headers["X-Accel-Buffering"] = "no"
    response.timeout = None  # the request deadline governs, not Quart's
    return response


async def _with_errors(
    events: AsyncIterator[bytes], done: bytes | None, error_event: Callable[[ApiError], bytes]
) -> AsyncIterator[bytes]:
    try:
        async for chunk in events:
            yield chunk
    except ApiError as error:
        yield error_event(error)
        return
    except Refused as refused:
        yield error_event(ApiError.from_failure(refused.failure))
        return
    except Exception as error:
        logger.exception("stream failed")
        yield error_event(ApiError(500, f"internal server error: {type(error).__name__}"))
        return
    if done is not None:
        yield done
