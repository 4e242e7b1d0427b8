"""The models' memory budget and each model's status before anything loads.

`--models-memory-bytes`, or three quarters of the memory available at start-up (`MemAvailable` on Linux, the
physical memory elsewhere: Metal shares it with the CPU); either way logged. Each declared model starts not
loaded, with its weights estimated from its files (`model/memory_estimate.py`) and charged that plus its live KV
allowance and its prompt-cache memory tier until it has loaded and been weighed. The default model's state is the
server's own `ServiceState` (so `/health` and `/metrics` read as they always did with one model); every other
model gets its own, sharing the server's fault, storage and connection counters.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from courier.core.served_models.residency import Leases
from courier.engine.prompt_cache.budget import MIN_BUDGET, available_memory
from courier.model.catalog import ModelCatalog
from courier.model.device import active_device, serving_dtype
from courier.model.memory_estimate import estimate_weight_bytes
from courier.settings import Settings
from courier.status.models import ModelsStatus, ModelStatus
from courier.status.scheduler_stats import SchedulerStats
from courier.status.service_state import ServiceState

logger = logging.getLogger(__name__)

BUDGET_SHARE_OF_MEMORY = 0.75
# With several models and no --prompt-cache-snapshot-capacity-bytes, a model's memory tier is at most this share
# of the budget, so one model's cache does not crowd out the others.
SNAPSHOT_BUDGET_SHARE = 4


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryBudget:
    bytes: int
    explanation: str


def memory_budget(settings: Settings) -> MemoryBudget:
    if settings.models_memory_bytes is not None:
        return MemoryBudget(bytes=settings.models_memory_bytes, explanation="--models-memory-bytes")
    available = available_memory()
    return MemoryBudget(
        bytes=int(available * BUDGET_SHARE_OF_MEMORY),
        explanation=f"three quarters of the {available} bytes available at start-up",
    )


def snapshot_ceiling(catalog: ModelCatalog, settings: Settings, budget: MemoryBudget) -> int | None:
    """A model's prompt-cache memory tier at most, when several models share the budget and none is configured."""
    if not catalog.several or settings.prompt_cache_snapshot_capacity_bytes is not None:
        return None
    return budget.bytes // SNAPSHOT_BUDGET_SHARE


def model_statuses(
    catalog: ModelCatalog, settings: Settings, server: ServiceState, budget: MemoryBudget
) -> ModelsStatus:
    """Every declared model, not loaded yet; the default's state is `server`. Before it loads a model is charged
    its estimated weights and its prompt cache's memory tier (its live KV is known once it has loaded)."""
    dtype = serving_dtype(settings.weight_format, active_device())
    dense_bytes = dtype.size if dtype is not None else None
    ceiling = snapshot_ceiling(catalog, settings, budget)
    cache = settings.prompt_cache_snapshot_capacity_bytes or min(MIN_BUDGET, ceiling or MIN_BUDGET)
    cache = cache if settings.prompt_cache else 0
    status = ModelsStatus(budget_bytes=budget.bytes, max_loaded=settings.max_loaded_models)
    pins = set(settings.pin)
    for index, model in enumerate(catalog.models):
        if index == 0:
            state = server
        else:
            state = ServiceState(
                blas=server.blas,
                cpu_attention=server.cpu_attention,
                model_id=model.model_id,
                scheduler=SchedulerStats(max_batch=settings.max_batch, max_queue=settings.max_queue),
                faults=server.faults,
                storage_faults=server.storage_faults,
                connections=server.connections,
                started_at=server.started_at,
            )
        weights = estimate_weight_bytes(model.source, settings.cache_dir, dense_bytes)
        status.models[model.model_id] = ModelStatus(
            names=model.names,
            source=model.source.describe(),
            state=state,
            leases=Leases(time.monotonic),
            pinned=bool(pins & set(model.names.names)),
            weights_bytes=weights,
            charge_bytes=(weights or 0) + cache,
        )
    unknown = pins - {name for model in catalog.models for name in model.names.names}
    if unknown:
        logger.warning("--pin names no served model: %s", ", ".join(sorted(unknown)))
    return status
