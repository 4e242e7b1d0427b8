"""Output specs parsed from Chat Completions and Responses bodies: each refusal names its parameter, and the
constraint each accepted spec turns into (checked with a real matcher where the grammar's language matters)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from courier.grammar import output_spec
from courier.grammar.compiler import GrammarCompiler
from courier.grammar.constraint import MAX_SCHEMA_BYTES, MAX_SCHEMA_DEPTH, Constraint, GrammarError, ToolGrammar
from courier.grammar.output_spec import OutputFormat, OutputSpec, ToolChoice
from tests.support.grammar import FORM, accepts, smollm2_compiler

WEATHER: dict[str, Any] = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
CLOCK: dict[str, Any] = {"name": "get_time", "parameters": {"type": "object", "properties": {}}}
CHAT_TOOLS = [{"type": "function", "function": WEATHER}, {"type": "function", "function": CLOCK}]
RESPONSES_TOOLS = [{"type": "function", **WEATHER}, {"type": "function", **CLOCK}]
PERSON = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


@pytest.fixture(scope="module")
def compiler(smollm2_dir: Path) -> GrammarCompiler:
    return smollm2_compiler(smollm2_dir)


def chat(body: Mapping[str, Any], tool_grammar: ToolGrammar | None = FORM) -> Constraint | None:
    """A Chat Completions body's constraint, parsed as the chat route parses it."""
    spec = output_spec.spec(
        output_spec.chat_response_format(body.get("response_format")),
        output_spec.tool_choice(body.get("tool_choice"), responses=False),
        bool(body.get("parallel_tool_calls", True)),
        body.get("tools"),
    )
    return output_spec.constraint(spec, tool_grammar)


def responses(body: Mapping[str, Any], tool_grammar: ToolGrammar | None = FORM) -> Constraint | None:
    """A Responses body's constraint, parsed as the Responses route parses it."""
    spec = output_spec.spec(
        output_spec.responses_text_format(body.get("text")),
        output_spec.tool_choice(body.get("tool_choice"), responses=True),
        bool(body.get("parallel_tool_calls", True)),
        body.get("tools"),
    )
    return output_spec.constraint(spec, tool_grammar)


def deep(containers: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(containers - 1):
        schema = {"type": "array", "items": schema}
    return schema


def json_schema_format(schema: Any, **fields: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, **fields}}


def text_format(schema: Any, **fields: Any) -> dict[str, Any]:
    return {"format": {"type": "json_schema", "name": "answer", "schema": schema, **fields}}


TOO_BIG = {"type": "string", "description": "x" * MAX_SCHEMA_BYTES}
NAMED_CHAT = {"type": "function", "function": {"name": "get_weather"}}
NAMED_RESPONSES = {"type": "function", "name": "get_weather"}

CHAT_REFUSALS: list[tuple[str, dict[str, Any], str]] = [
    # id, the body's fields, param
    ("format not an object", {"response_format": "json"}, "response_format"),
    ("unknown format type", {"response_format": {"type": "yaml"}}, "response_format.type"),
    ("format without a type", {"response_format": {}}, "response_format.type"),
    ("json_schema without its body", {"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    (
        "json_schema without schema",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        "response_format.json_schema.schema",
    ),
    (
        "Responses' flat shape",
        {"response_format": {"type": "json_schema", "name": "x", "schema": PERSON}},
        "response_format.json_schema",
    ),
    ("schema a string", {"response_format": json_schema_format("object")}, "response_format.json_schema.schema"),
    ("empty name", {"response_format": json_schema_format(PERSON, name="")}, "response_format.json_schema.name"),
    ("long name", {"response_format": json_schema_format(PERSON, name="n" * 65)}, "response_format.json_schema.name"),
    (
        "strict a string",
        {"response_format": json_schema_format(PERSON, strict="yes")},
        "response_format.json_schema.strict",
    ),
    (
        "description a number",
        {"response_format": json_schema_format(PERSON, description=1)},
        "response_format.json_schema.description",
    ),
    ("not", {"response_format": json_schema_format({"not": {}})}, "response_format.json_schema.schema"),
    (
        "uniqueItems",
        {"response_format": json_schema_format({"type": "array", "uniqueItems": True})},
        "response_format.json_schema.schema",
    ),
    (
        "bad $ref",
        {"response_format": json_schema_format({"$ref": "#/$defs/gone"})},
        "response_format.json_schema.schema",
    ),
    ("over 64 KiB", {"response_format": json_schema_format(TOO_BIG)}, "response_format.json_schema.schema"),
    (
        "deeper than 32",
        {"response_format": json_schema_format(deep(MAX_SCHEMA_DEPTH + 1))},
        "response_format.json_schema.schema",
    ),
    (
        "named function not a tool",
        {"tools": CHAT_TOOLS, "tool_choice": {**NAMED_CHAT, "function": {"name": "x"}}},
        "tool_choice",
    ),
    ("required without tools", {"tool_choice": "required"}, "tool_choice"),
    ("named without tools", {"tool_choice": NAMED_CHAT}, "tool_choice"),
    ("Responses' named shape", {"tools": CHAT_TOOLS, "tool_choice": NAMED_RESPONSES}, "tool_choice"),
    ("unknown choice", {"tools": CHAT_TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    (
        "function without a name",
        {"tools": CHAT_TOOLS, "tool_choice": {"type": "function", "function": {}}},
        "tool_choice",
    ),
    (
        "empty function name",
        {"tools": CHAT_TOOLS, "tool_choice": {"type": "function", "function": {"name": ""}}},
        "tool_choice",
    ),
]


@pytest.mark.parametrize(("body", "param"), [r[1:] for r in CHAT_REFUSALS], ids=[r[0] for r in CHAT_REFUSALS])
def test_chat_refusals_name_their_param(body: dict[str, Any], param: str) -> None:
    with pytest.raises(GrammarError) as refused:
        chat(body)
    assert refused.value.param == param
    assert refused.value.message


RESPONSES_REFUSALS: list[tuple[str, dict[str, Any], str]] = [
    ("text not an object", {"text": "json"}, "text"),
    ("verbosity", {"text": {"verbosity": "high"}}, "text.verbosity"),
    ("format not an object", {"text": {"format": "json_object"}}, "text.format"),
    ("unknown format type", {"text": {"format": {"type": "xml"}}}, "text.format.type"),
    ("json_schema without schema", {"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    (
        "Chat's nested shape",
        {"text": {"format": {"type": "json_schema", "json_schema": {"name": "x", "schema": PERSON}}}},
        "text.format.schema",
    ),
    ("bad name", {"text": text_format(PERSON, name=7)}, "text.format.name"),
    ("strict a string", {"text": text_format(PERSON, strict="true")}, "text.format.strict"),
    ("if", {"text": text_format({"if": {}, "then": {}})}, "text.format.schema"),
    ("bad $ref", {"text": text_format({"$ref": "#/definitions/gone"})}, "text.format.schema"),
    ("over 64 KiB", {"text": text_format(TOO_BIG)}, "text.format.schema"),
    ("deeper than 32", {"text": text_format(deep(MAX_SCHEMA_DEPTH + 1))}, "text.format.schema"),
    (
        "named function not a tool",
        {"tools": RESPONSES_TOOLS, "tool_choice": {**NAMED_RESPONSES, "name": "x"}},
        "tool_choice",
    ),
    ("required without tools", {"tool_choice": "required"}, "tool_choice"),
    ("Chat's named shape", {"tools": RESPONSES_TOOLS, "tool_choice": NAMED_CHAT}, "tool_choice"),
    ("choice of another type", {"tools": RESPONSES_TOOLS, "tool_choice": {"type": "web_search"}}, "tool_choice"),
]


@pytest.mark.parametrize(("body", "param"), [r[1:] for r in RESPONSES_REFUSALS], ids=[r[0] for r in RESPONSES_REFUSALS])
def test_responses_refusals_name_their_param(body: dict[str, Any], param: str) -> None:
    with pytest.raises(GrammarError) as refused:
        responses(body)
    assert refused.value.param == param
    assert refused.value.message


@pytest.mark.parametrize("value", [None, {"type": "text"}])
def test_plain_text_constrains_nothing(value: Any) -> None:
    assert output_spec.chat_response_format(value) == OutputFormat()
    assert chat({"response_format": value}) is None
    assert chat({"response_format": value, "tools": CHAT_TOOLS}, tool_grammar=None) is None  # native calls, parsed
    assert not output_spec.spec(OutputFormat(), ToolChoice(), True, None).constrained


def test_chat_and_responses_schemas_parse_alike() -> None:
    fields = {"name": "person", "schema": PERSON, "strict": True, "description": "Who."}
    from_chat = output_spec.chat_response_format({"type": "json_schema", "json_schema": fields})
    from_responses = output_spec.responses_text_format({"format": {"type": "json_schema", **fields}})
    assert (from_chat.kind, from_chat.name, from_chat.schema, from_chat.strict) == (
        "json_schema",
        "person",
        PERSON,
        True,
    )
    assert from_chat.param == "response_format.json_schema.schema"
    assert from_responses.param == "text.format.schema"
    assert from_responses.echo() == {"type": "json_schema", **fields}
    assert (
        output_spec.chat_response_format({"type": "json_schema", "json_schema": {"schema": PERSON}}).name == "response"
    )
    assert output_spec.responses_text_format({"format": {"type": "json_object"}}).echo() == {"type": "json_object"}
    assert output_spec.responses_text_format({"verbosity": "medium"}).echo() == {"type": "text"}


def test_a_schema_format_is_its_schema(compiler: GrammarCompiler) -> None:
    constraint = chat({"response_format": json_schema_format(PERSON)})
    assert constraint is not None and constraint.label == "json_schema 'answer'" and not constraint.trigger
    assert accepts(compiler, constraint, '{"name": "Ada"}')
    assert not accepts(compiler, constraint, '{"nom": "Ada"}')
    same = responses({"text": text_format(PERSON)})
    assert same is not None and same.key == constraint.key
    any_object = chat({"response_format": {"type": "json_object"}})
    assert any_object is not None and accepts(compiler, any_object, '{"nom": "Ada"}')


@pytest.mark.parametrize(
    ("choice", "responses_shape", "expected"),
    [
        (None, False, ToolChoice()),
        ("none", True, ToolChoice(mode="none")),
        ("required", False, ToolChoice(mode="required")),
        (NAMED_CHAT, False, ToolChoice(mode="function", name="get_weather")),
        (NAMED_RESPONSES, True, ToolChoice(mode="function", name="get_weather")),
    ],
)
def test_tool_choice_parses_and_echoes_in_its_api_shape(
    choice: Any, responses_shape: bool, expected: ToolChoice
) -> None:
    parsed = output_spec.tool_choice(choice, responses=responses_shape)
    assert parsed == expected
    assert parsed.echo(responses=responses_shape) == (choice if choice is not None else "auto")


def test_functions_are_read_from_both_tool_shapes() -> None:
    assert output_spec.functions(CHAT_TOOLS) == (WEATHER, CLOCK)
    assert [f["name"] for f in output_spec.functions(RESPONSES_TOOLS)] == ["get_weather", "get_time"]
    assert output_spec.functions(None) == ()


def test_tool_choice_none_offers_no_tools() -> None:
    spec = output_spec.spec(OutputFormat(), ToolChoice(mode="none"), True, CHAT_TOOLS)
    assert not spec.tools_offered and not spec.constrained
    assert chat({"tools": CHAT_TOOLS, "tool_choice": "none"}) is None


def call(name: str, arguments: Any) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def test_auto_with_tools_is_a_call_triggered_by_its_marker() -> None:
    constraint = chat({"tools": CHAT_TOOLS})
    assert constraint is not None
    assert constraint.trigger == "<tool_call>" and constraint.repeat is True
    single = chat({"tools": CHAT_TOOLS, "parallel_tool_calls": False})
    assert single is not None and single.repeat is False


def test_required_forces_a_call_to_any_tool(compiler: GrammarCompiler) -> None:
    constraint = responses({"tools": RESPONSES_TOOLS, "tool_choice": "required", "parallel_tool_calls": False})
    assert constraint is not None and not constraint.trigger
    assert accepts(compiler, constraint, call("get_time", {}))
    assert accepts(compiler, constraint, call("get_weather", {"city": "Oslo"}))
    assert not accepts(compiler, constraint, "It is sunny.")
    assert not accepts(compiler, constraint, call("get_time", {}) + "\n" + call("get_time", {}))


def test_a_named_choice_forces_a_call_to_that_function_only(compiler: GrammarCompiler) -> None:
    for constraint in (
        chat({"tools": CHAT_TOOLS, "tool_choice": NAMED_CHAT}),
        responses({"tools": RESPONSES_TOOLS, "tool_choice": NAMED_RESPONSES}),
    ):
        assert constraint is not None and constraint.label == "tool call (get_weather)"
        assert accepts(compiler, constraint, call("get_weather", {"city": "Oslo"}))
        assert not accepts(compiler, constraint, call("get_time", {}))


def test_a_named_choice_is_one_call_then_the_end_even_with_parallel_calls(compiler: GrammarCompiler) -> None:
    once = call("get_weather", {"city": "Oslo"})
    for constraint in (
        chat({"tools": CHAT_TOOLS, "tool_choice": NAMED_CHAT, "parallel_tool_calls": True}),
        responses({"tools": RESPONSES_TOOLS, "tool_choice": NAMED_RESPONSES}),
    ):
        assert constraint is not None and accepts(compiler, constraint, once)
        assert not accepts(compiler, constraint, once + "\n" + once)
    named = output_spec.spec(OutputFormat(), ToolChoice(mode="function", name="get_time"), True, RESPONSES_TOOLS)
    assert named.single_call and named.kept_calls(["first", "second"]) == ["first"]
    required = output_spec.spec(OutputFormat(), ToolChoice(mode="required"), True, RESPONSES_TOOLS)
    assert not required.single_call and required.kept_calls(["first", "second"]) == ["first", "second"]


def test_a_json_format_beside_auto_tools_is_an_answer_or_a_call(compiler: GrammarCompiler) -> None:
    constraint = chat({"tools": CHAT_TOOLS, "response_format": json_schema_format(PERSON)})
    assert constraint is not None and not constraint.trigger  # decided from the first token
    assert accepts(compiler, constraint, '{"name": "Ada"}')
    assert accepts(compiler, constraint, call("get_time", {}))
    assert not accepts(compiler, constraint, "Ada")


def test_an_answer_schema_beside_tools_is_still_bounded() -> None:
    with pytest.raises(GrammarError) as refused:
        chat({"tools": CHAT_TOOLS, "response_format": json_schema_format(deep(MAX_SCHEMA_DEPTH + 1))})
    assert refused.value.param == "response_format.json_schema.schema"


NATIVE_REFUSALS: list[tuple[str, dict[str, Any], str]] = [
    # A model whose own call format Courier cannot write: only auto with non-strict functions is served.
    ("required", {"tools": CHAT_TOOLS, "tool_choice": "required"}, "tool_choice"),
    ("named", {"tools": CHAT_TOOLS, "tool_choice": NAMED_CHAT}, "tool_choice"),
    ("strict function", {"tools": [{"type": "function", "function": {**WEATHER, "strict": True}}]}, "tools"),
    ("JSON format beside tools", {"tools": CHAT_TOOLS, "response_format": {"type": "json_object"}}, "tools"),
]


@pytest.mark.parametrize(("body", "param"), [r[1:] for r in NATIVE_REFUSALS], ids=[r[0] for r in NATIVE_REFUSALS])
def test_a_native_format_refuses_what_needs_a_call_grammar(body: dict[str, Any], param: str) -> None:
    with pytest.raises(GrammarError) as refused:
        chat(body, tool_grammar=None)
    assert refused.value.param == param
    assert "tool_choice 'auto'" in refused.value.message


def test_a_json_format_needs_no_call_grammar_without_tools() -> None:
    constraint = chat({"response_format": {"type": "json_object"}}, tool_grammar=None)
    assert constraint is not None and constraint.label == "json_object"


def test_a_spec_keeps_what_it_was_given() -> None:
    spec = output_spec.spec(OutputFormat(kind="json_object"), ToolChoice(mode="required"), False, RESPONSES_TOOLS)
    assert spec == OutputSpec(
        format=OutputFormat(kind="json_object"),
        tool_choice=ToolChoice(mode="required"),
        parallel_tool_calls=False,
        functions=tuple(RESPONSES_TOOLS),
    )
    assert spec.constrained and spec.tools_offered
