"""The token counter's inbox: tokenize text or chat messages, detokenize ids."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

from courier.media.images import FetchedImage
from courier.messages.base import Message, ReplyStream, RequestFailed
from courier.messages.media import VisionInputs


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
class TokenizeText(Message):
    text: str
    add_special_tokens: bool
    reply: ReplyStream[TokenizeReply]


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenizeChat(Message):
    """Render chat messages with the model's chat template, then tokenize."""

    messages: Sequence[Mapping[str, Any]]
    tools: Sequence[Mapping[str, Any]] | None
    add_generation_prompt: bool
    reply: ReplyStream[TokenizeReply]
    with_history_boundary: bool = False
    thinking: bool = True  # False renders with `enable_thinking=False` (templates without it ignore it)
    # The messages' images in order, fetched: a vision model's processor expands their placeholders.
    images: tuple[FetchedImage, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class Detokenize(Message):
    tokens: tuple[int, ...]
    reply: ReplyStream[DetokenizeReply]


TokenCounterMessage: TypeAlias = TokenizeText | TokenizeChat | Detokenize
