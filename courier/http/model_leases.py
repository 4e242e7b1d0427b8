"""A request's hold on its model, from the route that binds it until its response has ended, streams included.

`ModelLeaseScope` is an ASGI layer: each HTTP request (or websocket) runs with a list of what its routes hold: the
model leases they took (`hold`) and the generations they admitted (`hold_generation`). Quart handles a request in
tasks started from the layer's own, so they share that list. When the application call returns (the response's
last byte sent, or the client gone) every lease the request took is given back, so the registry never unloads a
model a response is still being written from, and every generation's events are closed, so none runs on for
nobody: a stream whose client left while its headers were being written never starts its body, and nothing else
would close them. A websocket serving one request after another gives each its own scope (`leases_held`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from contextvars import ContextVar
from typing import Any

from courier.messages.ingress import Admitted
from courier.messages.model_registry import ModelLease

# What the request being handled lets go of when it ends: a lease's release, a generation's discard.
_HELD: ContextVar[list[Callable[[], None]] | None] = ContextVar("courier_model_leases", default=None)
_SCOPED = ("http", "websocket")


class ModelLeaseScope:
    def __init__(self, app: Any) -> None:
        self._app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope.get("type") not in _SCOPED:
            await self._app(scope, receive, send)
            return
        held: list[Callable[[], None]] = []
        token = _HELD.set(held)
        try:
            await self._app(scope, receive, send)
        finally:
            _HELD.reset(token)
            _let_go(held)


def hold(lease: ModelLease) -> None:
    """Keep `lease` until the request being handled has ended."""
    held = _HELD.get()
    if held is None:
        lease.release()
        raise RuntimeError("a model lease taken outside a request: the app runs without ModelLeaseScope")
    held.append(lease.release)


def hold_generation(admitted: Admitted) -> None:
    """Close `admitted`'s events when the request being handled has ended, however it ended (events read to their
    end are closed already: nothing changes). Outside a request (an app without the layer) nothing is held."""
    held = _HELD.get()
    if held is not None:
        held.append(admitted.discard)


@asynccontextmanager
async def leases_held() -> AsyncIterator[None]:
    """The leases taken inside the block are given back when it ends (one request of several on a websocket)."""
    held: list[Callable[[], None]] = []
    token = _HELD.set(held)
    try:
        yield
    finally:
        _HELD.reset(token)
        _let_go(held)


def _let_go(held: list[Callable[[], None]]) -> None:
    """Last taken, first let go: a generation's events close before its model's lease is given back."""
    for release in reversed(held):
        release()
