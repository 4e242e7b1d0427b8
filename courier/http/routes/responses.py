"""The Responses API: create (whole, streamed, or over the WebSocket), retrieve, delete, cancel, input items and input
token counts, compact."""

from __future__ import annotations

import time

import anyio
from quart import Blueprint, Response, request

from courier.conversation.ids import new_response_id
from courier.conversation.turn import count_tokens, history_items, plan_turn, render, replayed, start_turn
from courier.core.failure_codes import FailureCode
from courier.http.context import AppContext
from courier.http.errors import ApiError
from courier.http.json_body import read_json_object
from courier.http.listing import list_object, page_query
from courier.http.responses.events import EventWriter
from courier.http.responses.items import unsealed
from courier.http.responses.prepare import prepared
from courier.http.responses.request import parse_compact_request, parse_responses_request
from courier.http.responses.run import held, run_compaction, run_streamed, run_whole
from courier.http.responses.websocket import serve_socket
from courier.http.schemas import responses as responses_schema
from courier.http.sse import event_stream_response
from courier.messages.asking import call
from courier.messages.compactor import CompactHistory
from courier.messages.storage import DeleteResponse, LoadResponse
from courier.storage.paging import UnknownCursor, page_of
from courier.storage.records import JsonObject, StoredResponse

# How long `cancel` waits for the generation to stop and its final object to be recorded.
CANCEL_WAIT_S = 30.0


def blueprint(context: AppContext) -> Blueprint:
    routes = Blueprint("responses", __name__)
    _websocket(routes, context)

    @routes.post("/responses")
    async def create_response() -> Response | JsonObject:
        bound, body = await context.read_for_model()  # the model the body names, held until the response ends
        parsed = await prepared(bound, body)
        services = bound.turn_services()
        plan = await plan_turn(services, parsed)
        if parsed.compaction_requested and not parsed.stream:
            return await run_compaction(bound, services, plan)
        if parsed.stream:
            # A due compaction runs inside the stream, so its progress can be streamed; otherwise admission
            # happens first and a refusal is a plain HTTP error.
            turn = None if plan.compaction_due else held(await start_turn(services, plan))
            emit = EventWriter()
            events = run_streamed(bound, services, plan, turn, emit, keepalive_s=bound.settings.stream_keepalive)
            return event_stream_response(events, done=None, error_event=emit.error)
        return await run_whole(bound, services, held(await start_turn(services, plan)))

    @routes.post("/responses/input_tokens")
    async def count_input_tokens() -> JsonObject:
        body = await read_json_object()
        bound = await context.for_body(body)
        parsed = parse_responses_request(body, bound.state.sampling_defaults, responses_schema.INPUT_TOKENS)
        services = bound.turn_services()
        items = [*await history_items(services, parsed), *unsealed(bound.seal, parsed.input_items)]
        rendered = render(services.capsules, parsed, items)
        return {"object": "response.input_tokens", "input_tokens": await count_tokens(services, parsed, rendered)}

    @routes.post("/responses/compact")
    async def compact_response() -> JsonObject:
        bound, body = await context.read_for_model()
        parsed = parse_compact_request(body)
        shown = replayed(bound.capsules, unsealed(bound.seal, parsed.input_items), parsed.instructions)
        result = await call(
            bound.outboxes.compactor,
            lambda reply: CompactHistory(
                context=shown,
                request_items=parsed.input_items,
                instructions=parsed.instructions,
                tools=parsed.template_tools,
                keep_tokens=parsed.keep_tokens,
                max_output_tokens=parsed.max_output_tokens,
                session=parsed.session,
                reply=reply,
                tenant=bound.caller().tenant,
            ),
        )
        return {
            "id": new_response_id(bound.settings.replica_id),
            "object": "response.compaction",
            "created_at": int(time.time()),
            "output": list(result.output),
            "usage": result.usage,
        }

    @routes.get("/responses/<response_id>")
    async def retrieve_response(response_id: str) -> JsonObject:
        running = context.responses.get(response_id, context.caller().tenant)
        if running is not None:
            return running.snapshot
        return (await _stored(context, response_id)).response

    @routes.delete("/responses/<response_id>")
    async def delete_response(response_id: str) -> JsonObject:
        if context.responses.get(response_id, context.caller().tenant) is not None:
            raise ApiError.invalid("the response is still in progress; cancel it first", param="response_id")
        if not await call(
            context.outboxes.storage,
            lambda reply: DeleteResponse(response_id=response_id, tenant=context.caller().tenant, reply=reply),
        ):
            raise _not_found(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    @routes.post("/responses/<response_id>/cancel")
    async def cancel_response(response_id: str) -> JsonObject:
        running = context.responses.get(response_id, context.caller().tenant)
        if running is None:
            stored = await _stored(context, response_id)
            if stored.response.get("status") == "cancelled":
                return stored.response
            message = f"Only an in-progress response can be cancelled; this one is {stored.response.get('status')}."
            raise ApiError.invalid(message, param="response_id", code=FailureCode.RESPONSE_NOT_CANCELLABLE)
        running.cancellation.request()
        with anyio.move_on_after(CANCEL_WAIT_S):
            await running.finished.wait()
        return running.snapshot

    @routes.get("/responses/<response_id>/input_items")
    async def list_input_items(response_id: str) -> JsonObject:
        query = page_query(request.args)
        stored = await _stored(context, response_id)
        try:
            return list_object(page_of(stored.input_items, query))
        except UnknownCursor:
            raise ApiError.invalid(f"no input item with id '{query.after}' in this response", param="after") from None

    return routes


def _websocket(routes: Blueprint, context: AppContext) -> None:
    @routes.websocket("/responses")
    async def responses_socket() -> Response | None:
        return await serve_socket(context)


async def _stored(context: AppContext, response_id: str) -> StoredResponse:
    stored = await call(
        context.outboxes.storage,
        lambda reply: LoadResponse(response_id=response_id, tenant=context.caller().tenant, reply=reply),
    )
    if stored is None:
        raise _not_found(response_id)
    return stored


def _not_found(response_id: str) -> ApiError:
    return ApiError(
        404, f"Response with id '{response_id}' not found.", param="response_id", code=FailureCode.NOT_FOUND
    )
