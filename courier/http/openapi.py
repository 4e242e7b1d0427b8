"""The OpenAPI 3.1 document of every route, served at `/openapi.json`.

Its request bodies are the schemas every body is validated with (`http/schemas/`): the document is the validator's
schema. Every route the app serves is documented with its methods (`tests/http/test_openapi.py`). OpenAI's generation,
listing and stored-state paths are also served without their `/v1` prefix (OpenAI clients may omit it; `http/app.py`);
those aliases are not listed twice.
"""

from __future__ import annotations

from courier.http.listing import MAX_LIMIT
from courier.http.schemas import anthropic, chat, completions, embeddings, responses
from courier.http.schemas.shared import NAME, OBJECT, STRING, Schema, nullable
from courier.settings import Settings

OPENAPI_VERSION = "3.1.0"
_ERROR = {"$ref": "#/components/schemas/Error"}
_ANTHROPIC_ERROR = {"$ref": "#/components/schemas/AnthropicError"}
_LIST_PARAMETERS = [
    {"name": "after", "in": "query", "required": False, "schema": STRING},
    {
        "name": "limit",
        "in": "query",
        "required": False,
        "schema": {"type": "integer", "minimum": 1, "maximum": MAX_LIMIT},
    },
    {"name": "order", "in": "query", "required": False, "schema": {"enum": ["asc", "desc"]}},
]


def _path_parameter(name: str) -> Schema:
    return {"name": name, "in": "path", "required": True, "schema": NAME}


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
            "200": {"description": "OK", "content": {content: {"schema": OBJECT} for content in content_types}},
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
_MODEL_ERRORS = (400, 404, 503)  # a route that names a model: unknown, or not loadable
_RESPONSES_WEBSOCKET: Schema = {
    "operationId": "responsesWebSocket",
    "summary": "The Responses WebSocket",
    "description": (
        'Upgraded to a WebSocket (`Upgrade: websocket`): each client message is `{"type": "response.create", ...}` '
        "with a create's fields, answered with the stream's events as JSON texts; a refusal is an `error` event."
    ),
    "responses": {
        "101": {"description": "Switching Protocols: the Responses WebSocket"},
        **{
            str(status): {
                "description": "An OpenAI error envelope",
                "content": {"application/json": {"schema": _ERROR}},
            }
            for status in (401, 405)  # 405: a GET that asks for no upgrade
        },
    },
}
_STREAMED = ("application/json", "text/event-stream")


def openapi_document(prefix: str = "", max_n: int | None = None) -> Schema:
    """The document, with every path under `prefix` (`--api-prefix`), for a server that samples at most `max_n`
    choices of a prompt (`--max-n`, at most `--max-batch`; without it, the defaults')."""
    if max_n is None:
        defaults = Settings()
        max_n = min(defaults.max_n, defaults.max_batch)
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
            "post": _operation(
                "tokenize", "Tokenize a prompt or render chat messages", body=chat.TOKENIZE, errors=_MODEL_ERRORS
            )
        },
        "/detokenize": {
            "post": _operation("detokenize", "Token ids to text", body=chat.DETOKENIZE, errors=_MODEL_ERRORS)
        },
        "/v1/embeddings": {
            "post": _operation("createEmbedding", "Embeddings", body=embeddings.REQUEST, errors=(400, 404, 503, 504))
        },
        "/v1/chat/completions": {
            "post": _operation(
                "createChatCompletion",
                "Chat Completions",
                body=chat.request(max_n),
                content_types=_STREAMED,
                errors=_GENERATION_ERRORS,
            )
        },
        "/v1/completions": {
            "post": _operation(
                "createCompletion",
                "Completions",
                body=completions.request(max_n),
                content_types=_STREAMED,
                errors=_GENERATION_ERRORS,
            )
        },
        "/v1/responses": {
            "post": _operation(
                "createResponse",
                "Create a response",
                body=responses.REQUEST,
                content_types=_STREAMED,
                errors=(*_GENERATION_ERRORS, 422),
            ),
            "get": _RESPONSES_WEBSOCKET,
        },
        "/v1/responses/input_tokens": {
            "post": _operation(
                "countInputTokens", "Count a response's input tokens", body=responses.INPUT_TOKENS, errors=(400, 404)
            )
        },
        "/v1/responses/compact": {
            "post": _operation(
                "compactResponse", "Compact a history", body=responses.COMPACT, errors=(400, 404, 422, 503)
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
            "post": _operation("createConversation", "Create a conversation", body=responses.CONVERSATION)
        },
        "/v1/conversations/{conversation_id}": {
            "get": _operation("retrieveConversation", "A conversation", parameters=conversation_id, errors=(404,)),
            "post": _operation(
                "updateConversation",
                "Replace its metadata",
                body=responses.CONVERSATION_UPDATE,
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
                body=responses.CONVERSATION_ITEMS,
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
                body=anthropic.MESSAGES,
                content_types=_STREAMED,
                errors=(400, 401, 404, 413, 429, 500, 503, 504),
                anthropic_errors=True,
            )
        },
        "/v1/messages/count_tokens": {
            "post": _operation(
                "countMessageTokens",
                "The prompt tokens a message would prefill",
                body=anthropic.COUNT_TOKENS,
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
            "API too. The OpenAI paths for generation, embeddings, models, responses and conversations are also served "
            "without the /v1 prefix (model load and unload, and the cache routes, only with it).",
        },
        "paths": {prefix + path: item_schema for path, item_schema in paths.items()},
        "components": {
            "schemas": {
                "AnthropicError": anthropic.ERROR_ENVELOPE,
                "Error": {
                    "type": "object",
                    "required": ["error"],
                    "properties": {
                        "error": {
                            "type": "object",
                            "required": ["message", "type", "param", "code"],
                            "properties": {
                                "message": STRING,
                                "type": STRING,
                                "param": nullable(STRING),
                                "code": nullable(STRING),
                            },
                        }
                    },
                },
            }
        },
    }
