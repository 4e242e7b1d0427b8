"""Validation of a Messages API body into the one internal request (`GenerationRequest`), plus what only this
dialect asks (a thinking budget, the model name to echo).

Each refusal is a 400 naming the field. Fields Anthropic defines that ask for something Courier cannot do (server
tools, MCP servers, a code execution container, clearing tool results) are refused; fields that ask nothing beyond
what it does anyway (`cache_control`, `anthropic-beta` features, `service_tier`, `output_config.effort`) are accepted;
unknown fields are ignored, as on the other routes. `max_tokens` is required, as Anthropic requires it, and capped at
what the context leaves (agents ask for 32,000-128,000 output tokens on every call).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from courier.core.sampling_defaults import OPENAI, SamplingDefaults
from courier.engine.generation import SamplingParams
from courier.grammar import output_spec
from courier.grammar.output_spec import OutputFormat, ToolChoice
from courier.http.anthropic.content import chat_messages
from courier.http.anthropic.context_edits import clear_thinking, thinking_turns_kept
from courier.http.constrained import refusing
from courier.http.errors import ApiError
from courier.http.openai_requests import MAX_TOP_K, GenerationRequest, int_in, number_in
from courier.http.unsupported_fields import Unsupported, refuse_unsupported
from courier.http.validation import optional_bool
from courier.messages.ingress import ChatPrompt

MAX_STOP_SEQUENCES = 32
MAX_USER_ID = 256  # metadata.user_id, as Anthropic bounds it
TOOL_CHOICES = ("auto", "any", "tool", "none")
EFFORTS = ("low", "medium", "high", "xhigh", "max")
UNSUPPORTED: Sequence[Unsupported] = (
    Unsupported("container", "is not supported: this server runs no code execution container"),
    Unsupported(
        "mcp_servers",
        "is not supported: this server connects to no MCP server; send its tools as tools",
        lambda value: value in (None, []),
    ),
    Unsupported(
        "service_tier",
        "other than 'auto' or 'standard_only' cannot be honoured: this server has one tier",
        lambda value: value in (None, "auto", "standard_only"),
    ),
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Thinking:
    """`thinking`: `enabled` and `adaptive` turn the template's reasoning switch on, `disabled` (and no field, as on
    Anthropic) off; `enabled` bounds the reasoning to `budget_tokens`."""

    enabled: bool = False
    budget_tokens: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class MessagesRequest:
    model: str  # as the request named it: the reply echoes it
    generation: GenerationRequest
    thinking: Thinking


def parse_messages_request(
    body: dict[str, Any], defaults: SamplingDefaults = OPENAI, *, counting: bool = False
) -> MessagesRequest:
    """`counting`: a `count_tokens` body, which has no `max_tokens`."""
    refuse_unsupported(body, UNSUPPORTED)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError.invalid("'model' is required: a model name (see /v1/models)", param="model")
    max_tokens = 0 if counting else _max_tokens(body.get("max_tokens"))
    messages, images = chat_messages(body.get("system"), body.get("messages"))
    messages = clear_thinking(messages, thinking_turns_kept(body.get("context_management")))
    tools = _tools(body.get("tools"))
    choice, parallel = _tool_choice(body.get("tool_choice"))
    output = refusing(lambda: output_spec.spec(_output_format(body), choice, parallel, tools))
    if choice.mode == "none":
        tools = None
    thinking = _thinking(body.get("thinking"), max_tokens)
    _effort(body.get("output_config"))
    sampling = SamplingParams(
        max_tokens=max_tokens,
        temperature=number_in(body, "temperature", 0.0, 1.0, min(defaults.temperature, 1.0)),
        top_p=number_in(body, "top_p", 0.0, 1.0, defaults.top_p, open_low=True),
        top_k=int_in(body, "top_k", 0, MAX_TOP_K, 0),
        stop=_stop_sequences(body.get("stop_sequences")),
    )
    generation = GenerationRequest(
        model=model,
        prompt=ChatPrompt(messages=messages, tools=tools, images=images, thinking=thinking.enabled),
        sampling=sampling,
        stream=optional_bool(body, "stream", False),
        include_usage=True,
        tools=tools,
        output=output,
        session=_session(body.get("metadata")),
        fit_to_context=True,
    )
    return MessagesRequest(model=model, generation=generation, thinking=thinking)


def _max_tokens(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ApiError.invalid("'max_tokens' is required: a positive integer", param="max_tokens")
    return value


def _tools(value: Any) -> tuple[Mapping[str, Any], ...] | None:
    """Custom tools as chat's function tools (`input_schema` the parameters); server tools are refused."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise ApiError.invalid("'tools' must be a list", param="tools")
    tools: list[Mapping[str, Any]] = []
    for index, tool in enumerate(value):
        param = f"tools[{index}]"
        if not isinstance(tool, dict):
            raise ApiError.invalid(f"{param} must be an object", param=param)
        kind = tool.get("type", "custom")
        if kind not in (None, "custom"):
            raise ApiError.invalid(
                f"{param}.type {str(kind)[:60]!r}: Anthropic's server tools (web search, code execution, computer "
                "use, ...) are not served here; send custom tools with an input_schema",
                param=f"{param}.type",
            )
        name, schema = tool.get("name"), tool.get("input_schema")
        if not isinstance(name, str) or not name:
            raise ApiError.invalid(f"{param}.name must be a non-empty string", param=f"{param}.name")
        if not isinstance(schema, dict):
            raise ApiError.invalid(f"{param}.input_schema must be a JSON Schema object", param=f"{param}.input_schema")
        if tool.get("defer_loading") not in (None, False):
            where = f"{param}.defer_loading"
            raise ApiError.invalid(f"{where}: tool search is not supported; send the tools themselves", param=where)
        # In chat's order (name, description, parameters): templates render a tool as JSON, keys in order.
        function: dict[str, Any] = {"name": name}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        function["parameters"] = schema
        if tool.get("strict") is not None:
            function["strict"] = tool["strict"]
        tools.append({"type": "function", "function": function})
    return tuple(tools) or None


def _tool_choice(value: Any) -> tuple[ToolChoice, bool]:
    """`{"type": "auto" | "any" | "tool" | "none", "name", "disable_parallel_tool_use"}` as the shared tool choice
    (`any` is OpenAI's `required`, `tool` a named function) and whether calls may be parallel."""
    if value is None:
        return ToolChoice(), True
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in TOOL_CHOICES:
        raise ApiError.invalid(
            f"'tool_choice' must be an object whose type is one of {', '.join(TOOL_CHOICES)}", param="tool_choice"
        )
    assert isinstance(value, dict)
    single = value.get("disable_parallel_tool_use", False)
    if not isinstance(single, bool):
        where = "tool_choice.disable_parallel_tool_use"
        raise ApiError.invalid(f"'{where}' must be a boolean", param=where)
    if kind == "tool":
        name = value.get("name")
        if not isinstance(name, str) or not name:
            raise ApiError.invalid("'tool_choice.name' must name one of the tools", param="tool_choice.name")
        return ToolChoice(mode="function", name=name), not single
    return ToolChoice(mode="required" if kind == "any" else str(kind)), not single


def _output_format(body: dict[str, Any]) -> OutputFormat:
    """`output_config.format` (or the older `output_format`): `{"type": "json_schema", "schema"}`."""
    config = body.get("output_config")
    if config is not None and not isinstance(config, dict):
        raise ApiError.invalid("'output_config' must be an object", param="output_config")
    value, param = (config or {}).get("format"), "output_config.format"
    if value is None:
        value, param = body.get("output_format"), "output_format"
    if value is None:
        return OutputFormat()
    if not isinstance(value, dict) or value.get("type") != "json_schema":
        raise ApiError.invalid(f"'{param}' must be {{'type': 'json_schema', 'schema': {{...}}}}", param=param)
    if not isinstance(value.get("schema"), dict):
        raise ApiError.invalid(f"'{param}.schema' must be a JSON Schema object", param=f"{param}.schema")
    return OutputFormat(kind="json_schema", name="output", schema=value["schema"], strict=True, param=f"{param}.schema")


def _effort(config: Any) -> None:
    """`output_config.effort` is a hint to spend fewer or more tokens: accepted, and the model's own length holds."""
    effort = config.get("effort") if isinstance(config, dict) else None
    if effort is not None and effort not in EFFORTS:
        where = "output_config.effort"
        raise ApiError.invalid(f"'{where}' must be one of {', '.join(EFFORTS)}", param=where)


def _thinking(value: Any, max_tokens: int) -> Thinking:
    if value is None:
        return Thinking()
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "disabled":
        return Thinking()
    if kind == "adaptive":
        return Thinking(enabled=True)
    if kind != "enabled":
        raise ApiError.invalid("'thinking.type' must be enabled, disabled or adaptive", param="thinking.type")
    assert isinstance(value, dict)
    budget = value.get("budget_tokens")
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ApiError.invalid("'thinking.budget_tokens' must be a positive integer", param="thinking.budget_tokens")
    if max_tokens and budget >= max_tokens:
        raise ApiError.invalid(
            "'thinking.budget_tokens' must be less than max_tokens (the reply needs room after its thinking)",
            param="thinking.budget_tokens",
        )
    return Thinking(enabled=True, budget_tokens=budget)


def _stop_sequences(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or len(value) > MAX_STOP_SEQUENCES or not all(isinstance(s, str) for s in value):
        raise ApiError.invalid(
            f"'stop_sequences' must be a list of at most {MAX_STOP_SEQUENCES} strings", param="stop_sequences"
        )
    return tuple(stop for stop in value if stop)


def _session(metadata: Any) -> str:
    """`metadata.user_id` names the prompt-cache session, as `user` does on chat (Claude Code sends one per
    session); any other metadata is the client's own and ignored."""
    if metadata is None:
        return ""
    if not isinstance(metadata, dict):
        raise ApiError.invalid("'metadata' must be an object", param="metadata")
    user = metadata.get("user_id")
    if user is not None and (not isinstance(user, str) or len(user) > MAX_USER_ID):
        where = "metadata.user_id"
        raise ApiError.invalid(f"'{where}' must be a string of at most {MAX_USER_ID} characters", param=where)
    return user or ""
