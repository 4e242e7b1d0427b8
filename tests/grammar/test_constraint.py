"""Constraints built from JSON schemas and tool lists: refusals naming their parameter, bounds, and the grammars'
language, checked by running a real matcher over the SmolLM2 vocabulary."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import orjson
import pytest

from courier.core.json_text import nesting_depth
from courier.grammar.compiler import GrammarCompiler
from courier.grammar.constraint import (
    MAX_SCHEMA_BYTES,
    MAX_SCHEMA_DEPTH,
    MAX_TOOLS,
    GrammarError,
    ToolGrammar,
    json_object,
    json_schema,
    tool_calls,
)
from tests.support.grammar import FORM, WEATHER, accepts, smollm2_compiler

PARAM = "response_format.json_schema.schema"


@pytest.fixture(scope="module")
def compiler(smollm2_dir: Path) -> GrammarCompiler:
    return smollm2_compiler(smollm2_dir)


def nested_arrays(containers: int) -> dict[str, Any]:
    """A schema `containers` objects deep: arrays of arrays ... of integers."""
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(containers - 1):
        schema = {"type": "array", "items": schema}
    return schema


def sized(size: int) -> dict[str, Any]:
    """A string schema whose compact JSON takes exactly `size` bytes."""
    empty = len(orjson.dumps({"description": "", "type": "string"}))
    return {"type": "string", "description": "x" * (size - empty)}


REFUSED: list[tuple[str, Any, str]] = [
    # id, schema, a phrase of the message
    ("not", {"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, "Unimplemented keys"),
    ("if-then", {"if": {"type": "string"}, "then": {"maxLength": 2}}, "Unimplemented keys"),
    ("uniqueItems", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "Unimplemented keys"),
    ("missing $defs entry", {"$ref": "#/$defs/person", "$defs": {}}, "does not exist"),
    ("missing definitions", {"type": "object", "properties": {"a": {"$ref": "#/definitions/x"}}}, "does not exist"),
    ("bad pattern", {"type": "string", "pattern": "(unclosed"}, "regex parse error"),
    ("not an object", ["type", "string"], "must be a JSON Schema object"),
    ("over 64 KiB", sized(MAX_SCHEMA_BYTES + 1), f"the most a schema may take is {MAX_SCHEMA_BYTES}"),
    ("deeper than 32", nested_arrays(MAX_SCHEMA_DEPTH + 1), f"nests deeper than {MAX_SCHEMA_DEPTH} levels"),
    ("not JSON", {"type": "string", "default": {1, 2}}, "is not JSON"),
    ("overlapping oneOf", {"oneOf": [{"type": "number"}, {"type": "integer"}]}, "may overlap"),
]


@pytest.mark.parametrize(("schema", "phrase"), [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_a_schema_that_cannot_be_honoured_is_refused_naming_its_param(schema: Any, phrase: str) -> None:
    with pytest.raises(GrammarError) as refused:
        json_schema(schema, name="answer", param=PARAM)
    assert refused.value.param == PARAM
    assert phrase in refused.value.message
    assert str(refused.value) == refused.value.message


def test_a_schema_of_exactly_the_most_bytes_is_accepted() -> None:
    at_size = sized(MAX_SCHEMA_BYTES)
    assert len(orjson.dumps(at_size, option=orjson.OPT_SORT_KEYS)) == MAX_SCHEMA_BYTES
    assert json_schema(at_size, name="big", param=PARAM).grammar


def test_a_schema_exactly_as_deep_as_the_bound_is_accepted() -> None:
    """32 containers deep is not "deeper than 32 levels", as Courier measures JSON depth elsewhere (json_text)."""
    deepest = nested_arrays(MAX_SCHEMA_DEPTH)
    assert nesting_depth(deepest) == MAX_SCHEMA_DEPTH
    assert json_schema(deepest, name="deep", param=PARAM).grammar


PERSON: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 2},
        "pet": {"$ref": "#/$defs/pet"},
        "age": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 150}, {"type": "null"}]},
    },
    "required": ["name", "address", "tags", "pet", "age"],
    "additionalProperties": False,
    "$defs": {"pet": {"enum": ["cat", "dog"]}},
}
VALID_PERSON: dict[str, Any] = {
    "name": "Ada",
    "address": {"city": "Paris", "zip": "75001"},
    "tags": ["a"],
    "pet": "cat",
    "age": None,
}

ACCEPTED: list[tuple[str, dict[str, Any], bool]] = [
    # id, an instance, whether the schema admits it
    ("valid", VALID_PERSON, True),
    ("integer age", {**VALID_PERSON, "age": 36}, True),
    ("two tags", {**VALID_PERSON, "tags": ["a", "b"]}, True),
    ("no tags (minItems)", {**VALID_PERSON, "tags": []}, False),
    ("three tags (maxItems)", {**VALID_PERSON, "tags": ["a", "b", "a"]}, False),
    ("tag outside the enum", {**VALID_PERSON, "tags": ["c"]}, False),
    ("pet outside the $defs enum", {**VALID_PERSON, "pet": "cow"}, False),
    ("zip off the pattern", {**VALID_PERSON, "address": {"city": "Paris", "zip": "7500"}}, False),
    ("age over the maximum", {**VALID_PERSON, "age": 151}, False),
    ("age a string (anyOf)", {**VALID_PERSON, "age": "old"}, False),
    ("name over maxLength", {**VALID_PERSON, "name": "Augustine!"}, False),
    ("extra property", {**VALID_PERSON, "extra": 1}, False),
    ("nested extra property", {**VALID_PERSON, "address": {"city": "P", "zip": "75001", "x": 1}}, False),
    ("missing required", {k: v for k, v in VALID_PERSON.items() if k != "pet"}, False),
]


@pytest.mark.parametrize(("instance", "valid"), [a[1:] for a in ACCEPTED], ids=[a[0] for a in ACCEPTED])
def test_a_supported_schema_admits_exactly_its_instances(
    compiler: GrammarCompiler, instance: dict[str, Any], valid: bool
) -> None:
    constraint = json_schema(PERSON, name="person", param=PARAM)
    assert accepts(compiler, constraint, json.dumps(instance)) is valid


def test_json_is_written_in_the_shape_json_dumps_writes(compiler: GrammarCompiler) -> None:
    constraint = json_schema({"type": "object"}, name="any", param=PARAM)
    assert accepts(compiler, constraint, '{"a": [1, 2], "b": {"c": null}}')
    assert not accepts(compiler, constraint, '{"a":[1,2]}')  # no whitespace beyond json.dumps' own
    assert not accepts(compiler, constraint, '{"a": 1} ')
    assert not accepts(compiler, constraint, '\n{"a": 1}')


def test_json_object_admits_any_object_and_nothing_else(compiler: GrammarCompiler) -> None:
    constraint = json_object()
    assert constraint.label == "json_object" and not constraint.trigger
    assert accepts(compiler, constraint, "{}")
    assert accepts(compiler, constraint, '{"x": [true, {"y": "z"}]}')
    assert not accepts(compiler, constraint, "[1]")
    assert not accepts(compiler, constraint, '"text"')


def test_the_cache_key_follows_the_grammar() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    first = json_schema(schema, name="one", param=PARAM)
    assert json_schema(dict(schema), name="two", param="text.format.schema").key == first.key  # names do not count
    assert json_schema({"type": "object"}, name="one", param=PARAM).key != first.key
    assert first.label == "json_schema 'one'"
    auto = tool_calls([WEATHER], FORM, forced=False, parallel=True, param="tools")
    single = tool_calls([WEATHER], FORM, forced=False, parallel=False, param="tools")
    assert auto.grammar == single.grammar and auto.key != single.key  # the same grammar, repeated or not


LOOSE: dict[str, Any] = {"name": "lookup", "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}


def call(name: str, arguments: Any) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def test_a_forced_call_admits_only_calls_to_the_tools(compiler: GrammarCompiler) -> None:
    constraint = tool_calls([WEATHER, LOOSE], FORM, forced=True, parallel=False, param="tools")
    assert not constraint.trigger and constraint.label == "tool call (get_weather, lookup)"
    assert accepts(compiler, constraint, call("get_weather", {"city": "Oslo"}))
    assert not accepts(compiler, constraint, call("get_weather", {"city": "Rome"}))  # its parameters hold
    assert accepts(compiler, constraint, call("lookup", {"q": "tides", "more": [1]}))
    assert not accepts(compiler, constraint, call("lookup", {"q": 1}))  # not strict, and still its parameters
    assert not accepts(compiler, constraint, call("lookup", []))  # arguments are an object
    assert not accepts(compiler, constraint, call("delete_all", {}))
    assert not accepts(compiler, constraint, "Sure! " + call("lookup", {}))
    two = call("lookup", {}) + "\n" + call("get_weather", {"city": "Paris"})
    assert not accepts(compiler, constraint, two)
    parallel = tool_calls([WEATHER, LOOSE], FORM, forced=True, parallel=True, param="tools")
    assert accepts(compiler, parallel, two)


def test_a_function_whose_parameters_cannot_constrain_takes_any_object_unless_strict(
    compiler: GrammarCompiler,
) -> None:
    odd = {"name": "odd", "parameters": {"type": "object", "not": {"required": ["x"]}}}
    constraint = tool_calls([odd], FORM, forced=True, parallel=False, param="tools")
    assert accepts(compiler, constraint, call("odd", {"x": 1}))
    assert not accepts(compiler, constraint, call("odd", "x"))
    with pytest.raises(GrammarError) as refused:
        tool_calls([LOOSE, {**odd, "strict": True}], FORM, forced=True, parallel=False, param="tools")
    assert refused.value.param == "tools[1]"
    assert "Unimplemented keys" in refused.value.message


def test_an_auto_call_is_triggered_by_the_start_marker(compiler: GrammarCompiler) -> None:
    constraint = tool_calls([WEATHER], FORM, forced=False, parallel=False, param="tools")
    assert constraint.trigger == "<tool_call>" and constraint.repeat is False
    # The grammar holds from just after the marker: the call's body and its end marker.
    assert accepts(compiler, constraint, call("get_weather", {"city": "Paris"}).removeprefix("<tool_call>"))
    assert not accepts(compiler, constraint, call("get_weather", {"city": "Paris"}))


def test_a_json_answer_can_stand_beside_forced_tools(compiler: GrammarCompiler) -> None:
    answer = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    constraint = tool_calls([WEATHER], FORM, forced=True, parallel=True, param="tools", answer_schema=answer)
    assert constraint.label.startswith("JSON answer or tool call")
    assert accepts(compiler, constraint, '{"ok": true}')
    assert accepts(compiler, constraint, call("get_weather", {"city": "Paris"}))
    assert not accepts(compiler, constraint, '{"ok": 1}')


def test_special_token_markers_are_matched_as_those_tokens(compiler: GrammarCompiler) -> None:
    tokenize = compiler.tokenizer.tokenize_str
    start, end = tokenize("<repo_name>"), tokenize("<file_sep>")
    assert len(start) == len(end) == 1  # special tokens of the SmolLM2 vocabulary
    form = ToolGrammar(start="<repo_name>", end="<file_sep>", start_token=start[0], end_token=end[0])
    constraint = tool_calls([WEATHER], form, forced=True, parallel=False, param="tools")
    body = tokenize("\n" + json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}}) + "\n")
    matcher = compiler.matcher(constraint)
    assert matcher.consume_tokens([*start, *body, *end])
    assert matcher.is_accepting()
    spelled = compiler.matcher(constraint)  # the marker's text in ordinary tokens is not the marker
    assert not spelled.consume_tokens([*tokenize("<"), *tokenize("repo_name>"), *body, *end])


TOOL_REFUSALS: list[tuple[str, list[dict[str, Any]], str, str]] = [
    # id, tools, param, a phrase of the message
    ("no tools", [], "tools", "no tools to call"),
    ("too many", [{**LOOSE, "name": f"f{i}"} for i in range(MAX_TOOLS + 1)], "tools", f"at most {MAX_TOOLS}"),
    ("nameless", [LOOSE, {"parameters": {}}], "tools[1]", "needs a name"),
    ("bad strict keyword", [{**WEATHER, "parameters": {"not": {}}}], "tools[0]", "Unimplemented keys"),
    ("strict too deep", [{**WEATHER, "parameters": nested_arrays(MAX_SCHEMA_DEPTH)}], "tools", "nests deeper"),
]


@pytest.mark.parametrize(
    ("tools", "param", "phrase"), [r[1:] for r in TOOL_REFUSALS], ids=[r[0] for r in TOOL_REFUSALS]
)
def test_tools_that_cannot_be_constrained_are_refused(tools: list[dict[str, Any]], param: str, phrase: str) -> None:
    with pytest.raises(GrammarError) as refused:
        tool_calls(tools, FORM, forced=True, parallel=True, param="tools")
    assert refused.value.param == param
    assert phrase in refused.value.message


def test_as_many_tools_as_the_bound_are_accepted() -> None:
    tools = [{**LOOSE, "name": f"f{i}"} for i in range(MAX_TOOLS)]
    assert tool_calls(tools, FORM, forced=True, parallel=True, param="tools").grammar


def custom_call(name: str, text: str) -> str:
    return "<tool_call>\n" + json.dumps({"name": name}) + "\n" + text + "\n</tool_call>"


def test_a_custom_tool_regex_is_rusts_syntax_matched_whole(compiler: GrammarCompiler) -> None:
    def tally(regex: str) -> dict[str, Any]:
        grammar = {"type": "grammar", "syntax": "regex", "definition": regex}
        return {"type": "custom", "name": "tally", "format": grammar}

    unicode_digits = tool_calls([tally(r"\d{3}/[a-z]"), LOOSE], FORM, forced=True, parallel=False, param="tools")
    assert accepts(compiler, unicode_digits, custom_call("tally", "123/x"))  # `/` needs no escaping
    assert not accepts(compiler, unicode_digits, custom_call("tally", "123/xy"))  # matched whole
    # Rust's `\d` is every Unicode digit (Python 3.11's `re` knows fewer: its tables are Unicode 14): a grammar
    # meaning ASCII digits spells `[0-9]`.
    assert accepts(compiler, unicode_digits, custom_call("tally", "௫४1/x"))
    ascii_digits = tool_calls([tally(r"[0-9]{3}/[a-z]")], FORM, forced=True, parallel=False, param="tools")
    assert not accepts(compiler, ascii_digits, custom_call("tally", "௫४1/x"))
    assert accepts(compiler, ascii_digits, custom_call("tally", "123/x"))
