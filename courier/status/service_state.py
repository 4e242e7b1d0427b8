"""The server's phase and what it serves, read by `/health` and the readiness check.

LOADING -> READY -> DRAINING (or LOADING -> DRAINING when a signal or a load
failure comes first). Only the supervisor moves the phase; HTTP handlers only read it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

from courier.core.reasoning import ReasoningFormat
from courier.core.sampling_defaults import OPENAI, SamplingDefaults
from courier.core.tools.calls import ToolCallFormat
from courier.grammar.compiler import GrammarCompiler
from courier.model.info import ModelInfo
from courier.platform.blas import BlasReport
from courier.runtime.faults import FaultCounter
from courier.status.connections import ConnectionStats
from courier.status.http_requests import HttpRequestCounts
from courier.status.scheduler_stats import AdmissionStats, SchedulerStats
from courier.status.tokenizer_stats import TokenizerStats
from courier.storage.faults import StorageFaults

if TYPE_CHECKING:  # it imports mlx.core, which must come after the BLAS (platform/blas.py)
    from courier.platform.cpu_attention import CpuAttention


class Phase(Enum):
    LOADING = "loading"
    READY = "ok"
    DRAINING = "draining"


@dataclass(slots=True, kw_only=True)
class ServiceState:
    blas: BlasReport
    cpu_attention: CpuAttention | None = None  # None: not installed by this process (an app built in a test)
    model_id: str
    scheduler: SchedulerStats
    admission: AdmissionStats = field(default_factory=AdmissionStats)
    tokenizer: TokenizerStats = field(default_factory=TokenizerStats)  # the token counter's
    faults: FaultCounter = field(default_factory=FaultCounter)  # every actor counts into it
    storage_faults: StorageFaults = field(default_factory=StorageFaults)  # the storage actor's
    connections: ConnectionStats = field(default_factory=lambda: ConnectionStats(limit=0))  # the connection gate's
    http_requests: HttpRequestCounts = field(default_factory=HttpRequestCounts)  # the access layer's
    phase: Phase = Phase.LOADING
    model: ModelInfo | None = None
    tool_format: ToolCallFormat | None = None
    reasoning: ReasoningFormat | None = None  # the model's reasoning markers (None: it does not think in tags)
    grammars: GrammarCompiler | None = None  # constrained decoding (None: the tokenizer cannot serve it)
    sampling_defaults: SamplingDefaults = OPENAI  # temperature and top_p for requests that send none
    # What `/v1/embeddings` gets from the model (dimensions, pooling, max_input_tokens); None: it does not embed.
    embeddings: dict[str, Any] | None = None
    started_at: float = field(default_factory=time.time)

    @property
    def rejected(self) -> int:
        """Requests refused at capacity: by the ingress before rendering, or by the scheduler when queueing."""
        return self.scheduler.rejected + self.admission.rejected

    def scheduler_view(self) -> dict[str, int]:
        """The scheduler's counters as `/health` shows them, `rejected` counting every refusal at capacity."""
        return {**self.scheduler.as_dict(), "rejected": self.rejected}

    def mark_ready(
        self,
        model: ModelInfo,
        tool_format: ToolCallFormat | None,
        grammars: GrammarCompiler | None = None,
        sampling_defaults: SamplingDefaults = OPENAI,
        *,
        reasoning: ReasoningFormat | None = None,
    ) -> None:
        self.model = model
        self.reasoning = reasoning
        self.sampling_defaults = sampling_defaults
        self.tool_format = tool_format
        self.grammars = grammars
        self.model_id = model.model_id
        self.phase = Phase.READY

    def capabilities(self) -> dict[str, Any]:
        """What the served model can be asked for beyond text: how it calls tools, and constrained outputs."""
        tools = self.tool_format
        constrained = self.grammars is not None
        return {
            "tool_calling": tools.mode if tools is not None else None,  # "native" or "generic"
            "tool_choice": ["auto", "none", "required", "function"]
            if constrained and tools is not None and tools.grammar is not None
            else ["auto", "none"],
            "structured_outputs": ["text", "json_object", "json_schema"] if constrained else ["text"],
            # The markers its reasoning is split out by (reasoning_content, reasoning items); None: it has none.
            "reasoning": [self.reasoning.start, self.reasoning.end] if self.reasoning is not None else None,
            "generation": self.model is not None,  # False: an embedding model, which answers /v1/embeddings only
            "embeddings": self.embeddings,
        }

    def mark_unloaded(self) -> None:
        """The model went (the registry unloaded it): what it served is forgotten, the phase stays the server's."""
        self.model = None
        self.embeddings = None
        self.reasoning = None
        self.tool_format = None
        self.grammars = None
        self.sampling_defaults = OPENAI

    def mark_serving(self) -> None:
        """Several models: the server serves once its registry runs, whether or not the default model loaded."""
        if self.phase is Phase.LOADING:
            self.phase = Phase.READY

    def mark_draining(self) -> None:
        self.phase = Phase.DRAINING
