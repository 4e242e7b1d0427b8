"""POST /v1/chat/completions (and /chat/completions), streamed or whole, with `n` samples as its choices."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from quart import Blueprint, Response

from courier.conversation.chat_render import assistant_message, template_tool_call
from courier.conversation.warm_up import warm_up_next_turn
from courier.core.tools.calls import ToolCall
from courier.engine.generation import FinishReason, GenerationFinished
from courier.http import openai_format
from courier.http.context import AppContext
from courier.http.generation import admit, new_request_id
from courier.http.json_body import read_json_object
from courier.http.openai_format import Header
from courier.http.openai_requests import GenerationRequest, parse_chat_request
from courier.http.reply import ReplyAssembler, ReplyParsing, assemble, reply_parsing
from courier.http.sse import SSE_KEEPALIVE, event_stream_response, sse
from courier.messages.generation_reader import Idle, events_or_idle
from courier.messages.ingress import Admitted, ChatPrompt


def blueprint(context: AppContext) -> Blueprint:
    routes = Blueprint("chat", __name__)

    @routes.post("/chat/completions")
    async def chat_completions() -> Response | dict[str, Any]:
        body = await read_json_object()
        bound = await context.for_body(body)  # the model the body names, held until the response ends
        request = parse_chat_request(body, bound.state.sampling_defaults, bound.max_n)
        request_id = new_request_id()
        admitted = await admit(bound, request, request_id)
        header = Header(completion_id=f"chatcmpl-{request_id}", created=int(time.time()), model=bound.state.model_id)
        if request.stream:
            tenant = bound.caller().tenant  # read now: the stream runs after this view has returned
            return event_stream_response(_stream(bound, request, admitted=admitted, header=header, tenant=tenant))
        replies = [ReplyAssembler(_parsing(bound, request, admitted)) for _ in range(request.n)]
        finishes = await assemble(admitted, bound.settings.request_timeout, replies)
        choices = []
        for index, (reply, finished) in enumerate(zip(replies, finishes, strict=True)):
            _, calls = reply.finish(cut=finished.reason is FinishReason.LENGTH)
            if request.n == 1:
                _warm_up_next_turn(bound, request, reply.content, calls, bound.caller().tenant)
            choices.append(
                openai_format.chat_choice(
                    index,
                    content=reply.content,
                    reasoning=reply.reasoning,
                    calls=calls,
                    logprobs=reply.logprobs if request.sampling.logprobs else None,
                    finish_reason=_finish_reason(finished, calls),
                )
            )
        reasoning_tokens = sum(reply.reasoning_tokens for reply in replies)
        return openai_format.chat_completion(header, choices, openai_format.usage(finishes, reasoning_tokens))

    return routes


async def _stream(
    context: AppContext,
    request: GenerationRequest,
    *,
    admitted: Admitted,
    header: Header,
    tenant: str,
) -> AsyncIterator[bytes]:
    """Chunks of every choice as they come (interleaved, each with its `index`); each choice ends with its own
    finish chunk, and the usage chunk comes after the last. An SSE comment is sent whenever the generation is silent
    for `--stream-keepalive` seconds."""
    usage_field = request.include_usage
    replies = [ReplyAssembler(_parsing(context, request, admitted)) for _ in range(request.n)]
    finishes: list[GenerationFinished] = []

    def chunk(delta: dict[str, Any] | None, index: int = 0, **fields: Any) -> bytes:
        return sse(openai_format.chat_chunk(header, delta=delta, index=index, include_usage=usage_field, **fields))

    for index in range(request.n):
        yield chunk({"role": "assistant", "content": ""}, index)
    # Closed with the stream, so a client that leaves takes its generation out of the batch at once.
    settings = context.settings
    events = events_or_idle(admitted, settings.request_timeout, idle_s=settings.stream_keepalive)
    async with aclosing(events):
        async for event in events:
            if isinstance(event, Idle):
                yield SSE_KEEPALIVE  # silent for a while (queued, or a long prefill): a comment clients skip
                continue
            index = event.choice
            reply = replies[index]
            if isinstance(event, GenerationFinished):
                finishes.append(event)
                rest, calls = reply.finish(cut=event.reason is FinishReason.LENGTH)
                held = rest.logprobs if request.sampling.logprobs else None
                if rest.reasoning or rest.content or held:
                    yield chunk(openai_format.delta(rest.reasoning, rest.content), index, logprobs=held)
                if request.n == 1:
                    _warm_up_next_turn(context, request, reply.content, calls, tenant)
                if calls:
                    yield chunk({"tool_calls": openai_format.tool_call_objects(calls, indexed=True)}, index)
                yield chunk({}, index, finish_reason=_finish_reason(event, calls))
                continue
            delta = reply.feed(event)
            logprobs = delta.logprobs if request.sampling.logprobs else None
            if delta.reasoning or delta.content or logprobs:
                yield chunk(openai_format.delta(delta.reasoning, delta.content), index, logprobs=logprobs)
    if usage_field:
        finishes.sort(key=lambda finished: finished.choice)
        reasoning_tokens = sum(reply.reasoning_tokens for reply in replies)
        yield chunk(None, usage_object=openai_format.usage(finishes, reasoning_tokens))


def _parsing(context: AppContext, request: GenerationRequest, admitted: Admitted) -> ReplyParsing:
    return reply_parsing(context.state, admitted, request.tools, request.output)


def _warm_up_next_turn(
    context: AppContext, request: GenerationRequest, content: str, calls: list[ToolCall], tenant: str
) -> None:
    """Ask for the conversation, reply included, to be prefilled while the server is idle (a tell; may be dropped).
    Only for a single choice: of several, which one the conversation goes on with is not known."""
    if not request.cache_prompt or not context.settings.prompt_cache or not isinstance(request.prompt, ChatPrompt):
        return
    reply = assistant_message(content, [template_tool_call(call.id, call.name, call.arguments) for call in calls])
    prompt = request.prompt
    messages = [*prompt.messages, reply]
    ingress = context.outboxes.ingress
    warm_up_next_turn(ingress, request.session, messages, prompt.tools, tenant, options=prompt.options)


def _finish_reason(finished: GenerationFinished, calls: list[ToolCall]) -> str:
    """ "length" whenever the token limit cut the reply (a call may have been cut with it), as OpenAI does."""
    if finished.reason is FinishReason.LENGTH:
        return FinishReason.LENGTH.value
    return "tool_calls" if calls else finished.reason.value
