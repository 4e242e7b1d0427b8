"""Anthropic's Messages API: `/v1/messages` and `/v1/messages/count_tokens`, and its error envelope."""

from __future__ import annotations

from courier.http.schemas.shared import (
    BOOLEAN,
    ERROR,
    KEEP_ALIVE,
    MAX_TOKEN_COUNT,
    MAX_TOP_K,
    NAME,
    OBJECT,
    OPTIONAL_BOOLEAN,
    STRING,
    Schema,
    integer,
    nullable,
    number,
    refused,
    union,
    variant,
    with_error,
)

MAX_STOP_SEQUENCES = 32
MAX_USER_ID = 256  # metadata.user_id, as Anthropic bounds it
MAX_INPUT_EXAMPLES = 32  # a tool's input_examples
TOOL_CHOICES = ("auto", "any", "tool", "none")
EFFORTS = ("low", "medium", "high", "xhigh", "max")
CLEAR_THINKING = "clear_thinking_20251015"

TEXT_BLOCK = variant("text", "text", text=STRING)
_TEXT_ONLY = union(TEXT_BLOCK, error="must be a text block")
_IMAGE = variant(
    "image",
    "source",
    source=union(
        with_error(
            variant("base64", "media_type", "data", media_type=STRING, data=STRING),
            "needs a string media_type and data",
        ),
        variant("url", "url", url=NAME),
        error="must be a base64 or url image source (file sources need Anthropic's Files API)",
    ),
)
_TOOL_RESULT = variant(
    "tool_result",
    "tool_use_id",
    tool_use_id=STRING,
    content={
        "type": ["string", "array"],
        "items": union(TEXT_BLOCK, _IMAGE, error="must be a text or image block"),
    },
    is_error=BOOLEAN,
)
_USER_BLOCK = union(
    TEXT_BLOCK,
    _IMAGE,
    _TOOL_RESULT,
    error="must be a text, image or tool_result block: other blocks (documents, search results, container uploads, "
    "server tools) are not supported here",
)
_ASSISTANT_BLOCK = union(
    TEXT_BLOCK,
    variant("thinking", "thinking", thinking=STRING, signature=STRING),
    variant("redacted_thinking", data=STRING),  # another server's encrypted reasoning: taken, and left out
    variant("tool_use", "id", "name", id=STRING, name=STRING, input=OBJECT),
    error="must be a text, thinking, redacted_thinking or tool_use block",
)


def _message(role: str, block: Schema) -> Schema:
    content = {"type": ["string", "array"], "items": block}
    return variant(role, "content", tag="role", content=content)


# The last message from the assistant (a prefill to continue) is a reader's refusal.
MESSAGE = union(
    _message("user", _USER_BLOCK),
    _message("assistant", _ASSISTANT_BLOCK),
    _message("system", _TEXT_ONLY),  # Claude Code's mid-conversation system messages
    tag="role",
)
_SERVER_TOOLS = (
    "Anthropic's server tools (web search, code execution, computer use, ...) are not served here; send custom "
    "tools with an input_schema"
)
TOOL = union(
    {
        "type": "object",
        "required": ["name", "input_schema"],
        "properties": {
            "type": nullable({"const": "custom"}),
            "name": NAME,
            "description": nullable(STRING),
            "input_schema": OBJECT,  # the function's parameters
            "strict": nullable(BOOLEAN),
            # Shown to the model after the description (request.py).
            "input_examples": nullable({"type": "array", "maxItems": MAX_INPUT_EXAMPLES, "items": OBJECT}),
            "defer_loading": refused("(tool search) is not supported; send the tools themselves", False),
        },
    },
    tag="type",
    error=_SERVER_TOOLS,
)
TOOL_CHOICE = nullable(
    union(
        *(variant(kind, disable_parallel_tool_use=BOOLEAN) for kind in ("auto", "any", "none")),
        variant("tool", "name", name=NAME, disable_parallel_tool_use=BOOLEAN),  # exactly one call of it
        error=f"must be an object whose type is one of {', '.join(TOOL_CHOICES)}",
    )
)
# `summarized` is served as the whole thinking (no model here summarizes it); `omitted` as empty thinking blocks.
THINKING_DISPLAYS = ("summarized", "omitted")
_DISPLAY = nullable({"enum": list(THINKING_DISPLAYS)})
THINKING = nullable(
    union(
        # budget_tokens: less than max_tokens
        variant("enabled", "budget_tokens", budget_tokens=integer(1, MAX_TOKEN_COUNT), display=_DISPLAY),
        variant("disabled"),
        variant("adaptive", display=_DISPLAY),
        tag="type",
    )
)
_FORMAT_ERROR = "must be {'type': 'json_schema', 'schema': {...}}"
OUTPUT_FORMAT = nullable(union(variant("json_schema", "schema", schema=OBJECT), error=_FORMAT_ERROR))
_KEEP_ERROR = "must be 'all' or {'type': 'thinking_turns', 'value': N}"
CONTEXT_MANAGEMENT = nullable(
    {
        "type": "object",
        "properties": {
            "edits": {
                "type": "array",
                "items": union(
                    variant(
                        CLEAR_THINKING,
                        keep=nullable(
                            union(
                                {"const": "all"},
                                variant("thinking_turns", "value", value=integer(0)),
                                error=_KEEP_ERROR,
                                whole=True,
                            )
                        ),
                    ),
                    error=f"only {CLEAR_THINKING} edits are supported, not {{type}} (tool results are never cleared "
                    "here; drop the edit or send a shorter history)",
                ),
            }
        },
    }
)
_COMMON: dict[str, Schema] = {
    "model": NAME,
    "keep_alive": KEEP_ALIVE,
    "messages": {"type": "array", "minItems": 1, "items": MESSAGE},
    "system": {"type": ["string", "array", "null"], "items": _TEXT_ONLY},
    "tools": nullable({"type": "array", "items": TOOL}),
    "tool_choice": TOOL_CHOICE,
    "thinking": THINKING,
    "output_config": nullable(
        {"type": "object", "properties": {"effort": nullable({"enum": list(EFFORTS)}), "format": OUTPUT_FORMAT}}
    ),
    "output_format": OUTPUT_FORMAT,  # output_config.format's older place
    "context_management": CONTEXT_MANAGEMENT,
    "cache_control": nullable(OBJECT),  # accepted: the prompt cache here is automatic
    "stream": OPTIONAL_BOOLEAN,
    "stop_sequences": nullable({"type": "array", "maxItems": MAX_STOP_SEQUENCES, "items": STRING}),
    "temperature": nullable(number(0, 1)),
    "top_p": nullable(number(0, 1, open_low=True)),
    "top_k": nullable(integer(0, MAX_TOP_K)),
    "metadata": nullable({"type": "object", "properties": {"user_id": nullable({**STRING, "maxLength": MAX_USER_ID})}}),
    "container": refused("is not supported: this server runs no code execution container"),
    "mcp_servers": {
        "type": ["array", "null"],
        "maxItems": 0,
        ERROR: "is not supported: this server connects to no MCP server; send its tools as tools",
    },
    "service_tier": refused(
        "other than 'auto' or 'standard_only' cannot be honoured: this server has one tier", "auto", "standard_only"
    ),
}
# `max_tokens` is capped at what the context leaves after the prompt (agents ask for more than a window holds).
MESSAGES: Schema = {
    "type": "object",
    "required": ["model", "messages", "max_tokens"],
    "properties": {**_COMMON, "max_tokens": integer(1, MAX_TOKEN_COUNT)},
}
COUNT_TOKENS: Schema = {"type": "object", "required": ["model", "messages"], "properties": _COMMON}
ERROR_ENVELOPE: Schema = {
    "type": "object",
    "required": ["type", "error"],
    "properties": {
        "type": {"const": "error"},
        "error": {
            "type": "object",
            "required": ["type", "message"],
            "properties": {"type": STRING, "message": STRING, "code": nullable(STRING), "param": nullable(STRING)},
        },
        "request_id": nullable(STRING),
    },
}
