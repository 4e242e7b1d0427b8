"""The storage circuit breaker's states: opened by an unreachable database, probed with backoff, closed by a probe."""

from __future__ import annotations

import pytest

from courier.storage.breaker import Backoff, BreakerState, CircuitBreaker

BACKOFF = Backoff(first_s=0.25, max_s=1.0)


def test_a_trip_opens_once_and_keeps_the_first_reason() -> None:
    breaker = CircuitBreaker(BACKOFF)
    assert (breaker.state, breaker.closed, breaker.reason) == (BreakerState.CLOSED, True, "")
    assert breaker.trip("Connection refused") is True  # news: the caller logs it and wakes the probe
    assert breaker.trip("terminating connection") is False  # already open: the other failing calls add nothing
    assert (breaker.state, breaker.closed, breaker.reason, breaker.trips) == (
        BreakerState.OPEN,
        False,
        "Connection refused",
        1,
    )


@pytest.mark.parametrize(
    ("failed_probes", "delay"),
    [(0, 0.25), (1, 0.5), (2, 1.0), (3, 1.0), (10, 1.0)],  # doubled after each failed probe, up to the most
)
def test_failed_probes_back_off_up_to_the_most(failed_probes: int, delay: float) -> None:
    breaker = CircuitBreaker(BACKOFF)
    breaker.trip("Connection refused")
    for attempt in range(failed_probes):
        breaker.probing()
        assert (breaker.state, breaker.closed) == (BreakerState.PROBING, False)  # calls are still refused meanwhile
        breaker.probe_failed(f"still refused {attempt}")
        assert (breaker.state, breaker.closed) == (BreakerState.OPEN, False)
    assert breaker.probe_delay_s == delay
    assert breaker.reason == (f"still refused {failed_probes - 1}" if failed_probes else "Connection refused")


def test_a_probe_that_connects_closes_it_and_the_next_outage_starts_the_backoff_over() -> None:
    breaker = CircuitBreaker(BACKOFF)
    breaker.trip("Connection refused")
    for _ in range(2):
        breaker.probing()
        breaker.probe_failed("Connection refused")
    breaker.probing()
    breaker.probe_succeeded()
    assert (breaker.state, breaker.reason, breaker.probe_delay_s) == (BreakerState.CLOSED, "", 0.25)
    assert breaker.trip("terminating connection") is True
    assert (breaker.trips, breaker.probe_delay_s) == (2, 0.25)


def test_a_probe_belongs_to_an_open_breaker() -> None:
    breaker = CircuitBreaker(BACKOFF)
    with pytest.raises(ValueError, match="from an open breaker"):
        breaker.probing()
    with pytest.raises(ValueError, match="no probe is under way"):
        breaker.probe_succeeded()
    breaker.trip("Connection refused")
    with pytest.raises(ValueError, match="no probe is under way"):
        breaker.probe_failed("Connection refused")
