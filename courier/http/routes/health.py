"""GET /health: phase, the default model, device, BLAS and weight format, every model's residency; 503 unless ready."""

from __future__ import annotations

import time

import orjson
from quart import Blueprint, Response

from courier.http.context import AppContext
from courier.platform.malloc_tuning import malloc_usage
from courier.platform.mlx_memory import mlx_memory
from courier.status.service_state import Phase


def blueprint(context: AppContext) -> Blueprint:
    routes = Blueprint("health", __name__)

    @routes.get("/health")
    async def health() -> Response:
        state = context.state
        model = state.model
        body = {
            "status": state.phase.value,
            "model": state.model_id,
            "device": model.device if model else None,
            "blas": state.blas.as_dict(),
            "cpu_attention": state.cpu_attention.as_dict() if state.cpu_attention else None,
            "weight_format": model.weight_format if model else None,
            "model_info": model.as_dict() if model else None,
            "capabilities": state.capabilities() if model else None,
            "scheduler": state.scheduler_view(),
            # Every servable model: loaded or not, its memory, a load's progress (several models: load on demand).
            "models": context.models.view(time.monotonic()) if context.models is not None else None,
            "speculation": state.scheduler.speculation.view(),
            "batch_kv": state.scheduler.batch_kv_view(),  # --kv-bits: null bits for as computed
            "connections": state.connections.as_dict(),
            "memory": mlx_memory().as_dict(),
            "malloc": malloc_usage(),
            "uptime_s": round(time.time() - state.started_at, 3),
        }
        status = 200 if state.phase is Phase.READY else 503
        return Response(orjson.dumps(body), status=status, content_type="application/json")

    return routes
