"""The Responses API: `/v1/responses` (and `/input_tokens`), `/v1/responses/compact`, and the Conversations API,
whose items are Responses' input items."""

from __future__ import annotations

from courier.http.schemas.chat import JSON_SCHEMA_FIELDS
from courier.http.schemas.shared import (
    BOOLEAN,
    CHAT_TEMPLATE_KWARGS,
    ERROR,
    IMAGE_DETAIL,
    IMAGE_OPTIONS,
    KEEP_ALIVE,
    MAX_TOKEN_COUNT,
    METADATA,
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

MESSAGE_ROLES = ("user", "assistant", "system", "developer")
# Tools OpenAI's servers run, or built-in client tools with call items of their own: taken, and left out of what
# the model is offered (`http/responses/tools.py`).
NOT_OFFERED = (
    "apply_patch",
    "code_interpreter",
    "computer",
    "computer_use",
    "computer_use_preview",
    "file_search",
    "image_generation",
    "local_shell",
    "mcp",
    "programmatic_tool_calling",
    "shell",
    "tool_search",
    "web_search",
    "web_search_2025_08_26",
    "web_search_preview",
    "web_search_preview_2025_03_11",
)
CUSTOM_SYNTAXES = ("lark", "regex")
SUMMARIES = ("auto", "concise", "detailed")
# `include` values: logprobs turns them on; sealed reasoning seals each reasoning item (its text stays in `content`
# too); the others are sent anyway (input images keep their URL) or concern hosted tools, which are never offered.
LOGPROBS_INCLUDE = "message.output_text.logprobs"
SEALED_INCLUDE = "reasoning.encrypted_content"
INCLUDABLE = (
    LOGPROBS_INCLUDE,
    SEALED_INCLUDE,
    "message.input_image.image_url",
    "file_search_call.results",
    "web_search_call.results",
    "web_search_call.action.sources",
    "code_interpreter_call.outputs",
    "computer_call_output.output.image_url",
)
MAX_SUMMARY_TOKENS = 16384
MAX_ITEMS_PER_CALL = 20  # items one conversation create or append may add (OpenAI's limit)
COMPACTION_TRIGGER = "compaction_trigger"  # the last input item of a request asking for a compaction; nowhere else
TOKEN_COUNT = integer(1, MAX_TOKEN_COUNT)

_TEXT_PARTS = ("input_text", "output_text", "text")
_PART_ERROR = (
    "must be an input_text, output_text, refusal or input_image part (input_file and input_audio parts are not "
    "supported)"
)
_PART = union(
    *(with_error(variant(kind, "text", text=STRING), _PART_ERROR) for kind in _TEXT_PARTS),
    with_error(variant("refusal", "refusal", refusal=STRING), _PART_ERROR),
    with_error(
        variant("input_image", "image_url", image_url=NAME, detail=IMAGE_DETAIL, file_id=nullable(STRING)),
        "must have an image_url (an http(s), data: or file:// URL): a file_id needs a Files API this server does "
        "not have",
    ),
    error=_PART_ERROR,
)


def _parts(*kinds: str) -> Schema:
    part = union(*(variant(kind, "text", text=STRING) for kind in kinds))
    return {"type": "array", "items": part, ERROR: f"must be a list of {kinds[0]} parts with a string 'text'"}


_CALL_ID = NAME
INPUT_ITEM = union(
    {
        "type": "object",
        "required": ["role", "content"],
        "properties": {
            "type": {"const": "message"},  # the default
            "role": {"enum": list(MESSAGE_ROLES)},
            "content": {"type": ["string", "array"], "items": _PART},
        },
    },
    variant(
        "function_call",
        "call_id",
        "name",
        "arguments",
        call_id=_CALL_ID,
        name=NAME,
        arguments=STRING,
        namespace=nullable(NAME),
    ),
    variant(
        "custom_tool_call",
        "call_id",
        "name",
        "input",
        call_id=_CALL_ID,
        name=NAME,
        input=STRING,
        namespace=nullable(NAME),
    ),
    {
        "type": "object",
        "required": ["type", "call_id", "output"],
        "properties": {
            "type": {"enum": ["function_call_output", "custom_tool_call_output"]},
            "call_id": _CALL_ID,
            "output": {
                "type": ["string", "array"],
                "items": union(*(variant(kind, "text", text=STRING) for kind in _TEXT_PARTS)),
                ERROR: "must be a string or a list of text parts",
            },
        },
    },
    # A capsule, checked when the history is replayed, where the server's key is known.
    variant("compaction", "encrypted_content", encrypted_content=NAME),
    variant(
        "reasoning",
        content=nullable(_parts("reasoning_text", "text")),
        summary=nullable(_parts("summary_text")),
        encrypted_content=nullable(NAME),  # a seal, opened with the server's key
    ),
    variant(COMPACTION_TRIGGER),
    tag="type",
)
INPUT: Schema = {"type": ["string", "array"], "minItems": 1, "items": INPUT_ITEM}
_FUNCTION = variant(
    "function",
    "name",
    name=NAME,
    description=nullable(STRING),
    parameters=nullable(OBJECT),
    strict=nullable(BOOLEAN),
)
_CUSTOM = variant(
    "custom",
    "name",
    name=NAME,
    description=nullable(STRING),
    format=nullable(
        union(
            variant("text"),
            variant(
                "grammar",
                "syntax",
                "definition",
                syntax={"enum": list(CUSTOM_SYNTAXES)},
                definition={"type": "string", "pattern": r"\S"},
            ),
            error="must be {'type': 'text'} or {'type': 'grammar', 'syntax': 'lark' or 'regex', 'definition': ...}",
        )
    ),
)
TOOL = union(
    _FUNCTION,
    _CUSTOM,
    variant(
        "namespace",
        "name",
        "tools",
        name=NAME,
        description=nullable(STRING),
        tools={"type": "array", "minItems": 1, "items": union(_FUNCTION, _CUSTOM, tag="type")},
    ),
    {"type": "object", "required": ["type"], "properties": {"type": {"enum": list(NOT_OFFERED)}}},
    tag="type",
)
TOOLS = nullable({"type": "array", "items": TOOL})
TOOL_CHOICE = nullable(
    union(
        {"type": "string", "enum": ["auto", "none", "required"]},
        {
            "type": "object",
            "required": ["type", "name"],
            "properties": {"type": {"enum": ["function", "custom"]}, "name": NAME, "namespace": nullable(STRING)},
        },
        error=(
            "must be 'auto', 'none', 'required' or {'type': 'function' or 'custom', 'name', 'namespace'?}: hosted "
            "tools are left out of what the model is offered and this server does not run them, so none can be "
            "forced; 'allowed_tools' is not supported"
        ),
        whole=True,
    )
)
TEXT = nullable(
    {
        "type": "object",
        "properties": {
            "verbosity": refused("other than 'medium' is not supported", "medium"),
            "format": nullable(
                union(
                    {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["text", "json_object"]}}},
                    variant("json_schema", "schema", **JSON_SCHEMA_FIELDS),
                    tag="type",
                )
            ),
        },
    }
)
REASONING = nullable(
    {
        "type": "object",
        "properties": {
            "effort": REASONING_EFFORT,
            "summary": nullable({"enum": list(SUMMARIES)}),
            "generate_summary": nullable({"enum": list(SUMMARIES)}),  # summary's older name
        },
    }
)
_REFUSED = {
    "prompt": refused("(stored prompt templates) is not supported: send the instructions and input themselves"),
    "prompt_cache_retention": PROMPT_CACHE_RETENTION,
    "prompt_cache_options": PROMPT_CACHE_OPTIONS,
    "moderation": MODERATION,
    "access_programs": refused("is not supported"),
    "background_options": refused("is not supported: background mode is not served; stream instead"),
    "image": IMAGE_OPTIONS,
    "service_tier": SERVICE_TIER,
    "background": refused("true is not supported; stream the response instead", False),
    "truncation": refused(
        "other than 'disabled' is not supported (an input too long for the context is a 400)", "disabled"
    ),
    "n": refused("other than 1 is not supported: a response has one output", 1),
}
# `input` is required unless `previous_response_id` or `conversation` gives the context (a reader's rule).
REQUEST: Schema = {
    "type": "object",
    "properties": {
        "model": MODEL,
        "keep_alive": KEEP_ALIVE,
        "input": INPUT,
        "instructions": nullable(STRING),
        "previous_response_id": nullable(STRING),
        "conversation": {
            "type": ["string", "object", "null"],
            "minLength": 1,
            "required": ["id"],
            "properties": {"id": NAME},
            ERROR: "must be a conversation id or an object with one",
        },
        "tools": TOOLS,
        "tool_choice": TOOL_CHOICE,
        "parallel_tool_calls": OPTIONAL_BOOLEAN,
        "max_tool_calls": nullable(integer(1)),
        "max_output_tokens": TOKENS,
        **SAMPLING,
        "top_logprobs": TOP_LOGPROBS,
        "include": nullable({"type": "array", "items": {"enum": list(INCLUDABLE)}}),
        "reasoning": REASONING,
        "text": TEXT,
        "chat_template_kwargs": CHAT_TEMPLATE_KWARGS,
        "metadata": METADATA,
        "store": OPTIONAL_BOOLEAN,
        "stream": OPTIONAL_BOOLEAN,
        "stream_options": nullable(
            {
                "type": "object",
                "properties": {
                    "include_obfuscation": refused("true is not supported: stream events carry no padding", False)
                },
            }
        ),
        "prompt_cache_key": SESSION,
        "user": SESSION,
        "safety_identifier": SESSION,
        "cache_prompt": OPTIONAL_BOOLEAN,
        "context_management": nullable(
            {
                "type": "array",
                "items": union(variant("compaction", "compact_threshold", compact_threshold=TOKEN_COUNT), tag="type"),
            }
        ),
        **_REFUSED,
    },
}
_PERSONALITY = refused("is not supported: the count is of the input as sent")
INPUT_TOKENS: Schema = {**REQUEST, "properties": {**REQUEST["properties"], "personality": _PERSONALITY}}
_WHOLE_HISTORY = "is not supported on /v1/responses/compact: send the whole history as 'input'"
COMPACT: Schema = {
    "type": "object",
    "required": ["input"],
    "properties": {
        "model": MODEL,
        "keep_alive": KEEP_ALIVE,
        "input": INPUT,
        "instructions": nullable(STRING),
        "tools": TOOLS,
        "max_output_tokens": nullable(integer(1, MAX_SUMMARY_TOKENS)),
        "keep_tokens": TOKENS,
        "prompt_cache_key": SESSION,
        "user": SESSION,
        "safety_identifier": SESSION,
        "stream": refused(_WHOLE_HISTORY, False),
        "previous_response_id": refused(_WHOLE_HISTORY, False),
        "conversation": refused(_WHOLE_HISTORY, False),
        "image": IMAGE_OPTIONS,
        "prompt_cache_retention": PROMPT_CACHE_RETENTION,
        "prompt_cache_options": PROMPT_CACHE_OPTIONS,
        "service_tier": SERVICE_TIER,
    },
}
# A string is taken as one user message, as Responses' `input` is.
_ITEMS: Schema = {"type": ["string", "array"], "minItems": 1, "maxItems": MAX_ITEMS_PER_CALL, "items": INPUT_ITEM}
CONVERSATION: Schema = {"type": "object", "properties": {"items": nullable(_ITEMS), "metadata": METADATA}}
CONVERSATION_UPDATE: Schema = {"type": "object", "required": ["metadata"], "properties": {"metadata": METADATA}}
CONVERSATION_ITEMS: Schema = {"type": "object", "required": ["items"], "properties": {"items": _ITEMS}}
