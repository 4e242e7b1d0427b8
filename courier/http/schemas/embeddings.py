"""`/v1/embeddings`: one input or a batch of them, as OpenAI takes them."""

from __future__ import annotations

from courier.http.schemas.shared import ERROR, KEEP_ALIVE, MODEL, SESSION, Schema, integer, nullable

MAX_INPUTS = 2048  # OpenAI's limit
ENCODING_FORMATS = ("float", "base64")

_INPUT_SHAPE = "a string, an array of strings, an array of token ids or an array of arrays of token ids"
# A string, or a list of strings, token ids or lists of token ids. Token ids beside strings or lists are a reader's
# refusal (a list is one input of ids, or a batch).
INPUT: Schema = {
    "type": ["string", "array"],
    "minItems": 1,
    "maxItems": MAX_INPUTS,
    "items": {
        "type": ["string", "integer", "array"],
        "minimum": 0,
        "minItems": 1,
        "items": integer(0),
        ERROR: "must be a string or an array of token ids",
    },
    ERROR: f"must be {_INPUT_SHAPE}, not empty, at most {MAX_INPUTS} inputs",
}
REQUEST: Schema = {
    "type": "object",
    "required": ["input"],
    "properties": {
        "model": MODEL,
        "input": INPUT,
        "encoding_format": nullable({"enum": list(ENCODING_FORMATS)}),
        "dimensions": nullable(integer(1)),
        "user": SESSION,
        "keep_alive": KEEP_ALIVE,
    },
}
