"""The requests the scheduler holds, by where each stands: waiting to join the batch, running in it, or leaving it.

`waiting` is in arrival order; `running` and `leaving` are keyed by request. A request leaving the batch (its
consumer went away, or one of its samples failed) is in `cancelled` until the next step tells the engine, and in
`leaving` until that step's outputs are delivered: the step may carry the state it had prefilled
(`engine/cancelled_prefill.py`), which goes to the store under its session. Counts are in sequences (a request of
`n` samples is `n`) and kept in the stats' `running` and `waiting` gauges.
"""

from __future__ import annotations

from collections import deque

from courier.actors.scheduling.queued_request import QueuedRequest
from courier.engine.generation import RequestId
from courier.status.scheduler_stats import SchedulerStats


class HeldRequests:
    def __init__(self, stats: SchedulerStats) -> None:
        self._stats = stats
        self.waiting: deque[QueuedRequest] = deque()
        self.running: dict[RequestId, QueuedRequest] = {}
        self.leaving: dict[RequestId, QueuedRequest] = {}
        self.cancelled: list[RequestId] = []

    def idle(self) -> bool:
        """Nothing waits, runs, or has yet to be taken out of the batch."""
        return not self.running and not self.waiting and not self.cancelled

    def live(self) -> bool:
        """Requests wait or run: live work, which comes before any warm-up."""
        return bool(self.running or self.waiting)

    def take_cancelled(self) -> list[RequestId]:
        """The requests the next step takes out of the batch."""
        cancelled, self.cancelled = self.cancelled, []
        return cancelled

    def left(self, cancelled: list[RequestId]) -> None:
        """The step that took `cancelled` out of the batch was delivered: their snapshots (if any) are kept."""
        for request_id in cancelled:
            self.leaving.pop(request_id, None)

    def running_sequences(self) -> int:
        return sum(queued.width for queued in self.running.values())

    def waiting_sequences(self) -> int:
        return sum(queued.width for queued in self.waiting)

    def update_counts(self) -> None:
        self._stats.running = self.running_sequences()
        self._stats.waiting = self.waiting_sequences()
