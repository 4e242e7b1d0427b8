"""Cancelling one generation from another task (`POST /v1/responses/{id}/cancel`).

The task consuming the generation's events watches the wait for its next event;
`request` cancels that wait, and the consumer then raises `GenerationCancelled`
and closes the event stream, which takes the request out of the batch.
"""

from __future__ import annotations

import anyio


class GenerationCancelled(Exception):
    """The generation was cancelled on request (it has left the batch)."""


class Cancellation:
    """A request to stop one generation, from another task (`POST /v1/responses/{id}/cancel`)."""

    def __init__(self) -> None:
        self._requested = False
        self._waiting: anyio.CancelScope | None = None

    @property
    def requested(self) -> bool:
        return self._requested

    def request(self) -> None:
        self._requested = True
        if self._waiting is not None:
            self._waiting.cancel()

    def watch(self, scope: anyio.CancelScope | None) -> None:
        """The scope of the wait for the next event (None once it is over): cancelling interrupts it."""
        self._waiting = scope
