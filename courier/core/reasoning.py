"""Separating a reasoning model's thinking from its answer in generated text.

Models that think in tags (Qwen3's `<think>…</think>`, DeepSeek-R1 and kin, and the other markers mlx-lm's
tokenizer wrapper recognises) open their reply with a reasoning block. Some templates open the block in the prompt
itself (DeepSeek-R1 and Qwen3's thinking-only releases end the generation prompt with `<think>\n`); then the reply
starts inside it and only the end marker appears, which `ReasoningFormat.open_at_end` tells from the prompt's tokens.

A reasoning block is recognised only where the reply begins (whitespace aside): a marker later in the answer is
the answer's text. Whitespace around the block (the newlines templates put there) belongs to neither part.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from courier.core.stop_text import held_back_length

# Tokens a template may write after the start marker that opens the reply's block (`<think>\n`: one newline token,
# two at most).
OPENING_SLACK = 2


@dataclass(frozen=True, slots=True, kw_only=True)
class ReasoningFormat:
    """The served model's reasoning markers, as text and as the token sequences they encode to."""

    start: str
    end: str
    start_tokens: tuple[int, ...]
    end_tokens: tuple[int, ...]

    def open_at_end(self, prompt: Sequence[int]) -> bool:
        """Whether the prompt's generation prompt opens a reasoning block: a start marker among its last tokens (the
        marker and the newline or two a template writes after it), not closed after it. Only the tail counts: a
        marker in a message (a user asking what `<think>` does) is text, not an open block."""
        if not self.start_tokens or not self.end_tokens:
            return False
        first = max(0, len(prompt) - 1 - OPENING_SLACK)  # where a marker that opens the reply may end
        for index in range(len(prompt) - 1, first - 1, -1):
            if _ends_with(prompt, index, self.end_tokens):
                return False
            if _ends_with(prompt, index, self.start_tokens):
                return True
        return False


@dataclass(frozen=True, slots=True)
class ReasoningSplit:
    reasoning: str
    content: str
    reasoned: bool = False  # the piece's tokens counted as reasoning (some of its text was)


class ReasoningSplitter:
    """Splits streamed text into reasoning and content, and counts the tokens spent reasoning.

    `inside`: the prompt opened the block, so the reply starts in it. A marker split across two pieces is held back
    until it is known whether it is one; so is whitespace at the end of the reasoning, which is dropped if the block
    ends there.
    """

    def __init__(self, markers: ReasoningFormat, *, inside: bool = False) -> None:
        self._start = markers.start
        self._end = markers.end
        self._state = _State.REASONING if inside else _State.OPENING
        self._buffer = ""
        self._reasoning_started = False  # leading whitespace of the reasoning is dropped
        self._content_started = True  # and so is the content's after a block (set when one opens)
        self.reasoning_tokens = 0

    @property
    def in_reasoning(self) -> bool:
        return self._state is _State.REASONING

    @property
    def undecided(self) -> bool:
        """Nothing but whitespace or part of a start marker seen: whether the reply opens a block is not known."""
        return self._state is _State.OPENING

    def feed(self, text: str, tokens: int = 0) -> ReasoningSplit:
        """`tokens`: how many generated tokens `text` came from; they count as reasoning if any of them was."""
        was_reasoning = self._state is _State.REASONING
        self._buffer += text
        reasoning: list[str] = []
        content: list[str] = []
        while True:
            if self._state is _State.OPENING:
                stripped = self._buffer.lstrip()
                if stripped.startswith(self._start):
                    self._buffer = stripped[len(self._start) :]
                    self._state = _State.REASONING
                    was_reasoning = True
                    continue
                if stripped and not self._start.startswith(stripped):  # the reply does not open a block
                    self._state = _State.CONTENT
                    continue
                break  # only whitespace or a partial start marker so far
            if self._state is _State.REASONING:
                index = self._buffer.find(self._end)
                if index < 0:
                    keep = held_back_length(self._buffer, (self._end,))
                    visible = self._buffer[: len(self._buffer) - keep]
                    held = visible[len(visible.rstrip()) :]  # trailing whitespace: maybe the block's last
                    reasoning.append(self._reasoning(visible[: len(visible) - len(held)]))
                    self._buffer = self._buffer[len(visible) - len(held) :]
                    break
                reasoning.append(self._reasoning(self._buffer[:index].rstrip()))
                self._buffer = self._buffer[index + len(self._end) :]
                self._state = _State.CONTENT
                self._content_started = False
                continue
            content.append(self._content(self._buffer))
            self._buffer = ""
            break
        if was_reasoning:
            self.reasoning_tokens += tokens
        return ReasoningSplit("".join(reasoning), "".join(content), was_reasoning)

    def finish(self) -> ReasoningSplit:
        """At the end of generation: what is held back is flushed (an unclosed block is all reasoning)."""
        rest, self._buffer = self._buffer, ""
        if self._state is _State.REASONING:
            return ReasoningSplit(self._reasoning(rest.rstrip()), "")
        return ReasoningSplit("", self._content(rest))  # a partial start marker and nothing more is plain text

    def _reasoning(self, text: str) -> str:
        if not self._reasoning_started:
            text = text.lstrip()
            self._reasoning_started = bool(text)
        return text

    def _content(self, text: str) -> str:
        if not self._content_started:
            text = text.lstrip()
            self._content_started = bool(text)
        return text


class _State(Enum):
    """Where the splitter is: before anything but whitespace, inside the block, or past it (plain content)."""

    OPENING = "opening"
    REASONING = "reasoning"
    CONTENT = "content"


def _ends_with(tokens: Sequence[int], last: int, marker: tuple[int, ...]) -> bool:
    """Whether `marker` ends at `tokens[last]`."""
    first = last - len(marker) + 1
    return tokens[last] == marker[-1] and first >= 0 and tuple(tokens[first : last + 1]) == marker
