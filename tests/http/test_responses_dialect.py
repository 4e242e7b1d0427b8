"""The Responses dialect agents speak, read without a server: tools (namespaces, custom tools, hosted ones left out),
`tool_choice` in the model's names, `reasoning.summary`, sealed reasoning, `compaction_trigger`, and calls read back
into the items their tools define."""

from __future__ import annotations

import secrets
from typing import Any

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from courier.conversation.chat_render import chat_messages, chat_tools
from courier.conversation.sealed import ReasoningSeal, derived_key
from courier.core.tools import custom as custom_tools
from courier.core.tools.calls import ToolCall
from courier.core.tools.generic import render
from courier.http.errors import ApiError
from courier.http.responses.items import input_items, unsealed
from courier.http.responses.request import parse_responses_request
from courier.http.responses.tools import responses_tools
from courier.runtime import trace_attributes
from courier.runtime.tracing import tracer

FUNCTION = {"type": "function", "name": "exec_command", "parameters": {"type": "object", "properties": {}}}
NAMESPACE = {
    "type": "namespace",
    "name": "multi_agent_v1",
    "description": "Sub-agents.",
    "tools": [
        {"type": "function", "name": "close_agent", "parameters": {"type": "object"}},
        {"type": "custom", "name": "note", "format": {"type": "grammar", "syntax": "regex", "definition": "[a-z]+"}},
    ],
}


def parse(**body: Any) -> Any:
    return parse_responses_request({"input": "hi", **body})


def refusal(**body: Any) -> ApiError:
    with pytest.raises(ApiError) as refused:
        parse(**body)
    return refused.value


def test_namespaces_are_flattened_under_qualified_names_and_hosted_tools_left_out() -> None:
    tools = responses_tools([FUNCTION, NAMESPACE, {"type": "web_search", "external_web_access": False}])
    assert [tool["name"] for tool in tools.offered] == [
        "exec_command",
        "multi_agent_v1.close_agent",
        "multi_agent_v1.note",
    ]
    assert tools.offered[2] == {
        "type": "custom",
        "name": "multi_agent_v1.note",
        "format": {"type": "grammar", "syntax": "regex", "definition": "[a-z]+"},
    }
    assert tools.not_offered == ("web_search",)
    call = tools.call_item(ToolCall(id="call_1", name="multi_agent_v1.close_agent", arguments="{}"))
    assert {key: call[key] for key in ("type", "name", "namespace", "arguments")} == {
        "type": "function_call",
        "name": "close_agent",
        "namespace": "multi_agent_v1",
        "arguments": "{}",
    }
    custom = tools.call_item(ToolCall(id="call_2", name="multi_agent_v1.note", arguments="abc"))
    assert {key: custom[key] for key in ("type", "name", "namespace", "input", "call_id")} == {
        "type": "custom_tool_call",
        "name": "note",
        "namespace": "multi_agent_v1",
        "input": "abc",
        "call_id": "call_2",
    }
    plain = tools.call_item(ToolCall(id="call_3", name="exec_command", arguments="{}"))
    assert "namespace" not in plain


def test_the_hosted_tools_left_out_are_named_on_the_request_span(span_exporter: InMemorySpanExporter) -> None:
    with tracer().start_as_current_span("POST /v1/responses"):
        parsed = parse(tools=[{"type": "web_search"}, {"type": "file_search", "vector_store_ids": []}, FUNCTION])
    assert [tool["name"] for tool in parsed.model_tools] == ["exec_command"]
    (span,) = span_exporter.get_finished_spans()
    assert span.attributes is not None
    assert tuple(span.attributes[trace_attributes.TOOLS_NOT_OFFERED]) == ("web_search", "file_search")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("choice", "forced"),
    [
        ({"type": "function", "name": "close_agent"}, "multi_agent_v1.close_agent"),
        ({"type": "function", "name": "close_agent", "namespace": "multi_agent_v1"}, "multi_agent_v1.close_agent"),
        ({"type": "custom", "name": "note"}, "multi_agent_v1.note"),
        ({"type": "function", "name": "exec_command"}, "exec_command"),
    ],
)
def test_tool_choice_names_a_tool_as_the_model_knows_it(choice: dict[str, str], forced: str) -> None:
    parsed = parse(tools=[FUNCTION, NAMESPACE], tool_choice=choice)
    assert (parsed.output.tool_choice.mode, parsed.output.tool_choice.name) == ("function", forced)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": [{"type": "web_search"}], "tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
        ({"tools": [FUNCTION], "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}, "tool_choice"),
        ({"tools": [{"type": "hologram"}]}, "tools[0].type"),
        ({"tools": [{**NAMESPACE, "tools": []}]}, "tools[0].tools"),
        ({"tools": [{**NAMESPACE, "tools": [{"type": "web_search"}]}]}, "tools[0].tools[0].type"),
        ({"tools": [FUNCTION, FUNCTION]}, "tools[1].name"),
        (
            {"tools": [{"type": "custom", "name": "x", "format": {"type": "grammar", "syntax": "ebnf"}}]},
            "tools[0].format.syntax",
        ),
        (
            {"tools": [{"type": "custom", "name": "x", "format": {"type": "grammar", "syntax": "lark"}}]},
            "tools[0].format.definition",
        ),
        ({"reasoning": {"summary": "verbose"}}, "reasoning.summary"),
        ({"include": ["reasoning.secret"]}, "include[0]"),
        ({"input": [{"type": "compaction_trigger"}, {"role": "user", "content": "hi"}]}, "input[0]"),
    ],
)
def test_what_cannot_be_honoured_is_a_400_naming_it(body: dict[str, Any], param: str) -> None:
    assert refusal(**body).param == param


def test_summary_seal_and_compaction_trigger_are_read() -> None:
    parsed = parse(
        reasoning={"summary": "auto"},
        include=["reasoning.encrypted_content"],
        input=[{"role": "user", "content": "hi"}, {"type": "compaction_trigger"}],
    )
    assert (parsed.reasoning_summary, parsed.seal_reasoning, parsed.compaction_requested) == ("auto", True, True)
    assert [item["type"] for item in parsed.input_items] == ["message"]
    plain = parse()
    assert (plain.reasoning_summary, plain.seal_reasoning, plain.compaction_requested) == (None, False, False)


def test_a_sealed_reasoning_item_opens_only_with_its_key() -> None:
    seal = ReasoningSeal(secrets.token_bytes(32))
    sealed = seal.seal("Two and two make four.")
    (item,) = input_items([{"type": "reasoning", "summary": [], "encrypted_content": sealed}])
    assert item["content"] == [{"type": "reasoning_text", "text": ""}]  # nothing read before it is opened
    (opened,) = unsealed(seal, [item])
    assert opened["content"] == [{"type": "reasoning_text", "text": "Two and two make four."}]
    altered = sealed[:-2] + ("AA" if not sealed.endswith("AA") else "BB")
    for bad in (altered, ReasoningSeal(secrets.token_bytes(32)).seal("x"), "crs1.", "crs1.!!!!", "plain"):
        with pytest.raises(ApiError) as refused:
            unsealed(seal, input_items([{"type": "reasoning", "summary": [], "encrypted_content": bad}]))
        assert refused.value.param == "input[0].encrypted_content"
        assert refused.value.code == "invalid_encrypted_content"


def test_a_sealing_key_derived_from_the_compaction_key_is_stable_and_its_own() -> None:
    secret = b"a-test-key-of-32-random-bytes!!!"
    assert derived_key(secret) == derived_key(secret) != secret
    sealed = ReasoningSeal(derived_key(secret)).seal("kept across replicas")
    assert ReasoningSeal(derived_key(secret)).unseal(sealed) == "kept across replicas"


def test_custom_calls_render_as_the_model_writes_them() -> None:
    tools = responses_tools([NAMESPACE]).offered
    items = input_items(
        [
            {"role": "user", "content": "note it"},
            {
                "type": "custom_tool_call",
                "call_id": "c1",
                "name": "note",
                "namespace": "multi_agent_v1",
                "input": "ab\ncd",
            },
            {"type": "custom_tool_call_output", "call_id": "c1", "output": "noted"},
        ]
    )
    messages = render(chat_messages(None, items), chat_tools(tools))
    assert messages[2] == {
        "role": "assistant",
        "content": '<tool_call>\n{"name": "multi_agent_v1.note"}\nab\ncd\n</tool_call>',
    }
    assert "<tool_response>\nnoted\n</tool_response>" in messages[3]["content"]
    assert "alone on the first line" in messages[0]["content"]  # the model is told how to write the input
    raw = '\n{"name": "multi_agent_v1.note"}\nab\ncd\n'
    assert custom_tools.parse_call(raw, {"multi_agent_v1.note"}) == ("multi_agent_v1.note", "ab\ncd")
    assert custom_tools.parse_call('\n{"name": "x", "arguments": {}}\n', {"x"}) is None
    assert custom_tools.parse_call("\nnot json\n", {"x"}) is None
