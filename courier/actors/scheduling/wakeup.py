"""How the scheduler's drive loop sleeps until something it waits for happens: a request arrives, a lookup answers,
a warm-up is queued. A wake-up set while no one waits is not kept: the loop looks at its state before it waits."""

from __future__ import annotations

import anyio


class Wakeup:
    def __init__(self) -> None:
        self._event = anyio.Event()

    def set(self) -> None:
        self._event.set()

    async def wait(self) -> None:
        """Until the next `set` from now on."""
        self._event = anyio.Event()
        await self._event.wait()
