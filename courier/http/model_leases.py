"""A request's hold on its model, from the route that binds it until its response has ended, streams included.

`ModelLeaseScope` is an ASGI layer: each HTTP request (or websocket) runs with a list of the model leases its
routes took (`hold`). Quart handles a request in tasks started from the layer's own, so they share that list.
When the application call returns (the response's last byte sent, or the client gone) every lease the request
took is given back, so the registry never unloads a model a response is still being written from. A websocket
serving one request after another gives each its own scope (`leases_held`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from contextvars import ContextVar
from typing import Any

from courier.messages.model_registry import ModelLease

_HELD: ContextVar[list[ModelLease] | None] = ContextVar("courier_model_leases", default=None)
_SCOPED = ("http", "websocket")


class ModelLeaseScope:
    def __init__(self, app: Any) -> None:
        self._app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope.get("type") not in _SCOPED:
            await self._app(scope, receive, send)
            return
        held: list[ModelLease] = []
        token = _HELD.set(held)
        try:
            await self._app(scope, receive, send)
        finally:
            _HELD.reset(token)
            for lease in held:
                lease.release()


def hold(lease: ModelLease) -> None:
    """Keep `lease` until the request being handled has ended."""
    held = _HELD.get()
    if held is None:
        lease.release()
        raise RuntimeError("a model lease taken outside a request: the app runs without ModelLeaseScope")
    held.append(lease)


@asynccontextmanager
async def leases_held() -> AsyncIterator[None]:
    """The leases taken inside the block are given back when it ends (one request of several on a websocket)."""
    held: list[ModelLease] = []
    token = _HELD.set(held)
    try:
        yield
    finally:
        _HELD.reset(token)
        for lease in held:
            lease.release()
