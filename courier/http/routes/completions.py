"""POST /v1/completions (and /completions): a string or token-id prompt, streamed or whole, `n` samples as its
choices."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from quart import Blueprint, Response

from courier.engine.generation import GenerationFinished, TokenLogprob
from courier.http import openai_format
from courier.http.context import AppContext
from courier.http.generation import admit, new_request_id
from courier.http.json_body import read_json_object
from courier.http.openai_format import Header
from courier.http.openai_requests import GenerationRequest, parse_completion_request
from courier.http.sse import SSE_KEEPALIVE, event_stream_response, sse
from courier.messages.generation_reader import Idle, events_or_idle, generated_events
from courier.messages.ingress import Admitted


def blueprint(context: AppContext) -> Blueprint:
    routes = Blueprint("completions", __name__)

    @routes.post("/completions")
    async def completions() -> Response | dict[str, Any]:
        body = await read_json_object()
        bound = await context.for_body(body)  # the model the body names, held until the response ends
        request = parse_completion_request(body, bound.state.sampling_defaults, bound.max_n)
        request_id = new_request_id()
        admitted = await admit(bound, request, request_id)
        header = Header(completion_id=f"cmpl-{request_id}", created=int(time.time()), model=bound.state.model_id)
        if request.stream:
            return event_stream_response(_stream(bound, request, admitted, header))
        texts: list[list[str]] = [[] for _ in range(request.n)]
        logprobs: list[list[TokenLogprob]] = [[] for _ in range(request.n)]
        finishes: dict[int, GenerationFinished] = {}
        async for event in generated_events(admitted, bound.settings.request_timeout):
            if isinstance(event, GenerationFinished):
                finishes[event.choice] = event
            else:
                texts[event.choice].append(event.text)
                logprobs[event.choice].extend(event.logprobs)
        ordered = [finishes[index] for index in range(request.n)]
        choices = [
            openai_format.text_choice(
                index,
                text="".join(texts[index]),
                logprobs=logprobs[index] if request.sampling.logprobs else None,
                finish_reason=finished.reason.value,
            )
            for index, finished in enumerate(ordered)
        ]
        return openai_format.text_completion(header, choices, usage_object=openai_format.usage(ordered))

    return routes


async def _stream(
    context: AppContext, request: GenerationRequest, admitted: Admitted, header: Header
) -> AsyncIterator[bytes]:
    """A chunk per piece of text of any choice (each with its `index`), a finish chunk per choice, then the usage; an
    SSE comment whenever the generation is silent for `--stream-keepalive` seconds."""
    usage_field = request.include_usage
    offsets = [0] * request.n
    finishes: list[GenerationFinished] = []

    def chunk(choice: dict[str, Any]) -> bytes:
        return sse(openai_format.text_completion(header, [choice], usage_object=None, include_usage=usage_field))

    # Closed with the stream, so a client that leaves takes its generation out of the batch at once.
    settings = context.settings
    events = events_or_idle(admitted, settings.request_timeout, idle_s=settings.stream_keepalive)
    async with aclosing(events):
        async for event in events:
            if isinstance(event, Idle):
                yield SSE_KEEPALIVE  # silent for a while (queued, or a long prefill): a comment clients skip
                continue
            index = event.choice
            if isinstance(event, GenerationFinished):
                finishes.append(event)
                finish = event.reason.value
                yield chunk(openai_format.text_choice(index, text="", logprobs=None, finish_reason=finish))
                continue
            logprobs = event.logprobs if request.sampling.logprobs else None
            choice = openai_format.text_choice(
                index, text=event.text, logprobs=logprobs, finish_reason=None, text_offset=offsets[index]
            )
            yield chunk(choice)
            offsets[index] += len(event.text)
    if usage_field:
        usage = openai_format.usage(sorted(finishes, key=lambda finished: finished.choice))
        yield sse(openai_format.text_completion(header, [], usage_object=usage))
