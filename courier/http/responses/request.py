"""`/v1/responses` (and `/v1/responses/input_tokens`) and `/v1/responses/compact` bodies read into typed requests.

Each body is first checked against its schema (`schemas/responses.py`): types, ranges, and the fields this server
cannot honour (background mode, `truncation: auto`, forcing a hosted tool), each refusal a 400 naming its `param`.
What is left here is what a schema cannot say: `previous_response_id` and `conversation` together, `input` needed
without either, a compaction trigger only last, tools named twice, and the conversion into the internal request.
Hosted tools merely declared are left out of what the model is offered (`tools.py`), and the request's span lists
them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from opentelemetry import trace

from courier.conversation.request import CompactRequest, ResponsesRequest
from courier.core.sampling_defaults import OPENAI, SamplingDefaults
from courier.core.template_options import TemplateOptionRefused, TemplateOptions, reasoning_effort, template_kwargs
from courier.grammar import output_spec
from courier.grammar.output_spec import OutputSpec
from courier.http.checked_fields import flag, optional_whole, text, whole
from courier.http.constrained import refusing
from courier.http.errors import ApiError
from courier.http.openai_requests import sampling_params, session_key
from courier.http.responses.items import input_items
from courier.http.responses.tools import ResponsesTools, forced_tool, responses_tools
from courier.http.schemas import responses
from courier.http.schemas.responses import COMPACTION_TRIGGER, LOGPROBS_INCLUDE, SEALED_INCLUDE
from courier.http.schemas.shared import Schema
from courier.http.schemas.validator import check
from courier.runtime import trace_attributes

DEFAULT_SUMMARY_TOKENS = 1024


def parse_responses_request(
    body: dict[str, Any], defaults: SamplingDefaults = OPENAI, schema: Schema = responses.REQUEST
) -> ResponsesRequest:
    """`schema`: the body's (`/v1/responses/input_tokens` refuses one more field)."""
    check(schema, body)
    previous = text(body, "previous_response_id")
    conversation = _conversation_id(body.get("conversation"))
    if previous is not None and conversation is not None:
        raise ApiError.invalid(
            "'previous_response_id' and 'conversation' cannot be used together", param="conversation"
        )
    raw_input = body.get("input")
    if raw_input is None and previous is None and conversation is None:
        raise ApiError.invalid("'input' is required", param="input")
    raw_input, compaction_requested = _compaction_trigger(raw_input)
    items = input_items(raw_input) if raw_input is not None else []
    tools = _declared_tools(body.get("tools"))
    top_logprobs = whole(body, "top_logprobs", 0)
    include = frozenset(body.get("include") or ())
    logprobs = LOGPROBS_INCLUDE in include or top_logprobs > 0
    # Beyond OpenAI's fields, the sampling extensions chat takes (seed, stop, top_k, min_p, penalties, logit_bias).
    sampling = sampling_params(
        body, "max_output_tokens", logprobs=logprobs, top_logprobs=top_logprobs, defaults=defaults
    )
    reasoning = body.get("reasoning") or {}
    return ResponsesRequest(
        model=body.get("model"),
        input_items=tuple(items),
        instructions=text(body, "instructions"),
        tools=tuple(body.get("tools") or ()),
        offered_tools=tools.offered,
        output=refusing(lambda: _output(body, tools)),
        sampling=sampling,
        max_output_tokens=optional_whole(body, "max_output_tokens"),
        metadata=dict(body.get("metadata") or {}),
        session=session_key(body, fallback_field="safety_identifier"),
        prompt_cache_key=body.get("prompt_cache_key"),
        user=body.get("user"),
        safety_identifier=body.get("safety_identifier"),
        store=flag(body, "store", True),
        stream=flag(body, "stream", False),
        previous_response_id=previous,
        conversation_id=conversation,
        cache_prompt=flag(body, "cache_prompt", True),
        compact_threshold=_compact_threshold(body.get("context_management")),
        template_options=_template_options(body),
        # `reasoning.summary` (or the older `generate_summary`): served as summary parts by a reasoning model,
        # accepted by any other (it has no reasoning to summarize).
        reasoning_summary=reasoning.get("summary") or reasoning.get("generate_summary"),
        seal_reasoning=SEALED_INCLUDE in include,
        compaction_requested=compaction_requested,
    )


def _declared_tools(value: Any) -> ResponsesTools:
    """`tools` as the model is offered them; the hosted tools left out are named on the request's span."""
    tools = responses_tools(value)
    if tools.not_offered:
        trace.get_current_span().set_attribute(trace_attributes.TOOLS_NOT_OFFERED, list(tools.not_offered))
    return tools


def _compaction_trigger(value: Any) -> tuple[Any, bool]:
    """An input that ends with `{"type": "compaction_trigger"}` asks for a compaction of everything before it
    (Codex's remote compaction v2): the input without it, and whether it was there."""
    if isinstance(value, list) and value[-1].get("type") == COMPACTION_TRIGGER:
        return value[:-1], True
    return value, False


def _template_options(body: Mapping[str, Any]) -> TemplateOptions:
    """`reasoning: {"effort", "summary"}`: the effort maps onto the chat template's reasoning switch (the summary is
    read above). `chat_template_kwargs` as on chat."""
    try:
        effort = reasoning_effort((body.get("reasoning") or {}).get("effort"), "reasoning.effort")
        kwargs = template_kwargs(body.get("chat_template_kwargs"))
    except TemplateOptionRefused as refused:
        raise ApiError.invalid(refused.message, param=refused.param) from None
    return TemplateOptions(kwargs=kwargs, reasoning_effort=effort, effort_param="reasoning.effort")


def parse_compact_request(body: dict[str, Any]) -> CompactRequest:
    """`/v1/responses/compact`: the whole history comes as `input`; nothing is stored or streamed."""
    check(responses.COMPACT, body)
    return CompactRequest(
        model=body.get("model"),
        input_items=tuple(input_items(body["input"])),
        instructions=text(body, "instructions"),
        tools=tuple(body.get("tools") or ()),
        offered_tools=_declared_tools(body.get("tools")).offered,
        max_output_tokens=whole(body, "max_output_tokens", DEFAULT_SUMMARY_TOKENS),
        keep_tokens=optional_whole(body, "keep_tokens"),
        session=session_key(body, fallback_field="safety_identifier"),
    )


def _output(body: Mapping[str, Any], tools: ResponsesTools) -> OutputSpec:
    return output_spec.spec(
        output_spec.responses_text_format(body.get("text")),
        output_spec.tool_choice(forced_tool(body.get("tool_choice"), tools), responses=True),
        flag(body, "parallel_tool_calls", True),
        list(tools.offered),
        optional_whole(body, "max_tool_calls"),
    )


def _compact_threshold(value: list[dict[str, Any]] | None) -> int | None:
    """`context_management: [{"type": "compaction", "compact_threshold": N}]` -> N (the last one's)."""
    thresholds = [int(entry["compact_threshold"]) for entry in value or ()]
    return thresholds[-1] if thresholds else None


def _conversation_id(value: str | dict[str, Any] | None) -> str | None:
    """An id, or an object with one."""
    return value.get("id") if isinstance(value, dict) else value
