"""The compaction summary's grammar: bullet lines within a budget proportional to what the summary replaces."""

from __future__ import annotations

from pathlib import Path

import pytest

from courier.grammar.compiler import GrammarCompiler
from courier.grammar.summary import LINE_CHARS, MAX_LINES, MIN_CHARS, summary_chars, summary_constraint
from tests.support.grammar import accepts, smollm2_compiler

ITINERARY = "".join(f"- Day {day}: museum {day}, cafe {day}\n" for day in range(1, 11))


@pytest.fixture(scope="module")
def compiler(smollm2_dir: Path) -> GrammarCompiler:
    return smollm2_compiler(smollm2_dir)


@pytest.mark.parametrize(
    ("replaced", "max_tokens", "chars"),
    [
        (10, 1024, MIN_CHARS),  # a line or two, whatever little it replaces
        (97, 1024, 96),  # one character per token replaced, less one, rounded down (64, 96, 128, 192, ...)
        (300, 1024, 256),
        (5000, 1024, 1024),  # never past the pass's max_tokens
        (5000, 100, 96),
        (300, 40, 32),
    ],
)
def test_the_budget_is_proportional_to_what_the_summary_replaces(replaced: int, max_tokens: int, chars: int) -> None:
    assert summary_chars(replaced, max_tokens) == chars


def test_bullet_lines_within_the_budget_are_a_summary(compiler: GrammarCompiler) -> None:
    constraint = summary_constraint(len(ITINERARY))
    assert accepts(compiler, constraint, ITINERARY)
    assert accepts(compiler, constraint, ITINERARY.rstrip("\n"))
    assert not accepts(compiler, constraint, "Day 1: museum 1")  # a line is a bullet
    assert not accepts(compiler, constraint, "")


@pytest.mark.parametrize(
    "text",
    [
        ITINERARY + "- Day 11: museum 11\n",  # past the characters
        "- a\n" * (MAX_LINES + 1),  # past the lines
        "- " + "x" * (LINE_CHARS + 1),  # past a line's length
    ],
    ids=["characters", "lines", "line length"],
)
def test_past_a_bound_the_summary_can_only_end(compiler: GrammarCompiler, text: str) -> None:
    assert not accepts(compiler, summary_constraint(len(ITINERARY)), text)


def test_once_the_budget_is_spent_only_the_end_may_follow(compiler: GrammarCompiler) -> None:
    matcher = compiler.matcher(summary_constraint(64))
    assert matcher.consume_tokens(compiler.tokenizer.tokenize_str("- " + "a" * 62))
    allowed = int.from_bytes(matcher.compute_bitmask(), "little")
    assert {token for token in range(compiler.vocab_size) if allowed >> token & 1} == set(compiler.eos_tokens)
