"""`POST /v1/embeddings` in OpenAI's shape: the request's fields checked, and the answer's vectors written.

`input`: a string, an array of strings, an array of token ids, or an array of such arrays (at most `MAX_INPUTS`
inputs). `encoding_format`: `float` (arrays of numbers) or `base64` (each vector's little-endian float32 bytes, as
OpenAI's clients decode them). `dimensions`: the first N components, normalized again (Matryoshka truncation, what
Qwen3-Embedding and other MRL-trained models are trained for).
"""

from __future__ import annotations

import base64
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from courier.http.errors import ApiError
from courier.messages.embedder import EmbeddingInput

MAX_INPUTS = 2048  # OpenAI's limit
ENCODING_FORMATS = ("float", "base64")


_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
# The request's schema in the OpenAPI document (`http/openapi.py`), beside the checks it describes.
EMBEDDINGS_REQUEST_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["input"],
    "properties": {
        "model": {"type": "string"},
        "input": {
            "oneOf": [
                {"type": "string", "minLength": 1},
                {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1, "maxItems": MAX_INPUTS},
                _TOKEN_IDS,
                {"type": "array", "items": _TOKEN_IDS, "minItems": 1, "maxItems": MAX_INPUTS},
            ]
        },
        "encoding_format": {"enum": list(ENCODING_FORMATS)},
        "dimensions": {"type": "integer", "minimum": 1},
        "user": {"type": "string"},
        "keep_alive": {"type": ["number", "string"]},
    },
}


@dataclass(frozen=True, slots=True, kw_only=True)
class EmbeddingsRequest:
    inputs: tuple[EmbeddingInput, ...]
    encoding_format: str = "float"
    dimensions: int | None = None


def parse_embeddings_request(body: dict[str, Any]) -> EmbeddingsRequest:
    encoding_format = body.get("encoding_format") or "float"
    if encoding_format not in ENCODING_FORMATS:
        raise ApiError.invalid("'encoding_format' must be 'float' or 'base64'", param="encoding_format")
    dimensions = body.get("dimensions")
    if dimensions is not None and (not _is_int(dimensions) or dimensions < 1):
        raise ApiError.invalid("'dimensions' must be a positive integer", param="dimensions")
    return EmbeddingsRequest(inputs=_inputs(body.get("input")), encoding_format=encoding_format, dimensions=dimensions)


def _inputs(value: Any) -> tuple[EmbeddingInput, ...]:
    shape = "a string, an array of strings, an array of token ids or an array of arrays of token ids"
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, list) or not value:
        raise ApiError.invalid(f"'input' must be {shape}, not empty", param="input")
    if len(value) > MAX_INPUTS:
        raise ApiError.invalid(f"'input' holds {len(value)} inputs; at most {MAX_INPUTS}", param="input")
    if all(_is_int(item) for item in value):
        return (tuple(value),)
    inputs: list[EmbeddingInput] = []
    for index, item in enumerate(value):
        if isinstance(item, str):
            inputs.append(item)
        elif isinstance(item, list) and all(_is_int(token) for token in item):
            inputs.append(tuple(item))
        else:
            raise ApiError.invalid(
                f"'input[{index}]' must be a string or an array of token ids", param=f"input[{index}]"
            )
    return tuple(inputs)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # bool is an int subclass


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
