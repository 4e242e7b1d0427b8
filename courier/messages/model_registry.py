"""The model registry's inbox: a model for a request (loaded if need be), an operator's load and unload, and the
registry's own news of the loads and unloads it runs.

A request holds its model by a `ModelLease` from `AcquireModel` until its response has ended; while any lease is
held the model is not unloaded. A lease carries the model's outboxes, the inboxes of its own actors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, TypeAlias

from anyio.streams.memory import MemoryObjectSendStream

from courier.core.served_models.residency import Leases
from courier.messages.base import Request
from courier.messages.compactor import CompactorMessage
from courier.messages.embedder import EmbedderMessage
from courier.messages.ingress import IngressMessage
from courier.messages.media import MediaFetcherMessage
from courier.messages.snapshot_store import SnapshotStoreMessage
from courier.messages.token_counter import TokenCounterMessage
from courier.runtime.message import Message


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelOutboxes:
    """A loaded model's actors, as the routes talk to them."""

    # None for all three: an embedding model, which generates nothing.
    token_counter: MemoryObjectSendStream[TokenCounterMessage] | None = None
    ingress: MemoryObjectSendStream[IngressMessage] | None = None
    compactor: MemoryObjectSendStream[CompactorMessage] | None = None
    embedder: MemoryObjectSendStream[EmbedderMessage] | None = (
        None  # it embeds (--embedding-pooling for a generative one)
    )
    snapshot_store: MemoryObjectSendStream[SnapshotStoreMessage] | None = None  # prompt cache on
    media_fetcher: MemoryObjectSendStream[MediaFetcherMessage] | None = None  # a vision model


class ModelRuntime(Protocol):
    """A loaded model with its actors running (made by the registry's loader, `server/model_runtime.py`)."""

    @property
    def outboxes(self) -> ModelOutboxes: ...

    @property
    def weights_bytes(self) -> int: ...

    @property
    def charge_bytes(self) -> int:
        """What the memory budget counts for it: weights, live KV allowance, prompt-cache memory tier."""
        ...

    async def unload(self) -> None:
        """Stop its actors (what memory caches is written to the disk tier first) and let its memory go."""
        ...


class ModelLease:
    """One request's hold on a loaded model. `release` gives it back (once; again does nothing); a lease that never
    reached its asker (who was cancelled) is released by `discard`."""

    __slots__ = ("_glance", "_keep_alive", "_leases", "_released", "model_id", "outboxes")

    def __init__(
        self, model_id: str, outboxes: ModelOutboxes, leases: Leases, keep_alive: float, *, glance: bool = False
    ) -> None:
        self.model_id = model_id
        self.outboxes = outboxes
        self._leases = leases
        self._keep_alive = keep_alive
        self._glance = glance  # a read of its figures: no use of the model (`Leases.take`)
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._leases.give_back(self._keep_alive, glance=self._glance)

    def discard(self) -> None:
        self.release()


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadResult:
    model_id: str
    state: str
    load_seconds: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class AcquireModel(Request[ModelLease]):
    """A lease on the model `name` names (None: the default), answered once it is loaded. `keep_alive`: seconds it
    may stay idle after this request (None: `--model-ttl`). `if_loaded`: answered at once, a `MODEL_NOT_LOADED`
    failure when it is not loaded (a figure asked of it must not load it)."""

    name: str | None
    keep_alive: float | None = None
    if_loaded: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadModel(Request[LoadResult]):
    """An operator's load, answered once the model is loaded."""

    name: str


@dataclass(frozen=True, slots=True, kw_only=True)
class UnloadModel(Request[LoadResult]):
    """An operator's unload, answered once the model's requests have ended and it is unloaded."""

    name: str


@dataclass(frozen=True, slots=True, kw_only=True)
class UnloadAll(Request[int]):
    """At shutdown: unload every model (their caches written to disk), answered with how many were loaded."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadFinished(Message):
    """The registry's own news: a load it started has ended, with the running model or why it failed."""

    model_id: str
    runtime: ModelRuntime | None
    error: str | None = None
    seconds: float = 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class UnloadFinished(Message):
    model_id: str


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckResidency(Message):
    """A wake-up: a model went idle, or a second passed (keep-alives run out, unloads wait for requests)."""


ModelRegistryMessage: TypeAlias = (
    AcquireModel | LoadModel | UnloadModel | UnloadAll | LoadFinished | UnloadFinished | CheckResidency
)
