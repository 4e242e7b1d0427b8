"""A compiled grammar's first steps, walked when it is compiled (SmolLM2's vocabulary): the grammars llguidance
compiles but fails on as an output begins are refused; grammars whose outputs can begin are not."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from llguidance import LLMatcher

from courier.grammar.compiler import GrammarCompiler
from courier.grammar.constraint import LIMITS, Constraint, GrammarError, json_object, json_schema, tool_calls
from courier.grammar.probe import OPENERS, first_steps_failure, opener_tokens
from tests.support.grammar import FORM, WEATHER, smollm2_compiler


@pytest.fixture(scope="module")
def compiler(smollm2_dir: Path) -> GrammarCompiler:
    return smollm2_compiler(smollm2_dir)


def leaves_8x8x8() -> dict[str, Any]:
    leaves = iter(range(8**3))

    def level(depth: int) -> dict[str, Any]:
        if depth == 0:
            properties = {f"x{next(leaves)}": {"type": "integer"}, "y": {"type": "string"}}
            return {"type": "object", "properties": properties, "required": ["y"]}
        return {"anyOf": [level(depth - 1) for _ in range(8)]}

    return level(3)


THOUSANDS = {"type": "object", "properties": {f"p{n}": {} for n in range(2000)}}
ITSELF = {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"], "additionalProperties": False}
FAILING: dict[str, tuple[dict[str, Any], str]] = {
    # id: (schema, llguidance's reason)
    "no finite instance": (ITSELF, "Too many items"),
    "anyOf 8x8x8": (leaves_8x8x8(), "Current row has 2048 items; max is 2000"),
    "2,000 properties": (THOUSANDS, "max is 2000"),
    "2,000 properties, one level down": (
        {"type": "object", "properties": {"inner": THOUSANDS}, "required": ["inner"], "additionalProperties": False},
        "max is 2000",
    ),
    "512 identical alternatives": (
        {"anyOf": [{"anyOf": [{"anyOf": [{"type": "object"}] * 8}] * 8}] * 8},
        "max is 2000",
    ),
}
TREE = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "children": {"type": "array", "items": {"$ref": "#"}}},
}
FOLLOWED: dict[str, Constraint] = {
    "a tree (recursive, finite)": json_schema({**TREE, "required": ["name", "children"]}, name="tree", param="p"),
    "json_object": json_object(),
    "a string": json_schema({"type": "string"}, name="s", param="p"),
    "an integer": json_schema({"type": "integer"}, name="n", param="p"),
    "forced calls": tool_calls([WEATHER], FORM, forced=True, parallel=True, param="tools"),
    "a triggered call": tool_calls([WEATHER], FORM, forced=False, parallel=True, param="tools"),
}


def compiled(compiler: GrammarCompiler, constraint: Constraint) -> LLMatcher:
    """Compiled as the compiler compiles it, but without its probe."""
    matcher = LLMatcher(compiler.tokenizer, constraint.grammar, log_level=0, limits=LIMITS)
    assert not matcher.is_error(), matcher.get_error()
    return matcher


def test_the_openers_are_one_token_each(compiler: GrammarCompiler) -> None:
    tokens = opener_tokens(compiler.tokenizer)
    assert [compiler.tokenizer.decode_str([token]) for token in tokens] == list(OPENERS)


@pytest.mark.parametrize(("schema", "reason"), FAILING.values(), ids=FAILING.keys())
def test_a_grammar_that_fails_as_an_output_begins_is_refused_naming_its_param(
    compiler: GrammarCompiler, schema: dict[str, Any], reason: str
) -> None:
    constraint = json_schema(schema, name="x", param="response_format.json_schema.schema")  # checks pass
    failure = first_steps_failure(compiled(compiler, constraint), opener_tokens(compiler.tokenizer))
    assert reason in failure and "\n" not in failure
    entries = compiler.stats().entries
    with pytest.raises(GrammarError) as refused:
        compiler.check(constraint, "response_format.json_schema.schema")
    assert refused.value.param == "response_format.json_schema.schema"
    assert reason in refused.value.message and "first steps" in refused.value.message
    assert compiler.stats().entries == entries  # not cached: asked again, it is refused again


@pytest.mark.parametrize("constraint", FOLLOWED.values(), ids=FOLLOWED.keys())
def test_a_grammar_whose_outputs_can_begin_is_compiled(compiler: GrammarCompiler, constraint: Constraint) -> None:
    assert first_steps_failure(compiled(compiler, constraint), opener_tokens(compiler.tokenizer)) == ""
    compiler.check(constraint, "p")


def test_the_probe_leaves_the_compiled_matcher_as_it_was(compiler: GrammarCompiler) -> None:
    matcher = compiled(compiler, FOLLOWED["json_object"])
    before = matcher.compute_bitmask()
    first_steps_failure(matcher, opener_tokens(compiler.tokenizer))
    assert matcher.compute_bitmask() == before and not matcher.is_error()
