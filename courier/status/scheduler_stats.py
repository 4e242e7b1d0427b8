"""Counters `/health` and `/metrics` show: what runs, what waits, how requests ended.

Each has one writer: `SchedulerStats` the scheduler actor, `AdmissionStats` the
ingress actor. HTTP handlers only read them, on the same event loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any


@dataclass(slots=True)
class SpeculationStats:
    """Multi-token decode steps since start, copied from the engine after each step by the scheduler actor."""

    mode: str = "off"  # "on", or why not
    steps: int = 0  # forward passes of the generation batch
    verify_steps: int = 0  # of which verified drafts or forced tokens
    tokens: int = 0  # tokens those passes produced
    drafted: int = 0
    accepted: int = 0
    forced: int = 0

    def view(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "drafted_tokens": self.drafted,
            "accepted_tokens": self.accepted,
            "forced_tokens": self.forced,
            "acceptance_rate": round(self.accepted / self.drafted, 4) if self.drafted else None,
            "decode_steps": self.steps,
            "verify_steps": self.verify_steps,
            "tokens_per_step": round(self.tokens / self.steps, 3) if self.steps else None,
        }


@dataclass(slots=True)
class SchedulerStats:
    """Written by the scheduler actor only; the ingress reads the occupancy to refuse early."""

    max_batch: int
    max_queue: int
    running: int = 0
    waiting: int = 0
    completed: int = 0
    cancelled: int = 0
    failed: int = 0
    timed_out: int = 0  # past their deadline before their first token: 504
    cut_at_deadline: int = 0  # past their deadline after writing: ended as a length cut with it (completed too)
    rejected: int = 0  # refused by the scheduler: its batch and queue full
    generated_tokens: int = 0
    snapshots_dropped: int = 0
    lookups_timed_out: int = 0  # prefix lookups the store did not answer in time: served as misses
    warmups_run: int = 0
    warmups_skipped: int = 0
    warmups_paused: int = 0  # interrupted by live requests: kept in line with their progress, resumed when idle
    warmups_pending: int = 0
    warmups_queued: int = 0
    # An idle scheduler's admissions: after waiting for a burst to gather (`--admission-window-ms`), or at once
    # because the step admitting what waited was estimated at no more than a window.
    admission_windows_waited: int = 0
    admission_windows_skipped: int = 0
    speculation: SpeculationStats = field(default_factory=SpeculationStats)
    # How the running batch holds attention KV (`--kv-bits`): quantized to these bits in groups of this size, or
    # None for as computed. Set once, when the engine is built.
    kv_bits: int | None = None
    kv_group_size: int | None = None

    @property
    def at_capacity(self) -> bool:
        return self.running + self.waiting >= self.max_batch + self.max_queue

    def as_dict(self) -> dict[str, int]:
        """The counters (speculation and the batch KV's quantization have their own views)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in _NOT_COUNTERS}

    def batch_kv_view(self) -> dict[str, int | None]:
        return {"bits": self.kv_bits, "group_size": self.kv_group_size}


_NOT_COUNTERS = frozenset({"speculation", "kv_bits", "kv_group_size"})


@dataclass(slots=True)
class AdmissionStats:
    """Written by the ingress actor only."""

    rejected: int = 0  # refused before rendering, the scheduler being at capacity
