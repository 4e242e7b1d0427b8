"""POST /v1/completions (and /completions): a string or token-id prompt, streamed or whole."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from quart import Blueprint, Response

from courier.engine.generation import GenerationFinished
from courier.http import openai_format
from courier.http.context import AppContext
from courier.http.generation import admit, new_request_id, sse
from courier.http.json_body import read_json_object
from courier.http.openai_format import Header
from courier.http.openai_requests import GenerationRequest, parse_completion_request
from courier.http.streaming import event_stream_response
from courier.messages.generation_reader import collect, generated_events
from courier.messages.ingress import Admitted


def blueprint(context: AppContext) -> Blueprint:
    routes = Blueprint("completions", __name__)

    @routes.post("/v1/completions")
    @routes.post("/completions")
    async def completions() -> Response | dict[str, Any]:
        request = parse_completion_request(await read_json_object(), context.state.sampling_defaults)
        request_id = new_request_id()
        admitted = await admit(context, request, request_id)
        header = Header(completion_id=f"cmpl-{request_id}", created=int(time.time()), model=context.state.model_id)
        if request.stream:
            return event_stream_response(_stream(context, request, admitted, header))
        collected = await collect(admitted, context.settings.request_timeout)
        return openai_format.text_completion(
            header,
            text=collected.text,
            logprobs=collected.logprobs if request.sampling.logprobs else None,
            finish_reason=collected.finished.reason.value,
            usage_object=openai_format.usage(collected.finished),
        )

    return routes


async def _stream(
    context: AppContext, request: GenerationRequest, admitted: Admitted, header: Header
) -> AsyncIterator[bytes]:
    usage_field = request.include_usage
    offset = 0
    async for event in generated_events(admitted, context.settings.request_timeout):
        if isinstance(event, GenerationFinished):
            reason = event.reason.value
            yield sse(
                openai_format.text_completion(
                    header, text="", logprobs=None, finish_reason=reason, usage_object=None, include_usage=usage_field
                )
            )
            if usage_field:
                usage = openai_format.usage(event)
                yield sse(
                    openai_format.text_completion(
                        header, text="", logprobs=None, finish_reason=None, usage_object=usage, with_choice=False
                    )
                )
            return
        logprobs = event.logprobs if request.sampling.logprobs else None
        yield sse(
            openai_format.text_completion(
                header,
                text=event.text,
                logprobs=logprobs,
                finish_reason=None,
                usage_object=None,
                text_offset=offset,
                include_usage=usage_field,
            )
        )
        offset += len(event.text)
