"""Per-model Prometheus families, each with a `model` label: every declared model's residency and memory, and, for
each, its own scheduler's counters (they are kept while it is unloaded, so a counter never goes back). Read from
`ModelsStatus` at scrape time, as the rest of `/metrics` is. The unlabelled families stay the default model's."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from courier.core.served_models.residency import Residency
from courier.status.models import ModelsStatus

OUTCOMES = ("completed", "cancelled", "failed", "timed_out", "cut_at_deadline")


def model_families(models: ModelsStatus) -> Iterator[Metric]:
    prefix = "courier_model"
    yield GaugeMetricFamily(
        "courier_models_memory_budget_bytes", "Memory the loaded models may take together", value=models.budget_bytes
    )
    yield GaugeMetricFamily(
        "courier_models_memory_charged_bytes", "Memory the loaded models are charged", value=models.charged_bytes
    )
    state = GaugeMetricFamily(f"{prefix}_state", "1 for the model's residency state", labels=["model", "state"])
    charged = GaugeMetricFamily(f"{prefix}_charged_bytes", "What the memory budget counts for it", labels=["model"])
    in_flight = GaugeMetricFamily(f"{prefix}_requests_in_flight", "Requests holding the model", labels=["model"])
    loads = CounterMetricFamily(f"{prefix}_loads", "Loads completed", labels=["model"])
    unloads = CounterMetricFamily(f"{prefix}_unloads", "Unloads completed", labels=["model"])
    running = GaugeMetricFamily(f"{prefix}_requests_running", "Sequences in its running batch", labels=["model"])
    waiting = GaugeMetricFamily(f"{prefix}_requests_waiting", "Requests waiting for its batch", labels=["model"])
    requests = CounterMetricFamily(
        f"{prefix}_requests", "Its generation requests by outcome", labels=["model", "outcome"]
    )
    generated = CounterMetricFamily(f"{prefix}_generated_tokens", "Tokens it generated", labels=["model"])
    for model_id, model in models.models.items():
        for residency in Residency:
            state.add_metric([model_id, residency.value], 1.0 if model.residency is residency else 0.0)
        charged.add_metric([model_id], model.charge_bytes or 0)
        in_flight.add_metric([model_id], model.leases.in_flight)
        loads.add_metric([model_id], model.loads)
        unloads.add_metric([model_id], model.unloads)
        stats = model.state.scheduler
        running.add_metric([model_id], stats.running)
        waiting.add_metric([model_id], stats.waiting)
        for outcome in OUTCOMES:
            requests.add_metric([model_id, outcome], getattr(stats, outcome))
        requests.add_metric([model_id, "rejected"], model.state.rejected)
        generated.add_metric([model_id], stats.generated_tokens)
    yield from (state, charged, in_flight, loads, unloads, running, waiting, requests, generated)


def model_ttft_histogram(registry: CollectorRegistry, buckets: tuple[float, ...]) -> Histogram:
    """Time to first token by model (`courier_model_time_to_first_token_seconds{model}`)."""
    return Histogram(
        "courier_model_time_to_first_token_seconds",
        "Seconds from a generation being queued to its first token, by model",
        labelnames=["model"],
        buckets=buckets,
        registry=registry,
    )
