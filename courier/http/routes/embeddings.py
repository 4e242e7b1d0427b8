"""POST /v1/embeddings, answered by the model's embedder actor (an embedding model's, or a generative model's whose
pooling the operator enabled; any other model is a 400 saying so)."""

from __future__ import annotations

from typing import Any

from quart import Blueprint

from courier.http.context import AppContext
from courier.http.embeddings_request import embeddings_response, parse_embeddings_request
from courier.http.errors import ApiError
from courier.http.json_body import read_json_object
from courier.messages.asking import call
from courier.messages.embedder import EmbedInputs


def blueprint(context: AppContext) -> Blueprint:
    routes = Blueprint("embeddings", __name__)

    @routes.post("/embeddings")
    async def embeddings() -> dict[str, Any]:
        body = await read_json_object()
        request = parse_embeddings_request(body)  # before the model is bound: a bad request loads nothing
        bound = await context.for_body(body, embeddings=True)
        embedder = bound.outboxes.embedder
        assert embedder is not None, "for_body(embeddings=True) binds a model that embeds"
        width = (bound.state.embeddings or {}).get("dimensions")
        if request.dimensions is not None and isinstance(width, int) and request.dimensions > width:
            message = f"'dimensions' is {request.dimensions}; this model's embeddings have {width}"
            raise ApiError.invalid(message, param="dimensions")
        result = await call(embedder, lambda reply: EmbedInputs(inputs=request.inputs, reply=reply))
        return embeddings_response(result.vectors, request, bound.served_names.model_id, result.prompt_tokens)

    return routes
