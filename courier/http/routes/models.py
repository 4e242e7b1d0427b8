"""GET /v1/models and /v1/models/{id} (and /models, /models/{id}), in OpenAI's list and model shapes.

The list holds the served model under its id and under each exact alias of `--served-model-name` (a pattern
such as `claude-*` names no one model and is not listed); a model object shows the name it was asked by.
"""

from __future__ import annotations

from typing import Any

from quart import Blueprint

from courier.http.context import AppContext

OWNER = "courier"


def blueprint(context: AppContext) -> Blueprint:
    routes = Blueprint("models", __name__)

    def model_object(name: str) -> dict[str, Any]:
        info = context.state.model
        created = info.created if info else int(context.state.started_at)
        shown: dict[str, Any] = {"id": name, "object": "model", "created": created, "owned_by": OWNER}
        if info is not None:
            shown["capabilities"] = context.state.capabilities()
            # `max_tokens`: a reply's limit when its request sets none (null: whatever the context leaves).
            cap = context.settings.default_max_tokens or None
            shown["sampling_defaults"] = {**context.state.sampling_defaults.as_dict(), "max_tokens": cap}
        return shown

    @routes.get("/v1/models")
    @routes.get("/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [model_object(name) for name in context.served_names.listed]}

    @routes.get("/v1/models/<path:model_id>")
    @routes.get("/models/<path:model_id>")
    async def retrieve_model(model_id: str) -> dict[str, Any]:
        context.require_model(model_id)
        return model_object(model_id)

    return routes
