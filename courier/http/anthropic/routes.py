"""POST /v1/messages (whole or streamed; `?beta=true` as Claude Code sends it) and POST /v1/messages/count_tokens.

The same admission, engine, grammar, prompt cache, auth and tracing as the OpenAI routes: the body becomes the one
internal request (`request.py`), the engine's events become Anthropic's message or stream (`run.py`, `message.py`,
`events.py`). Nothing is stored. Failures answer in Anthropic's error envelope (`http/errors.py`, chosen by this
blueprint's name in `http/app.py`).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from quart import Blueprint, Response

from courier.conversation.chat_render import assistant_message, template_tool_call
from courier.conversation.warm_up import warm_up_next_turn
from courier.http.anthropic import thinking_budget
from courier.http.anthropic.events import MessageEvents, error_event, ping
from courier.http.anthropic.message import (
    Usage,
    content_blocks,
    message_object,
    new_message_id,
    tool_use_block,
)
from courier.http.anthropic.request import MessagesRequest, parse_messages_request
from courier.http.anthropic.run import MessageRun
from courier.http.context import AppContext
from courier.http.generation import admit, new_request_id
from courier.http.json_body import read_json_object
from courier.http.sse import event_stream_response
from courier.messages.asking import call
from courier.messages.generation_reader import Idle
from courier.messages.ingress import ChatPrompt
from courier.messages.media import FetchMemo
from courier.messages.token_counter import TokenizeChat
from courier.storage.records import JsonObject

BLUEPRINT = "anthropic"


def blueprint(context: AppContext) -> Blueprint:
    routes = Blueprint(BLUEPRINT, __name__)

    @routes.post("/messages")
    async def create_message() -> Response | JsonObject:
        body = await read_json_object()
        bound = await context.for_body(body)  # the model the body names, held until the response ends
        request = parse_messages_request(body, bound.state.sampling_defaults)
        tenant = bound.caller().tenant  # read now: a stream runs after this view has returned
        if thinking_budget.enforced(bound, request):
            request = await thinking_budget.prerendered(bound, request, tenant)
        deadline = time.monotonic() + bound.settings.request_timeout  # the whole message's, continuation included
        admitted = await admit(bound, request.generation, new_request_id(), tenant, deadline=deadline)
        run = MessageRun(bound, request, admitted, tenant, deadline)
        if request.generation.stream:
            return event_stream_response(_stream(bound, request, run, tenant), done=None, error_event=error_event)
        async with aclosing(run.parts()) as parts:
            async for _ in parts:
                pass
        outcome = run.outcome
        _warm_up_next_turn(bound, request, run, tenant)
        reply = run.reply
        return message_object(
            message_id=new_message_id(),
            model=request.model,
            content=content_blocks(
                reply.reasoning, reply.content, outcome.calls, thinking_shown=request.thinking.shown
            ),
            stop=outcome.stop_reason,
            stop_sequence=outcome.stop_sequence,
            usage=outcome.usage,
        )

    @routes.post("/messages/count_tokens")
    async def count_tokens() -> dict[str, Any]:
        """The tokens the same body's message would prefill (its images counted as the tokens they expand to)."""
        body = await read_json_object()
        bound = await context.for_body(body)
        request = parse_messages_request(body, bound.state.sampling_defaults, counting=True)
        prompt = request.generation.prompt
        assert isinstance(prompt, ChatPrompt)
        images = await bound.image_admission().admit_for_count(prompt.images, FetchMemo())
        result = await call(
            bound.outboxes.token_counter,
            lambda reply: TokenizeChat(
                messages=prompt.messages,
                tools=prompt.tools,
                add_generation_prompt=True,
                reply=reply,
                thinking=prompt.thinking,
                options=prompt.options,
                images=images,
                max_tokens=bound.context_length,
                reuse_scope=bound.caller().tenant if request.generation.cache_prompt else None,
            ),
        )
        return {"input_tokens": len(result.tokens)}

    return routes


async def _stream(context: AppContext, request: MessagesRequest, run: MessageRun, tenant: str) -> AsyncIterator[bytes]:
    """Anthropic's events; a `ping` whenever the generation is silent for `--stream-keepalive` seconds (queued, or
    prefilling a long prompt), so the client keeps waiting. `message_start` reports the whole prompt as
    `input_tokens`; how much of it the cache served is known at the end, and `message_delta` carries it."""
    writer = MessageEvents(thinking_shown=request.thinking.shown)
    started = Usage(prompt_tokens=run.prompt_tokens, output_tokens=0)
    yield writer.start(
        message_object(
            message_id=new_message_id(), model=request.model, content=[], stop=None, stop_sequence=None, usage=started
        )
    )
    # Closed with the stream, so a client that leaves closes the generation's events at once (out of the batch).
    async with aclosing(run.parts(context.settings.stream_keepalive)) as parts:
        async for part in parts:
            if isinstance(part, Idle):
                yield ping()
                continue
            for chunk in (*writer.thinking(part.reasoning), *writer.text(part.content)):
                yield chunk
    outcome = run.outcome
    for call_made in outcome.calls:
        for chunk in writer.tool_use(tool_use_block(call_made)):
            yield chunk
    _warm_up_next_turn(context, request, run, tenant)
    for chunk in writer.finish(outcome.stop_reason, outcome.stop_sequence, outcome.usage.as_dict()):
        yield chunk


def _warm_up_next_turn(context: AppContext, request: MessagesRequest, run: MessageRun, tenant: str) -> None:
    """Ask for the conversation, this reply included, to be prefilled while the server is idle, the reply rendered
    as the client will send it back (its text, its thinking, its calls under their `toolu_` ids)."""
    prompt = request.generation.prompt
    if not context.settings.prompt_cache or not isinstance(prompt, ChatPrompt):
        return
    reply = run.reply
    calls = [tool_use_block(call_made) for call_made in run.outcome.calls]
    message = assistant_message(
        reply.content if reply.content.strip() else "",
        [template_tool_call(block["id"], block["name"], block["input"]) for block in calls],
    )
    if reply.reasoning and request.thinking.shown:  # an omitted block comes back empty
        message["reasoning_content"] = reply.reasoning
    messages = [*prompt.messages, message]
    session = request.generation.session
    ingress = context.outboxes.ingress
    warm_up_next_turn(
        ingress, session, messages, prompt.tools, tenant, options=prompt.options, thinking=prompt.thinking
    )
