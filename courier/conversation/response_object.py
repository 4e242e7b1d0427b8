"""The Responses API's response object: whole, or as a snapshot while streaming; its usage and outcome.

`ResponseDraft` holds what a response repeats from its request; `response_object`
turns it, an `Outcome` (status, output so far, usage or error) into OpenAI's shape,
which is also what storage keeps and `GET /v1/responses/{id}` returns.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum

from courier.conversation.ids import new_response_id
from courier.conversation.request import ResponsesRequest
from courier.engine.generation import FinishReason, GenerationFinished
from courier.messages.base import RequestFailed
from courier.storage.records import JsonObject


class Status(Enum):
    IN_PROGRESS = "in_progress"
    COMPLETED = "completed"
    INCOMPLETE = "incomplete"
    FAILED = "failed"
    CANCELLED = "cancelled"


TERMINAL_EVENTS = {
    Status.COMPLETED: "response.completed",
    Status.INCOMPLETE: "response.incomplete",
    Status.FAILED: "response.failed",
    # OpenAI's stream has no cancelled event; a cancelled stream ends with response.incomplete, status "cancelled".
    Status.CANCELLED: "response.incomplete",
}


@dataclass(frozen=True, slots=True, kw_only=True)
class ResponseDraft:
    request: ResponsesRequest
    model: str
    id: str = field(default_factory=new_response_id)
    created_at: int = field(default_factory=lambda: int(time.time()))


@dataclass(frozen=True, slots=True, kw_only=True)
class Outcome:
    status: Status
    output: Sequence[JsonObject] = ()
    usage: JsonObject | None = None
    error: JsonObject | None = None
    incomplete_reason: str | None = None


def response_object(draft: ResponseDraft, outcome: Outcome) -> JsonObject:
    request = draft.request
    terminal = outcome.status is not Status.IN_PROGRESS
    return {
        "id": draft.id,
        "object": "response",
        "created_at": draft.created_at,
        "status": outcome.status.value,
        "background": False,
        "completed_at": int(time.time()) if outcome.status is Status.COMPLETED else None,
        "error": outcome.error,
        "incomplete_details": {"reason": outcome.incomplete_reason} if outcome.incomplete_reason else None,
        "instructions": request.instructions,
        "max_output_tokens": request.max_output_tokens,
        "max_tool_calls": request.output.max_tool_calls,
        "model": draft.model,
        "output": list(outcome.output),
        "parallel_tool_calls": request.output.parallel_tool_calls,
        "previous_response_id": request.previous_response_id,
        "conversation": {"id": request.conversation_id} if request.conversation_id else None,
        "reasoning": {"effort": request.template_options.reasoning_effort, "summary": request.reasoning_summary},
        "store": request.store,
        "temperature": request.sampling.temperature,
        "text": {"format": request.output.format.echo(), "verbosity": "medium"},
        "tool_choice": request.output.tool_choice.echo(responses=True),
        "tools": list(request.tools),
        "top_logprobs": request.sampling.top_logprobs,
        "top_p": request.sampling.top_p,
        "truncation": "disabled",
        "usage": outcome.usage if terminal else None,
        "user": request.user,
        "metadata": request.metadata,
        "prompt_cache_key": request.prompt_cache_key,
        "safety_identifier": request.safety_identifier,
        "service_tier": "default",
    }


def usage_object(finished: GenerationFinished, reasoning_tokens: int = 0) -> JsonObject:
    # `cache_write_tokens`: the prompt tokens beyond the cached ones whose state the turn handed to the snapshot store.
    return {
        "input_tokens": finished.prompt_tokens,
        "input_tokens_details": {
            "cached_tokens": finished.cached_tokens,
            "cache_write_tokens": finished.cache_write_tokens,
        },
        "output_tokens": finished.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": finished.prompt_tokens + finished.completion_tokens,
    }


def finished_outcome(finished: GenerationFinished, output: Sequence[JsonObject], reasoning_tokens: int = 0) -> Outcome:
    cut = finished.reason is FinishReason.LENGTH
    return Outcome(
        status=Status.INCOMPLETE if cut else Status.COMPLETED,
        output=output,
        usage=usage_object(finished, reasoning_tokens),
        incomplete_reason="max_output_tokens" if cut else None,
    )


def failed_outcome(failure: RequestFailed, output: Sequence[JsonObject]) -> Outcome:
    error = {"code": failure.failure_code, "message": failure.message}
    return Outcome(status=Status.FAILED, output=output, error=error)
