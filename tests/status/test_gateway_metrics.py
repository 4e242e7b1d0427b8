"""The gauges an inference gateway reads, by vLLM's names, from the scheduler's own counters."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from courier.status.gateway_metrics import gateway_gauges
from courier.status.scheduler_stats import SchedulerStats


def exposition(stats: SchedulerStats) -> dict[str, float]:
    class Gauges(Collector):
        def collect(self) -> Iterator[Metric]:
            yield from gateway_gauges(stats, "smollm2")

    registry = CollectorRegistry()
    registry.register(Gauges())
    text = generate_latest(registry).decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line[0] != "#"}


def test_queue_running_and_cache_use_are_exported_under_vllms_names() -> None:
    samples = exposition(SchedulerStats(max_batch=8, max_queue=64, running=6, waiting=3))
    assert samples == {
        'vllm:num_requests_waiting{model_name="smollm2"}': 3.0,
        'vllm:num_requests_running{model_name="smollm2"}': 6.0,
        'vllm:kv_cache_usage_perc{model_name="smollm2"}': 0.75,
        'vllm:gpu_cache_usage_perc{model_name="smollm2"}': 0.75,
    }


def test_an_idle_server_reports_an_empty_cache() -> None:
    samples = exposition(SchedulerStats(max_batch=8, max_queue=64))
    assert samples['vllm:kv_cache_usage_perc{model_name="smollm2"}'] == 0.0
