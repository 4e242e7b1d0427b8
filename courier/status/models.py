"""Every servable model as `/v1/models`, `/health` and `/metrics` show it: loaded or not, its memory, its load.

One writer, the model registry actor (and, for `progress`, the load it runs, which names its current step);
HTTP handlers only read. Each model has its own `ServiceState` (its info, formats and scheduler counters once
loaded); the requests in flight are its `Leases`' count.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from courier.core.served_models.names import ServedNames
from courier.core.served_models.residency import FOREVER, Leases, Residency, Resident
from courier.status.service_state import ServiceState


@dataclass(slots=True, kw_only=True)
class ModelStatus:
    names: ServedNames
    source: str
    state: ServiceState  # the model's own: its info and counters once loaded
    leases: Leases
    pinned: bool = False
    residency: Residency = Residency.NOT_LOADED
    weights_bytes: int | None = None  # estimated from its files until it has loaded, then weighed
    weights_measured: bool = False
    charge_bytes: int | None = None  # what the memory budget counts for it: weights, KV allowance, cache tier
    progress: str | None = None  # the step its load is in
    error: str | None = None  # why its last load failed
    loads: int = 0
    unloads: int = 0
    load_seconds: float | None = None  # the last load's
    capabilities: dict[str, Any] | None = None  # what it could do when it was last loaded

    @property
    def model_id(self) -> str:
        return self.names.model_id

    def resident(self) -> Resident:
        """What the residency policy needs to know of it."""
        return Resident(
            name=self.model_id,
            residency=self.residency,
            charge=self.charge_bytes or 0,
            in_flight=self.leases.in_flight,
            last_used=self.leases.last_used,
            pinned=self.pinned,
            idle_until=self.leases.idle_until,
        )

    def view(self, now: float) -> dict[str, Any]:
        """Its entry in `/v1/models` (`status`) and `/health` (`models`); `now`: the leases' clock's."""
        idle_until = self.leases.idle_until
        idle = self.residency is Residency.LOADED and not self.leases.in_flight and idle_until != FOREVER
        return {
            "state": self.residency.value,
            "aliases": list(self.names.names[1:]),
            "source": self.source,
            "pinned": self.pinned,
            "memory": {
                "weights_bytes": self.weights_bytes,
                "weights": "measured" if self.weights_measured else "estimated",
                "charged_bytes": self.charge_bytes,
            },
            "requests_in_flight": self.leases.in_flight,
            # Seconds until it goes, idle (null: it stays until its memory is needed, or it is not idle).
            "unloads_in_s": round(max(0.0, idle_until - now), 3) if idle else None,
            "progress": self.progress,
            "error": self.error,
            "loads": self.loads,
            "unloads": self.unloads,
            "load_seconds": self.load_seconds,
        }


@dataclass(slots=True, kw_only=True)
class ModelsStatus:
    models: dict[str, ModelStatus] = field(default_factory=dict)  # by id, the default model first
    budget_bytes: int = 0
    max_loaded: int = 0  # 0: no count limit

    @property
    def charged_bytes(self) -> int:
        present = (model for model in self.models.values() if model.residency is not Residency.NOT_LOADED)
        return sum(model.charge_bytes or 0 for model in present)

    def residents(self) -> list[Resident]:
        return [model.resident() for model in self.models.values()]

    def view(self, now: float) -> dict[str, Any]:
        """`/health`'s `models`: the budget and each model."""
        return {
            "memory_budget_bytes": self.budget_bytes,
            "memory_charged_bytes": self.charged_bytes,
            "max_loaded_models": self.max_loaded or None,
            "models": {model_id: model.view(now) for model_id, model in self.models.items()},
        }
