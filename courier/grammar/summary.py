"""The grammar a compaction summary is written in: a bounded list of bullet lines, then the end.

A small model summarizing an enumeration (an itinerary's "Day i: ...") goes on enumerating past its end, and a
summary left to its own length ran to `max_output_tokens` and was refused as cut. Bounded by construction instead:
the summary is one to `MAX_LINES` lines, each `- ` and at most `LINE_CHARS` characters, and at most `chars`
characters in all; once the budget is spent only the end can follow. The budget is proportional to what the
summary replaces (one character per token replaced) and never more than the pass's `max_tokens`: a token of ASCII
text is at least one character, so an ASCII summary always ends before `max_tokens` and is always shorter, in
tokens, than the history it replaces (text outside ASCII, where a character may take several tokens, is bounded
by its characters only).
"""

from __future__ import annotations

from courier.grammar.constraint import Constraint, lark_constraint

MAX_LINES = 32
LINE_CHARS = 240
MIN_CHARS = 64  # the smallest budget: a line or two, whatever little it replaces
PARAM = "input"


def summary_chars(replaced_tokens: int, max_tokens: int) -> int:
    """The summary's budget in characters: one per token it replaces (less one, so it is shorter), at least
    `MIN_CHARS`, never more than `max_tokens`; rounded down to a step of two per doubling (64, 96, 128, 192, ...),
    so summaries share a few compiled grammars rather than each filling the compiler's cache with its own."""
    wanted = max(1, min(max(MIN_CHARS, replaced_tokens - 1), max_tokens))
    step = 1 << max(0, wanted.bit_length() - 1)  # the power of two at or below it
    return step + step // 2 if wanted >= step + step // 2 else step


def summary_constraint(chars: int) -> Constraint:
    """Bullet lines (`- ` and some text each, one per line, at most `MAX_LINES`) of at most `chars` characters."""
    line = f"- [^\\n]{{1,{LINE_CHARS}}}"
    lines = f"({line}\\n){{0,{MAX_LINES - 1}}}{line}\\n?"
    grammar = f"start: SUMMARY\nSUMMARY: /{lines}/ & /[\\s\\S]{{1,{chars}}}/\n"
    return lark_constraint(grammar, label=f"compaction summary ({chars} characters)", param=PARAM)
