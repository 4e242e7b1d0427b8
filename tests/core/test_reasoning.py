"""The reasoning splitter: where a block opens and closes, whitespace, markers split across pieces, token counts."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from courier.core.reasoning import ReasoningFormat, ReasoningSplitter

TAGS = ReasoningFormat(start="<think>", end="</think>", start_tokens=(7,), end_tokens=(8,))


def split(pieces: list[str], *, inside: bool = False) -> tuple[str, str]:
    splitter = ReasoningSplitter(TAGS, inside=inside)
    parts = [splitter.feed(piece) for piece in pieces] + [splitter.finish()]
    return "".join(part.reasoning for part in parts), "".join(part.content for part in parts)


@pytest.mark.parametrize(
    ("text", "inside", "expected"),
    [
        ("<think>\nhmm\n</think>\n\nIt is 4.", False, ("hmm", "It is 4.")),
        ("  <think>a b</think>answer", False, ("a b", "answer")),
        ("hmm\n</think>\n\nIt is 4.", True, ("hmm", "It is 4.")),
        ("It is 4.", False, ("", "It is 4.")),
        ("\n\nIt is 4.", False, ("", "\n\nIt is 4.")),  # no block: the content is the model's, whitespace and all
        ("It is <think>4</think>.", False, ("", "It is <think>4</think>.")),  # a marker past the start is text
        ("<think>\nstill thinking", False, ("still thinking", "")),  # cut inside the block
        ("<think>\n\n</think>\n\nIt is 4.", False, ("", "It is 4.")),  # an empty block
        ("<thi", False, ("", "<thi")),  # a partial marker and nothing more is text
        ("<think>a</think>b</think>", False, ("a", "b</think>")),
        ("", True, ("", "")),
    ],
)
def test_split(text: str, inside: bool, expected: tuple[str, str]) -> None:
    assert split([text], inside=inside) == expected


@given(st.lists(st.integers(min_value=0, max_value=40), max_size=8))
def test_any_chunking_gives_the_same_split(cuts: list[int]) -> None:
    text = "  <think>\nfirst line\n\nsecond </thi line\n</think>\n\nThe answer <think> stays."
    points = sorted({min(cut, len(text)) for cut in cuts})
    pieces = [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]
    assert split(pieces) == ("first line\n\nsecond </thi line", "The answer <think> stays.")


def test_whitespace_ending_the_reasoning_is_held_until_the_block_goes_on() -> None:
    splitter = ReasoningSplitter(TAGS)
    assert splitter.feed("<think>one\n").reasoning == "one"
    assert splitter.feed("two").reasoning == "\ntwo"


def test_tokens_count_as_reasoning_through_the_end_marker() -> None:
    splitter = ReasoningSplitter(TAGS)
    pieces = [("<think>", 1), ("\nhm", 2), ("</think>", 1), ("\n\n", 1), ("Yes", 1)]
    reasoned = [splitter.feed(text, tokens).reasoned for text, tokens in pieces]
    assert reasoned == [True, True, True, False, False]
    assert splitter.reasoning_tokens == 4


@pytest.mark.parametrize(
    ("prompt", "opens"),
    [
        ([1, 2, 7], True),
        ([1, 2, 7, 3], True),
        ([7, 3, 8, 5], False),
        ([7, 3, 8, 7], True),
        ([1, 2, 3], False),
        ([], False),
        ([7, 1, 2, 3, 4], False),  # a marker in a message, turns before the generation prompt, is text
        ([1, 7, 3, 4], True),  # the marker and two tokens after it (`<think>` and newlines)
    ],
)
def test_a_prompt_opens_the_block_when_its_last_marker_is_a_start(prompt: list[int], opens: bool) -> None:
    assert TAGS.open_at_end(prompt) is opens


def test_multi_token_markers_are_matched_whole() -> None:
    markers = ReasoningFormat(start="<|channel>thought", end="<channel|>", start_tokens=(5, 6), end_tokens=(9,))
    assert markers.open_at_end([1, 5, 6, 2])
    assert not markers.open_at_end([5, 6, 1, 2, 3])
    assert not markers.open_at_end([1, 6, 2])  # half a start marker
