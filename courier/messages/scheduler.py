"""The scheduler's inbox: queue a generation (or be told the queue is full)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

from anyio.streams.memory import MemoryObjectSendStream

from courier.messages.base import Message, ReplyStream, RequestFailed, RequestId
from courier.messages.generation import GenerationEvent, SamplingParams
from courier.messages.media import VisionInputs


@dataclass(frozen=True, slots=True, kw_only=True)
class GenerationQueued:
    request_id: RequestId
    queue_position: int


SubmitReply: TypeAlias = GenerationQueued | RequestFailed


@dataclass(frozen=True, slots=True, kw_only=True)
class SubmitGeneration(Message):
    """Run `prompt_tokens` with `sampling`; events go to `events`, which the scheduler closes at the end."""

    request_id: RequestId
    prompt_tokens: tuple[int, ...]
    sampling: SamplingParams
    events: MemoryObjectSendStream[GenerationEvent]
    reply: ReplyStream[SubmitReply]
    # Prompt caching: the conversation's session key, where its history ends in the prompt, and whether to use it.
    session: str
    boundary: int
    cache_prompt: bool
    vision: VisionInputs | None = None  # the prompt's images, for a vision model's prefill


@dataclass(frozen=True, slots=True, kw_only=True)
class QueueWarmUp(Message):
    """When idle, extend `session`'s snapshot over `tokens` (the history through the last reply); no reply."""

    session: str
    tokens: tuple[int, ...]


SchedulerMessage: TypeAlias = SubmitGeneration | QueueWarmUp
