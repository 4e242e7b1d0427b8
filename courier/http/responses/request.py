"""Validation of `/v1/responses` (and `/v1/responses/input_tokens`) bodies into a typed request.

Each refusal is a 400 naming the offending `param`. Unknown fields are ignored;
known features this server cannot honour (background mode, `truncation: auto`, forcing a hosted tool)
are refused, never silently dropped. Hosted tools merely declared are left out of what the model is
offered (`tools.py`), and the request's span lists them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry import trace

from courier.conversation.request import CompactRequest, ResponsesRequest
from courier.core.sampling_defaults import OPENAI, SamplingDefaults
from courier.core.template_options import TemplateOptionRefused, TemplateOptions, reasoning_effort, template_kwargs
from courier.grammar import output_spec
from courier.grammar.output_spec import OutputSpec
from courier.http import unsupported_fields
from courier.http.constrained import refusing
from courier.http.errors import ApiError
from courier.http.openai_requests import (
    MAX_TOP_LOGPROBS_CHAT,
    int_in,
    model_name,
    optional_positive_int,
    sampling_params,
    session_key,
)
from courier.http.responses.items import COMPACTION_TRIGGER, input_items
from courier.http.responses.tools import ResponsesTools, forced_tool, responses_tools
from courier.http.unsupported_fields import Unsupported, refuse_obfuscation, refuse_unsupported
from courier.http.validation import optional_bool, optional_str
from courier.runtime import trace_attributes

MAX_METADATA_ENTRIES = 16
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512


def parse_responses_request(
    body: dict[str, Any],
    defaults: SamplingDefaults = OPENAI,
    unsupported: Sequence[Unsupported] = unsupported_fields.RESPONSES,
) -> ResponsesRequest:
    """`unsupported`: the OpenAI fields refused (`/v1/responses/input_tokens` has one more)."""
    _refuse_unsupported(body)
    refuse_unsupported(body, unsupported)
    previous = optional_str(body, "previous_response_id") or None
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
    instructions = optional_str(body, "instructions") or None
    top_logprobs = int_in(body, "top_logprobs", 0, MAX_TOP_LOGPROBS_CHAT, 0)
    max_output_tokens = optional_positive_int(body, "max_output_tokens")
    include = _include(body.get("include"))
    logprobs = LOGPROBS_INCLUDE in include or top_logprobs > 0
    # Beyond OpenAI's fields, the sampling extensions chat takes (seed, stop, top_k, min_p, penalties, logit_bias).
    sampling = sampling_params(
        body, "max_output_tokens", logprobs=logprobs, top_logprobs=top_logprobs, defaults=defaults
    )
    _stream_options(body.get("stream_options"))
    return ResponsesRequest(
        model=model_name(body),
        input_items=tuple(items),
        instructions=instructions,
        tools=tuple(body.get("tools") or ()),
        offered_tools=tools.offered,
        output=refusing(lambda: _output(body, tools)),
        sampling=sampling,
        max_output_tokens=max_output_tokens,
        metadata=parse_metadata(body.get("metadata")),
        session=session_key(body, fallback_field="safety_identifier"),
        prompt_cache_key=optional_str(body, "prompt_cache_key"),
        user=optional_str(body, "user"),
        safety_identifier=optional_str(body, "safety_identifier"),
        store=optional_bool(body, "store", True),
        stream=optional_bool(body, "stream", False),
        previous_response_id=previous,
        conversation_id=conversation,
        cache_prompt=optional_bool(body, "cache_prompt", True),
        compact_threshold=_compact_threshold(body.get("context_management")),
        template_options=_template_options(body),
        reasoning_summary=_reasoning_summary(body.get("reasoning")),
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
    if (
        isinstance(value, list)
        and value
        and isinstance(value[-1], dict)
        and value[-1].get("type") == COMPACTION_TRIGGER
    ):
        return value[:-1], True
    return value, False


SUMMARIES = ("auto", "concise", "detailed")


def _reasoning_summary(value: Any) -> str | None:
    """`reasoning.summary` (or the older `generate_summary`): served as summary parts by a reasoning model,
    accepted by any other (it has no reasoning to summarize)."""
    if not isinstance(value, dict):
        return None
    for key in ("summary", "generate_summary"):
        summary = value.get(key)
        if summary is None:
            continue
        if summary not in SUMMARIES:
            raise ApiError.invalid(f"'reasoning.{key}' must be one of {', '.join(SUMMARIES)}", param=f"reasoning.{key}")
        return str(summary)
    return None


def _template_options(body: Mapping[str, Any]) -> TemplateOptions:
    """`reasoning: {"effort", "summary"}`: the effort maps onto the chat template's reasoning switch (the summary is
    `_reasoning_summary`'s). `chat_template_kwargs` as on chat."""
    value = body.get("reasoning")
    if value is not None and not isinstance(value, dict):
        raise ApiError.invalid("'reasoning' must be an object", param="reasoning")
    value = value or {}
    try:
        effort = reasoning_effort(value.get("effort"), "reasoning.effort")
        kwargs = template_kwargs(body.get("chat_template_kwargs"))
    except TemplateOptionRefused as refused:
        raise ApiError.invalid(refused.message, param=refused.param) from None
    return TemplateOptions(kwargs=kwargs, reasoning_effort=effort, effort_param="reasoning.effort")


# `include` values: logprobs turns them on; sealed reasoning seals each reasoning item (its text stays in `content`
# too); the others are sent anyway (input images keep their URL) or concern hosted tools, which are never offered.
LOGPROBS_INCLUDE = "message.output_text.logprobs"
SEALED_INCLUDE = "reasoning.encrypted_content"
INCLUDABLE = frozenset(
    {
        LOGPROBS_INCLUDE,
        SEALED_INCLUDE,
        "message.input_image.image_url",
        "file_search_call.results",
        "web_search_call.results",
        "web_search_call.action.sources",
        "code_interpreter_call.outputs",
        "computer_call_output.output.image_url",
    }
)


def _include(value: Any) -> frozenset[str]:
    """`include`'s values. Values this server does not know are refused."""
    if value is None:
        return frozenset()
    if not isinstance(value, list):
        raise ApiError.invalid("'include' must be a list of strings", param="include")
    for index, entry in enumerate(value):
        if not isinstance(entry, str) or entry not in INCLUDABLE:
            raise ApiError.invalid(
                f"include[{index}]: {str(entry)[:80]!r} is not supported; one of {sorted(INCLUDABLE)}",
                param=f"include[{index}]",
            )
    return frozenset(value)


def _stream_options(value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, dict):
        raise ApiError.invalid("'stream_options' must be an object", param="stream_options")
    refuse_obfuscation(value)


DEFAULT_SUMMARY_TOKENS = 1024
MAX_SUMMARY_TOKENS = 16384


def parse_compact_request(body: dict[str, Any]) -> CompactRequest:
    """`/v1/responses/compact`: the whole history comes as `input`; nothing is stored or streamed."""
    refuse_unsupported(body, unsupported_fields.COMPACT)
    for field in ("stream", "previous_response_id", "conversation"):
        if body.get(field) not in (None, False):
            message = f"'{field}' is not supported on /v1/responses/compact: send the whole history as 'input'"
            raise ApiError.invalid(message, param=field)
    if body.get("input") is None:
        raise ApiError.invalid("'input' is required", param="input")
    keep_tokens = body.get("keep_tokens")
    if keep_tokens is not None and (
        isinstance(keep_tokens, bool) or not isinstance(keep_tokens, int) or keep_tokens < 1
    ):
        raise ApiError.invalid("'keep_tokens' must be a positive integer", param="keep_tokens")
    return CompactRequest(
        model=model_name(body),
        input_items=tuple(input_items(body["input"])),
        instructions=optional_str(body, "instructions") or None,
        tools=tuple(body.get("tools") or ()),
        offered_tools=_declared_tools(body.get("tools")).offered,
        max_output_tokens=int_in(body, "max_output_tokens", 1, MAX_SUMMARY_TOKENS, DEFAULT_SUMMARY_TOKENS),
        keep_tokens=keep_tokens,
        session=session_key(body, fallback_field="safety_identifier"),
    )


def parse_metadata(value: Any, param: str = "metadata") -> dict[str, str]:
    """At most 16 string pairs; keys up to 64 characters, values up to 512."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ApiError.invalid(f"'{param}' must be an object of strings", param=param)
    if len(value) > MAX_METADATA_ENTRIES:
        raise ApiError.invalid(f"'{param}' holds at most {MAX_METADATA_ENTRIES} entries", param=param)
    for key, entry in value.items():
        if len(key) > MAX_METADATA_KEY or not isinstance(entry, str) or len(entry) > MAX_METADATA_VALUE:
            message = (
                f"'{param}' keys must be strings of at most {MAX_METADATA_KEY} characters and values strings "
                f"of at most {MAX_METADATA_VALUE}"
            )
            raise ApiError.invalid(message, param=f"{param}.{key}")
    return dict(value)


def _refuse_unsupported(body: Mapping[str, Any]) -> None:
    if body.get("background") not in (None, False):
        raise ApiError.invalid("'background': true is not supported; stream the response instead", param="background")
    truncation = body.get("truncation")
    if truncation not in (None, "disabled"):
        message = f"'truncation': {truncation!r} is not supported; only 'disabled' (too long an input is a 400)"
        raise ApiError.invalid(message, param="truncation")
    if body.get("n") not in (None, 1):
        raise ApiError.invalid("only one output per response is supported", param="n")


def _output(body: Mapping[str, Any], tools: ResponsesTools) -> OutputSpec:
    return output_spec.spec(
        output_spec.responses_text_format(body.get("text")),
        output_spec.tool_choice(forced_tool(body.get("tool_choice"), tools), responses=True),
        optional_bool(dict(body), "parallel_tool_calls", True),
        list(tools.offered),
        optional_positive_int(body, "max_tool_calls"),
    )


def _compact_threshold(value: Any) -> int | None:
    """`context_management: [{"type": "compaction", "compact_threshold": N}]` -> N."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise ApiError.invalid("'context_management' must be a list", param="context_management")
    threshold = None
    for index, entry in enumerate(value):
        param = f"context_management[{index}]"
        if not isinstance(entry, dict) or entry.get("type") != "compaction":
            raise ApiError.invalid(f"{param}: only type 'compaction' is supported", param=f"{param}.type")
        raw = entry.get("compact_threshold")
        if isinstance(raw, bool) or not isinstance(raw, int) or raw < 1:
            message = f"{param}.compact_threshold must be a positive number of tokens"
            raise ApiError.invalid(message, param=f"{param}.compact_threshold")
        threshold = raw
    return threshold


def _conversation_id(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, dict):
        value = value.get("id")
    if not isinstance(value, str) or not value:
        raise ApiError.invalid("'conversation' must be a conversation id or an object with one", param="conversation")
    return value
