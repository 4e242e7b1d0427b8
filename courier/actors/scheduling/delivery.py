"""What reaches each request's event stream, and how a request leaves the scheduler.

The engine's outputs go on their requests' streams (`deliver`); a request ends with exactly one `GenerationFinished`
(per sample) or `GenerationFailed`, and its stream is closed after it. A consumer that went away (closed its end)
takes its request out: dropped while it waits, out of the batch at the next step while it runs. A deadline that
passes fails a waiting request (504: it never started) and hands a running one to the engine to end. Snapshots the
engine takes go to the store under their request's session, a cancelled request's too (what it had prefilled).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import suppress

import anyio
from anyio.streams.memory import MemoryObjectSendStream

from courier.actors.prompt_cache.store_link import StoreLink
from courier.actors.scheduling.held_requests import HeldRequests
from courier.actors.scheduling.queued_request import QueuedRequest
from courier.core.failure_codes import FailureCode
from courier.engine.engine_io import EngineOutput, SnapshotTaken
from courier.engine.generation import GenerationEvent, GenerationFailed, GenerationFinished, RequestId, TokensGenerated
from courier.status.scheduler_stats import SchedulerStats

DEADLINE_MESSAGE = "the request reached its deadline (--request-timeout) before its first token"


class Delivery:
    def __init__(
        self,
        held: HeldRequests,
        store: StoreLink,
        stats: SchedulerStats,
        *,
        observe_time_to_first_token: Callable[[float], None] | None,
        clock: Callable[[], float],
    ) -> None:
        self._held = held
        self._store = store
        self._stats = stats
        self._observe_ttft = observe_time_to_first_token
        self._clock = clock  # what requests' deadlines are read against (`time.monotonic` in the server)

    def deliver(self, outputs: list[EngineOutput]) -> None:
        held, stats = self._held, self._stats
        for output in outputs:
            running = held.running.get(output.request_id)
            if isinstance(output.event, SnapshotTaken):
                owner = running if running is not None else held.leaving.get(output.request_id)
                if owner is not None:
                    self._keep_snapshot(owner, output.event)
                continue
            if running is None:
                continue
            running.prefilling = False
            events = running.events
            if isinstance(output.event, TokensGenerated):
                stats.generated_tokens += len(output.event.token_ids)
                if not running.first_token_seen and self._observe_ttft is not None:
                    running.first_token_seen = True
                    self._observe_ttft(time.monotonic() - running.queued_at)
            try:
                events.send_nowait(output.event)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, anyio.WouldBlock):
                self.end(output.request_id, cancelled=True)
                continue
            if isinstance(output.event, GenerationFinished):
                running.finished += 1
                running.tally.add(output.event)
                if running.finished == running.width:
                    running.tally.record(running.trace, output.event)
                    stats.completed += 1
                    stats.cut_at_deadline += output.event.deadline
                    self.end(output.request_id)
            elif isinstance(output.event, GenerationFailed):
                if output.event.code is FailureCode.DEADLINE_EXCEEDED:
                    stats.timed_out += 1
                else:
                    stats.failed += 1
                # One sample failing fails the request: the others leave the batch (as a cancellation would).
                self.end(output.request_id, cancelled=running.finished + 1 < running.width, counted=False)

    def _keep_snapshot(self, running: QueuedRequest, snapshot: SnapshotTaken) -> None:
        if running.cache_prompt:  # a request that opted out of the prompt cache leaves nothing in it
            self._store.insert(running.session, snapshot, running.trace, running.bucket)

    def end(self, request_id: RequestId, *, cancelled: bool = False, counted: bool = True) -> None:
        """`cancelled`: its sequences still in the batch leave it (`counted`: as a cancellation in the stats)."""
        held = self._held
        running = held.running.pop(request_id, None)
        if running is not None:
            running.events.close()
        if cancelled:
            if counted:
                self._stats.cancelled += 1
            held.cancelled.append(request_id)
            if running is not None:
                held.leaving[request_id] = running
        held.update_counts()

    def drop_abandoned(self) -> None:
        """Consumers that closed their end: queued ones are dropped, running ones leave the batch."""
        held = self._held
        for queued in [q for q in held.waiting if _abandoned(q.events)]:
            held.waiting.remove(queued)
            queued.events.close()
            self._stats.cancelled += 1
        for request_id in [r for r, queued in held.running.items() if _abandoned(queued.events)]:
            self.end(request_id, cancelled=True)

    def expire(self) -> list[RequestId]:
        """Requests past their deadline. A waiting one fails (504: it never started); running ones are returned for
        the engine, which ends each as a length cut with what it wrote (or fails it, if it wrote nothing)."""
        held = self._held
        now = self._clock()
        for queued in [q for q in held.waiting if q.past_deadline(now)]:
            held.waiting.remove(queued)
            late = GenerationFailed(message=DEADLINE_MESSAGE, code=FailureCode.DEADLINE_EXCEEDED)
            with suppress(anyio.BrokenResourceError, anyio.ClosedResourceError, anyio.WouldBlock):
                queued.events.send_nowait(late)
            queued.events.close()
            self._stats.timed_out += 1
        held.update_counts()
        expired = [r for r, queued in held.running.items() if not queued.expired and queued.past_deadline(now)]
        for request_id in expired:
            held.running[request_id].expired = True
        return expired

    def fail_everything(self, message: str) -> None:
        """The scheduler stops: every request it holds fails (`SHUTTING_DOWN`) and its stream is closed."""
        held = self._held
        failure = GenerationFailed(message=message, code=FailureCode.SHUTTING_DOWN)
        streams = [q.events for q in held.waiting] + [q.events for q in held.running.values()]
        held.waiting.clear()
        held.running.clear()
        held.leaving.clear()
        for events in streams:
            with suppress(anyio.BrokenResourceError, anyio.ClosedResourceError, anyio.WouldBlock):
                events.send_nowait(failure)
            events.close()
            self._stats.failed += 1
        held.update_counts()


def _abandoned(events: MemoryObjectSendStream[GenerationEvent]) -> bool:
    return events.statistics().open_receive_streams == 0
