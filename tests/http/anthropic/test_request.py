"""A Messages API body into the one internal request: what each field becomes, and each refusal naming its field."""

from __future__ import annotations

from typing import Any

import pytest

from courier.core.sampling_defaults import SamplingDefaults
from courier.grammar.output_spec import ToolChoice
from courier.http.anthropic.request import TEMPLATE_EFFORTS, Thinking, parse_messages_request
from courier.http.errors import ApiError
from courier.http.schemas.anthropic import EFFORTS
from courier.messages.ingress import ChatPrompt

USER = [{"role": "user", "content": "Hi"}]
TOOL = {"name": "get_weather", "description": "Weather", "input_schema": {"type": "object"}}
BODY: dict[str, Any] = {"model": "claude-opus-4-8", "max_tokens": 64000, "messages": USER}


def parse(**fields: Any) -> Any:
    return parse_messages_request({**BODY, **fields}, SamplingDefaults(temperature=0.2, top_p=0.9))


def test_a_plain_body_is_an_admission_that_fits_the_context() -> None:
    parsed = parse()
    generation = parsed.generation
    assert parsed.model == generation.model == "claude-opus-4-8"
    assert generation.fit_to_context and generation.sampling.max_tokens == 64000
    assert (generation.sampling.temperature, generation.sampling.top_p, generation.sampling.top_k) == (0.2, 0.9, 0)
    assert isinstance(generation.prompt, ChatPrompt) and generation.prompt.thinking is False
    assert (generation.stream, generation.session, generation.tools) == (False, "", None)
    assert parsed.thinking == Thinking()


def test_sampling_stops_metadata_and_stream() -> None:
    parsed = parse(
        temperature=0,
        top_p=0.5,
        top_k=40,
        stop_sequences=["\n\nHuman:", ""],
        metadata={"user_id": "session-1"},
        stream=True,
    )
    sampling = parsed.generation.sampling
    assert (sampling.temperature, sampling.top_p, sampling.top_k, sampling.stop) == (0.0, 0.5, 40, ("\n\nHuman:",))
    assert (parsed.generation.session, parsed.generation.stream) == ("session-1", True)


@pytest.mark.parametrize(
    ("choice", "mode", "name", "parallel"),
    [
        (None, "auto", None, True),
        ({"type": "auto", "disable_parallel_tool_use": True}, "auto", None, False),
        ({"type": "any"}, "required", None, True),
        ({"type": "tool", "name": "get_weather"}, "function", "get_weather", True),
        ({"type": "none"}, "none", None, True),
    ],
)
def test_tool_choice_is_the_shared_choice(choice: Any, mode: str, name: str | None, parallel: bool) -> None:
    output = parse(tools=[TOOL], tool_choice=choice).generation.output
    assert output.tool_choice == ToolChoice(mode=mode, name=name)
    assert output.parallel_tool_calls is parallel
    assert output.functions[0]["parameters"] == {"type": "object"}


def test_tools_become_function_tools_unless_the_choice_is_none() -> None:
    tools = parse(tools=[{**TOOL, "cache_control": {"type": "ephemeral"}, "strict": True}]).generation.tools
    assert tools == (
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather",
                "parameters": {"type": "object"},
                "strict": True,
            },
        },
    )
    assert tools is not None and list(tools[0]["function"]) == ["name", "description", "parameters", "strict"]
    assert parse(tools=[TOOL], tool_choice={"type": "none"}).generation.tools is None


def test_thinking_types() -> None:
    assert parse(thinking={"type": "adaptive"}).thinking == Thinking(enabled=True)
    assert parse(thinking={"type": "disabled"}).thinking == Thinking()
    enabled = parse(thinking={"type": "enabled", "budget_tokens": 2048})
    assert enabled.thinking == Thinking(enabled=True, budget_tokens=2048)
    prompt = enabled.generation.prompt
    assert isinstance(prompt, ChatPrompt) and prompt.thinking


def test_what_claude_code_sends_beyond_the_basics_is_accepted() -> None:
    parsed = parse(
        thinking={"type": "adaptive"},
        context_management={"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        output_config={"effort": "high"},
        service_tier="auto",
        mcp_servers=[],
    )
    assert parsed.generation.output.format.kind == "text"


@pytest.mark.parametrize("effort", EFFORTS)
def test_every_effort_is_an_advisory_template_option_in_the_templates_words(effort: str) -> None:
    prompt = parse(output_config={"effort": effort}).generation.prompt
    assert isinstance(prompt, ChatPrompt)
    assert prompt.options.effort_advisory and prompt.options.effort_param == "output_config.effort"
    assert prompt.options.reasoning_effort == TEMPLATE_EFFORTS[effort] in ("low", "medium", "high")
    assert prompt.options.for_template("{{ reasoning_effort }}", thinking=True) == {
        "reasoning_effort": TEMPLATE_EFFORTS[effort]
    }
    assert prompt.options.for_template("{{ enable_thinking }}", thinking=True) == {}  # thinking is `thinking`'s
    assert prompt.options.left_out("{{ enable_thinking }}") == ("output_config.effort",)
    assert prompt.options.left_out("{{ reasoning_effort }}") == ()


def test_input_examples_are_written_after_the_description() -> None:
    examples = [{"city": "Paris"}, {"city": "Zürich", "days": 2}]
    (tool,) = parse(tools=[{**TOOL, "input_examples": examples}]).generation.tools
    assert (
        tool["function"]["description"]
        == 'Weather\n\nExample inputs:\n{"city": "Paris"}\n{"city": "Zürich", "days": 2}'
    )
    (bare,) = parse(tools=[{"name": "f", "input_schema": {"type": "object"}, "input_examples": [{}]}]).generation.tools
    assert bare["function"]["description"] == "Example inputs:\n{}"
    (none,) = parse(tools=[{**TOOL, "input_examples": []}]).generation.tools
    assert none["function"]["description"] == "Weather"


def test_output_config_format_is_a_json_schema_answer() -> None:
    schema = {"type": "object", "properties": {"title": {"type": "string"}}, "required": ["title"]}
    output = parse(output_config={"effort": "high", "format": {"type": "json_schema", "schema": schema}}).generation
    assert output.output.format.kind == "json_schema" and output.output.format.schema == schema
    assert output.output.format.param == "output_config.format.schema"


def test_clear_thinking_keeps_the_latest_turns_reasoning() -> None:
    turn = {
        "role": "assistant",
        "content": [{"type": "thinking", "thinking": "t", "signature": ""}, {"type": "text", "text": "a"}],
    }
    history = [*USER, turn, *USER, turn, *USER]
    kept = parse(messages=history, context_management={"edits": [{"type": "clear_thinking_20251015"}]})
    prompt = kept.generation.prompt
    assert isinstance(prompt, ChatPrompt)
    assert ["reasoning_content" in message for message in prompt.messages] == [False, False, False, True, False]
    whole = parse(messages=history, context_management={"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]})
    assert isinstance(whole.generation.prompt, ChatPrompt)
    assert sum("reasoning_content" in message for message in whole.generation.prompt.messages) == 2


def test_count_tokens_needs_no_max_tokens() -> None:
    body = {"model": "m", "messages": USER}
    assert parse_messages_request(body, counting=True).generation.sampling.max_tokens == 0


REFUSED: list[tuple[dict[str, Any], str]] = [
    ({"model": None}, "model"),
    ({"max_tokens": None}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"temperature": 1.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"stop_sequences": "stop"}, "stop_sequences"),
    ({"stop_sequences": ["s"] * 33}, "stop_sequences"),
    ({"metadata": {"user_id": "u" * 257}}, "metadata.user_id"),
    ({"metadata": "me"}, "metadata"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"name": "f"}]}, "tools[0].input_schema"),
    ({"tools": [{"input_schema": {}}]}, "tools[0].name"),
    ({"tools": [{**TOOL, "defer_loading": True}]}, "tools[0].defer_loading"),
    ({"tools": [TOOL], "tool_choice": "auto"}, "tool_choice"),
    ({"tools": [TOOL], "tool_choice": {"type": "tool"}}, "tool_choice.name"),
    ({"tools": [TOOL], "tool_choice": {"type": "tool", "name": "other"}}, "tool_choice"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
    (
        {"tools": [TOOL], "tool_choice": {"type": "auto", "disable_parallel_tool_use": 1}},
        "tool_choice.disable_parallel_tool_use",
    ),
    ({"thinking": {"type": "enabled"}}, "thinking.budget_tokens"),
    ({"thinking": {"type": "enabled", "budget_tokens": 64000}}, "thinking.budget_tokens"),
    ({"thinking": {"type": "always"}}, "thinking.type"),
    ({"output_config": {"effort": "extreme"}}, "output_config.effort"),
    ({"output_config": {"format": {"type": "json_schema"}}}, "output_config.format.schema"),
    ({"output_format": {"type": "regex"}}, "output_format"),
    ({"context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}}, "context_management.edits[0]"),
    (
        {"context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": 2}]}},
        "context_management.edits[0].keep",
    ),
    ({"container": "container_1"}, "container"),
    ({"mcp_servers": [{"type": "url", "url": "https://mcp.example"}]}, "mcp_servers"),
    ({"service_tier": "priority"}, "service_tier"),
]


@pytest.mark.parametrize(("fields", "param"), REFUSED)
def test_refusals_name_the_field(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as refused:
        parse(**fields)
    assert (refused.value.status, refused.value.param) == (400, param)
