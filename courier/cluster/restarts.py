"""When to start a replica again that ended on its own: after a delay that doubles while it keeps failing.

A replica that crashes (or was killed) is started again with its name, port and prompt-cache
directory, so the front's checks bring it back into the ring and its keys return to it. A
replica that cannot start (a bad flag, a model that does not load) would otherwise restart in a
tight loop: each failure doubles the wait, up to `MAX_DELAY_S`, and a replica that has stayed up
for `STABLE_AFTER_S` is forgiven its past failures. Pure: the caller passes the time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

FIRST_DELAY_S = 1.0
MAX_DELAY_S = 60.0
STABLE_AFTER_S = 120.0


@dataclass(slots=True)
class _Record:
    delay_s: float = FIRST_DELAY_S
    started_at: float | None = None
    restart_at: float | None = None


@dataclass(slots=True)
class RestartSchedule:
    _records: dict[str, _Record] = field(default_factory=dict)

    def started(self, name: str, now: float) -> None:
        record = self._records.setdefault(name, _Record())
        record.started_at, record.restart_at = now, None

    def exited(self, name: str, now: float) -> float:
        """Note that `name` ended at `now` (once per exit); the time to start it again."""
        record = self._records.setdefault(name, _Record())
        if record.restart_at is not None:
            return record.restart_at
        if record.started_at is not None and now - record.started_at >= STABLE_AFTER_S:
            record.delay_s = FIRST_DELAY_S
        record.restart_at = now + record.delay_s
        record.delay_s = min(record.delay_s * 2, MAX_DELAY_S)
        return record.restart_at

    def due(self, name: str, now: float) -> bool:
        """Whether `name`, which has exited, should be started now."""
        record = self._records.get(name)
        return record is not None and record.restart_at is not None and now >= record.restart_at

    def waiting(self, name: str) -> bool:
        """Whether an exit of `name` was noted and it has not been started since."""
        record = self._records.get(name)
        return record is not None and record.restart_at is not None
