"""POST /tokenize and /detokenize, answered by the token counter actor.

Shapes follow vLLM's: `{prompt}` or `{messages, add_generation_prompt, tools}` ->
`{count, max_model_len, tokens}`; `{tokens}` -> `{prompt}`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from quart import Blueprint

from courier.http.checked_fields import flag
from courier.http.context import AppContext
from courier.http.errors import ApiError
from courier.http.json_body import read_json_object
from courier.http.openai_requests import parse_chat_messages
from courier.http.schemas import chat
from courier.http.schemas.validator import check
from courier.http.validation import optional_str
from courier.messages.asking import call
from courier.messages.base import Request, RequestFailed
from courier.messages.token_counter import Detokenize, TokenizeChat, TokenizeResult, TokenizeText
from courier.runtime.message import ReplyStream


def blueprint(context: AppContext) -> Blueprint:
    routes = Blueprint("tokenize", __name__)

    @routes.post("/tokenize")
    async def tokenize() -> dict[str, Any]:
        body = await read_json_object()
        bound = await context.for_model(optional_str(body, "model"))
        build = _tokenize_message(body, bound.context_length)
        result = await call(bound.outboxes.token_counter, build)
        model = bound.state.model
        return {
            "count": len(result.tokens),
            "max_model_len": model.context_length if model else None,
            "tokens": list(result.tokens),
        }

    @routes.post("/detokenize")
    async def detokenize() -> dict[str, Any]:
        body = await read_json_object()
        bound = await context.for_model(optional_str(body, "model"))
        check(chat.DETOKENIZE, body)
        tokens = tuple(int(token) for token in body["tokens"])
        result = await call(bound.outboxes.token_counter, lambda reply: Detokenize(tokens=tokens, reply=reply))
        return {"prompt": result.text}

    return routes


TokenizeBuilder = Callable[[ReplyStream[TokenizeResult | RequestFailed]], Request[TokenizeResult]]


def _tokenize_message(body: dict[str, Any], max_tokens: int) -> TokenizeBuilder:
    """Check a /tokenize body (its schema is `schemas/chat.py`'s `TOKENIZE`); return a builder of the message for
    the token counter (a text too big for `max_tokens`, by its size alone, is refused before it is tokenized)."""
    raw_messages = body.get("messages")
    prompt = body.get("prompt")
    if (raw_messages is None) == (prompt is None):  # a rule across fields, told before their shapes
        raise ApiError.invalid(
            "send exactly one of 'prompt' (a string) or 'messages' (a list of objects)", param="prompt"
        )
    check(chat.TOKENIZE, body)
    if raw_messages is not None:
        messages, _ = parse_chat_messages(raw_messages)  # images count as their placeholder tokens
        tools: list[dict[str, Any]] | None = body.get("tools")
        add_generation_prompt = flag(body, "add_generation_prompt", True)
        return lambda reply: TokenizeChat(
            messages=messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            max_tokens=max_tokens,
            reply=reply,
        )
    text: str = body["prompt"]  # exactly one of the two is there
    add_special_tokens = flag(body, "add_special_tokens", True)
    return lambda reply: TokenizeText(
        text=text, add_special_tokens=add_special_tokens, max_tokens=max_tokens, reply=reply
    )
