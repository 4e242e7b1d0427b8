"""GET /openapi.json: the OpenAPI 3.1 document of every route."""

from __future__ import annotations

from typing import Any

from quart import Blueprint

from courier.http.context import AppContext
from courier.http.openapi import openapi_document


def blueprint(context: AppContext) -> Blueprint:
    routes = Blueprint("openapi", __name__)
    document = openapi_document(context.settings.api_prefix, context.max_n)

    @routes.get("/openapi.json")
    async def openapi() -> dict[str, Any]:
        return document

    return routes
