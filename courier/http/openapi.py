"""The OpenAPI 3.1 document of every route, served at `/openapi.json`.

Kept beside the hand-written validation (`openai_requests.py`, `responses/request.py`, ...) and tested for
agreement with it (`tests/http/test_openapi.py`): every route the app serves is documented with its methods, and
documented constraints are the ones the validators enforce. Each path is also served without its `/v1` prefix
(OpenAI clients may omit it); those aliases are not listed twice.
"""

from __future__ import annotations

from typing import Any

from courier.core.template_options import REASONING_EFFORTS
from courier.http.anthropic import schema as anthropic
from courier.http.embeddings_request import EMBEDDINGS_REQUEST_SCHEMA
from courier.http.listing import MAX_LIMIT
from courier.http.openai_requests import (
    MAX_LOGIT_BIAS,
    MAX_REPETITION_PENALTY,
    MAX_STOP_SEQUENCES,
    MAX_TEMPERATURE,
    MAX_TOP_K,
    MAX_TOP_LOGPROBS_CHAT,
    MIN_REPETITION_PENALTY,
)
from courier.http.responses.request import INCLUDABLE, MAX_METADATA_ENTRIES, MAX_SUMMARY_TOKENS, SUMMARIES
from courier.http.responses.tools import NOT_OFFERED

Schema = dict[str, Any]

OPENAPI_VERSION = "3.1.0"
_ERROR = {"$ref": "#/components/schemas/Error"}
_ANTHROPIC_ERROR = {"$ref": "#/components/schemas/AnthropicError"}
_OBJECT: Schema = {"type": "object"}
_TEXT: Schema = {"type": "string"}
_ID: Schema = {"type": "string", "minLength": 1}


def _nullable(schema: Schema) -> Schema:
    return {"anyOf": [schema, {"type": "null"}]}


_MODEL = _nullable({"type": "string"})
_POSITIVE = _nullable({"type": "integer", "minimum": 1})
_TEMPERATURE = _nullable({"type": "number", "minimum": 0, "maximum": MAX_TEMPERATURE})
_TOP_P = _nullable({"type": "number", "exclusiveMinimum": 0, "maximum": 1})
_SESSION = _nullable({"type": "string"})
_BOOL = _nullable({"type": "boolean"})
_STOP = _nullable({"anyOf": [_TEXT, {"type": "array", "items": _TEXT, "maxItems": MAX_STOP_SEQUENCES}]})
_METADATA = _nullable(
    {
        "type": "object",
        "maxProperties": MAX_METADATA_ENTRIES,
        "propertyNames": {"maxLength": 64},
        "additionalProperties": {"type": "string", "maxLength": 512},
    }
)
_FUNCTION_NAME: Schema = {"type": "string", "minLength": 1}
_FORMAT_NAME: Schema = {"type": "string", "minLength": 1, "maxLength": 64}
_JSON_SCHEMA_BODY: Schema = {
    "name": _FORMAT_NAME,
    "schema": _OBJECT,
    "strict": _nullable({"type": "boolean"}),
    "description": _nullable(_TEXT),
}
_RESPONSE_FORMAT = _nullable(
    {
        "oneOf": [
            {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["text", "json_object"]}}},
            {
                "type": "object",
                "required": ["type", "json_schema"],
                "properties": {
                    "type": {"const": "json_schema"},
                    "json_schema": {"type": "object", "required": ["schema"], "properties": _JSON_SCHEMA_BODY},
                },
            },
        ]
    }
)
_TEXT_FORMAT = _nullable(
    {
        "type": "object",
        "properties": {
            "verbosity": _nullable({"const": "medium"}),
            "format": _nullable(
                {
                    "oneOf": [
                        {
                            "type": "object",
                            "required": ["type"],
                            "properties": {"type": {"enum": ["text", "json_object"]}},
                        },
                        {
                            "type": "object",
                            "required": ["type", "schema"],
                            "properties": {"type": {"const": "json_schema"}, **_JSON_SCHEMA_BODY},
                        },
                    ]
                }
            ),
        },
    }
)
_CHAT_TOOL_CHOICE = _nullable(
    {
        "anyOf": [
            {"enum": ["auto", "none", "required"]},
            {
                "type": "object",
                "required": ["type", "function"],
                "properties": {
                    "type": {"const": "function"},
                    "function": {"type": "object", "required": ["name"], "properties": {"name": _FUNCTION_NAME}},
                },
            },
        ]
    }
)
_RESPONSES_TOOL_CHOICE = _nullable(
    {
        "anyOf": [
            {"enum": ["auto", "none", "required"]},
            {
                "type": "object",
                "required": ["type", "name"],
                "properties": {
                    "type": {"enum": ["function", "custom"]},
                    "name": _FUNCTION_NAME,
                    "namespace": _nullable(_FUNCTION_NAME),
                },
            },
        ]
    }
)
_CHAT_TOOL = {
    "type": "object",
    "required": ["type", "function"],
    "properties": {
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "required": ["name"],
            "properties": {"name": {"type": "string", "minLength": 1}, "parameters": _nullable(_OBJECT)},
        },
    },
}
_RESPONSES_FUNCTION_TOOL = {
    "type": "object",
    "required": ["type", "name"],
    "properties": {
        "type": {"const": "function"},
        "name": {"type": "string", "minLength": 1},
        "parameters": _nullable(_OBJECT),
    },
}
_CUSTOM_TOOL = {
    "type": "object",
    "required": ["type", "name"],
    "properties": {
        "type": {"const": "custom"},
        "name": {"type": "string", "minLength": 1},
        "description": _nullable(_TEXT),
        "format": _nullable(
            {
                "anyOf": [
                    {"type": "object", "required": ["type"], "properties": {"type": {"const": "text"}}},
                    {
                        "type": "object",
                        "required": ["type", "syntax", "definition"],
                        "properties": {
                            "type": {"const": "grammar"},
                            "syntax": {"enum": ["lark", "regex"]},
                            "definition": {"type": "string", "pattern": "\\S"},
                        },
                    },
                ]
            }
        ),
    },
}
# Hosted tools are taken and left out of what the model is offered (http/responses/tools.py).
_RESPONSES_TOOL = {
    "anyOf": [
        _RESPONSES_FUNCTION_TOOL,
        _CUSTOM_TOOL,
        {
            "type": "object",
            "required": ["type", "name", "tools"],
            "properties": {
                "type": {"const": "namespace"},
                "name": {"type": "string", "minLength": 1},
                "tools": {"type": "array", "minItems": 1, "items": {"anyOf": [_RESPONSES_FUNCTION_TOOL, _CUSTOM_TOOL]}},
            },
        },
        {"type": "object", "required": ["type"], "properties": {"type": {"enum": sorted(NOT_OFFERED)}}},
    ]
}
_CHAT_PART = {
    "oneOf": [
        {"type": "object", "required": ["type", "text"], "properties": {"type": {"const": "text"}, "text": _TEXT}},
        {
            "type": "object",
            "required": ["type", "image_url"],
            "properties": {"type": {"const": "image_url"}, "image_url": {"type": "object", "required": ["url"]}},
        },
    ]
}
_CHAT_MESSAGE = {
    "type": "object",
    "required": ["role"],  # `content` too, except an assistant message with `tool_calls` (null content)
    "properties": {
        "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
        "content": _nullable({"anyOf": [_TEXT, {"type": "array", "items": _CHAT_PART}]}),
        "tool_calls": _nullable({"type": "array"}),
        "tool_call_id": _TEXT,
        "name": _TEXT,
        "reasoning_content": _nullable(_TEXT),
        "reasoning": _nullable(_TEXT),
    },
}
_SAMPLING = {
    "model": _MODEL,
    "temperature": _TEMPERATURE,
    "top_p": _TOP_P,
    "seed": _nullable({"type": "integer", "minimum": 0, "maximum": 2**63 - 1}),
    "stop": _STOP,
    "n": _nullable({"type": "integer", "minimum": 1}),
    "stream": _BOOL,
    "stream_options": _nullable(
        {"type": "object", "properties": {"include_usage": _BOOL, "include_obfuscation": _nullable({"const": False})}}
    ),
    "user": _SESSION,
    "service_tier": _nullable({"enum": ["auto", "default"]}),
    "prompt_cache_retention": _nullable({"const": "in_memory"}),
    "prompt_cache_key": _SESSION,
    "cache_prompt": _BOOL,
    "top_k": _nullable({"type": "integer", "minimum": -1, "maximum": MAX_TOP_K}),
    "min_p": _nullable({"type": "number", "minimum": 0, "maximum": 1}),
    "presence_penalty": _nullable({"type": "number", "minimum": -2, "maximum": 2}),
    "frequency_penalty": _nullable({"type": "number", "minimum": -2, "maximum": 2}),
    "repetition_penalty": _nullable(
        {"type": "number", "minimum": MIN_REPETITION_PENALTY, "maximum": MAX_REPETITION_PENALTY}
    ),
    "logit_bias": _nullable(
        {
            "type": "object",
            "maxProperties": MAX_LOGIT_BIAS,
            "propertyNames": {"pattern": "^[0-9]{1,12}$"},
            "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
        }
    ),
}
_CHAT_REQUEST = {
    "type": "object",
    "required": ["messages"],
    "properties": {
        **_SAMPLING,
        "messages": {"type": "array", "minItems": 1, "items": _CHAT_MESSAGE},
        "max_tokens": _POSITIVE,
        "max_completion_tokens": _POSITIVE,
        "logprobs": _BOOL,
        "top_logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": MAX_TOP_LOGPROBS_CHAT}),
        "tools": _nullable({"type": "array", "items": _CHAT_TOOL}),
        "tool_choice": _CHAT_TOOL_CHOICE,
        "parallel_tool_calls": _BOOL,
        "response_format": _RESPONSE_FORMAT,
        "safety_identifier": _SESSION,
        "store": _nullable({"const": False}),
        "metadata": _nullable({"type": "object", "maxProperties": 0}),
        "modalities": _nullable({"const": ["text"]}),
        "verbosity": _nullable({"const": "medium"}),
        "reasoning_effort": _nullable({"enum": list(REASONING_EFFORTS)}),
        "chat_template_kwargs": _nullable(
            {
                "type": "object",
                "maxProperties": 16,
                "additionalProperties": {"type": ["string", "number", "boolean", "null"]},
            }
        ),
    },
}
_COMPLETION_REQUEST = {
    "type": "object",
    "required": ["prompt"],
    "properties": {
        **_SAMPLING,
        "prompt": {"anyOf": [_TEXT, {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}]},
        "max_tokens": _POSITIVE,
        "logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": 5}),
        "max_completion_tokens": _POSITIVE,
        "echo": _nullable({"const": False}),
        "suffix": _nullable({"const": ""}),
        "best_of": _nullable({"const": 1}),
        "response_format": _RESPONSE_FORMAT,
    },
}
_INPUT_PART = {
    "type": "object",
    "required": ["type"],
    "properties": {"type": {"enum": ["input_text", "output_text", "input_image", "refusal"]}, "text": _TEXT},
}


def _text_parts(part_type: str) -> dict[str, Any]:
    item = {"type": "object", "required": ["type", "text"], "properties": {"type": {"const": part_type}, "text": _TEXT}}
    return {"type": "array", "items": item}


_INPUT_ITEM = {
    "oneOf": [
        {
            "type": "object",
            "required": ["role", "content"],
            "properties": {
                "type": {"const": "message"},
                "role": {"enum": ["user", "assistant", "system", "developer"]},
                "content": {"anyOf": [_TEXT, {"type": "array", "items": _INPUT_PART}]},
            },
        },
        {
            "type": "object",
            "required": ["type", "call_id", "name", "arguments"],
            "properties": {
                "type": {"const": "function_call"},
                "call_id": _ID,
                "name": _ID,
                "arguments": _TEXT,
                "namespace": _nullable(_ID),
            },
        },
        {
            "type": "object",
            "required": ["type", "call_id", "name", "input"],
            "properties": {
                "type": {"const": "custom_tool_call"},
                "call_id": _ID,
                "name": _ID,
                "input": _TEXT,
                "namespace": _nullable(_ID),
            },
        },
        {
            "type": "object",
            "required": ["type", "call_id", "output"],
            "properties": {
                "type": {"enum": ["function_call_output", "custom_tool_call_output"]},
                "call_id": _ID,
                "output": _TEXT,
            },
        },
        {
            "type": "object",
            "required": ["type", "encrypted_content"],
            "properties": {"type": {"const": "compaction"}, "encrypted_content": _ID},
        },
        {
            "type": "object",
            "required": ["type"],
            "properties": {
                "type": {"const": "reasoning"},
                "content": _nullable(_text_parts("reasoning_text")),
                "summary": _nullable(_text_parts("summary_text")),
                # Only this server's seals are taken (a seal is `crs1.` and base64url).
                "encrypted_content": _nullable({"type": "string", "pattern": "^crs1\\.[A-Za-z0-9_-]+$"}),
            },
        },
    ]
}
_INPUT = {"anyOf": [_TEXT, {"type": "array", "minItems": 1, "items": _INPUT_ITEM}]}
_RESPONSES_REQUEST = {
    "type": "object",
    "properties": {
        "model": _MODEL,
        "input": _INPUT,
        "instructions": _nullable(_TEXT),
        "tools": _nullable({"type": "array", "items": _RESPONSES_TOOL}),
        "tool_choice": _RESPONSES_TOOL_CHOICE,
        "parallel_tool_calls": _BOOL,
        "max_tool_calls": _POSITIVE,
        "reasoning": _nullable(
            {
                "type": "object",
                "properties": {
                    "effort": _nullable({"enum": list(REASONING_EFFORTS)}),
                    "summary": _nullable({"enum": list(SUMMARIES)}),
                },
            }
        ),
        "max_output_tokens": _POSITIVE,
        "temperature": _TEMPERATURE,
        "top_p": _TOP_P,
        "top_logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": MAX_TOP_LOGPROBS_CHAT}),
        "metadata": _METADATA,
        "store": _BOOL,
        "stream": _BOOL,
        "previous_response_id": _nullable(_TEXT),
        "conversation": _nullable({"anyOf": [_ID, {"type": "object", "required": ["id"], "properties": {"id": _ID}}]}),
        "prompt_cache_key": _SESSION,
        "user": _SESSION,
        "safety_identifier": _SESSION,
        "background": _nullable({"const": False}),
        "truncation": _nullable({"const": "disabled"}),
        "text": _TEXT_FORMAT,
        "cache_prompt": _BOOL,
        "service_tier": _nullable({"enum": ["auto", "default"]}),
        "prompt_cache_retention": _nullable({"const": "in_memory"}),
        "include": _nullable({"type": "array", "items": {"enum": sorted(INCLUDABLE)}}),
        "context_management": _nullable(
            {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["type", "compact_threshold"],
                    "properties": {
                        "type": {"const": "compaction"},
                        "compact_threshold": {"type": "integer", "minimum": 1},
                    },
                },
            }
        ),
    },
}
_COMPACT_REQUEST = {
    "type": "object",
    "required": ["input"],
    "properties": {
        "model": _MODEL,
        "input": _INPUT,
        "instructions": _nullable(_TEXT),
        "tools": _nullable({"type": "array", "items": _RESPONSES_TOOL}),
        "max_output_tokens": _nullable({"type": "integer", "minimum": 1, "maximum": MAX_SUMMARY_TOKENS}),
        "keep_tokens": _POSITIVE,
        "prompt_cache_key": _SESSION,
        "user": _SESSION,
        "safety_identifier": _SESSION,
        "stream": _nullable({"const": False}),
        "previous_response_id": {"type": "null"},
        "conversation": {"type": "null"},
    },
}
_CONVERSATION_REQUEST = {
    "type": "object",
    "properties": {
        "items": _nullable({"anyOf": [_TEXT, {"type": "array", "maxItems": 20, "items": _INPUT_ITEM}]}),
        "metadata": _METADATA,
    },
}
_ITEMS_REQUEST = {
    "type": "object",
    "required": ["items"],
    "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 20, "items": _INPUT_ITEM}},
}
_METADATA_REQUEST = {"type": "object", "required": ["metadata"], "properties": {"metadata": _METADATA}}
_TOKENIZE_REQUEST = {
    "anyOf": [
        {"type": "object", "required": ["prompt"], "properties": {"prompt": _TEXT, "add_special_tokens": _BOOL}},
        {
            "type": "object",
            "required": ["messages"],
            "properties": {
                "messages": {"type": "array", "minItems": 1, "items": _CHAT_MESSAGE},
                "add_generation_prompt": _BOOL,
            },
        },
    ]
}
_DETOKENIZE_REQUEST = {
    "type": "object",
    "required": ["tokens"],
    "properties": {"tokens": {"type": "array", "items": {"type": "integer", "minimum": 0}}},
}
_LIST_PARAMETERS = [
    {"name": "after", "in": "query", "required": False, "schema": _TEXT},
    {
        "name": "limit",
        "in": "query",
        "required": False,
        "schema": {"type": "integer", "minimum": 1, "maximum": MAX_LIMIT},
    },
    {"name": "order", "in": "query", "required": False, "schema": {"enum": ["asc", "desc"]}},
]


def _path_parameter(name: str) -> Schema:
    return {"name": name, "in": "path", "required": True, "schema": _ID}


def _operation(
    operation_id: str,
    summary: str,
    *,
    body: Schema | None = None,
    parameters: list[Schema] | None = None,
    content_types: tuple[str, ...] = ("application/json",),
    errors: tuple[int, ...] = (400,),
    anthropic_errors: bool = False,
) -> Schema:
    operation: Schema = {
        "operationId": operation_id,
        "summary": summary,
        "responses": {
            "200": {"description": "OK", "content": {content: {"schema": _OBJECT} for content in content_types}},
            **{
                str(status): {
                    "description": "An Anthropic error envelope" if anthropic_errors else "An OpenAI error envelope",
                    "content": {"application/json": {"schema": _ANTHROPIC_ERROR if anthropic_errors else _ERROR}},
                }
                for status in errors
            },
        },
    }
    if body is not None:
        operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": body}}}
    if parameters:
        operation["parameters"] = parameters
    return operation


_GENERATION_ERRORS = (400, 404, 429, 500, 503, 504)
_RESPONSES_WEBSOCKET: Schema = {
    "operationId": "responsesWebSocket",
    "summary": "The Responses WebSocket",
    "description": (
        'Upgraded to a WebSocket (`Upgrade: websocket`): each client message is `{"type": "response.create", ...}` '
        "with a create's fields, answered with the stream's events as JSON texts; a refusal is an `error` event."
    ),
    "responses": {
        "101": {"description": "Switching Protocols: the Responses WebSocket"},
        "401": {"description": "An OpenAI error envelope", "content": {"application/json": {"schema": _ERROR}}},
    },
}
_STREAMED = ("application/json", "text/event-stream")


def openapi_document(prefix: str = "") -> Schema:
    """The document, with every path under `prefix` (`--api-prefix`)."""
    response_id = [_path_parameter("response_id")]
    conversation_id = [_path_parameter("conversation_id")]
    item = [*conversation_id, _path_parameter("item_id")]
    paths: dict[str, Schema] = {
        "/health": {"get": _operation("health", "Readiness, model, device and scheduler counters", errors=(503,))},
        "/metrics": {"get": _operation("metrics", "Prometheus metrics", content_types=("text/plain",), errors=())},
        "/openapi.json": {"get": _operation("openapi", "This document", errors=())},
        "/v1/models": {"get": _operation("listModels", "Every servable model, loaded or not", errors=())},
        "/v1/models/{model_id}": {
            "get": _operation("retrieveModel", "One model", parameters=[_path_parameter("model_id")], errors=(404,))
        },
        "/v1/models/{model_id}/load": {
            "post": _operation(
                "loadModel", "An operator's load", parameters=[_path_parameter("model_id")], errors=(403, 404, 503)
            )
        },
        "/v1/models/{model_id}/unload": {
            "post": _operation(
                "unloadModel", "An operator's unload", parameters=[_path_parameter("model_id")], errors=(403, 404)
            )
        },
        "/tokenize": {
            "post": _operation("tokenize", "Tokenize a prompt or render chat messages", body=_TOKENIZE_REQUEST)
        },
        "/detokenize": {"post": _operation("detokenize", "Token ids to text", body=_DETOKENIZE_REQUEST)},
        "/v1/embeddings": {
            "post": _operation(
                "createEmbedding", "Embeddings", body=EMBEDDINGS_REQUEST_SCHEMA, errors=(400, 404, 503, 504)
            )
        },
        "/v1/chat/completions": {
            "post": _operation(
                "createChatCompletion",
                "Chat Completions",
                body=_CHAT_REQUEST,
                content_types=_STREAMED,
                errors=_GENERATION_ERRORS,
            )
        },
        "/v1/completions": {
            "post": _operation(
                "createCompletion",
                "Completions",
                body=_COMPLETION_REQUEST,
                content_types=_STREAMED,
                errors=_GENERATION_ERRORS,
            )
        },
        "/v1/responses": {
            "post": _operation(
                "createResponse",
                "Create a response",
                body=_RESPONSES_REQUEST,
                content_types=_STREAMED,
                errors=(*_GENERATION_ERRORS, 422),
            ),
            "get": _RESPONSES_WEBSOCKET,
        },
        "/v1/responses/input_tokens": {
            "post": _operation(
                "countInputTokens", "Count a response's input tokens", body=_RESPONSES_REQUEST, errors=(400, 404)
            )
        },
        "/v1/responses/compact": {
            "post": _operation(
                "compactResponse", "Compact a history", body=_COMPACT_REQUEST, errors=(400, 404, 422, 503)
            )
        },
        "/v1/responses/{response_id}": {
            "get": _operation(
                "retrieveResponse", "A stored or in-progress response", parameters=response_id, errors=(404,)
            ),
            "delete": _operation(
                "deleteResponse", "Delete a stored response", parameters=response_id, errors=(400, 404)
            ),
        },
        "/v1/responses/{response_id}/cancel": {
            "post": _operation(
                "cancelResponse", "Cancel an in-progress response", parameters=response_id, errors=(400, 404)
            )
        },
        "/v1/responses/{response_id}/input_items": {
            "get": _operation(
                "listInputItems",
                "A response's input items",
                parameters=[*response_id, *_LIST_PARAMETERS],
                errors=(400, 404),
            )
        },
        "/v1/conversations": {
            "post": _operation("createConversation", "Create a conversation", body=_CONVERSATION_REQUEST)
        },
        "/v1/conversations/{conversation_id}": {
            "get": _operation("retrieveConversation", "A conversation", parameters=conversation_id, errors=(404,)),
            "post": _operation(
                "updateConversation",
                "Replace its metadata",
                body=_METADATA_REQUEST,
                parameters=conversation_id,
                errors=(400, 404),
            ),
            "delete": _operation(
                "deleteConversation", "Delete a conversation", parameters=conversation_id, errors=(404,)
            ),
        },
        "/v1/conversations/{conversation_id}/items": {
            "get": _operation(
                "listConversationItems",
                "A conversation's items",
                parameters=[*conversation_id, *_LIST_PARAMETERS],
                errors=(400, 404),
            ),
            "post": _operation(
                "addConversationItems",
                "Append items",
                body=_ITEMS_REQUEST,
                parameters=conversation_id,
                errors=(400, 404),
            ),
        },
        "/v1/conversations/{conversation_id}/items/{item_id}": {
            "get": _operation("retrieveConversationItem", "One item", parameters=item, errors=(404,)),
            "delete": _operation("deleteConversationItem", "Delete one item", parameters=item, errors=(404,)),
        },
        "/v1/messages": {
            "post": _operation(
                "createMessage",
                "Anthropic Messages API (also with ?beta=true)",
                body=anthropic.MESSAGES_REQUEST,
                content_types=_STREAMED,
                errors=(400, 401, 404, 413, 429, 500, 503, 504),
                anthropic_errors=True,
            )
        },
        "/v1/messages/count_tokens": {
            "post": _operation(
                "countMessageTokens",
                "The prompt tokens a message would prefill",
                body=anthropic.COUNT_TOKENS_REQUEST,
                errors=(400, 401, 404),
                anthropic_errors=True,
            )
        },
        "/v1/cache/stats": {"get": _operation("cacheStats", "Prompt cache statistics", errors=())},
        "/v1/cache/reset": {"post": _operation("cacheReset", "Drop every prompt cache snapshot", errors=())},
    }
    return {
        "openapi": OPENAPI_VERSION,
        "info": {
            "title": "Courier",
            "version": "1",
            "description": "An OpenAI-compatible inference server for MLX models, which speaks Anthropic's Messages "
            "API too. Every OpenAI /v1 path is also served without the /v1 prefix.",
        },
        "paths": {prefix + path: item_schema for path, item_schema in paths.items()},
        "components": {
            "schemas": {
                "AnthropicError": anthropic.ERROR,
                "Error": {
                    "type": "object",
                    "required": ["error"],
                    "properties": {
                        "error": {
                            "type": "object",
                            "required": ["message", "type", "param", "code"],
                            "properties": {
                                "message": _TEXT,
                                "type": _TEXT,
                                "param": _nullable(_TEXT),
                                "code": _nullable(_TEXT),
                            },
                        }
                    },
                },
            }
        },
    }
