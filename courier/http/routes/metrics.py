"""GET /metrics: Prometheus text format (the snapshot store's figures asked of its actor first)."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST
from quart import Blueprint, Response

from courier.http.context import AppContext
from courier.messages.asking import Refused


def blueprint(context: AppContext) -> Blueprint:
    routes = Blueprint("metrics", __name__)

    @routes.get("/metrics")
    async def metrics() -> Response:
        try:
            bound = await context.for_loaded_model(None)  # the default model's store, when it is loaded
            snapshot_stats = await bound.snapshot_stats() if bound is not None else None
        except Refused:
            snapshot_stats = None  # a store too busy to answer: its family is left out of this scrape
        return Response(context.metrics.render(snapshot_stats), content_type=CONTENT_TYPE_LATEST)

    return routes
