"""Counters `/health` and `/metrics` show: what runs, what waits, how requests ended.

Each has one writer: `SchedulerStats` the scheduler actor, `AdmissionStats` the
ingress actor. HTTP handlers only read them, on the same event loop.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


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
    rejected: int = 0  # refused by the scheduler: its batch and queue full
    generated_tokens: int = 0
    snapshots_dropped: int = 0
    lookups_timed_out: int = 0  # prefix lookups the store did not answer in time: served as misses
    warmups_run: int = 0
    warmups_skipped: int = 0
    warmups_pending: int = 0
    warmups_queued: int = 0

    @property
    def at_capacity(self) -> bool:
        return self.running + self.waiting >= self.max_batch + self.max_queue

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass(slots=True)
class AdmissionStats:
    """Written by the ingress actor only."""

    rejected: int = 0  # refused before rendering, the scheduler being at capacity
