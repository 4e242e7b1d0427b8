"""Idle warm-ups: `QueueWarmUp` extends a conversation's snapshot over the reply just given, while no request runs or
waits, so the conversation's next turn prefills only what is new.

One warm-up waits per conversation (a newer one replaces it), at most `WARM_UP_QUEUE` in all, the newest run first.
A warm-up pauses as soon as live requests arrive: it keeps its place and what it prefilled, and resumes at the next
idle moment. A warm-up the store already covers, or whose lookup the store does not answer in time, is skipped.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from functools import partial

from courier.actors.prompt_cache.store_link import WARM_UP_LOOKUP_TIMEOUT_S, StoreLink, cached_prefix
from courier.engine.batch_engine import BatchEngine
from courier.engine.warm_up import WarmUp
from courier.messages.scheduler import QueueWarmUp
from courier.messages.snapshot_store import PrefixMissed
from courier.runtime.mlx_thread import MlxThread
from courier.status.scheduler_stats import SchedulerStats

# Warm-ups waiting for an idle moment, one per session, newest kept.
WARM_UP_QUEUE = 8


def _conversation(message: QueueWarmUp) -> tuple[str, str]:
    """Whose conversation a warm-up extends: its tenant's session (two keys' callers may name a session alike)."""
    return message.tenant, message.session


class WarmUps:
    def __init__(self, store: StoreLink, stats: SchedulerStats, mlx: MlxThread) -> None:
        self._store = store
        self._stats = stats
        self._mlx = mlx
        self._queue: OrderedDict[tuple[str, str], QueueWarmUp] = OrderedDict()
        # The warm-up live work interrupted, with what it had prefilled: resumed when it is next in line.
        self._paused: tuple[QueueWarmUp, WarmUp] | None = None

    def __bool__(self) -> bool:
        """Warm-ups wait to run."""
        return bool(self._queue)

    def queue(self, message: QueueWarmUp) -> bool:
        """Whether it was queued (not without prompt caching)."""
        if not self._store.enabled:
            return False
        self._stats.warmups_queued += 1
        if self._queue.pop(_conversation(message), None) is not None:
            self._stats.warmups_skipped += 1  # superseded by this newer one of the same conversation
        self._queue[_conversation(message)] = message
        self._trim()
        if self._paused is not None and self._queue.get(_conversation(self._paused[0])) is not self._paused[0]:
            self._paused = None  # its warm-up was superseded or dropped: let go of its state
        self._stats.warmups_pending = len(self._queue)
        return True

    async def run_next(self, engine: BatchEngine, live: Callable[[], bool]) -> None:
        """Run the next warm-up until it is done, or until `live()` says requests run or wait."""
        message = self._next()
        try:
            await self._run(engine, message, live)
        finally:
            self._stats.warmups_pending = len(self._queue)

    def _next(self) -> QueueWarmUp:
        """The paused warm-up first (it was next when live work came, and keeps what it prefilled), else the newest."""
        if self._paused is not None:
            return self._queue.pop(_conversation(self._paused[0]))
        return self._queue.popitem(last=True)[1]

    async def _run(self, engine: BatchEngine, message: QueueWarmUp, live: Callable[[], bool]) -> None:
        """Extend the session's snapshot over `message.tokens`, yielding to live requests between chunks."""
        tokens = message.tokens
        bucket = self._store.bucket("", message.tenant)
        paused, self._paused = self._paused, None  # `_next` handed out the paused one first
        found = await self._store.look_up(
            message.session,
            tokens,
            message.trace,
            bucket,
            check_extended=True,
            timeout_s=min(self._store.lookup_timeout_s, WARM_UP_LOOKUP_TIMEOUT_S),
        )
        prefix = cached_prefix(found)
        already = isinstance(found, PrefixMissed) and found.extended
        # A store that did not answer (busy, or late under load) is no reason to prefill the whole history cold:
        # that adds the load that made it late. The next turn starts from what the store holds.
        if found is None or already or (prefix is not None and prefix.matched >= len(tokens) - 1):
            self._stats.warmups_skipped += 1  # the conversation has moved on, or this is covered already
            return
        if paused is not None and paused[0] is message:
            job = paused[1]  # resumed where live work interrupted it
        else:
            job = await self._mlx.call(partial(WarmUp, engine.model, tokens, prefix, engine.snapshot_quantization))
        while not job.finished:
            if live():
                self._pause(message, job)  # live work first, always; this one keeps its place
                return
            await self._mlx.call(job.advance)
        snapshot = await self._mlx.call(job.snapshot)
        self._store.insert(message.session, snapshot, message.trace, bucket)
        self._stats.warmups_run += 1

    def _pause(self, message: QueueWarmUp, job: WarmUp) -> None:
        """Live work arrived: the warm-up goes back in line as the next one (unless a newer warm-up of its conversation
        came meanwhile), keeping what it prefilled. Dropped, the conversation's next turn would prefill its reply."""
        if _conversation(message) in self._queue:
            self._stats.warmups_skipped += 1  # superseded by the newer one
            return
        self._stats.warmups_paused += 1
        self._queue[_conversation(message)] = message
        self._paused = (message, job)
        self._trim()
        self._stats.warmups_pending = len(self._queue)

    def _trim(self) -> None:
        """Only the newest `WARM_UP_QUEUE` wait."""
        while len(self._queue) > WARM_UP_QUEUE:
            self._queue.popitem(last=False)
            self._stats.warmups_skipped += 1
