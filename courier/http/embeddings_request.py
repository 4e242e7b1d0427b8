"""`POST /v1/embeddings` in OpenAI's shape: the request's fields checked, and the answer's vectors written.

`input`: a string, an array of strings, an array of token ids, or an array of such arrays (at most `MAX_INPUTS`
inputs). `encoding_format`: `float` (arrays of numbers) or `base64` (each vector's little-endian float32 bytes, as
OpenAI's clients decode them). `dimensions`: the first N components, normalized again (Matryoshka truncation, what
Qwen3-Embedding and other MRL-trained models are trained for). The fields' shapes are `schemas/embeddings.py`'s.
"""

from __future__ import annotations

import base64
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from courier.http.checked_fields import optional_whole
from courier.http.errors import ApiError
from courier.http.schemas import embeddings
from courier.http.schemas.validator import check
from courier.messages.embedder import EmbeddingInput


@dataclass(frozen=True, slots=True, kw_only=True)
class EmbeddingsRequest:
    inputs: tuple[EmbeddingInput, ...]
    encoding_format: str = "float"
    dimensions: int | None = None


def parse_embeddings_request(body: dict[str, Any]) -> EmbeddingsRequest:
    check(embeddings.REQUEST, body)
    return EmbeddingsRequest(
        inputs=_inputs(body["input"]),
        encoding_format=body.get("encoding_format") or "float",
        dimensions=optional_whole(body, "dimensions"),
    )


def _inputs(value: str | list[Any]) -> tuple[EmbeddingInput, ...]:
    """The inputs of a value the schema took: a list of token ids alone is one input; beside strings or lists of
    them, a token id is refused."""
    if isinstance(value, str):
        return (value,)
    if all(isinstance(item, int | float) for item in value):
        return (tuple(int(item) for item in value),)
    inputs: list[EmbeddingInput] = []
    for index, item in enumerate(value):
        if isinstance(item, int | float):
            message = f"'input[{index}]' is a token id beside strings or lists of them; send it in a list"
            raise ApiError.invalid(message, param=f"input[{index}]")
        inputs.append(item if isinstance(item, str) else tuple(int(token) for token in item))
    return tuple(inputs)


def shaped(vector: Sequence[float], dimensions: int | None) -> list[float]:
    """The vector truncated to `dimensions` and normalized again (as it is, when None)."""
    if dimensions is None or dimensions >= len(vector):
        return list(vector)
    head = list(vector[:dimensions])
    norm = math.sqrt(sum(value * value for value in head))
    return [value / norm for value in head] if norm > 0 else head


def encoded(vector: Sequence[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return list(vector)


def embeddings_response(
    vectors: Sequence[Sequence[float]], request: EmbeddingsRequest, model_id: str, prompt_tokens: int
) -> dict[str, Any]:
    data = [
        {
            "object": "embedding",
            "index": index,
            "embedding": encoded(shaped(vector, request.dimensions), request.encoding_format),
        }
        for index, vector in enumerate(vectors)
    ]
    usage = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}
    return {"object": "list", "data": data, "model": model_id, "usage": usage}
