"""Fields OpenAI's API defines that this server cannot honour: a 400 naming each, never a silent 200.

Unknown fields are ignored (real clients send extras), but a field OpenAI defines asks for something specific;
when Courier cannot do it, saying so is the only honest answer. Each entry lists the values that ask for nothing
beyond what Courier does anyway (`store: false`, `modalities: ["text"]`, ...): those are accepted.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from courier.http.errors import ApiError


@dataclass(frozen=True, slots=True)
class Unsupported:
    field: str
    why: str  # completes "'<field>' ...": what cannot be done, and what to do instead
    harmless: Callable[[Any], bool] = lambda value: value is None  # values that ask for nothing more


def _falsy(value: Any) -> bool:
    return value in (None, False)


def _one_of(*values: Any) -> Callable[[Any], bool]:
    return lambda value: value is None or value in values


def _empty(value: Any) -> bool:
    return value is None or value in ({}, [])


_TIER = Unsupported(
    "service_tier",
    "other than 'auto' or 'default' cannot be honoured: this server has one tier",
    _one_of("auto", "default"),
)
_RETENTION = Unsupported(
    "prompt_cache_retention",
    "other than 'in_memory' cannot be honoured: the prompt cache lives in memory (--snapshot-ttl sets how long)",
    _one_of("in_memory"),
)
_CACHE_OPTIONS = Unsupported("prompt_cache_options", "is not supported; --snapshot-ttl sets how long state is kept")
_MODERATION = Unsupported("moderation", "is not supported: this server runs no moderation model")
_IMAGE = Unsupported("image", "options are not supported: images are read at the size the model's processor takes")

CHAT: Sequence[Unsupported] = (
    Unsupported("functions", "(legacy function calling) is not supported; send 'tools' instead"),
    Unsupported("function_call", "(legacy function calling) is not supported; send 'tool_choice' instead"),
    Unsupported("audio", "output is not supported: this server generates text"),
    Unsupported("modalities", "other than ['text'] cannot be honoured: this server generates text", _one_of(["text"])),
    Unsupported("prediction", "(predicted outputs) is not supported"),
    Unsupported("web_search_options", "is not supported: this server has no web search"),
    Unsupported(
        "store", "true is not supported: chat completions are not stored (the Responses API stores responses)", _falsy
    ),
    Unsupported("metadata", "is kept only with stored chat completions, which this server does not keep", _empty),
    Unsupported("verbosity", "other than 'medium' cannot be honoured", _one_of("medium")),
    _MODERATION,
    _RETENTION,
    _CACHE_OPTIONS,
    _TIER,
)
COMPLETIONS: Sequence[Unsupported] = (_TIER, _RETENTION, _CACHE_OPTIONS)
RESPONSES: Sequence[Unsupported] = (
    Unsupported("prompt", "(stored prompt templates) is not supported: send the instructions and input themselves"),
    _RETENTION,
    _CACHE_OPTIONS,
    _MODERATION,
    Unsupported("access_programs", "is not supported"),
    Unsupported("background_options", "is not supported: background mode is not served; stream instead"),
    _IMAGE,
    _TIER,
)
INPUT_TOKENS: Sequence[Unsupported] = (
    *RESPONSES,
    Unsupported("personality", "is not supported: the count is of the input as sent"),
)
COMPACT: Sequence[Unsupported] = (_IMAGE, _RETENTION, _CACHE_OPTIONS, _TIER)


def refuse_unsupported(body: Mapping[str, Any], fields: Sequence[Unsupported]) -> None:
    for entry in fields:
        value = body.get(entry.field)
        if not entry.harmless(value):
            raise ApiError.invalid(f"'{entry.field}' {entry.why}", param=entry.field)


def refuse_obfuscation(options: Mapping[str, Any], param: str = "stream_options") -> None:
    """`stream_options.include_obfuscation: true` asks for padding on every stream event, which this server does
    not send (it is off unless asked for, unlike OpenAI's default)."""
    if options.get("include_obfuscation") not in (None, False):
        raise ApiError.invalid(
            f"'{param}.include_obfuscation' true is not supported: stream events carry no padding",
            param=f"{param}.include_obfuscation",
        )
