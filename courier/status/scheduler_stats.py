"""Counters the scheduler keeps and `/health` shows: what runs, what waits, how requests ended."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(slots=True)
class SchedulerStats:
    """Written by the scheduler actor (and `rejected` by the ingress, for refusals before rendering); read by
    HTTP handlers on the same event loop."""

    max_batch: int
    max_queue: int
    running: int = 0
    waiting: int = 0
    completed: int = 0
    cancelled: int = 0
    failed: int = 0
    rejected: int = 0
    generated_tokens: int = 0
    snapshots_dropped: int = 0
    warmups_run: int = 0
    warmups_skipped: int = 0
    warmups_pending: int = 0
    warmups_queued: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)
