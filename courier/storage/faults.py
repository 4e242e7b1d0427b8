"""Storage faults since start-up: damaged records met, calls the database could not serve, and the breaker.

The storage actor is the one writer; `/metrics` may read the counters and the
breaker's state (`breaker.py`). Each method
says whether the fault is news, so the actor logs a damaged record once however
often it is read, and a failing disk when it starts failing and when a write
succeeds again, not once per request. Pure: no database, no I/O.
"""

from __future__ import annotations

from courier.storage.breaker import CircuitBreaker


class StorageFaults:
    def __init__(self, breaker: CircuitBreaker | None = None) -> None:
        self.breaker = breaker if breaker is not None else CircuitBreaker()
        self.damaged_records = 0  # distinct damaged records met
        self.damaged_reads = 0  # reads refused because the record they read is damaged
        self.unavailable_calls = 0  # calls the database could not serve (full disk, I/O error)
        # Bounded by the damaged rows of the database itself.
        self._damaged: set[str] = set()
        self._failures_since_write = 0

    def damaged(self, record: str) -> bool:
        """A read met the damaged `record` ("response 'resp_1'"); True the first time it is met."""
        self.damaged_reads += 1
        if record in self._damaged:
            return False
        self._damaged.add(record)
        self.damaged_records += 1
        return True

    def unavailable(self) -> bool:
        """A call could not be served; True when it is the first since a write last succeeded."""
        self.unavailable_calls += 1
        self._failures_since_write += 1
        return self._failures_since_write == 1

    def written(self) -> int:
        """A write succeeded: how many calls had failed since the one before (non-zero: storing has resumed)."""
        failures, self._failures_since_write = self._failures_since_write, 0
        return failures
