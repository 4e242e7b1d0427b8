"""The generation span: one per request, from its arrival at the scheduler to its last sample's finish.

The scheduler tallies each sample's `GenerationFinished` here and records the span when the request's last sample
finishes, in the request's own trace: prompt, completion and cached tokens, how it finished, and what multi-token
decode steps did for it (draft tokens verified, accepted, and tokens its grammar forced).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from courier.engine.generation import GenerationFinished
from courier.runtime import trace_attributes
from courier.runtime.tracing import TraceCarrier, record_span

SPAN_NAME = "scheduler.generation"


@dataclass(slots=True)
class GenerationTally:
    started_ns: int = field(default_factory=time.time_ns)
    completion_tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    forced: int = 0

    def add(self, finished: GenerationFinished) -> None:
        self.completion_tokens += finished.completion_tokens
        self.drafted += finished.drafted_tokens
        self.accepted += finished.accepted_tokens
        self.forced += finished.forced_tokens

    def record(self, carrier: TraceCarrier, last: GenerationFinished) -> None:
        """The span, ended now; `last` is the request's last sample to finish."""
        record_span(
            SPAN_NAME,
            carrier,
            self.started_ns,
            {
                trace_attributes.GENERATION_PROMPT_TOKENS: last.prompt_tokens,
                trace_attributes.GENERATION_COMPLETION_TOKENS: self.completion_tokens,
                trace_attributes.GENERATION_CACHED_TOKENS: last.cached_tokens,
                trace_attributes.GENERATION_FINISH_REASON: last.reason.value,
                trace_attributes.GENERATION_DRAFTED_TOKENS: self.drafted,
                trace_attributes.GENERATION_ACCEPTED_TOKENS: self.accepted,
                trace_attributes.GENERATION_FORCED_TOKENS: self.forced,
            },
        )
