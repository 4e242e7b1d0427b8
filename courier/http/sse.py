"""Server-sent events: the framing every API's stream uses (OpenAI's `data:` lines and `[DONE]`, the named events of
the Responses and Messages APIs, keep-alives), and the response that sends them, with errors mid-stream.

Once the first byte is sent the status is 200 for good, so a failure after that
is sent as one `data: {"error": ...}` event (the OpenAI client raises it) and the
stream ends without `[DONE]`.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable

import orjson
from quart import Response

from courier.http.errors import ApiError
from courier.messages.asking import Refused

logger = logging.getLogger(__name__)

SSE_DONE = b"data: [DONE]\n\n"
# An SSE comment, sent while a stream is silent (queued, or prefilling a long prompt): clients skip it (the openai
# client's decoder drops lines that begin with a colon), proxies and client read timeouts see bytes arrive.
SSE_KEEPALIVE = b": keep-alive\n\n"


def sse(payload: object) -> bytes:
    """An unnamed event: one `data:` line (Chat Completions, Completions)."""
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def sse_event(kind: str, payload: object) -> bytes:
    """A named event: its `event:` line, then its `data:` line (the Responses and Messages APIs)."""
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"


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
