"""The storage circuit breaker: once the database cannot be reached, calls fail at once until a probe reaches it.

CLOSED: calls go to the database. A call that finds it unreachable (`StorageUnreachable`)
trips the breaker: OPEN, every call is refused at once with that reason (a 503), with no
wait for a pool or a connection timeout, and a probe is due after `probe_delay_s`.
PROBING: the probe is trying to connect; calls are still refused. A probe that connects
closes the breaker; one that fails opens it again with the delay doubled, up to
`Backoff.max_s`. Only an unreachable database trips it: a slow one, a full disk, a
damaged record stay with the calls that meet them.

Pure: the storage actor owns the clock, runs the probe and moves the state; `/metrics`
reads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class BreakerState(Enum):
    CLOSED = "closed"  # calls reach the database
    OPEN = "open"  # the database cannot be reached: calls are refused at once, a probe is due
    PROBING = "probing"  # a probe is connecting; calls are still refused


@dataclass(frozen=True, slots=True, kw_only=True)
class Backoff:
    """The delay before the first probe after the breaker opens, doubled after each failed probe up to `max_s`."""

    first_s: float = 0.25
    max_s: float = 4.0


class CircuitBreaker:
    def __init__(self, backoff: Backoff = Backoff()) -> None:
        self.state = BreakerState.CLOSED
        self.reason = ""  # why the database cannot be reached ("" while closed)
        self.trips = 0  # times it opened since start-up
        self._backoff = backoff
        self.probe_delay_s = backoff.first_s

    @property
    def closed(self) -> bool:
        return self.state is BreakerState.CLOSED

    def trip(self, reason: str) -> bool:
        """A call found the database unreachable: open. True when it was closed (the outage is news)."""
        if self.state is not BreakerState.CLOSED:
            return False
        self.state = BreakerState.OPEN
        self.reason = reason
        self.trips += 1
        self.probe_delay_s = self._backoff.first_s
        return True

    def probing(self) -> None:
        if self.state is not BreakerState.OPEN:
            raise ValueError(f"a probe starts from an open breaker, not a {self.state.value} one")
        self.state = BreakerState.PROBING

    def probe_failed(self, reason: str) -> None:
        self._probed()
        self.state = BreakerState.OPEN
        self.reason = reason
        self.probe_delay_s = min(self.probe_delay_s * 2, self._backoff.max_s)

    def probe_succeeded(self) -> None:
        self._probed()
        self.state = BreakerState.CLOSED
        self.reason = ""
        self.probe_delay_s = self._backoff.first_s

    def _probed(self) -> None:
        if self.state is not BreakerState.PROBING:
            raise ValueError(f"no probe is under way: the breaker is {self.state.value}")
