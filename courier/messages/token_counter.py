"""The token counter's inbox: tokenize text or chat messages, detokenize ids."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, TypeAlias

from courier.core.template_options import NO_OPTIONS, TemplateOptions
from courier.engine.generation import VisionInputs
from courier.media.images import FetchedImage
from courier.messages.base import Request, RequestFailed


class MessageNames(Enum):
    """What chat messages are to the client, so a chat template's failure names the one at fault in its terms."""

    REQUEST = "request"  # the request's own `messages` (chat, /tokenize): `messages[i]`
    CONVERSATION = "conversation"  # a Responses context rebuilt from items: its position and role, under `input`
    BUILT = "built"  # messages Courier wrote (a compaction's segments and summary prompt): under `input`, unnamed

    @property
    def param(self) -> str:
        """The request field the messages came from, as a refusal names it: `messages`, or a Responses `input`."""
        return "messages" if self is MessageNames.REQUEST else "input"


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenizeResult:
    tokens: tuple[int, ...]
    # For chat: where the conversation's history ends in `tokens` (0 when not asked for, and with images).
    history_boundary: int = 0
    vision: VisionInputs | None = None  # the images, prepared for the model (chat with images only)


@dataclass(frozen=True, slots=True, kw_only=True)
class DetokenizeResult:
    text: str


TokenizeReply: TypeAlias = TokenizeResult | RequestFailed
DetokenizeReply: TypeAlias = DetokenizeResult | RequestFailed


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenizeText(Request[TokenizeResult]):
    text: str
    add_special_tokens: bool
    # The most tokens the caller can use (the context length): a text whose size alone shows it is longer is refused
    # (400 context_length_exceeded) without being tokenized. None: tokenize whatever comes.
    max_tokens: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenizeChat(Request[TokenizeResult]):
    """Render chat messages with the model's chat template, then tokenize."""

    messages: Sequence[Mapping[str, Any]]
    tools: Sequence[Mapping[str, Any]] | None
    add_generation_prompt: bool
    with_history_boundary: bool = False
    thinking: bool = True  # False renders with `enable_thinking=False` (templates without it ignore it)
    options: TemplateOptions = NO_OPTIONS  # chat_template_kwargs, a reasoning effort
    # The messages' images in order, fetched: a vision model's processor expands their placeholders.
    images: tuple[FetchedImage, ...] = ()
    max_tokens: int | None = None  # as for `TokenizeText`: refused by size alone, before any render, beyond it
    names: MessageNames = MessageNames.REQUEST  # how a chat template's failure names the message at fault
    # Whose recent renders this one may take tokens from, and is kept for (a tenant's; None: tokenized on its own).
    reuse_scope: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Detokenize(Request[DetokenizeResult]):
    tokens: tuple[int, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class ForgetRenders(Request[int]):
    """Drop every recent render kept for reuse (`POST /v1/cache/reset`); answered with how many were kept."""


TokenCounterMessage: TypeAlias = TokenizeText | TokenizeChat | Detokenize | ForgetRenders
