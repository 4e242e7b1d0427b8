"""What the batch engine takes and gives: a request to run, the outputs of a step, and the batch's limits.

The scheduler builds `EngineRequest`s and reads `EngineOutput`s (a request's generation events, and the snapshots
the engine took for the snapshot store); everything here is plain data.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from courier.core.prompt_cache.entries import Origin
from courier.core.prompt_cache.quantization import KvQuantization
from courier.core.step_planning.depth_costs import DepthCosts
from courier.core.step_planning.prompt_lookup import LookupLimits
from courier.core.step_planning.verify_width import StepCosts
from courier.engine import shared_prefix
from courier.engine.generation import GenerationEvent, RequestId, SamplingParams, VisionInputs
from courier.engine.model_state import CachedPrefix


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineRequest:
    request_id: RequestId
    prompt_tokens: tuple[int, ...]
    sampling: SamplingParams
    prefix: CachedPrefix | None = None
    # Where the conversation's history ends in the prompt: a boundary snapshot is taken there (0: none).
    boundary: int = 0
    snapshots: bool = False
    vision: VisionInputs | None = None  # the prompt's images (a vision-language model only)
    # `n` samples of one prompt: it is prefilled once and each sample starts from a copy of its state.
    n: int = 1
    choice: int = 0  # which sample this sequence is (set by the engine)
    # Whose request it is (an API key's; "" without keys): state computed for one tenant is never reused for
    # another, an in-batch shared prefix included, so no tenant can infer another's prompt from timing.
    tenant: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class SnapshotTaken:
    """A private copy of a sequence's model state after `tokens` (for the snapshot store)."""

    origin: Origin
    tokens: tuple[int, ...]
    state: Any
    nbytes: int
    continues: int | None = None
    prompt_length: int | None = None  # for a completion: how many of `tokens` were the prompt


@dataclass(frozen=True, slots=True)
class EngineOutput:
    request_id: RequestId
    event: GenerationEvent | SnapshotTaken


@dataclass(frozen=True, slots=True, kw_only=True)
class BatchLimits:
    max_batch: int
    prefill_batch: int
    prefill_step_size: int
    # Requests admitted in the same step that share at least this many new prompt tokens prefill them once (0: off).
    shared_prefix_min_tokens: int = shared_prefix.MIN_SHARED_TOKENS
    # Prompt-lookup drafts verified in multi-token steps (None: one token per step, mlx-lm's own steps).
    speculation: LookupLimits | None = None
    # How a verify pass is costed when choosing its width: fitted to timed passes (tests pin a line).
    step_costs: Callable[[], StepCosts] = StepCosts
    # What a step's prefill may take, in seconds (`core/step_planning/prefill_budget.py`; 0: no budget, whole
    # chunks), and how a step is costed for that, at its depth (fitted to timed steps; tests pin a model).
    prefill_stall_s: float = 0.0
    prefill_costs: Callable[[], DepthCosts] = DepthCosts
    # How the snapshots it hands the store hold attention KV (`--prompt-cache-bits`; None: as computed).
    snapshot_quantization: KvQuantization | None = None
    # How the running generation batch holds attention KV (`--kv-bits`; None: as computed).
    kv_quantization: KvQuantization | None = None
