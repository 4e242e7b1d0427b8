"""The Messages API's part of the OpenAPI document (`http/openapi.py`): its bodies and its error envelope.

Kept beside the validators (`request.py`, `content.py`) and tested for agreement with them
(`tests/http/anthropic/test_schema.py`).
"""

from __future__ import annotations

from typing import Any

from courier.http.anthropic.request import EFFORTS, MAX_STOP_SEQUENCES, MAX_USER_ID, TOOL_CHOICES
from courier.http.openai_requests import MAX_TOP_K

Schema = dict[str, Any]

_TEXT: Schema = {"type": "string"}
_OBJECT: Schema = {"type": "object"}


def _nullable(schema: Schema) -> Schema:
    return {"anyOf": [schema, {"type": "null"}]}


def _block(kind: str, required: tuple[str, ...] = (), **properties: Schema) -> Schema:
    return {
        "type": "object",
        "required": ["type", *required],
        "properties": {"type": {"const": kind}, **properties},
    }


_TEXT_BLOCK = _block("text", ("text",), text=_TEXT)
_IMAGE_SOURCE = {
    "oneOf": [
        _block("base64", ("media_type", "data"), media_type=_TEXT, data=_TEXT),
        _block("url", ("url",), url=_TEXT),
    ]
}
_IMAGE_BLOCK = _block("image", ("source",), source=_IMAGE_SOURCE)
_TOOL_RESULT = _block(
    "tool_result",
    ("tool_use_id",),
    tool_use_id=_TEXT,
    content={"anyOf": [_TEXT, {"type": "array", "items": _TEXT_BLOCK}]},
    is_error={"type": "boolean"},
)
_USER_BLOCK = {"oneOf": [_TEXT_BLOCK, _IMAGE_BLOCK, _TOOL_RESULT]}
_ASSISTANT_BLOCK = {
    "oneOf": [
        _TEXT_BLOCK,
        _block("thinking", ("thinking",), thinking=_TEXT, signature=_TEXT),
        _block("redacted_thinking", ("data",), data=_TEXT),
        _block("tool_use", ("id", "name"), id=_TEXT, name=_TEXT, input=_OBJECT),
    ]
}


def _message(role: str, block: Schema) -> Schema:
    return {
        "type": "object",
        "required": ["role", "content"],
        "properties": {"role": {"const": role}, "content": {"anyOf": [_TEXT, {"type": "array", "items": block}]}},
    }


_MESSAGE = {
    "oneOf": [
        _message("user", _USER_BLOCK),
        _message("assistant", _ASSISTANT_BLOCK),
        _message("system", _TEXT_BLOCK),  # Claude Code's mid-conversation system messages
    ]
}
_TOOL = {
    "type": "object",
    "required": ["name", "input_schema"],
    "properties": {
        "type": _nullable({"const": "custom"}),
        "name": {"type": "string", "minLength": 1},
        "description": _TEXT,
        "input_schema": _OBJECT,
        "strict": {"type": "boolean"},
        "defer_loading": _nullable({"const": False}),
    },
}
_THINKING = {
    "oneOf": [
        _block("enabled", ("budget_tokens",), budget_tokens={"type": "integer", "minimum": 1}),
        _block("disabled"),
        _block("adaptive"),
    ]
}
_CLEAR_THINKING = _block(
    "clear_thinking_20251015",
    keep={
        "anyOf": [
            {"const": "all"},
            _block("thinking_turns", ("value",), value={"type": "integer", "minimum": 0}),
        ]
    },
)
_USER_ID: Schema = {"type": "string", "maxLength": MAX_USER_ID}
_COUNT_PROPERTIES: Schema = {
    "model": {"type": "string", "minLength": 1},
    "messages": {"type": "array", "minItems": 1, "items": _MESSAGE},
    "system": {"anyOf": [_TEXT, {"type": "array", "items": _TEXT_BLOCK}]},
    "tools": {"type": "array", "items": _TOOL},
    "tool_choice": {
        "type": "object",
        "required": ["type"],
        "properties": {
            "type": {"enum": list(TOOL_CHOICES)},
            "name": {"type": "string", "minLength": 1},
            "disable_parallel_tool_use": {"type": "boolean"},
        },
    },
    "thinking": _THINKING,
    "context_management": {
        "type": "object",
        "properties": {"edits": {"type": "array", "items": _CLEAR_THINKING}},
    },
    "output_config": {
        "type": "object",
        "properties": {
            "effort": {"enum": list(EFFORTS)},
            "format": _block("json_schema", ("schema",), schema=_OBJECT),
        },
    },
    "mcp_servers": {"type": "array", "maxItems": 0},
    "container": {"type": "null"},
    "service_tier": {"enum": ["auto", "standard_only"]},
}
COUNT_TOKENS_REQUEST: Schema = {"type": "object", "required": ["model", "messages"], "properties": _COUNT_PROPERTIES}
MESSAGES_REQUEST: Schema = {
    "type": "object",
    "required": ["model", "messages", "max_tokens"],
    "properties": {
        **_COUNT_PROPERTIES,
        "max_tokens": {"type": "integer", "minimum": 1},
        "stream": {"type": "boolean"},
        "stop_sequences": {"type": "array", "maxItems": MAX_STOP_SEQUENCES, "items": _TEXT},
        "temperature": {"type": "number", "minimum": 0, "maximum": 1},
        "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        "top_k": {"type": "integer", "minimum": 0, "maximum": MAX_TOP_K},
        "metadata": {"type": "object", "properties": {"user_id": _nullable(_USER_ID)}},
    },
}
ERROR: Schema = {
    "type": "object",
    "required": ["type", "error"],
    "properties": {
        "type": {"const": "error"},
        "error": {
            "type": "object",
            "required": ["type", "message"],
            "properties": {"type": _TEXT, "message": _TEXT, "code": _nullable(_TEXT), "param": _nullable(_TEXT)},
        },
        "request_id": _nullable(_TEXT),
    },
}
