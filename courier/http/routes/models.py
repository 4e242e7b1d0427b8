"""GET /v1/models and /v1/models/{id} (and /models, /models/{id}), in OpenAI's list and model shapes.

The list holds every servable model under its id and under each exact alias (a pattern such as `claude-*` names no
one model and is not listed); a model object shows the name it was asked by. Beside OpenAI's fields each carries
`status`: whether it is loaded, loading or not loaded, what it is charged against the memory budget (its weights
estimated until it has loaded), its requests in flight and its last load; and once it has loaded, its
`capabilities` and `sampling_defaults`. Listing never loads a model. A request that sends `anthropic-version` (any
Anthropic SDK) gets Anthropic's shapes instead, paginated as Anthropic's are (`http/anthropic/models.py`).

POST /v1/models/{id}/load and /unload: an operator's (an admin key), answered when done; a blueprint of their own,
served under `/v1` only (`http/app.py`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import anyio
from quart import Blueprint, request

from courier.core.failure_codes import FailureCode
from courier.core.served_models.names import named_by
from courier.http.anthropic import models as anthropic_models
from courier.http.auth import require_admin
from courier.http.context import AppContext
from courier.http.errors import ApiError
from courier.messages.asking import call
from courier.messages.base import RequestFailed
from courier.messages.model_registry import LoadModel, LoadResult, UnloadModel
from courier.runtime.message import ReplyStream
from courier.status.models import ModelStatus
from courier.status.service_state import ServiceState

OWNER = "courier"
BLUEPRINT = "models"
LOADING_BLUEPRINT = "model_loading"


def blueprint(context: AppContext) -> Blueprint:
    routes = Blueprint(BLUEPRINT, __name__)

    def model_object(name: str, model: ModelStatus | None) -> dict[str, Any]:
        state = model.state if model is not None else context.state
        info = state.model
        created = info.created if info else int(context.state.started_at)
        shown: dict[str, Any] = {"id": name, "object": "model", "created": created, "owned_by": OWNER}
        if model is not None:
            shown["status"] = model.view(time.monotonic())
        if info is not None:
            shown.update(_capabilities(context, state))
        elif model is not None and model.capabilities is not None:
            shown["capabilities"] = model.capabilities  # as it had them when it was last loaded
        return shown

    def listed() -> list[tuple[str, ModelStatus | None]]:
        if context.models is None:
            return [(name, None) for name in context.served_names.listed]
        return [(name, model) for model in context.models.models.values() for name in model.names.listed]

    def anthropic_object(name: str, model: ModelStatus | None) -> dict[str, Any]:
        info = (model.state if model is not None else context.state).model
        created = info.created if info else int(context.state.started_at)
        return anthropic_models.model_info(name, created, info.usable_context_length if info else None)

    @routes.get("/models")
    async def list_models() -> dict[str, Any]:
        if anthropic_models.wants_anthropic_shape(request.headers):
            shown = [anthropic_object(name, model) for name, model in listed()]
            return anthropic_models.model_page(shown, request.args)
        return {"object": "list", "data": [model_object(name, model) for name, model in listed()]}

    @routes.get("/models/<path:model_id>")
    async def retrieve_model(model_id: str) -> dict[str, Any]:
        shape = anthropic_object if anthropic_models.wants_anthropic_shape(request.headers) else model_object
        if context.models is None:
            context.require_model(model_id)
            return shape(model_id, None)
        model = named_by(context.models.models.values(), model_id, lambda status: status.names)
        if model is not None:  # the one a request naming it is served by
            return shape(model_id, model)
        served = ", ".join(f"'{model}'" for model in context.models.models)
        raise ApiError(
            404,
            f"The model '{model_id}' does not exist; this server serves {served}",
            param="model",
            code=FailureCode.MODEL_NOT_FOUND,
        )

    return routes


def loading_blueprint(context: AppContext) -> Blueprint:
    routes = Blueprint(LOADING_BLUEPRINT, __name__)

    @routes.post("/models/<path:model_id>/load")
    async def load_model(model_id: str) -> dict[str, Any]:
        """An operator's load (an admin key): answered once it is loaded, or with why it could not be."""
        return await _by_hand(context, lambda reply: LoadModel(name=model_id, reply=reply))

    @routes.post("/models/<path:model_id>/unload")
    async def unload_model(model_id: str) -> dict[str, Any]:
        """An operator's unload (an admin key): answered once its requests have ended and it is unloaded; its
        prompt cache's disk tier stays, so its next load finds its conversations warm."""
        return await _by_hand(context, lambda reply: UnloadModel(name=model_id, reply=reply))

    return routes


async def _by_hand(
    context: AppContext, build: Callable[[ReplyStream[LoadResult | RequestFailed]], LoadModel | UnloadModel]
) -> dict[str, Any]:
    require_admin(context.caller())
    context.require_ready()
    if context.registry is None:
        raise ApiError.invalid("this server loads and unloads no models by hand")
    registry, limit_s = context.registry, context.settings.request_timeout
    try:
        with anyio.fail_after(limit_s):  # every wait bounded; the load or unload itself goes on
            result = await call(registry, build)
    except TimeoutError:
        message = f"not done within --request-timeout ({limit_s:g} s); it goes on, and GET /v1/models shows its state"
        raise ApiError(504, message, param="model", code=FailureCode.DEADLINE_EXCEEDED) from None
    return {"id": result.model_id, "object": "model", "state": result.state, "load_seconds": result.load_seconds}


def _capabilities(context: AppContext, state: ServiceState) -> dict[str, Any]:
    # `max_tokens`: a reply's limit when its request sets none (null: whatever the context leaves).
    cap = context.settings.default_max_tokens or None
    return {
        "capabilities": state.capabilities(),
        "sampling_defaults": {**state.sampling_defaults.as_dict(), "max_tokens": cap},
    }
