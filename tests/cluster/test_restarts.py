"""When a replica that ended starts again: after a delay that doubles while it keeps failing, reset once it stays up."""

from __future__ import annotations

from courier.cluster.restarts import FIRST_DELAY_S, MAX_DELAY_S, STABLE_AFTER_S, RestartSchedule


def test_the_first_exit_waits_the_first_delay_and_is_due_only_then() -> None:
    schedule = RestartSchedule()
    schedule.started("r1", now=0.0)
    assert not schedule.waiting("r1")
    assert schedule.exited("r1", now=5.0) == 5.0 + FIRST_DELAY_S
    assert schedule.waiting("r1")
    assert not schedule.due("r1", now=5.0) and schedule.due("r1", now=5.0 + FIRST_DELAY_S)
    assert schedule.exited("r1", now=5.5) == 5.0 + FIRST_DELAY_S  # the same exit noted again changes nothing
    assert not schedule.due("r2", now=100.0)


def test_a_replica_that_keeps_failing_waits_twice_as_long_each_time_up_to_the_cap() -> None:
    schedule = RestartSchedule()
    now, delays = 0.0, []
    for _ in range(10):
        schedule.started("r1", now)
        now += 1.0  # ends one second after each start
        delays.append(schedule.exited("r1", now) - now)
        now = delays[-1] + now
    assert delays[:4] == [FIRST_DELAY_S, 2 * FIRST_DELAY_S, 4 * FIRST_DELAY_S, 8 * FIRST_DELAY_S]
    assert max(delays) == MAX_DELAY_S and delays[-1] == MAX_DELAY_S


def test_a_replica_that_stayed_up_is_forgiven_its_past_failures() -> None:
    schedule = RestartSchedule()
    for now in (0.0, 10.0, 20.0):
        schedule.started("r1", now)
        schedule.exited("r1", now + 1)
    schedule.started("r1", 100.0)
    assert schedule.exited("r1", 100.0 + STABLE_AFTER_S) == 100.0 + STABLE_AFTER_S + FIRST_DELAY_S
