"""How waiting requests are promoted into the batch: their prefix lookups, the order they join in, and an idle
engine's burst wait.

Each waiting request that fits in the batch's free slots has its longest cached prefix looked up (`LookupPrefix`) in
a task of its own, so the batch steps on while it is out, and a request waits for its answer at most the lookup
timeout. A request whose prompt another request is still prefilling (the same request sent again) looks up only once
that one's state is in the store (`_leader`). Requests join in order while their samples fit; one whose lookup is
still out keeps its place while the ready ones behind it go ahead.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import anyio
from anyio.abc import TaskGroup

from courier.actors.prompt_cache.store_link import StoreLink, cached_prefix
from courier.actors.scheduling.held_requests import HeldRequests
from courier.actors.scheduling.queued_request import Lookup, QueuedRequest
from courier.actors.scheduling.wakeup import Wakeup
from courier.engine.batch_engine import BatchEngine
from courier.engine.engine_io import EngineRequest
from courier.status.scheduler_stats import SchedulerStats

logger = logging.getLogger(__name__)

# An idle scheduler gathers a burst for at most this many admission windows.
BURST_WINDOWS = 5
# A request waits for another's prefill (`_leader`) only when that covers at least this many tokens of its prompt.
LEADER_MIN_TOKENS = 256


class Promotion:
    def __init__(
        self,
        held: HeldRequests,
        store: StoreLink,
        stats: SchedulerStats,
        wake: Wakeup,
        *,
        admission_window_s: float,
    ) -> None:
        self._held = held
        self._store = store
        self._stats = stats
        self._wake = wake
        self._admission_window_s = admission_window_s

    def start_lookups(self, lookups: TaskGroup) -> None:
        """Ask the store for the prefixes of the waiting requests that fit in the batch's free slots (in order), each
        in its own task of `lookups`: a lookup that takes long holds up only its own request."""
        free = self._stats.max_batch - self._held.running_sequences()
        for queued in self._held.waiting:
            free -= queued.width
            if free < 0:
                return
            if queued.lookup is not Lookup.NOT_STARTED or self._leader(queued) is not None:
                continue  # (looked up when what its leader prefills is in the store)
            if not queued.cache_prompt:
                queued.lookup = Lookup.DONE
                continue
            queued.lookup = Lookup.OUT
            lookups.start_soon(self._look_up, queued)

    async def _look_up(self, queued: QueuedRequest) -> None:
        try:
            found = await self._store.look_up(queued.session, queued.request.prompt_tokens, queued.trace, queued.bucket)
            queued.prefix = cached_prefix(found)
        except Exception:  # a lookup's trouble is a miss for its request, never the scheduler's end
            logger.exception("prompt cache: a prefix lookup failed; the request runs without a cached prefix")
        finally:
            queued.lookup = Lookup.DONE
            self._wake.set()

    def promote(self) -> list[EngineRequest]:
        """Waiting requests join the batch in order while their samples fit (the first that does not fit waits, and
        so do those behind it). One whose lookup is still out keeps its place while those behind it that are ready
        go ahead: a slow lookup holds up its own request only, and the batch steps on meanwhile."""
        held = self._held
        added: list[EngineRequest] = []
        for queued in list(held.waiting):
            if held.running_sequences() + queued.width > self._stats.max_batch:
                break
            if queued.lookup is not Lookup.DONE:
                continue
            if self._leader(queued) is not None:  # it came while its lookup was out: look up again after the leader
                queued.lookup = Lookup.NOT_STARTED
                queued.prefix = None
                continue
            held.waiting.remove(queued)
            held.running[queued.request.request_id] = queued
            request = queued.request
            added.append(replace(request, prefix=queued.prefix) if queued.prefix is not None else request)
            queued.prefix = None  # the engine holds it now
        held.update_counts()
        return added

    def _leader(self, queued: QueuedRequest) -> QueuedRequest | None:
        """A running (or just cancelled) request still prefilling all of `queued`'s prompt but its last token, for the
        store (the same request sent again, by a client that gave up on the first or not): `queued` waits for it and
        then looks up what it left there, rather than prefilling the same tokens beside it or from zero."""
        if not queued.cache_prompt:
            return None
        prompt = queued.request.prompt_tokens
        for leader in (*self._held.running.values(), *self._held.leaving.values()):
            if leader.prefilling and leader.cache_prompt and leader.bucket == queued.bucket and leader.width == 1:
                covered = leader.request.prompt_tokens[:-1]
                if len(covered) >= LEADER_MIN_TOKENS and prompt[: len(covered)] == covered:
                    return leader
        return None

    async def gather_burst(self, engine: BatchEngine) -> None:
        """Let a burst of arrivals gather so it is prefilled as one batch; only an idle engine waits, and only for a
        step longer than a window.

        The wait lasts while requests keep arriving at most one window apart (a burst of clients sent
        by one process takes longer than one window to arrive), up to `BURST_WINDOWS` windows in all,
        and ends early once a full batch waits. A lone request waits one window (its lookup's wait included),
        unless the step that would admit it is estimated at no more than a window (`_short_step_ahead`).
        """
        window = self._admission_window_s
        if window <= 0:
            return
        waiting = self._held.waiting
        started = time.monotonic()
        deadline = started + window * BURST_WINDOWS
        seen = len(waiting)
        if await self._short_step_ahead(engine, window):
            self._stats.admission_windows_skipped += 1
            return
        self._stats.admission_windows_waited += 1
        first = started + window  # the first window runs from the start: the lookups' wait is part of it
        while waiting:
            await anyio.sleep(max(0.0, first - time.monotonic()))
            arrived = len(waiting) > seen
            if not arrived or len(waiting) >= self._stats.max_batch or time.monotonic() >= deadline:
                return
            seen, first = len(waiting), time.monotonic() + window

    async def _short_step_ahead(self, engine: BatchEngine, window: float) -> bool:
        """Whether a lone request (one sample, no images) waits, and the step admitting it would take at most
        `window` by the engine's cost model, once its lookup has answered (waited for at most a window). A burst
        that comes during so short a step joins at the next one, sooner than a window's wait would have admitted
        it: an agent's turn, most of its prompt cached, goes in at once. More than one request waiting is a burst
        already; a request of several samples prefills its whole prompt to fork it, and an image's encoder is not
        in the cost model: those wait the window."""
        waiting = self._held.waiting
        if len(waiting) != 1 or waiting[0].width != 1 or waiting[0].request.vision is not None:
            return False
        with anyio.move_on_after(window):
            while waiting and waiting[0].lookup is not Lookup.DONE:
                await self._wake.wait()
        if len(waiting) != 1 or waiting[0].lookup is not Lookup.DONE:
            return False
        queued = waiting[0]
        depth = queued.prefix.matched if queued.prefix is not None else 0
        return engine.admission_seconds([(depth, len(queued.request.prompt_tokens) - depth)]) <= window
