"""Output specs built once: a kept constraint is the one a fresh build makes, refusals are never kept, and the
cache holds at most its count and its characters."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from courier.grammar import output_spec
from courier.grammar.built_constraints import BuiltConstraints, spec_key
from courier.grammar.compiler import GrammarCompiler
from courier.grammar.constraint import Constraint, GrammarError, ToolGrammar
from courier.grammar.output_spec import OutputSpec
from tests.support.grammar import FORM, WEATHER, accepts, smollm2_compiler

CLOCK: dict[str, Any] = {"name": "get_time", "parameters": {"type": "object", "properties": {}}}
NOTE: dict[str, Any] = {
    "name": "note",
    "parameters": {
        "type": "object",
        "properties": {"title": {"type": "string"}, "body": {"type": "string"}},
        "required": ["title", "body"],
        "additionalProperties": False,
    },
    "strict": True,
}


def spec(*functions: dict[str, Any], choice: str = "auto", parallel: bool = True) -> OutputSpec:
    tools = [{"type": "function", **function} for function in functions]
    return output_spec.spec(
        output_spec.responses_text_format(None),
        output_spec.tool_choice(choice, responses=True),
        parallel,
        tools,
    )


class Builds:
    """`output_spec.constraint`, counting its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def of(self, output: OutputSpec, tool_grammar: ToolGrammar | None = FORM) -> Any:
        def build() -> Constraint | None:
            self.calls += 1
            return output_spec.constraint(output, tool_grammar)

        return build


def test_the_same_spec_is_built_once_and_kept_as_a_fresh_build_makes_it() -> None:
    kept, builds = BuiltConstraints(capacity=8), Builds()
    first = kept.get(spec(WEATHER, CLOCK), FORM, builds.of(spec(WEATHER, CLOCK)))
    again = kept.get(spec(WEATHER, CLOCK), FORM, builds.of(spec(WEATHER, CLOCK)))  # an equal spec, parsed anew
    assert builds.calls == 1 and kept.hits == 1 and len(kept) == 1
    fresh = output_spec.constraint(spec(WEATHER, CLOCK), FORM)
    assert first is again and first is not None and fresh is not None
    assert (first.grammar, first.key, first.trigger, first.repeat) == (
        fresh.grammar,
        fresh.key,
        fresh.trigger,
        fresh.repeat,
    )


@pytest.mark.parametrize(
    ("other", "tool_grammar"),
    [
        (spec(WEATHER, CLOCK, choice="required"), FORM),
        (spec(WEATHER, CLOCK, parallel=False), FORM),
        (spec(CLOCK, WEATHER), FORM),  # the tools in another order
        (spec(WEATHER, {**CLOCK, "description": "now"}), FORM),
        (spec(WEATHER, CLOCK), ToolGrammar(start="<call>", end="</call>")),  # a model writing calls otherwise
    ],
    ids=["tool choice", "parallel calls", "tool order", "a description", "the model's call format"],
)
def test_a_spec_that_differs_in_anything_the_grammar_reads_is_built_again(
    other: OutputSpec, tool_grammar: ToolGrammar
) -> None:
    kept, builds = BuiltConstraints(capacity=8), Builds()
    kept.get(spec(WEATHER, CLOCK), FORM, builds.of(spec(WEATHER, CLOCK)))
    kept.get(other, tool_grammar, builds.of(other, tool_grammar))
    assert builds.calls == 2 and kept.hits == 0 and len(kept) == 2


def test_a_schema_with_its_properties_in_another_order_is_another_spec() -> None:
    """Key order orders the generated properties, so it is part of what is kept."""
    swapped = {
        **NOTE,
        "parameters": {**NOTE["parameters"], "properties": {"body": {"type": "string"}, "title": {"type": "string"}}},
    }
    assert spec_key(spec(NOTE), FORM) != spec_key(spec(swapped), FORM)
    assert spec_key(spec(NOTE), FORM) == spec_key(spec(dict(NOTE)), FORM)


def test_a_refused_spec_is_not_kept_and_is_refused_again() -> None:
    broken = {**WEATHER, "parameters": {"type": "object", "properties": {"city": {"type": "no such type"}}}}
    kept, builds = BuiltConstraints(capacity=8), Builds()
    for _ in range(2):
        with pytest.raises(GrammarError) as refused:
            kept.get(spec(broken), FORM, builds.of(spec(broken)))
        assert refused.value.param.startswith("tools")
    assert builds.calls == 2 and len(kept) == 0 and kept.hits == 0


def test_a_spec_needing_no_grammar_is_kept_as_none() -> None:
    kept, builds = BuiltConstraints(capacity=8), Builds()
    for _ in range(2):
        assert kept.get(spec(CLOCK), None, builds.of(spec(CLOCK), None)) is None  # auto, the model's own format
    assert builds.calls == 1 and kept.hits == 1


def test_at_most_its_capacity_is_kept_least_recently_used_out() -> None:
    kept, builds = BuiltConstraints(capacity=2), Builds()
    a, b, c = spec(WEATHER), spec(CLOCK), spec(NOTE)
    for output in (a, b, a, c):  # `a` used again after `b`: `b` goes when `c` comes
        kept.get(output, FORM, builds.of(output))
    assert (builds.calls, kept.hits, len(kept)) == (3, 1, 2)
    kept.get(a, FORM, builds.of(a))
    assert builds.calls == 3
    kept.get(b, FORM, builds.of(b))
    assert builds.calls == 4 and len(kept) == 2


def test_at_most_its_characters_are_kept() -> None:
    sizes = {}
    for name, function in (("weather", WEATHER), ("clock", CLOCK), ("note", NOTE)):
        constraint = output_spec.constraint(spec(function), FORM)
        assert constraint is not None
        sizes[name] = len(constraint.grammar)
    kept, builds = BuiltConstraints(capacity=8, max_chars=sizes["weather"] + sizes["clock"]), Builds()
    for output in (spec(WEATHER), spec(CLOCK), spec(NOTE)):
        kept.get(output, FORM, builds.of(output))
    assert len(kept) < 3  # the third pushed the first out
    kept.get(spec(NOTE), FORM, builds.of(spec(NOTE)))
    assert builds.calls == 3  # the newest is kept
    tiny, builds = BuiltConstraints(capacity=8, max_chars=10), Builds()
    for _ in range(2):
        tiny.get(spec(WEATHER), FORM, builds.of(spec(WEATHER)))
    assert builds.calls == 2 and len(tiny) == 0  # larger than the whole bound: never kept


@pytest.fixture(scope="module")
def compiler(smollm2_dir: Path) -> GrammarCompiler:
    return smollm2_compiler(smollm2_dir)


def test_the_compiler_builds_a_spec_once_and_hands_it_out_compiled(compiler: GrammarCompiler) -> None:
    before = compiler.stats()
    first = compiler.output_constraint(spec(WEATHER, choice="required"), FORM, "tools")
    second = compiler.output_constraint(spec(WEATHER, choice="required"), FORM, "tools")
    after = compiler.stats()
    assert first is not None and second is not None and first.compiled is not None
    assert (after.built_hits, after.built_entries) == (before.built_hits + 1, before.built_entries + 1)
    assert after.misses == before.misses + 1  # compiled once
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert accepts(compiler, second, call) and not accepts(compiler, second, call.replace("Oslo", "Rome"))


def test_each_tenant_builds_and_compiles_for_itself(compiler: GrammarCompiler) -> None:
    """Another key's spec, built and compiled already, is built and compiled again for this key: a hit (counted in
    /metrics, and a reply up to a second faster) would tell it that someone sent that exact schema."""
    secret = {**NOTE, "name": "acme_wire_transfer"}
    before = compiler.stats()
    assert compiler.output_constraint(spec(secret, choice="required"), FORM, "tools", "tenant-a") is not None
    assert compiler.output_constraint(spec(secret, choice="required"), FORM, "tools", "tenant-b") is not None
    after = compiler.stats()
    assert (after.built_hits, after.hits, after.misses) == (before.built_hits, before.hits, before.misses + 2)
    assert compiler.output_constraint(spec(secret, choice="required"), FORM, "tools", "tenant-b") is not None
    again = compiler.stats()
    assert (again.built_hits, again.misses) == (after.built_hits + 1, after.misses)  # its own: kept
    assert spec_key(spec(secret), FORM, "tenant-a") != spec_key(spec(secret), FORM, "tenant-b")


def test_the_compiler_refuses_a_spec_each_time_it_is_sent(compiler: GrammarCompiler) -> None:
    cyclic = {
        **WEATHER,
        "parameters": {
            "$ref": "#/$defs/a",
            "$defs": {"a": {"type": "object", "properties": {"a": {"$ref": "#/$defs/a"}}, "required": ["a"]}},
        },
    }
    before = compiler.stats()
    for _ in range(2):
        with pytest.raises(GrammarError):
            compiler.output_constraint(spec(cyclic, choice="required"), FORM, "tools")
    assert compiler.stats().built_entries == before.built_entries
