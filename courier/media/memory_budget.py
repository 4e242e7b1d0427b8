"""The bytes of decoded image pixels held at once, across requests (`--max-image-memory-bytes`).

Image files are small on the wire and large once decoded: a 186 KiB PNG can
claim 7000x7000 pixels, 196 MB decoded. So every decode of a client's image
reserves `width x height x 4` bytes (read from the header, before a pixel is
decoded) from one budget for as long as its pixels exist, and gives them back
after. Where pixels live, and so where the reservations are:

- the fetcher decodes each image once to refuse what does not decode (a 400
  naming the part), then drops the pixels: a request reserves the sum for its
  images before that decode and releases it when they are done;
- the render (the model's processor, on the token counter's worker thread)
  decodes a request's images again and holds them until the processor has built
  its arrays: it reserves the sum for that long (`held_in_worker_thread`).

A request whose own images need more than the whole budget is refused (the
fetcher names the image that crosses it, `first_over`); one that would overrun
what other requests hold waits, first come first served (a large request is not
starved by a stream of small ones), for at most its deadline. Holders never wait
for anything while holding, so waiting cannot deadlock.

`ByteLedger` is the pure accounting; `ImageMemoryBudget` the anyio shell around it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from typing import Generic, TypeVar

import anyio
import anyio.from_thread

W = TypeVar("W")


def first_over(needs: Sequence[int], capacity: int) -> int | None:
    """The index of the first need whose running total passes `capacity`, or None when all fit together."""
    total = 0
    for index, need in enumerate(needs):
        total += need
        if total > capacity:
            return index
    return None


class ByteLedger(Generic[W]):
    """Bytes granted out of a capacity, and the waiters (any hashable token) queued for more, oldest first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.held = 0
        self._queue: deque[tuple[W, int]] = deque()

    @property
    def waiting(self) -> int:
        return len(self._queue)

    def request(self, waiter: W, nbytes: int) -> bool:
        """Grant `nbytes` now (True), or queue the waiter behind those already waiting (False)."""
        if nbytes > self.capacity:
            raise ValueError(f"{nbytes} bytes can never fit a budget of {self.capacity}")
        if nbytes == 0 or (not self._queue and self.held + nbytes <= self.capacity):
            self.held += nbytes
            return True
        self._queue.append((waiter, nbytes))
        return False

    def withdraw(self, waiter: W) -> bool:
        """Take a waiter out of the queue (it gave up); False when it is not queued (it was granted already)."""
        for entry in self._queue:
            if entry[0] is waiter:
                self._queue.remove(entry)
                return True
        return False

    def release(self, nbytes: int) -> list[W]:
        """Give `nbytes` back; the waiters granted as a result, in order (the queue stops at the first that does
        not fit, so none is overtaken)."""
        if nbytes > self.held:
            raise ValueError(f"releasing {nbytes} bytes, but only {self.held} are held")
        self.held -= nbytes
        return self._grant()

    def _grant(self) -> list[W]:
        granted: list[W] = []
        while self._queue and self.held + self._queue[0][1] <= self.capacity:
            waiter, nbytes = self._queue.popleft()
            self.held += nbytes
            granted.append(waiter)
        return granted


class ImageMemoryBudget:
    """One budget shared by every request; its methods run on the event loop (the worker thread's go through it)."""

    def __init__(self, capacity: int) -> None:
        self._ledger: ByteLedger[anyio.Event] = ByteLedger(capacity)

    @property
    def capacity(self) -> int:
        return self._ledger.capacity

    @property
    def held(self) -> int:
        return self._ledger.held

    @property
    def waiting(self) -> int:
        return self._ledger.waiting

    async def acquire(self, nbytes: int) -> None:
        """Wait until `nbytes` are granted (first come first served); cancelling the wait takes nothing."""
        granted = anyio.Event()
        if self._ledger.request(granted, nbytes):
            return
        try:
            await granted.wait()
        except BaseException:
            if not self._ledger.withdraw(granted):  # granted just as the wait was cancelled: hand it on
                self.release(nbytes)
            raise

    def release(self, nbytes: int) -> None:
        for waiter in self._ledger.release(nbytes):
            waiter.set()

    @asynccontextmanager
    async def reserved(self, nbytes: int, *, wait_s: float) -> AsyncIterator[None]:
        """`nbytes` held for the block; `TimeoutError` when they are not granted within `wait_s`."""
        with anyio.fail_after(wait_s):
            await self.acquire(nbytes)
        try:
            yield
        finally:
            self.release(nbytes)

    @contextmanager
    def held_in_worker_thread(self, nbytes: int) -> Iterator[None]:
        """From an anyio worker thread: block until `nbytes` are granted, hold them for the block. A need over the
        whole budget (never passed by the fetcher's check) takes the whole budget rather than waiting forever."""
        nbytes = min(nbytes, self.capacity)
        anyio.from_thread.run(self.acquire, nbytes)
        try:
            yield
        finally:
            anyio.from_thread.run_sync(self.release, nbytes)
