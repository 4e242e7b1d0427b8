"""GET /metrics: Prometheus text format."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from quart import Blueprint, Response

from courier.http.context import AppContext


def blueprint(context: AppContext) -> Blueprint:
    routes = Blueprint("metrics", __name__)

    @routes.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(context.metrics.registry), content_type=CONTENT_TYPE_LATEST)

    return routes
