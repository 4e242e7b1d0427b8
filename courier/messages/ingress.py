"""The ingress's inbox: admit a generation request (validate, render, check context, queue)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

from anyio.streams.memory import MemoryObjectReceiveStream

from courier.core.template_options import NO_OPTIONS, TemplateOptions
from courier.engine.generation import GenerationEvent, RequestId, SamplingParams
from courier.messages.base import Request, RequestFailed
from courier.messages.media import FetchMemo, ImageRef
from courier.messages.token_counter import MessageNames, TokenizeResult
from courier.runtime.message import Message


@dataclass(frozen=True, slots=True, kw_only=True)
class ChatPrompt:
    """Chat messages rendered with the model's chat template (and tools, when given)."""

    messages: Sequence[Mapping[str, Any]]
    tools: Sequence[Mapping[str, Any]] | None
    thinking: bool = True  # False asks templates that support it (`enable_thinking`) for no reasoning block
    options: TemplateOptions = NO_OPTIONS  # chat_template_kwargs, a reasoning effort
    images: tuple[ImageRef, ...] = ()  # image parts, in order; admitted (or refused) before anything is fetched
    # Already rendered by the token counter exactly as admission renders it (generation prompt, these tools, thinking
    # and images, the history boundary when the prompt is cached): admission checks and queues it without another
    # render. A Responses turn counted against its compaction threshold passes its count here.
    rendered: TokenizeResult | None = None
    names: MessageNames = MessageNames.REQUEST  # what the messages are to the client, as `TokenizeChat.names`


@dataclass(frozen=True, slots=True, kw_only=True)
class TextPrompt:
    text: str


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenPrompt:
    tokens: tuple[int, ...]


Prompt: TypeAlias = ChatPrompt | TextPrompt | TokenPrompt


@dataclass(frozen=True, slots=True, kw_only=True)
class Admitted:
    """The request is queued; its events arrive on `events` (close it to cancel)."""

    request_id: RequestId
    prompt_tokens: int
    max_tokens: int
    events: MemoryObjectReceiveStream[GenerationEvent]
    # The prompt leaves a reasoning block open (a template that starts the reply thinking): the reply begins in it.
    opens_in_reasoning: bool = False
    choices: int = 1  # samples of the prompt: their events interleave, each finishes once

    def discard(self) -> None:
        """Nobody will read its events (the asker went away): closing them takes it out of the queue or batch."""
        self.events.close()


AdmitReply: TypeAlias = Admitted | RequestFailed


@dataclass(frozen=True, slots=True, kw_only=True)
class AdmitGeneration(Request[Admitted]):
    """`sampling.max_tokens` of 0 means: as many as the context leaves room for."""

    request_id: RequestId
    prompt: Prompt
    sampling: SamplingParams
    session: str  # the prompt-cache session ("" for anonymous callers, who share one)
    cache_prompt: bool
    # Images already read for this work (a compaction's counts): each URL is read once across all of it.
    memo: FetchMemo | None = None
    # Cap `sampling.max_tokens` at what the context leaves instead of refusing (a turn just compacted to fit).
    fit_to_context: bool = False
    tenant: str = ""  # whose prompt-cache state it may reuse (an API key's; "" without keys)
    n: int = 1  # samples of the prompt (chat and completions' `n`), prefilled once
    # `time.monotonic()` by which it ends: past it a generation that has written tokens ends as a length cut with
    # them, one that has not fails (504). None: no deadline but the reader's.
    deadline: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class WarmUpConversation(Message):
    """A chat turn just ended: prepare its conversation's next turn (the history including the reply)."""

    session: str
    messages: Sequence[Mapping[str, Any]]
    tools: Sequence[Mapping[str, Any]] | None
    tenant: str = ""
    # Rendered as the next turn will be: with the request's template options (an effort) and thinking switch.
    options: TemplateOptions = NO_OPTIONS
    thinking: bool = True


IngressMessage: TypeAlias = AdmitGeneration | WarmUpConversation
