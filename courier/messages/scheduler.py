"""The scheduler's inbox: queue a generation (or be told the queue is full); prepare a conversation when idle."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

from anyio.streams.memory import MemoryObjectSendStream

from courier.engine.generation import GenerationEvent, RequestId, SamplingParams, VisionInputs
from courier.messages.base import Request, RequestFailed
from courier.runtime.message import Message


@dataclass(frozen=True, slots=True, kw_only=True)
class GenerationQueued:
    request_id: RequestId
    queue_position: int


SubmitReply: TypeAlias = GenerationQueued | RequestFailed


@dataclass(frozen=True, slots=True, kw_only=True)
class SubmitGeneration(Request[GenerationQueued]):
    """Run `prompt_tokens` with `sampling`; events go to `events`, which the scheduler closes at the end."""

    request_id: RequestId
    prompt_tokens: tuple[int, ...]
    sampling: SamplingParams
    events: MemoryObjectSendStream[GenerationEvent]
    # Prompt caching: the conversation's session key, where its history ends in the prompt, and whether to use it.
    session: str
    boundary: int
    cache_prompt: bool
    vision: VisionInputs | None = None  # the prompt's images, for a vision model's prefill
    tenant: str = ""  # whose snapshots it may reuse and keep (an API key's; "" without keys)
    n: int = 1  # samples of the prompt: each takes a batch slot, all join the batch together
    deadline: float | None = None  # `time.monotonic()` by which it ends (see `AdmitGeneration.deadline`)


@dataclass(frozen=True, slots=True, kw_only=True)
class QueueWarmUp(Message):
    """When idle, extend `session`'s snapshot over `tokens` (the history through the last reply); no reply."""

    session: str
    tokens: tuple[int, ...]
    tenant: str = ""


SchedulerMessage: TypeAlias = SubmitGeneration | QueueWarmUp
