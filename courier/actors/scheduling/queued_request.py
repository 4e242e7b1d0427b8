"""A request the scheduler holds, from its `SubmitGeneration` until its last event: where it waits, what its prefix
lookup found, how far its samples have come, and its deadline."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from anyio.streams.memory import MemoryObjectSendStream

from courier.actors.scheduling.generation_trace import GenerationTally
from courier.core.prompt_cache.entries import Bucket
from courier.engine.engine_io import EngineRequest
from courier.engine.generation import GenerationEvent
from courier.engine.model_state import CachedPrefix
from courier.runtime.tracing import TraceCarrier


class Lookup(Enum):
    """Where a request's prefix lookup stands."""

    NOT_STARTED = "not_started"  # it could not join the batch next yet, or waits for a leader's prefill
    OUT = "out"  # asked of the store, no answer yet
    DONE = "done"  # answered (or timed out, or nothing to ask): it may join the batch


@dataclass(slots=True, kw_only=True)
class QueuedRequest:
    request: EngineRequest
    events: MemoryObjectSendStream[GenerationEvent]
    session: str
    cache_prompt: bool
    queued_at: float
    # The request's trace, so the snapshot store's spans for it join the request's trace.
    trace: TraceCarrier
    # Where its snapshots live: the model's bucket for exactly its images and its tenant (None: no caching).
    bucket: Bucket | None = None
    first_token_seen: bool = False
    # No event of its generation has come yet (queued, or prefilling): the same request sent again waits for it.
    prefilling: bool = True
    finished: int = 0  # samples finished (a request of `n` ends with its last)
    # Its prefix lookup: started once it could join the batch next, done when the store answered (or the deadline
    # passed); `prefix` is what it found.
    lookup: Lookup = Lookup.NOT_STARTED
    prefix: CachedPrefix | None = None
    tally: GenerationTally = field(default_factory=GenerationTally)  # for its generation span
    deadline: float | None = None  # `time.monotonic()` by which it ends
    expired: bool = False  # its deadline passed while it ran: the engine was told to end it

    def past_deadline(self, now: float) -> bool:
        return self.deadline is not None and now >= self.deadline

    @property
    def width(self) -> int:
        """The batch slots it takes: one per sample."""
        return self.request.n
