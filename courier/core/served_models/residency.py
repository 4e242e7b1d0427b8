"""Which models stay loaded: room for one more under a memory budget and a count, idle expiry, pins. Pure.

The model registry (`actors/model_registry.py`) keeps one `Resident` per model that is loading, loaded or
unloading, and asks this module what to do:

- `plan_room`: to load a model that needs `need` bytes, which loaded models go. Idle ones first, least recently
  used first; then, if that is not enough, busy ones, least recently used first, which are unloaded only once
  their requests have ended (a stream is never cut to make room). Pinned and loading models never go; when only
  models still loading stand in the way, the answer is to wait for them. A model that cannot fit even with every
  other one gone is refused, saying what holds the memory.
- `fits_now`: whether the model fits in what is held this moment (unloading models still hold theirs).
- `expired`: idle models whose keep-alive has run out.

Memory is what each model is charged (its weights, its live KV allowance and its prompt cache's memory tier, as
the registry computes it), counted against the budget while it loads, serves and unloads.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import Enum

# A keep-alive without a unit is in seconds; Ollama's durations add these (`1h30m`, `90s`, `500ms`).
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
FOREVER = math.inf


class Residency(Enum):
    NOT_LOADED = "not_loaded"
    LOADING = "loading"
    LOADED = "loaded"
    UNLOADING = "unloading"  # taking no new requests; unloaded once its requests have ended


@dataclass(frozen=True, slots=True, kw_only=True)
class Resident:
    name: str
    residency: Residency
    charge: int  # bytes counted against the budget
    in_flight: int = 0
    last_used: float = 0.0  # when a request last took or let go of it
    pinned: bool = False
    idle_until: float = FOREVER  # when, idle, it may be unloaded (FOREVER: only to make room)

    @property
    def holds_memory(self) -> bool:
        return self.residency is not Residency.NOT_LOADED

    @property
    def evictable(self) -> bool:
        return self.residency is Residency.LOADED and not self.pinned


@dataclass(frozen=True, slots=True, kw_only=True)
class Room:
    evict: tuple[str, ...] = ()  # idle: unload now
    drain: tuple[str, ...] = ()  # busy: unload once their requests have ended
    wait: bool = False  # it fits only once loads now running have ended (and those models may go): ask again then
    refused: str | None = None  # why the model cannot fit at all (None: it fits once those are gone)

    @property
    def fits(self) -> bool:
        return self.refused is None


def plan_room(residents: Iterable[Resident], *, need: int, budget: int, max_loaded: int = 0) -> Room:
    """Which loaded models must go so one more needing `need` bytes fits `budget` and, when `max_loaded` is set,
    the count. Models already unloading count as gone: their memory is on its way back."""
    present = [resident for resident in residents if resident.holds_memory]
    if need > budget:
        return Room(refused=f"it needs {need} bytes, more than the whole budget of {budget} bytes")
    staying = [resident for resident in present if resident.residency is not Residency.UNLOADING]
    used = sum(resident.charge for resident in staying)
    count = len(staying)
    idle = sorted((r for r in staying if r.evictable and r.in_flight == 0), key=lambda r: r.last_used)
    busy = sorted((r for r in staying if r.evictable and r.in_flight > 0), key=lambda r: r.last_used)
    evict: list[str] = []
    drain: list[str] = []
    for candidate in (*idle, *busy):
        if _fits(used, count, need, budget, max_loaded):
            break
        (evict if candidate.in_flight == 0 else drain).append(candidate.name)
        used -= candidate.charge
        count -= 1
    if not _fits(used, count, need, budget, max_loaded):
        loading = [r for r in staying if r.residency is Residency.LOADING and not r.pinned]
        if _fits(used - sum(r.charge for r in loading), count - len(loading), need, budget, max_loaded):
            return Room(wait=True)
        kept = [r for r in staying if not r.evictable]
        held = ", ".join(f"{r.name} ({r.residency.value}{', pinned' if r.pinned else ''})" for r in kept) or "none"
        return Room(
            refused=f"it needs {need} bytes and the models that cannot be unloaded hold {used} of the budget's "
            f"{budget} bytes ({held})"
            if need + used > budget
            else f"--max-loaded-models {max_loaded} are loaded or loading and none can be unloaded ({held})"
        )
    return Room(evict=tuple(evict), drain=tuple(drain))


def fits_now(residents: Iterable[Resident], *, need: int, budget: int, max_loaded: int = 0) -> bool:
    """Whether one more needing `need` bytes fits what is held this moment (unloading models included)."""
    present = [resident for resident in residents if resident.holds_memory]
    staying = sum(1 for resident in present if resident.residency is not Residency.UNLOADING)
    return sum(r.charge for r in present) + need <= budget and (max_loaded <= 0 or staying + 1 <= max_loaded)


def expired(residents: Iterable[Resident], now: float) -> tuple[str, ...]:
    """Idle, unpinned loaded models whose keep-alive has run out, longest expired first."""
    due = [r for r in residents if r.evictable and r.in_flight == 0 and r.idle_until <= now]
    return tuple(r.name for r in sorted(due, key=lambda r: r.idle_until))


def parse_keep_alive(value: object) -> float:
    """Ollama's `keep_alive`: seconds (a number or its text) or a duration (`5m`, `1h30m`, `90s`); negative: for
    ever (FOREVER); 0: unloaded as soon as its requests end. `ValueError` for anything else."""
    if isinstance(value, bool):
        raise ValueError("keep_alive is a number of seconds or a duration such as 5m")
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str):
        seconds = _duration(value.strip())
    else:
        raise ValueError("keep_alive is a number of seconds or a duration such as 5m")
    if math.isnan(seconds):
        raise ValueError("keep_alive is a number of seconds or a duration such as 5m")
    return FOREVER if seconds < 0 else seconds


def _duration(text: str) -> float:
    sign = -1.0 if text.startswith("-") else 1.0
    body = text.removeprefix("-")
    try:
        return sign * float(body)
    except ValueError:
        pass
    parts = _DURATION_PART.findall(body)
    if not body or "".join(number + unit for number, unit in parts) != body:
        raise ValueError(f"keep_alive {text!r} is not a number of seconds or a duration such as 5m or 1h30m")
    return sign * sum(float(number) * _UNIT_SECONDS[unit] for number, unit in parts)


def _fits(used: int, count: int, need: int, budget: int, max_loaded: int) -> bool:
    return used + need <= budget and (max_loaded <= 0 or count + 1 <= max_loaded)


class Leases:
    """A model's requests in flight. The registry takes one per request it lets in; each request gives its own back
    when its response has ended (streams included), on the same event loop, so a plain count is enough. The last
    one given back sets when the idle model may go (`idle_until`) and calls `on_idle` (a wake-up for the
    registry). `clock`: the registry's."""

    __slots__ = ("_clock", "_idle_for", "idle_until", "in_flight", "last_used", "on_idle")

    def __init__(self, clock: Callable[[], float], on_idle: Callable[[], None] | None = None) -> None:
        self._clock = clock
        self.on_idle = on_idle
        self.in_flight = 0
        self.last_used = clock()
        self.idle_until = FOREVER
        self._idle_for = FOREVER  # the keep-alive of the last request served (or of the load)

    def loaded(self, keep_alive: float) -> None:
        """The model has just loaded: idle from now, for `keep_alive` seconds (`--model-ttl`) unless a request
        takes it first. Without this a model loaded again kept the timer of its last use, already run out."""
        self.last_used = self._clock()
        self._idle_for = keep_alive
        self.idle_until = FOREVER if self.in_flight else self.last_used + keep_alive

    def take(self, *, glance: bool = False) -> None:
        """`glance`: a read of the model's figures (`/metrics`, cache stats), which holds it while it reads but is
        no use of it: its idle timer and its place in the eviction order stay as they were."""
        self.in_flight += 1
        if not glance:
            self.last_used = self._clock()
        self.idle_until = FOREVER

    def give_back(self, keep_alive: float, *, glance: bool = False) -> None:
        """`keep_alive`: seconds the model may stay idle after this request (FOREVER: until memory is needed)."""
        self.in_flight = max(0, self.in_flight - 1)
        if not glance:
            self.last_used = self._clock()
            self._idle_for = keep_alive
        if self.in_flight == 0:
            self.idle_until = self.last_used + self._idle_for
            if self.on_idle is not None:
                self.on_idle()
