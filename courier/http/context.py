"""What the routes need from the running server: settings, state and actor inboxes."""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field, replace
from typing import Any

import anyio
from anyio.streams.memory import MemoryObjectSendStream
from quart import g

from courier.conversation.capsule import CapsuleCodec
from courier.conversation.images import ImageAdmission
from courier.conversation.sealed import KEY_BYTES, ReasoningSeal
from courier.conversation.turn import TurnServices
from courier.core.failure_codes import FailureCode
from courier.core.prompt_cache.stats import StoreStats
from courier.core.served_models.names import ServedNames
from courier.core.served_models.residency import parse_keep_alive
from courier.http.access_log import note_model
from courier.http.auth import ANYONE, ApiKeys, Caller
from courier.http.errors import ApiError
from courier.http.json_body import read_json_object
from courier.http.model_leases import hold
from courier.http.responses.in_flight import InFlightResponses
from courier.messages.asking import Refused, call
from courier.messages.compactor import CompactorMessage
from courier.messages.embedder import EmbedderMessage
from courier.messages.ingress import IngressMessage
from courier.messages.media import MediaFetcherMessage
from courier.messages.model_registry import AcquireModel, ModelRegistryMessage
from courier.messages.snapshot_store import ReadSnapshotStats, SnapshotStoreMessage
from courier.messages.storage import StorageMessage
from courier.messages.token_counter import TokenCounterMessage
from courier.runtime import trace_attributes
from courier.runtime.tracing import tracer
from courier.settings import Settings
from courier.status.metrics import CourierMetrics
from courier.status.models import ModelsStatus
from courier.status.service_state import Phase, ServiceState


@dataclass(frozen=True, slots=True, kw_only=True)
class Outboxes:
    token_counter: MemoryObjectSendStream[TokenCounterMessage]
    ingress: MemoryObjectSendStream[IngressMessage]
    storage: MemoryObjectSendStream[StorageMessage]
    compactor: MemoryObjectSendStream[CompactorMessage]
    snapshot_store: MemoryObjectSendStream[SnapshotStoreMessage] | None = None
    media_fetcher: MemoryObjectSendStream[MediaFetcherMessage] | None = None  # served only for a vision model
    embedder: MemoryObjectSendStream[EmbedderMessage] | None = None  # a model that embeds


@dataclass(frozen=True, slots=True, kw_only=True)
class AppContext:
    settings: Settings
    state: ServiceState
    outboxes: Outboxes
    metrics: CourierMetrics
    capsules: CapsuleCodec
    # Seals reasoning items for stateless clients (`include: ["reasoning.encrypted_content"]`).
    seal: ReasoningSeal = field(default_factory=lambda: ReasoningSeal(secrets.token_bytes(KEY_BYTES)))
    responses: InFlightResponses = field(default_factory=InFlightResponses)
    api_keys: ApiKeys = field(default_factory=lambda: ApiKeys(()))
    # The model registry and what it shows (None: one model, started as the context was built: tests' apps).
    registry: MemoryObjectSendStream[ModelRegistryMessage] | None = None
    models: ModelsStatus | None = None
    names: ServedNames | None = None  # the bound model's names (a context `for_model` made)

    async def for_loaded_model(self, requested: str | None) -> AppContext | None:
        """`for_model` for a model already loaded (None when it is not, or the server is not serving): figures asked
        of it never load it."""
        if self.state.phase is not Phase.READY:
            return None
        if self.registry is None or self.models is None:
            return self if self.state.model is not None else None
        try:
            return await self.for_model(requested, if_loaded=True)
        except Refused as refused:
            if refused.failure.code is FailureCode.MODEL_NOT_LOADED:
                return None
            raise

    async def for_model(
        self,
        requested: str | None,
        *,
        keep_alive: float | None = None,
        if_loaded: bool = False,
        embeddings: bool = False,
    ) -> AppContext:
        """The context of the model `requested` names (None: the default), whose state and outboxes are that
        model's: loaded if it is not (waiting at most `--request-timeout`), and held until the response has ended
        (streams included), so it is not unloaded under the request. A 404 for a model not served, a 503 when it
        cannot be loaded, a 504 when it does not load in time; a 400 for an embedding model asked to generate, or,
        `embeddings`, for a model that does not embed."""
        self.require_ready()
        if self.registry is None or self.models is None:
            self.require_model(requested)
            if not if_loaded:  # a figure asked of a loaded model is no request served by it
                note_model(self.state.model_id)
            if embeddings and self.outboxes.embedder is None:
                raise _does_not_embed(self.state.model_id)
            return self
        registry = self.registry
        attributes = {trace_attributes.MODEL: requested or ""}
        with tracer().start_as_current_span("model_registry.wait", attributes=attributes):
            try:
                with anyio.fail_after(self.settings.request_timeout):
                    lease = await call(
                        registry,
                        lambda reply: AcquireModel(
                            name=requested, keep_alive=keep_alive, if_loaded=if_loaded, reply=reply
                        ),
                    )
            except TimeoutError:
                message = f"the model '{requested}' did not load within --request-timeout"
                raise ApiError(504, message, param="model", code=FailureCode.DEADLINE_EXCEEDED) from None
        hold(lease)
        if not if_loaded:
            note_model(lease.model_id)
        model = self.models.models[lease.model_id]
        model_outboxes = lease.outboxes
        if embeddings and model_outboxes.embedder is None:
            raise _does_not_embed(lease.model_id)
        if model_outboxes.ingress is None and not embeddings:
            message = f"the model '{lease.model_id}' is an embedding model: it answers POST /v1/embeddings only"
            raise ApiError.invalid(message, param="model", code=FailureCode.MODEL_NOT_SUPPORTED)
        base = self.outboxes  # an embedding model's generation outboxes stay the unbound ones (closed)
        outboxes = Outboxes(
            token_counter=model_outboxes.token_counter
            if model_outboxes.token_counter is not None
            else base.token_counter,
            ingress=model_outboxes.ingress if model_outboxes.ingress is not None else base.ingress,
            storage=base.storage,
            compactor=model_outboxes.compactor if model_outboxes.compactor is not None else base.compactor,
            snapshot_store=model_outboxes.snapshot_store,
            media_fetcher=model_outboxes.media_fetcher,
            embedder=model_outboxes.embedder,
        )
        return replace(self, state=model.state, outboxes=outboxes, names=model.names)

    async def read_for_model(self) -> tuple[AppContext, dict[str, Any]]:
        """The request's JSON object body, and the context of the model it names (`for_body`)."""
        body = await read_json_object()
        return await self.for_body(body), body

    async def for_body(self, body: dict[str, Any], *, embeddings: bool = False) -> AppContext:
        """`for_model` for the model a request body names in `model` (anything but text: the default, and its
        validation says what is wrong), kept loaded `keep_alive` after it (Ollama's: seconds or a duration)."""
        model = body.get("model")
        keep_alive = None
        if "keep_alive" in body and body["keep_alive"] is not None:
            try:
                keep_alive = parse_keep_alive(body["keep_alive"])
            except ValueError as error:
                raise ApiError.invalid(str(error), param="keep_alive") from None
        requested = model if isinstance(model, str) else None
        return await self.for_model(requested, keep_alive=keep_alive, embeddings=embeddings)

    def caller(self) -> Caller:
        """Who sent the request being handled (checked before any route runs)."""
        caller = getattr(g, "caller", None)
        return caller if isinstance(caller, Caller) else ANYONE

    def require_ready(self) -> None:
        """Refuse work the model is not ready for, with a retryable 503."""
        phase = self.state.phase
        if phase is Phase.READY:
            return
        if phase is Phase.LOADING:
            raise ApiError.unavailable("the model is still loading; retry shortly", code=FailureCode.MODEL_LOADING)
        raise ApiError.unavailable("the server is shutting down", code=FailureCode.SHUTTING_DOWN)

    @property
    def context_length(self) -> int:
        model = self.state.model
        assert model is not None, "require_ready() first"
        return model.usable_context_length

    @property
    def max_n(self) -> int:
        """The most samples one request may ask for: `--max-n`, and never more than a batch holds."""
        return min(self.settings.max_n, self.settings.max_batch)

    @property
    def served_names(self) -> ServedNames:
        """The served model's id and its aliases (`--served-model-name ID,ALIAS,...`)."""
        if self.names is not None:
            return self.names
        names = ServedNames.parse(self.settings.served_model_name, self.state.model_id)
        return ServedNames((self.state.model_id, *names.names[1:]))

    def require_model(self, requested: str | None) -> None:
        """A request that names a model must name the served one, or one of its aliases."""
        if requested is not None and not self.served_names.matches(requested):
            raise ApiError(
                404,
                f"The model '{requested}' does not exist; this server serves '{self.state.model_id}'",
                param="model",
                code=FailureCode.MODEL_NOT_FOUND,
            )

    def image_admission(self) -> ImageAdmission:
        """The image rules for the served model (after `require_ready()`)."""
        model = self.state.model
        assert model is not None, "require_ready() first"
        fetcher = self.outboxes.media_fetcher if model.accepts_images else None
        return ImageAdmission(max_images=self.settings.max_images, model_id=model.model_id, fetcher=fetcher)

    def turn_services(self) -> TurnServices:
        """What a Responses turn talks to (after `require_ready()`)."""
        return TurnServices(
            storage=self.outboxes.storage,
            token_counter=self.outboxes.token_counter,
            compactor=self.outboxes.compactor,
            ingress=self.outboxes.ingress,
            images=self.image_admission(),
            capsules=self.capsules,
            model_id=self.state.model_id,
            context_length=self.context_length,
            warm_up=self.settings.prompt_cache,
            tenant=self.caller().tenant,
            replica_id=self.settings.replica_id,
            deadline=time.monotonic() + self.settings.request_timeout,
        )

    async def snapshot_stats(self) -> StoreStats | None:
        """The snapshot store's figures, asked of its actor; None while it does not run (prompt cache off, or the
        model still loading). A busy or stopped store is `Refused`."""
        outbox = self.outboxes.snapshot_store
        if outbox is None or self.state.model is None:
            return None
        return await call(outbox, lambda reply: ReadSnapshotStats(reply=reply))


def _does_not_embed(model_id: str) -> ApiError:
    message = (
        f"the model '{model_id}' is a generative model and does not embed; an operator may let it, its hidden "
        "states pooled (--embedding-pooling NAME=mean or NAME=last)"
    )
    return ApiError.invalid(message, param="model", code=FailureCode.MODEL_NOT_SUPPORTED)
