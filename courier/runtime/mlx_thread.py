"""The one thread all MLX work runs on.

MLX streams and the model's arrays belong to the thread that uses them, and MLX
work must never block the event loop, so everything that touches the model is
submitted here and awaited. The thread is a daemon: a load still running at
shutdown cannot keep the process alive past its shutdown deadline.

Closing parks the thread instead of ending it: when a thread that used MLX ends
before the process exits, MLX (0.32) aborts the process at exit ("terminate
called without an active exception") in most runs; a parked thread never does.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")

THREAD_NAME = "courier-mlx"
# Work items waiting for the thread; callers await their result, so this stays small.
QUEUE_CAPACITY = 64
# A work item that holds the thread at least this long is logged (debug): what held the step loop, and how long.
SLOW_CALL_S = 0.5

logger = logging.getLogger(__name__)


class MlxThreadClosed(RuntimeError):
    """Work was submitted after the MLX thread was closed."""


class MlxThreadBusy(RuntimeError):
    """More than QUEUE_CAPACITY items are already waiting for the MLX thread."""


class MlxThread:
    def __init__(self) -> None:
        self._work: queue.Queue[tuple[Callable[[], Any], Future[Any]] | None] = queue.Queue(QUEUE_CAPACITY)
        self._closed = False
        self._parked = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=THREAD_NAME, daemon=True)
        self._thread.start()

    async def call(self, function: Callable[[], T]) -> T:
        """Run `function` on the MLX thread and return its result (or raise its exception)."""
        if self._closed:
            raise MlxThreadClosed("the MLX thread is closed")
        future: Future[T] = Future()
        try:
            self._work.put_nowait((function, future))
        except queue.Full:
            raise MlxThreadBusy(f"{QUEUE_CAPACITY} work items already wait for the MLX thread") from None
        return await asyncio.wrap_future(future)

    def close(self, timeout: float) -> bool:
        """Stop taking work; wait up to `timeout` s for queued work to finish. True if it did."""
        if not self._closed:
            self._closed = True
            self._work.put(None)  # may wait for room: the queue drains while the thread runs
        return self._parked.wait(timeout)

    def _loop(self) -> None:
        while (item := self._work.get()) is not None:
            function, future = item
            if not future.set_running_or_notify_cancel():
                continue
            started = time.perf_counter()
            try:
                result, error = function(), None
            except BaseException as raised:  # delivered to the awaiting task, which decides
                result, error = None, raised
            held = time.perf_counter() - started
            if held >= SLOW_CALL_S:  # logged before the caller wakes, so the log precedes what follows the call
                logger.debug("MLX thread held %.2f s by %s", held, _name(function))
            if error is None:
                future.set_result(result)
            else:
                future.set_exception(error)
        self._parked.set()
        threading.Event().wait()  # parked until the process exits; see the module docstring


def _name(function: Callable[[], Any]) -> str:
    """What a work item is, for the log: a partial's function, else the callable's own name."""
    inner = getattr(function, "func", function)
    return str(getattr(inner, "__qualname__", type(inner).__name__))
