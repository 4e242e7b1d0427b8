"""`/v1/completions`: chat's sampling fields around a prompt."""

from __future__ import annotations

from functools import cache

from courier.http.schemas.chat import RESPONSE_FORMAT
from courier.http.schemas.shared import (
    ERROR,
    KEEP_ALIVE,
    MODEL,
    OPTIONAL_BOOLEAN,
    PROMPT_CACHE_OPTIONS,
    PROMPT_CACHE_RETENTION,
    SAMPLING,
    SERVICE_TIER,
    SESSION,
    STREAM_OPTIONS,
    TOKENS,
    Schema,
    integer,
    nullable,
    refused,
)

MAX_LOGPROBS = 5
# A string or token ids, or a one-element list of either; several prompts in one request are a reader's refusal.
PROMPT: Schema = {
    "type": ["string", "array"],
    "minItems": 1,
    "items": {
        "type": ["integer", "string", "array"],
        "minimum": 0,
        "minItems": 1,
        "items": integer(0),
    },
    ERROR: "must be a string or a non-empty list of token ids",
}


@cache
def request(max_n: int) -> Schema:
    """The body, for a server that samples at most `max_n` choices of one prompt (`--max-n`)."""
    return {
        "type": "object",
        "required": ["prompt"],
        "properties": {
            "model": MODEL,
            "keep_alive": KEEP_ALIVE,
            "prompt": PROMPT,
            "max_tokens": TOKENS,  # 16 when absent, as OpenAI's
            "max_completion_tokens": TOKENS,
            **SAMPLING,
            "n": nullable(integer(1, max_n)),
            "logprobs": nullable(integer(0, MAX_LOGPROBS)),
            "stream": OPTIONAL_BOOLEAN,
            "stream_options": STREAM_OPTIONS,
            "response_format": RESPONSE_FORMAT,
            "prompt_cache_key": SESSION,
            "user": SESSION,
            "cache_prompt": OPTIONAL_BOOLEAN,
            "echo": refused("is not supported", False),
            "suffix": {"type": ["string", "null"], "maxLength": 0, ERROR: "is not supported"},
            "best_of": refused("other than 1 is not supported", 1),
            "service_tier": SERVICE_TIER,
            "prompt_cache_retention": PROMPT_CACHE_RETENTION,
            "prompt_cache_options": PROMPT_CACHE_OPTIONS,
        },
    }
