"""The load gauges Kubernetes inference gateways read, under the names they read them by.

The Gateway API Inference Extension's endpoint picker (and llm-d, built on it) scrapes each model server's
`/metrics` for its queue, its running requests and its KV-cache utilisation, and names vLLM's metrics for them
(its model-server protocol). Courier exports the same three under those names, with vLLM's `model_name` label, so
such a gateway routes to Courier unchanged. Courier keeps each running sequence's KV cache in a batch slot rather
than in a pool of blocks, so its cache utilisation is the share of `--max-batch` slots in use; both of vLLM's names
for it are exported (`gpu_cache_usage_perc` before vLLM's V1 engine, `kv_cache_usage_perc` since).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily, Metric

from courier.status.scheduler_stats import SchedulerStats


def gateway_gauges(stats: SchedulerStats, model: str) -> Iterator[Metric]:
    utilisation = stats.running / stats.max_batch if stats.max_batch > 0 else 0.0
    for name, documentation, value in (
        ("vllm:num_requests_waiting", "Requests waiting for a batch slot (as vLLM names it)", stats.waiting),
        ("vllm:num_requests_running", "Sequences in the running batch (as vLLM names it)", stats.running),
        ("vllm:kv_cache_usage_perc", "Share of the batch's KV-cache slots in use, 0-1 (as vLLM names it)", utilisation),
        ("vllm:gpu_cache_usage_perc", "Share of the batch's KV-cache slots in use, 0-1 (older name)", utilisation),
    ):
        gauge = GaugeMetricFamily(name, documentation, labels=["model_name"])
        gauge.add_metric([model], value)
        yield gauge
