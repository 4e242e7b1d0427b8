"""The served tokenizer as `core/token_reuse.py` needs it: ids with the character each starts at, and its anchors.

Only a fast (Rust) Hugging Face tokenizer qualifies: it cuts a text at its added tokens before anything else, and
tells each token's offsets. Not one that keeps special tokens whole as text (`split_special_tokens`), where that
cut does not happen. An anchor is an added token matched in the raw text (`normalized` off) that takes no
whitespace beside it and is no single-word match (`lstrip`, `rstrip`, `single_word` off): where it starts, the
text before and after it are encoded apart. A tokenizer without one is not reused (`offsets_encoder` is None).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class FastTokenizerOffsets:
    tokenizer: Any  # a fast `transformers` tokenizer
    anchors: frozenset[int]
    longest_anchor: int

    def encode_with_starts(self, text: str) -> tuple[list[int], list[int]]:
        encoding = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(encoding["input_ids"]), [start for start, _ in encoding["offset_mapping"]]


def offsets_encoder(tokenizer: Any) -> FastTokenizerOffsets | None:
    """`tokenizer` (mlx-lm's wrapper, or a `transformers` tokenizer) as an offsets encoder, or None."""
    # mlx-lm's wrapper answers the tokenizer's attributes but is not callable; a `transformers` one is.
    inner = tokenizer if callable(tokenizer) else getattr(tokenizer, "_tokenizer", None)
    if not callable(inner) or not getattr(inner, "is_fast", False) or getattr(inner, "split_special_tokens", False):
        return None
    added = getattr(inner, "added_tokens_decoder", None)
    if not isinstance(added, dict) or not added:
        return None
    anchors = frozenset(
        token_id
        for token_id, token in added.items()
        if not any(getattr(token, flag, True) for flag in ("normalized", "lstrip", "rstrip", "single_word"))
    )
    if not anchors:
        return None
    longest = max(len(str(getattr(token, "content", token))) for token in added.values())
    return FastTokenizerOffsets(tokenizer=inner, anchors=anchors, longest_anchor=longest)
