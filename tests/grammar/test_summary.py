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


def exactly(chars: int) -> str:
    """Bullet lines of `chars` characters in all, each line as long as it may be (the last one shorter)."""
    lines: list[str] = []
    left = chars
    while left > LINE_CHARS + 2:  # a full line: `- `, the text, the newline
        lines.append("- " + "x" * LINE_CHARS + "\n")
        left -= LINE_CHARS + 3
    lines.append("- " + "x" * (left - 2))  # the last, with no newline
    return "".join(lines)


@pytest.mark.parametrize("chars", [MIN_CHARS, 256, 1024])
def test_a_summary_of_exactly_the_budget_is_admitted_and_one_longer_refused(
    compiler: GrammarCompiler, chars: int
) -> None:
    text = exactly(chars)
    assert len(text) == chars and len(text.splitlines()) <= MAX_LINES
    constraint = summary_constraint(chars)
    assert accepts(compiler, constraint, text)
    longer = text[:-1] + "x" + text[-1]  # one character more on the last line, still within its length
    assert len(longer.splitlines()[-1]) <= LINE_CHARS + 2
    assert not accepts(compiler, constraint, longer)


@pytest.mark.parametrize("chars", [MIN_CHARS, 1024])
def test_the_summary_can_end_once_a_line_has_text(compiler: GrammarCompiler, chars: int) -> None:
    """Token by token through a summary of the whole budget: some token is always allowed, and the end is, as soon
    as the line being written has text (or the last one is complete)."""
    matcher = compiler.matcher(summary_constraint(chars))
    tokens = compiler.tokenizer.tokenize_str(exactly(chars))
    for count, token in enumerate(tokens):
        written = compiler.tokenizer.decode_str(tokens[:count])
        allowed = int.from_bytes(matcher.compute_bitmask(), "little")
        assert allowed, f"no token allowed after {written!r}"
        line = written.rsplit("\n", 1)[-1]
        if written and (line == "" or len(line) > 2):
            assert any(allowed >> eos & 1 for eos in compiler.eos_tokens), f"cannot end after {written!r}"
        assert matcher.consume_token(token)
    assert matcher.is_accepting()
