"""A Messages API body read into the one internal request (`GenerationRequest`), plus what only this dialect asks (a
thinking budget, the model name to echo).

The body is first checked against its schema (`schemas/anthropic.py`): types, ranges, and the fields Anthropic defines
that ask for what Courier cannot do (server tools, MCP servers, a code execution container, clearing tool results), each
refusal a 400 naming its field; fields that ask nothing beyond what it does anyway (`cache_control`, `anthropic-beta`
features, `service_tier`) are accepted; `output_config.effort` reaches a template that takes an effort, and is left out,
visibly, for one that does not; unknown fields are ignored, as on the other routes. What is left here: a thinking budget
within `max_tokens`, a named tool among the tools, the last message a user's, and the translation. `max_tokens` is
required, as Anthropic requires it, and capped at what the context leaves (agents ask for 32,000-128,000 output tokens
on every call).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from courier.core.sampling_defaults import OPENAI, SamplingDefaults
from courier.core.template_options import NO_OPTIONS, TemplateOptions
from courier.engine.generation import SamplingParams
from courier.grammar import output_spec
from courier.grammar.output_spec import OutputFormat, ToolChoice
from courier.http.anthropic.content import chat_messages
from courier.http.anthropic.context_edits import clear_thinking, thinking_turns_kept
from courier.http.checked_fields import flag, real, whole
from courier.http.constrained import refusing
from courier.http.errors import ApiError
from courier.http.openai_requests import GenerationRequest
from courier.http.schemas import anthropic
from courier.http.schemas.validator import check
from courier.messages.ingress import ChatPrompt

# Anthropic's efforts in a template's words (gpt-oss's reasoning_effort takes low, medium and high).
TEMPLATE_EFFORTS = {"low": "low", "medium": "medium", "high": "high", "xhigh": "high", "max": "high"}


@dataclass(frozen=True, slots=True, kw_only=True)
class Thinking:
    """`thinking`: `enabled` and `adaptive` turn the template's reasoning switch on, `disabled` (and no field, as on
    Anthropic) off; `enabled` bounds the reasoning to `budget_tokens`."""

    enabled: bool = False
    budget_tokens: int | None = None
    shown: bool = True  # `display: "omitted"`: thinking blocks come back with their text empty


@dataclass(frozen=True, slots=True, kw_only=True)
class MessagesRequest:
    model: str  # as the request named it: the reply echoes it
    generation: GenerationRequest
    thinking: Thinking


def parse_messages_request(
    body: dict[str, Any], defaults: SamplingDefaults = OPENAI, *, counting: bool = False
) -> MessagesRequest:
    """`counting`: a `count_tokens` body, which has no `max_tokens`."""
    check(anthropic.COUNT_TOKENS if counting else anthropic.MESSAGES, body)
    model = body["model"]
    max_tokens = 0 if counting else int(body["max_tokens"])
    messages, images = chat_messages(body.get("system"), body["messages"])
    messages = clear_thinking(messages, thinking_turns_kept(body.get("context_management")))
    tools = _tools(body.get("tools"))
    choice, parallel = _tool_choice(body.get("tool_choice"))
    output = refusing(lambda: output_spec.spec(_output_format(body), choice, parallel, tools))
    if choice.mode == "none":
        tools = None
    thinking = _thinking(body.get("thinking"), max_tokens)
    sampling = SamplingParams(
        max_tokens=max_tokens,
        temperature=real(body, "temperature", min(defaults.temperature, 1.0)),
        top_p=real(body, "top_p", defaults.top_p),
        top_k=whole(body, "top_k", 0),
        stop=tuple(stop for stop in body.get("stop_sequences") or () if stop),
    )
    generation = GenerationRequest(
        model=model,
        prompt=ChatPrompt(
            messages=messages, tools=tools, images=images, thinking=thinking.enabled, options=_effort(body)
        ),
        sampling=sampling,
        stream=flag(body, "stream", False),
        include_usage=True,
        tools=tools,
        output=output,
        # `metadata.user_id` names the prompt-cache session, as `user` does on chat (Claude Code sends one per
        # session); any other metadata is the client's own and ignored.
        session=(body.get("metadata") or {}).get("user_id") or "",
        fit_to_context=True,
    )
    return MessagesRequest(model=model, generation=generation, thinking=thinking)


def _tools(value: list[dict[str, Any]] | None) -> tuple[Mapping[str, Any], ...] | None:
    """Custom tools as chat's function tools (`input_schema` the parameters, `input_examples` written after the
    description, where every template shows a function to the model)."""
    tools: list[Mapping[str, Any]] = []
    for tool in value or ():
        # In chat's order (name, description, parameters): templates render a tool as JSON, keys in order.
        function: dict[str, Any] = {"name": tool["name"]}
        description = _with_examples(tool.get("description"), tool.get("input_examples"))
        if description is not None:
            function["description"] = description
        function["parameters"] = tool["input_schema"]
        if tool.get("strict") is not None:
            function["strict"] = tool["strict"]
        tools.append({"type": "function", "function": function})
    return tuple(tools) or None


def _with_examples(description: str | None, examples: list[dict[str, Any]] | None) -> str | None:
    if not examples:
        return description
    lines = "\n".join(json.dumps(example, ensure_ascii=False, separators=(", ", ": ")) for example in examples)
    return f"{description}\n\nExample inputs:\n{lines}" if description else f"Example inputs:\n{lines}"


def _tool_choice(value: dict[str, Any] | None) -> tuple[ToolChoice, bool]:
    """`{"type": "auto" | "any" | "tool" | "none", "name", "disable_parallel_tool_use"}` as the shared tool choice
    (`any` is OpenAI's `required`, `tool` a named function) and whether calls may be parallel."""
    if value is None:
        return ToolChoice(), True
    parallel = not value.get("disable_parallel_tool_use", False)
    kind = value["type"]
    if kind == "tool":
        return ToolChoice(mode="function", name=value["name"]), parallel
    return ToolChoice(mode="required" if kind == "any" else kind), parallel


def _output_format(body: dict[str, Any]) -> OutputFormat:
    """`output_config.format` (or the older `output_format`): `{"type": "json_schema", "schema"}`."""
    value, param = (body.get("output_config") or {}).get("format"), "output_config.format"
    if value is None:
        value, param = body.get("output_format"), "output_format"
    if value is None:
        return OutputFormat()
    return OutputFormat(kind="json_schema", name="output", schema=value["schema"], strict=True, param=f"{param}.schema")


def _effort(body: dict[str, Any]) -> TemplateOptions:
    """`output_config.effort` for a template's `reasoning_effort` variable, in its words (gpt-oss's low, medium,
    high: `xhigh` and `max` ask for its most); a template without one is served without it (template_options.py)."""
    effort = (body.get("output_config") or {}).get("effort")
    if effort is None:
        return NO_OPTIONS
    return TemplateOptions(
        reasoning_effort=TEMPLATE_EFFORTS[effort], effort_param="output_config.effort", effort_advisory=True
    )


def _thinking(value: dict[str, Any] | None, max_tokens: int) -> Thinking:
    """`enabled` and `adaptive` turn thinking on; `enabled` bounds it, and the reply needs room after it."""
    if value is None or value["type"] == "disabled":
        return Thinking()
    shown = value.get("display") != "omitted"
    if value["type"] == "adaptive":
        return Thinking(enabled=True, shown=shown)
    budget = int(value["budget_tokens"])
    if max_tokens and budget >= max_tokens:
        raise ApiError.invalid(
            "'thinking.budget_tokens' must be less than max_tokens (the reply needs room after its thinking)",
            param="thinking.budget_tokens",
        )
    return Thinking(enabled=True, budget_tokens=budget, shown=shown)
