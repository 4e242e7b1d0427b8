"""The Responses WebSocket: `GET /v1/responses` upgraded, one `response.create` after another on one connection.

The openai client (`client.responses.connect()`) and Codex (a provider with `supports_websockets = true`) speak it:
each client message is `{"type": "response.create", ...}` with the fields of a `POST /v1/responses` body (`stream`
implicit), and the server answers with the same events a stream would carry, one JSON text each, every one echoing
the request's `stream_id` when it gave one. Requests on one connection are served in order (one lane). A request
refused, or that fails outside its response's lifecycle, is one `error` event `{type, status, error: {type, code,
message, param}}`, and the connection stays open for the next. `generate: false` (prepare state without output)
and `response.steer` are refused that way. A missing or wrong API key refuses the upgrade itself with a 401, as the
HTTP routes answer; a client that leaves mid-response has it recorded as a stream whose client left.
"""

from __future__ import annotations

import logging
from contextlib import aclosing
from dataclasses import dataclass, replace
from typing import Any

import orjson
from quart import Response, g, websocket

from courier.conversation.turn import plan_turn, start_turn
from courier.http.access_log import note_tenant
from courier.http.context import AppContext
from courier.http.errors import ApiError, Envelope
from courier.http.model_leases import leases_held
from courier.http.responses.events import EventWriter
from courier.http.responses.prepare import prepared
from courier.http.responses.run import held, run_streamed
from courier.messages.asking import Refused
from courier.runtime.tracing import tracer
from courier.storage.records import JsonObject

logger = logging.getLogger(__name__)

# Envelope fields of a `response.create` that are not fields of the create body.
_ENVELOPE = ("type", "stream_id", "generate")


async def serve_socket(context: AppContext) -> Response | None:
    """The connection's life: refused before the upgrade (a 401), or accepted and served until the client leaves."""
    try:
        g.caller = context.api_keys.caller(websocket.headers.get("Authorization"))
        note_tenant(g.caller.tenant)
    except ApiError as error:
        return error.response(Envelope.OPENAI)
    await websocket.accept()
    logger.info("responses websocket: a connection opened (%s)", websocket.headers.get("User-Agent", "no user agent"))
    connection = _Connection()
    while True:
        message = await websocket.receive()
        await _serve(context, message, connection)


@dataclass(slots=True)
class _Connection:
    """What one connection remembers: its last completed response and the whole history it continues, so the next
    `response.create` may continue it by `previous_response_id` though it was not stored (Codex sends `store:
    false` and only the new items, as OpenAI's WebSocket mode serves them). Only the last one is kept."""

    last: tuple[str, tuple[JsonObject, ...]] | None = None


async def _serve(context: AppContext, message: str | bytes, connection: _Connection) -> None:
    event: Any = None
    try:
        event = orjson.loads(message)
    except orjson.JSONDecodeError:
        await websocket.send(_error(ApiError.invalid("a message must be one JSON object"), None))
        return
    stream_id = event.get("stream_id") if isinstance(event, dict) else None
    stream_id = stream_id if isinstance(stream_id, str) else None
    try:
        body = _create_body(event)
        with tracer().start_as_current_span("WEBSOCKET /v1/responses response.create"):
            await _respond(context, body, EventWriter(json_frames=True, stream_id=stream_id), connection)
    except ApiError as error:
        await websocket.send(_error(error, stream_id))
    except Refused as refused:
        await websocket.send(_error(ApiError.from_failure(refused.failure), stream_id))
    except Exception as error:  # a fault of this request's: told as a 500, and the connection serves the next
        logger.exception("responses websocket: a request failed")
        await websocket.send(_error(ApiError(500, f"internal server error: {type(error).__name__}"), stream_id))


def _create_body(event: Any) -> dict[str, Any]:
    if not isinstance(event, dict) or event.get("type") != "response.create":
        kind = event.get("type") if isinstance(event, dict) else None
        raise ApiError.invalid(f"only 'response.create' events are served, not {kind!r}", param="type")
    if event.get("generate") is False:
        raise ApiError.invalid("'generate': false is not supported; send the input with the next turn", "generate")
    return {**{key: value for key, value in event.items() if key not in _ENVELOPE}, "stream": True}


async def _respond(context: AppContext, body: dict[str, Any], emit: EventWriter, connection: _Connection) -> None:
    async with leases_held():  # the model this request names, held until its last event is sent
        bound = await context.for_body(body)
        parsed = await prepared(bound, body)
        services = replace(bound.turn_services(), connection_last=connection.last)
        plan = await plan_turn(services, parsed)
        turn = None if plan.compaction_due else held(await start_turn(services, plan))
        final: JsonObject | None = None
        async with aclosing(run_streamed(bound, services, plan, turn, emit)) as events:
            async for chunk in events:
                text = chunk.decode()
                await websocket.send(text)
                final = _completed(text) or final
        if final is not None:
            connection.last = (str(final["id"]), (*plan.items, *final["output"]))


_ENDED = ("response.completed", "response.incomplete")


def _completed(frame: str) -> JsonObject | None:
    """The response a frame that ends one carries, if it may be continued: completed, or cut by its limit (None for
    any other frame, a failed or cancelled response among them)."""
    if not any(f'"{kind}"' in frame for kind in _ENDED):
        return None
    event = orjson.loads(frame)
    response = event.get("response") if event.get("type") in _ENDED else None
    if not isinstance(response, dict) or response.get("status") not in ("completed", "incomplete"):
        return None
    return response


def _error(error: ApiError, stream_id: str | None) -> str:
    detail = {"type": error.error_type, "code": error.code, "message": error.message, "param": error.param}
    payload: dict[str, Any] = {"type": "error", "status": error.status, "error": detail}
    if stream_id is not None:
        payload["stream_id"] = stream_id
    return orjson.dumps(payload).decode()
