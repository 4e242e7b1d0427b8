"""The served tokenizer as `core/token_reuse.py` needs it: ids with the character each starts at, and its anchors.

Only a fast (Rust) Hugging Face tokenizer qualifies: it cuts a text at its added tokens before anything else, and
tells each token's offsets. Not one that keeps special tokens whole as text (`split_special_tokens`), where that
cut does not happen, nor one whose offsets call gives other ids than its `encode` on a probe (a class that rewrites
the text in `encode`). An anchor is an added token matched in the raw text (`normalized` off) that takes no
whitespace beside it and is no single-word match (`lstrip`, `rstrip`, `single_word` off): where it starts, the
text before and after it are encoded apart. A tokenizer without one is not reused (`offsets_encoder` is None;
`WholeTexts` encodes with it all the same, every text whole).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class FastTokenizerOffsets:
    tokenizer: Any  # a fast `transformers` tokenizer
    anchors: dict[int, str]  # id -> the text it stands for
    longest_anchor: int

    def encode_with_starts(self, text: str) -> tuple[list[int], list[int]]:
        encoding = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(encoding["input_ids"]), [start for start, _ in encoding["offset_mapping"]]


@dataclass(frozen=True, slots=True)
class WholeTexts:
    """A tokenizer whose texts are never cut: no anchors, so `core/token_reuse.py` encodes every text whole with
    its own `encode` (the starts it gives are never read)."""

    tokenizer: Any  # mlx-lm's wrapper, or a `transformers` tokenizer
    anchors: dict[int, str] = field(default_factory=dict)
    longest_anchor: int = 0

    def encode_with_starts(self, text: str) -> tuple[list[int], list[int]]:
        ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        return ids, [0] * len(ids)


def offsets_encoder(tokenizer: Any) -> FastTokenizerOffsets | None:
    """`tokenizer` (mlx-lm's wrapper, or a `transformers` tokenizer) as an offsets encoder, or None."""
    # mlx-lm's wrapper answers the tokenizer's attributes but is not callable; a `transformers` one is.
    inner = tokenizer if callable(tokenizer) else getattr(tokenizer, "_tokenizer", None)
    if not callable(inner) or not getattr(inner, "is_fast", False) or getattr(inner, "split_special_tokens", False):
        return None
    added = getattr(inner, "added_tokens_decoder", None)
    if not isinstance(added, dict) or not added:
        return None
    anchors = {
        token_id: str(getattr(token, "content", token))
        for token_id, token in added.items()
        if not any(getattr(token, flag, True) for flag in ("normalized", "lstrip", "rstrip", "single_word"))
    }
    if not anchors:
        return None
    longest = max(len(str(getattr(token, "content", token))) for token in added.values())
    offsets = FastTokenizerOffsets(tokenizer=inner, anchors=anchors, longest_anchor=longest)
    return offsets if _encodes_alike(tokenizer, offsets) else None


def _encodes_alike(tokenizer: Any, offsets: FastTokenizerOffsets) -> bool:
    """Whether the offsets call gives the ids `encode` does, on text with what tokenizer classes treat apart
    (newlines, runs of spaces, tabs, digits, accents, other scripts, the anchors): a class that overrides `encode`
    (mlx-lm's `NewlineTokenizer` rewrites newlines there) is tokenized whole, as `encode` does it."""
    probe = "".join(f"{content}x\n\n  y\t12345 é 雪 ☃\r\n" for content in offsets.anchors.values())
    try:
        return list(tokenizer.encode(probe, add_special_tokens=False)) == offsets.encode_with_starts(probe)[0]
    except Exception:  # a tokenizer that cannot: it is not reused
        return False
