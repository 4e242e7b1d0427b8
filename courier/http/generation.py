"""From a validated request to generated events: admission, the deadline, cancellation.

`admit` asks the ingress (refusals become OpenAI errors before any byte of the
response is sent); `generated_events` yields the request's events until its
terminal one, enforcing the per-request deadline and honouring a `Cancellation`,
and always closes the event stream on the way out, which is what takes an
abandoned or cancelled request out of the batch.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import anyio
import orjson

from courier.http.asking import ask_actor
from courier.http.cancellation import Cancellation, GenerationCancelled
from courier.http.context import AppContext
from courier.http.errors import ApiError
from courier.http.openai_requests import GenerationRequest
from courier.messages.base import RequestId
from courier.messages.generation import (
    GenerationFailed,
    GenerationFinished,
    SamplingParams,
    TokenLogprob,
    TokensGenerated,
)
from courier.messages.ingress import AdmitGeneration, Admitted, Prompt
from courier.messages.media import FetchMemo


@dataclass(frozen=True, slots=True, kw_only=True)
class Collected:
    text: str
    logprobs: list[TokenLogprob]
    finished: GenerationFinished


def new_request_id() -> RequestId:
    return RequestId(uuid.uuid4().hex)


async def admit(context: AppContext, request: GenerationRequest, request_id: RequestId) -> Admitted:
    context.require_ready()
    context.require_model(request.model)
    return await admit_prompt(
        context,
        request.prompt,
        request.sampling,
        request_id,
        session=request.session,
        cache_prompt=request.cache_prompt,
    )


async def admit_prompt(
    context: AppContext,
    prompt: Prompt,
    sampling: SamplingParams,
    request_id: RequestId,
    *,
    session: str,
    cache_prompt: bool,
    fit_to_context: bool = False,
    memo: FetchMemo | None = None,
) -> Admitted:
    context.require_ready()
    return await ask_actor(
        context.outboxes.ingress,
        lambda reply: AdmitGeneration(
            request_id=request_id,
            prompt=prompt,
            sampling=sampling,
            reply=reply,
            session=session,
            cache_prompt=cache_prompt,
            fit_to_context=fit_to_context,
            memo=memo,
        ),
        Admitted,
    )


async def generated_events(
    admitted: Admitted, timeout_s: float, cancellation: Cancellation | None = None
) -> AsyncIterator[TokensGenerated | GenerationFinished]:
    """Events until `GenerationFinished`; a failure or the deadline raises `ApiError`, a cancellation
    `GenerationCancelled`."""
    deadline = time.monotonic() + timeout_s
    with admitted.events as events:
        while True:
            if cancellation is not None and cancellation.requested:
                raise GenerationCancelled
            event = None
            with anyio.move_on_after(max(0.0, deadline - time.monotonic())) as scope:
                if cancellation is not None:
                    cancellation.watch(scope)
                event = await _next_event(events)
            if cancellation is not None:
                cancellation.watch(None)
                if event is None and cancellation.requested:
                    raise GenerationCancelled
            if event is None:
                raise ApiError(504, f"the request did not finish within {timeout_s:g} s", code="deadline_exceeded")
            if isinstance(event, GenerationFailed):
                if event.code == "shutting_down":
                    raise ApiError.unavailable(event.message, code="shutting_down")
                raise ApiError(500, event.message, code=event.code)
            yield event
            if isinstance(event, GenerationFinished):
                return


async def collect(admitted: Admitted, timeout_s: float, cancellation: Cancellation | None = None) -> Collected:
    texts: list[str] = []
    logprobs: list[TokenLogprob] = []
    async for event in generated_events(admitted, timeout_s, cancellation):
        if isinstance(event, TokensGenerated):
            texts.append(event.text)
            logprobs.extend(event.logprobs)
        else:
            return Collected(text="".join(texts), logprobs=logprobs, finished=event)
    raise ApiError(500, "the generation ended without a result", code="generation_failed")


def sse(payload: object) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


async def _next_event(
    events: anyio.abc.ObjectReceiveStream[TokensGenerated | GenerationFinished | GenerationFailed],
) -> TokensGenerated | GenerationFinished | GenerationFailed:
    try:
        return await events.receive()
    except anyio.EndOfStream:
        return GenerationFailed(message="the generation ended without a result")
