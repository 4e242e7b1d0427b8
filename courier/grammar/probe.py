"""A compiled grammar's first steps, walked once when it is compiled: a grammar that fails there is refused.

llguidance bounds each step's work (`constraint.LIMITS`), but it meets most of those bounds only while it parses
the output, not when it compiles: an object of 2,000 properties, or 512 object shapes under nested `anyOf`s, builds
an Earley row past `max_items_in_row` as soon as the object opens, and a schema with no finite instance (a required
property whose schema is its own object again) forces text without end, past `step_max_items`. Met mid-generation,
such a grammar could only end the reply after `{` or `{"`. So the compiler walks the first steps of every new
grammar on a copy of its matcher, the way an output would begin: the text the grammar forces, then one character
that opens or enters structure (`{`, `[`, `"`, a space), again and again, and refuses a grammar whose matcher fails
on that walk, with llguidance's reason. It is a bounded probe, not a proof: a limit met deeper in an output still
ends that reply, as a cut (`engine/constrained.py`).
"""

from __future__ import annotations

from collections.abc import Sequence

from llguidance import LLMatcher, LLTokenizer

PROBE_STEPS = 8  # characters chosen; each followed by whatever text the grammar then forces
OPENERS = ("{", "[", '"', " ")  # in this order: the first the grammar allows is taken


def opener_tokens(tokenizer: LLTokenizer) -> tuple[int, ...]:
    """The tokens that are exactly one opening character each, in `OPENERS` order (those the vocabulary has)."""
    found = (tokenizer.tokenize_str(character) for character in OPENERS)
    return tuple(tokens[0] for tokens in found if len(tokens) == 1)


def first_steps_failure(compiled: LLMatcher, openers: Sequence[int]) -> str:
    """Why the grammar of `compiled` fails on its first steps ("" when it does not); `compiled` is left as it was."""
    matcher = compiled.deep_copy()
    for _ in range(PROBE_STEPS):
        forced = matcher.compute_ff_tokens()
        if matcher.is_error() or (forced and not matcher.consume_tokens(forced)):
            return _reason(matcher)
        if matcher.is_stopped():
            return ""
        opener = next((token for token in openers if matcher.validate_tokens([token]) == 1), None)
        if matcher.is_error():
            return _reason(matcher)
        if opener is None:
            return ""
        if not matcher.consume_token(opener):
            return _reason(matcher)
    return ""


def _reason(matcher: LLMatcher) -> str:
    """llguidance's error, its first line (a parser state dump follows it)."""
    return matcher.get_error().strip().splitlines()[0] if matcher.get_error().strip() else "the grammar failed"
