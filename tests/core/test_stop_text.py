from __future__ import annotations

import pytest

from courier.core.stop_text import StopTextMatcher, held_back_length


def run(stops: list[str], pieces: list[str]) -> tuple[str, bool]:
    matcher = StopTextMatcher(stops)
    emitted = []
    for piece in pieces:
        scan = matcher.feed(piece)
        emitted.append(scan.text)
        if scan.stopped:
            return "".join(emitted), True
    return "".join(emitted) + matcher.flush(), False


@pytest.mark.parametrize(
    ("stops", "pieces", "text", "stopped"),
    [
        ([], ["a", "b"], "ab", False),
        (["END"], ["hello E", "N", "D more"], "hello ", True),
        (["END"], ["hello EN", "X"], "hello ENX", False),
        (["END"], ["hello EN"], "hello EN", False),  # held text is flushed at the end
        (["\n\n", "###"], ["line one\n", "\nline two"], "line one", True),
        (["b", "ab"], ["xab"], "x", True),  # the earliest stop in the text wins, whatever the list order
        (["stop"], ["sto", "p"], "", True),
    ],
)
def test_stop_strings_cut_text_and_never_leak(stops: list[str], pieces: list[str], text: str, stopped: bool) -> None:
    assert run(stops, pieces) == (text, stopped)


def test_partial_stop_is_held_back_until_decided() -> None:
    matcher = StopTextMatcher(["<end>"])
    assert matcher.feed("abc<en").text == "abc"
    assert matcher.feed("x").text == "<enx"


@pytest.mark.parametrize(
    ("text", "markers", "length"),
    [("abc<to", ["<tool>"], 3), ("abc", ["<tool>"], 0), ("<tool", ["<tool>"], 5), ("x<", ["<a>", "<b>"], 1)],
)
def test_held_back_length(text: str, markers: list[str], length: int) -> None:
    assert held_back_length(text, markers) == length
