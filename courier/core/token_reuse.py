"""Tokenizing only what is new: a text that shares a long start with one tokenized before takes that one's tokens.

An agent sends its whole conversation every turn (20-100K tokens for Claude Code, all but the last few hundred
unchanged), and a fast tokenizer takes ~40 ms per 20K tokens on a CPU core, so tokenizing every render whole made
tokenization the largest share of a cached turn's time to first token (twice per turn: the prompt and its history
boundary, and once more for the warm-up after the reply). The prompt cache already prefills only the new tokens;
this makes tokenizing cost the same.

Why reusing is exact: a Hugging Face tokenizer first cuts the text at its added tokens (`<|im_start|>`, ...), then
normalizes, pre-tokenizes and encodes each piece between them on its own. So wherever an anchor (an added token
that takes no whitespace beside it) starts, the tokens before it depend only on the text before it, and the
tokens from it on only on the text from it on (the anchor encoded at the start of the re-encoded tail, so a piece
after it is never the text's first, which some pre-tokenizers treat apart). A text that shares its first `P`
characters with one encoded before keeps that one's tokens up to its last anchor starting at least
`longest_anchor` characters before `P` (so no added token beginning earlier could read past `P`), and encodes the
rest. Which tokenizers qualify, and what an anchor is: `model/tokenizer_offsets.py`.

`RecentEncodings` keeps the last texts encoded, bounded in count and bytes, each under the scope it was encoded
for (a tenant: a text is only ever reused for its own tenant, so no one can time another's).
"""

from __future__ import annotations

import sys
from array import array
from bisect import bisect_left, bisect_right
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from courier.core.token_prefix import common_prefix_length

# How many recent encodings are kept, and the most bytes they may hold (text, token ids, anchor positions).
RECENT_ENCODINGS = 64
RECENT_ENCODING_BYTES = 64 * 1024 * 1024
# Kept texts are found by their starts, hashed every this many characters: a text shorter has none, and is
# tokenized whole (a few milliseconds at most).
CHECKPOINT_CHARS = 2048


class OffsetsEncoder(Protocol):
    """A tokenizer that cuts at its added tokens first: ids and where each token starts in the text."""

    @property
    def anchors(self) -> Mapping[int, str]:
        """The added tokens a text may be cut at: id -> the text it stands for."""

    @property
    def longest_anchor(self) -> int:
        """The length in characters of the longest added token (anchor or not)."""

    def encode_with_starts(self, text: str) -> tuple[list[int], list[int]]:
        """The text's token ids (no special tokens added), and the character each one starts at."""


@dataclass(frozen=True, slots=True)
class Encoded:
    """A text, its token ids, and where its anchors are: their token indices and starting characters, ascending."""

    text: str
    ids: array[int]
    anchor_tokens: array[int]
    anchor_starts: array[int]

    @property
    def bytes(self) -> int:
        """What it holds in memory: the text as Python stores it (1, 2 or 4 bytes a character), ids and anchors."""
        return sys.getsizeof(self.text) + self.ids.itemsize * (len(self.ids) + 2 * len(self.anchor_tokens))


@dataclass(frozen=True, slots=True)
class Reused:
    """An encoding, and how many of its tokens came from an earlier one."""

    encoded: Encoded
    reused_tokens: int


def encode(text: str, encoder: OffsetsEncoder, base: Encoded | None = None) -> Reused:
    """`text` encoded, taking `base`'s tokens for the start they share up to the last anchor it can be cut at."""
    cut = _cut(text, encoder, base) if base is not None else None
    if base is not None and cut is not None:
        token, start = cut
        kept = bisect_left(base.anchor_tokens, token)  # the anchors before the cut
        head = (base.ids[:token], base.anchor_tokens[:kept], base.anchor_starts[:kept])
        encoded = _with_tail(text, start, head, encoder)
        if encoded.ids[token : token + 1] == base.ids[token : token + 1]:  # the tail began with its anchor
            return Reused(encoded, token)
    return Reused(_with_tail(text, 0, (array("i"), array("i"), array("i")), encoder), 0)


def _cut(text: str, encoder: OffsetsEncoder, base: Encoded) -> tuple[int, int] | None:
    """The token index and character of `base`'s last anchor that `text` can be cut at (None: none can)."""
    latest = common_prefix_length(text, base.text) - encoder.longest_anchor
    position = bisect_right(base.anchor_starts, latest) - 1 if latest >= 0 else -1
    if position < 0:
        return None
    return base.anchor_tokens[position], base.anchor_starts[position]


def _with_tail(
    text: str, start: int, head: tuple[array[int], array[int], array[int]], encoder: OffsetsEncoder
) -> Encoded:
    """`head` (the ids of `text[:start]`, and its anchors' token indices and characters) and `text[start:]`
    encoded after it."""
    ids, anchor_tokens, anchor_starts = head
    tail, starts = encoder.encode_with_starts(text[start:])
    anchors, offset = encoder.anchors, len(ids)
    for index, token_id in enumerate(tail):
        # An anchor's id that the text does not spell out there (a normalizer made it) is not a cut.
        if token_id in anchors and text.startswith(anchors[token_id], start + starts[index]):
            anchor_tokens.append(offset + index)
            anchor_starts.append(start + starts[index])
    return Encoded(text=text, ids=ids + array("i", tail), anchor_tokens=anchor_tokens, anchor_starts=anchor_starts)


def checkpoints(text: str) -> list[int]:
    """A chained hash of each whole `CHECKPOINT_CHARS` start of `text`: the `k`th stands for its first
    `(k + 1) * CHECKPOINT_CHARS` characters."""
    marks, mark = [], 0
    for end in range(CHECKPOINT_CHARS, len(text) + 1, CHECKPOINT_CHARS):
        mark = hash((mark, text[end - CHECKPOINT_CHARS : end]))
        marks.append(mark)
    return marks


@dataclass(frozen=True, slots=True)
class _Kept:
    scope: str
    encoded: Encoded
    marks: list[int]


class RecentEncodings:
    """The last texts encoded, each under its scope; the least recently used go first past either bound. A text's
    candidates are found by its checkpoints (the kept texts that start with the same characters up to the most
    of them), not by comparing it with every kept text."""

    def __init__(self, entries: int = RECENT_ENCODINGS, max_bytes: int = RECENT_ENCODING_BYTES) -> None:
        self._entries = entries
        self._max_bytes = max_bytes
        self._bytes = 0
        self._kept: OrderedDict[int, _Kept] = OrderedDict()
        self._by_start: dict[tuple[str, int, int], set[int]] = {}  # (scope, checkpoint, its hash): keys
        self._next_key = 0

    def __len__(self) -> int:
        return len(self._kept)

    @property
    def bytes(self) -> int:
        return self._bytes

    def closest(self, scope: str, text: str) -> Encoded | None:
        """The encoding of `scope` sharing the longest start with `text` among those sharing the most checkpoints
        (None: none shares the first)."""
        marks = checkpoints(text)
        for index in range(len(marks) - 1, -1, -1):
            keys = self._by_start.get((scope, index, marks[index]))
            if keys:
                best = self._longest_shared(keys, text, index)
                self._kept.move_to_end(best)
                return self._kept[best].encoded
        return None

    def _longest_shared(self, keys: set[int], text: str, index: int) -> int:
        """Of the kept texts `keys`, which all share `text`'s checkpoint `index`, the one sharing the most of it
        (the newest of equals). None shares its next checkpoint, so each parts from `text` within the next
        `CHECKPOINT_CHARS` characters, and only those are compared: an agent's conversation keeps a render per turn,
        each tens of KB. `encode` compares the whole start again, so a hash that lied costs reuse, never a token."""
        start, end = (index + 1) * CHECKPOINT_CHARS, (index + 2) * CHECKPOINT_CHARS
        window = text[start:end]
        shared = {key: common_prefix_length(window, self._kept[key].encoded.text[start:end]) for key in keys}
        return max(keys, key=lambda key: (shared[key], key))

    def remember(self, scope: str, encoded: Encoded) -> None:
        """Keep `encoded` for `scope`; not one too short to have a checkpoint (no text could find it) or larger than
        the bound."""
        marks = checkpoints(encoded.text)
        if not marks or _kept_bytes(encoded, marks) > self._max_bytes:
            return
        for key in list(self._by_start.get((scope, len(marks) - 1, marks[-1]), ())):  # the same text: the newest
            if self._kept[key].encoded.text == encoded.text:
                self._forget(key)
        key, self._next_key = self._next_key, self._next_key + 1
        self._kept[key] = _Kept(scope=scope, encoded=encoded, marks=marks)
        for index, mark in enumerate(marks):
            self._by_start.setdefault((scope, index, mark), set()).add(key)
        self._bytes += _kept_bytes(encoded, marks)
        while len(self._kept) > self._entries or self._bytes > self._max_bytes:
            self._forget(next(iter(self._kept)))

    def clear(self) -> int:
        """Forget every encoding; how many there were."""
        kept = len(self._kept)
        self._kept.clear()
        self._by_start.clear()
        self._bytes = 0
        return kept

    def _forget(self, key: int) -> None:
        kept = self._kept.pop(key)
        self._bytes -= _kept_bytes(kept.encoded, kept.marks)
        for index, mark in enumerate(kept.marks):
            start = (kept.scope, index, mark)
            keys = self._by_start[start]
            keys.discard(key)
            if not keys:
                del self._by_start[start]


# What a checkpoint costs beside an encoding: its hash in the list, and its key and set in the index.
CHECKPOINT_BYTES = 320


def _kept_bytes(encoded: Encoded, marks: list[int]) -> int:
    return encoded.bytes + CHECKPOINT_BYTES * len(marks)
