"""`/v1/chat/completions`, and `/tokenize` and `/detokenize`, whose chat form takes chat's messages."""

from __future__ import annotations

from functools import cache

from courier.grammar.output_spec import MAX_NAME
from courier.http.schemas.shared import (
    BOOLEAN,
    CHAT_TEMPLATE_KWARGS,
    ERROR,
    IMAGE_DETAIL,
    KEEP_ALIVE,
    MODEL,
    MODERATION,
    NAME,
    OBJECT,
    OPTIONAL_BOOLEAN,
    PROMPT_CACHE_OPTIONS,
    PROMPT_CACHE_RETENTION,
    REASONING_EFFORT,
    SAMPLING,
    SERVICE_TIER,
    SESSION,
    STREAM_OPTIONS,
    STRING,
    TOKENS,
    TOP_LOGPROBS,
    Schema,
    integer,
    nullable,
    refused,
    union,
    variant,
    with_error,
)

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")

_PART_ERROR = "must be a text part with a string 'text', or an image_url part (audio and file parts are not supported)"
_PART = union(
    with_error(variant("text", "text", text=STRING), _PART_ERROR),
    with_error(
        variant(
            "image_url",
            "image_url",
            image_url={
                "type": ["string", "object"],
                "minLength": 1,
                "required": ["url"],
                "properties": {"url": NAME, "detail": IMAGE_DETAIL},
            },
        ),
        "must be an image_url part whose image_url is a URL (or an object with 'url')",
    ),
    error=_PART_ERROR,
)
_TOOL_CALL = {
    "type": "object",
    "required": ["function"],
    "properties": {
        "id": nullable(STRING),
        "function": {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": STRING,
                # A mapping too: the template's own shape, which clients send back as they got it.
                "arguments": {"type": ["string", "object"], ERROR: "must be a JSON string"},
            },
        },
    },
    ERROR: "must have a function with a name",
}
MESSAGE: Schema = {
    "type": "object",
    "required": ["role"],  # `content` too, except for an assistant message with `tool_calls` (a reader's rule)
    "properties": {
        "role": {"enum": list(CHAT_ROLES)},
        "content": {"type": ["string", "array", "null"], "items": _PART},
        "tool_calls": nullable({"type": "array", "items": _TOOL_CALL}),
        "tool_call_id": nullable(STRING),
        "name": nullable(STRING),
        "reasoning_content": nullable(STRING),
        "reasoning": nullable(STRING),  # reasoning_content's alias
    },
}
MESSAGES: Schema = {"type": "array", "minItems": 1, "items": MESSAGE}
TOOL: Schema = {
    "type": "object",
    "required": ["type", "function"],
    "properties": {
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": NAME,
                "description": nullable(STRING),
                "parameters": nullable(OBJECT),
                "strict": nullable(BOOLEAN),
            },
            ERROR: "must have a non-empty string 'name', and 'parameters' must be an object",
        },
    },
    ERROR: "must be an object with type 'function'",
}
_NAMED: Schema = {"name": NAME}
TOOL_CHOICE = nullable(
    union(
        {"type": "string", "enum": ["auto", "none", "required"]},
        variant("function", "function", function={"type": "object", "required": ["name"], "properties": _NAMED}),
        error="must be 'auto', 'none', 'required' or {'type': 'function', 'function': {'name': ...}}",
        whole=True,
    )
)
JSON_SCHEMA_FIELDS: Schema = {
    "name": {"type": "string", "minLength": 1, "maxLength": MAX_NAME},
    "schema": OBJECT,
    "strict": nullable(BOOLEAN),
    "description": nullable(STRING),
}
RESPONSE_FORMAT = nullable(
    union(
        {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["text", "json_object"]}}},
        variant(
            "json_schema",
            "json_schema",
            json_schema={"type": "object", "required": ["schema"], "properties": JSON_SCHEMA_FIELDS},
        ),
        tag="type",
    )
)


@cache
def request(max_n: int) -> Schema:
    """The body, for a server that samples at most `max_n` choices of one prompt (`--max-n`)."""
    return {
        "type": "object",
        "required": ["messages"],
        "properties": {
            "model": MODEL,
            "keep_alive": KEEP_ALIVE,
            "messages": MESSAGES,
            "max_tokens": TOKENS,
            "max_completion_tokens": TOKENS,  # wins over max_tokens when both are sent
            **SAMPLING,
            "n": nullable(integer(1, max_n)),
            "logprobs": OPTIONAL_BOOLEAN,
            "top_logprobs": TOP_LOGPROBS,
            "stream": OPTIONAL_BOOLEAN,
            "stream_options": STREAM_OPTIONS,
            "tools": nullable({"type": "array", "items": TOOL}),
            "tool_choice": TOOL_CHOICE,
            "parallel_tool_calls": OPTIONAL_BOOLEAN,
            "response_format": RESPONSE_FORMAT,
            "chat_template_kwargs": CHAT_TEMPLATE_KWARGS,
            "reasoning_effort": REASONING_EFFORT,
            "prompt_cache_key": SESSION,
            "user": SESSION,
            "safety_identifier": SESSION,
            "cache_prompt": OPTIONAL_BOOLEAN,
            "service_tier": SERVICE_TIER,
            "store": refused(
                "true is not supported: chat completions are not stored (the Responses API stores responses)", False
            ),
            "metadata": {
                "type": ["object", "array", "null"],
                "maxProperties": 0,
                "maxItems": 0,
                ERROR: "is kept only with stored chat completions, which this server does not keep",
            },
            "modalities": refused("other than ['text'] cannot be honoured: this server generates text", ["text"]),
            "verbosity": refused("other than 'medium' cannot be honoured", "medium"),
            "prompt_cache_retention": PROMPT_CACHE_RETENTION,
            "prompt_cache_options": PROMPT_CACHE_OPTIONS,
            "moderation": MODERATION,
            "functions": refused("(legacy function calling) is not supported; send 'tools' instead"),
            "function_call": refused("(legacy function calling) is not supported; send 'tool_choice' instead"),
            "audio": refused("output is not supported: this server generates text"),
            "prediction": refused("(predicted outputs) is not supported"),
            "web_search_options": refused("is not supported: this server has no web search"),
        },
    }


# `prompt` or `messages`, exactly one of them (a reader's rule).
TOKENIZE: Schema = {
    "type": "object",
    "properties": {
        "model": MODEL,
        "prompt": nullable(STRING),
        "add_special_tokens": OPTIONAL_BOOLEAN,
        "messages": nullable(MESSAGES),
        "tools": nullable({"type": "array", "items": OBJECT}),
        "add_generation_prompt": OPTIONAL_BOOLEAN,
    },
}
DETOKENIZE: Schema = {
    "type": "object",
    "required": ["tokens"],
    "properties": {
        "model": MODEL,
        "tokens": {
            "type": "array",
            "items": integer(0),
            ERROR: "must be a list of integer token ids",
        },
    },
}
