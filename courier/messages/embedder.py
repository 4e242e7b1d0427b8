"""The embedder's inbox: inputs (texts or token ids) to embed, answered with one unit vector each."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

from courier.messages.base import Request, RequestFailed

EmbeddingInput: TypeAlias = str | tuple[int, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class Embedded:
    vectors: tuple[tuple[float, ...], ...]  # one per input, in order, each of norm 1 (or all zeros)
    prompt_tokens: int  # the inputs' tokens, all together


EmbedReply: TypeAlias = Embedded | RequestFailed


@dataclass(frozen=True, slots=True, kw_only=True)
class EmbedInputs(Request[Embedded]):
    """Embed `inputs` (texts, tokenized by the model's tokenizer, or token ids as they are)."""

    inputs: tuple[EmbeddingInput, ...]


EmbedderMessage: TypeAlias = EmbedInputs
