"""Prometheus metrics: read from the actors' own counters at scrape time, plus a TTFT histogram.

The counters the scheduler and the ingress keep (`status/`) are exported by a
collector that reads them when `/metrics` is scraped, so nothing is counted twice;
the snapshot store's figures are a copy its actor sent for this scrape. Only
time-to-first-token needs its own instrument.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from courier.core.prompt_cache.rejections import FileRejection
from courier.core.prompt_cache.stats import StoreStats
from courier.platform.malloc_tuning import malloc_usage
from courier.platform.mlx_memory import mlx_memory
from courier.status.gateway_metrics import gateway_gauges
from courier.status.model_metrics import model_families, model_ttft_histogram
from courier.status.models import ModelsStatus
from courier.status.service_state import ServiceState
from courier.status.tokenizer_stats import TokenizerStats
from courier.storage.breaker import BreakerState, CircuitBreaker

TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)


class CourierMetrics:
    """`models`: every declared model (several models: per-model families labelled `model` as well)."""

    def __init__(self, state: ServiceState, models: ModelsStatus | None = None) -> None:
        self.registry = CollectorRegistry()
        self._collector = _StateCollector(state, models)
        self.registry.register(self._collector)
        self.time_to_first_token = Histogram(
            "courier_time_to_first_token_seconds",
            "Seconds from a generation being queued to its first token",
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self._model_ttft = model_ttft_histogram(self.registry, TTFT_BUCKETS)

    def observe_time_to_first_token(self, model_id: str) -> Callable[[float], None]:
        """What a model's scheduler reports its time to first token to: the server's histogram and the model's."""
        labelled = self._model_ttft.labels(model=model_id)

        def observe(seconds: float) -> None:
            self.time_to_first_token.observe(seconds)
            labelled.observe(seconds)

        return observe

    def render(self, snapshot_stats: StoreStats | None) -> bytes:
        """The Prometheus text exposition, with the snapshot store's figures as its actor reported them."""
        self._collector.snapshot_stats = snapshot_stats
        try:
            return generate_latest(self.registry)
        finally:
            self._collector.snapshot_stats = None


class _StateCollector(Collector):
    def __init__(self, state: ServiceState, models: ModelsStatus | None) -> None:
        self._state = state
        self._models = models
        self.snapshot_stats: StoreStats | None = None  # set for the length of one synchronous scrape

    def collect(self) -> Iterator[Metric]:
        yield from self._scheduler()
        yield from gateway_gauges(self._state.scheduler, self._state.model_id)
        yield from self._faults()
        yield from self._connections()
        yield from self._prompt_cache()
        yield from _tokenizer(self._state.tokenizer)
        yield from self._grammars()
        yield from self._mlx_memory()
        if self._models is not None:
            yield from model_families(self._models)

    def _grammars(self) -> Iterator[Metric]:
        grammars = self._state.grammars
        if grammars is None:
            return
        stats = grammars.stats()
        yield GaugeMetricFamily("courier_grammar_cache_entries", "Compiled grammars kept", value=stats.entries)
        yield CounterMetricFamily("courier_grammar_cache_hits", "Constraints served a cached grammar", value=stats.hits)
        yield CounterMetricFamily("courier_grammar_compiles", "Grammars compiled (cache misses)", value=stats.misses)
        yield CounterMetricFamily(
            "courier_grammar_compile_seconds", "Seconds spent compiling grammars", value=stats.compile_seconds
        )
        yield GaugeMetricFamily(
            "courier_grammar_built_entries", "Requests' output specs kept built", value=stats.built_entries
        )
        yield CounterMetricFamily(
            "courier_grammar_built_hits", "Output specs whose grammar was not built again", value=stats.built_hits
        )

    def _scheduler(self) -> Iterator[Metric]:
        stats = self._state.scheduler
        yield GaugeMetricFamily("courier_requests_running", "Sequences in the running batch", value=stats.running)
        yield GaugeMetricFamily("courier_requests_waiting", "Requests waiting for a batch slot", value=stats.waiting)
        outcomes = CounterMetricFamily("courier_requests", "Generation requests by outcome", labels=["outcome"])
        for outcome in ("completed", "cancelled", "failed", "timed_out", "cut_at_deadline"):
            outcomes.add_metric([outcome], getattr(stats, outcome))
        outcomes.add_metric(["rejected"], self._state.rejected)
        yield outcomes
        yield CounterMetricFamily("courier_generated_tokens", "Tokens generated", value=stats.generated_tokens)
        yield from self._speculation()

    def _speculation(self) -> Iterator[Metric]:
        speculation = self._state.scheduler.speculation
        for name, help_text, value in (
            ("steps", "Forward passes of the generation batch (decode steps)", speculation.steps),
            ("verify_steps", "Decode steps that verified drafts or appended forced tokens", speculation.verify_steps),
            ("emitted_tokens", "Tokens decode steps produced", speculation.tokens),
            ("drafted_tokens", "Prompt-lookup draft tokens verified", speculation.drafted),
            ("accepted_tokens", "Draft tokens kept (the model agreed)", speculation.accepted),
            ("forced_tokens", "Tokens a grammar forced, appended without sampling", speculation.forced),
        ):
            yield CounterMetricFamily(f"courier_speculative_{name}", help_text, value=value)

    def _connections(self) -> Iterator[Metric]:
        connections = self._state.connections
        yield GaugeMetricFamily("courier_connections_open", "Open client connections", value=connections.open)
        yield GaugeMetricFamily(
            "courier_connections_limit", "Most open client connections (--max-connections)", value=connections.limit
        )
        yield CounterMetricFamily(
            "courier_connections_refused", "Connections answered 503 at the connection cap", value=connections.refused
        )
        answered = CounterMetricFamily(
            "courier_http_requests",
            "HTTP requests answered, by the route template matched, method and status",
            labels=["route", "method", "status"],
        )
        for (route, method, status), count in sorted(self._state.http_requests.counts.items()):
            answered.add_metric([route, method, status], count)
        yield answered
        yield CounterMetricFamily(
            "courier_requests_client_gone",
            "Requests whose client went away before their answer was written (their work cancelled)",
            value=connections.client_gone,
        )

    def _faults(self) -> Iterator[Metric]:
        faults = CounterMetricFamily(
            "courier_request_faults",
            "Requests failed by an unexpected exception in an actor (each logged with its trace)",
            labels=["actor"],
        )
        for actor, count in sorted(self._state.faults.by_actor().items()):
            faults.add_metric([actor], count)
        yield faults
        storage = self._state.storage_faults
        for name, help_text, value in (
            (
                "damaged_records",
                "Distinct stored records found damaged (each read of one is a 500)",
                storage.damaged_records,
            ),
            ("damaged_reads", "Reads refused because the record they read is damaged", storage.damaged_reads),
            (
                "unavailable",
                "Storage calls the database could not serve (full disk, I/O error): 503s",
                storage.unavailable_calls,
            ),
        ):
            yield CounterMetricFamily(f"courier_storage_{name}", help_text, value=value)
        yield from _breaker(storage.breaker)

    def _mlx_memory(self) -> Iterator[Metric]:
        memory = mlx_memory()
        yield GaugeMetricFamily("courier_mlx_active_bytes", "Bytes held by MLX arrays", value=memory.active_bytes)
        yield GaugeMetricFamily(
            "courier_mlx_cache_bytes", "Bytes of freed buffers MLX keeps for reuse", value=memory.cache_bytes
        )
        yield GaugeMetricFamily("courier_mlx_peak_bytes", "Most bytes MLX arrays held at once", value=memory.peak_bytes)
        heap = malloc_usage()
        if heap is not None:
            yield GaugeMetricFamily(
                "courier_malloc_in_use_bytes", "Bytes in use in glibc's heap", value=heap["in_use_bytes"]
            )
            yield GaugeMetricFamily(
                "courier_malloc_free_held_bytes", "Freed bytes glibc's heap keeps", value=heap["free_held_bytes"]
            )

    def _prompt_cache(self) -> Iterator[Metric]:
        store = self.snapshot_stats
        if store is None:
            return
        counters = store.counters
        prefix = "courier_prompt_cache"
        yield GaugeMetricFamily(f"{prefix}_entries", "Snapshots held", value=store.entries)
        yield GaugeMetricFamily(f"{prefix}_bytes", "Bytes held by snapshots", value=store.nbytes)
        yield GaugeMetricFamily(f"{prefix}_capacity_bytes", "Snapshot byte budget", value=store.limits.capacity_bytes)
        for name, help_text, value in (
            ("lookups", "Prefix lookups", counters.lookups),
            ("hits", "Lookups that found a reusable prefix", counters.hits),
            ("inserts", "Snapshots inserted", counters.inserts),
            ("supersedes", "Snapshots superseded by a newer one of their conversation", counters.supersedes),
            ("rejections_oversized", "Snapshots refused as larger than the budget", counters.rejections_oversized),
            ("self_evictions", "LRU evictions of a session's own snapshots", counters.self_evictions),
            ("tokens_reused", "Prompt tokens served from snapshots", counters.tokens_reused),
            ("divergences", "Lookups that missed or left their conversation's cached history", counters.divergences),
        ):
            yield CounterMetricFamily(f"{prefix}_{name}", help_text, value=value)
        evictions = CounterMetricFamily(f"{prefix}_evictions", "Snapshots evicted, by reason", labels=["reason"])
        evictions.add_metric(["lru"], counters.evictions_lru)
        evictions.add_metric(["ttl"], counters.evictions_ttl)
        evictions.add_metric(["disk_lru"], counters.evictions_disk)
        evictions.add_metric(["disk_unreadable"], counters.disk_unreadable)
        evictions.add_metric(["disk_write_failed"], counters.disk_write_losses)
        yield evictions
        yield from _tiers(store)


def _tokenizer(stats: TokenizerStats) -> Iterator[Metric]:
    """Chat renders tokenized, and the tokens taken from renders kept for reuse (docs/prompt-cache.md)."""
    prefix = "courier_tokenizer"
    yield CounterMetricFamily(f"{prefix}_renders", "Chat renders tokenized", value=stats.renders)
    yield CounterMetricFamily(f"{prefix}_tokens", "Tokens of the chat renders tokenized", value=stats.tokens)
    yield CounterMetricFamily(
        f"{prefix}_reused_tokens", "Of those, tokens taken from a render kept before", value=stats.reused_tokens
    )
    yield GaugeMetricFamily(f"{prefix}_kept_renders", "Renders kept for reuse", value=stats.kept_renders)
    yield GaugeMetricFamily(f"{prefix}_kept_bytes", "Bytes the renders kept for reuse hold", value=stats.kept_bytes)


def _tiers(store: StoreStats) -> Iterator[Metric]:
    """The prompt cache's memory and disk tiers, labelled by tier; the disk tier's I/O."""
    prefix = "courier_prompt_cache"
    counters, io = store.counters, store.disk_io
    for name, help_text, memory, disk in (
        ("tier_entries", "Snapshots held, by tier (an entry may be in both)", store.memory_entries, store.disk_entries),
        ("tier_bytes", "Bytes charged, by tier", store.nbytes, store.disk_nbytes),
        ("tier_capacity_bytes", "Byte budget, by tier", store.limits.capacity_bytes, store.limits.disk_capacity_bytes),
    ):
        gauge = GaugeMetricFamily(f"{prefix}_{name}", help_text, labels=["tier"])
        gauge.add_metric(["memory"], memory)
        gauge.add_metric(["disk"], disk)
        yield gauge
    hits = CounterMetricFamily(f"{prefix}_tier_hits", "Lookup hits, by the tier that held the state", labels=["tier"])
    hits.add_metric(["memory"], counters.hits - counters.disk_hits)
    hits.add_metric(["disk"], counters.disk_hits)
    yield hits
    for name, help_text, value in (
        ("spills", "Memory evictions that kept the snapshot on disk", counters.spills),
        ("restores", "Snapshots read back from disk into memory", counters.restores),
        ("disk_adopted", "Snapshots kept from an earlier run's files", counters.adopted),
        ("disk_writes", "Snapshot files written", io.writes),
        ("disk_write_bytes", "Bytes of snapshot files written", io.write_bytes),
        ("disk_write_seconds", "Seconds spent writing snapshot files (encode, hash, write, fsync)", io.write_seconds),
        ("disk_write_errors", "Snapshot files that could not be written (a full disk among them)", io.write_errors),
        ("disk_writes_refused", "Writes refused because the writer had too much waiting", io.writes_refused),
        ("disk_reads", "Snapshot files read back", io.reads),
        ("disk_read_bytes", "State bytes read back from snapshot files", io.read_bytes),
        ("disk_read_seconds", "Seconds spent reading snapshot files back (read, verify, build)", io.read_seconds),
        ("disk_read_errors", "Snapshot files found corrupt, truncated, foreign or gone on reading", io.read_errors),
    ):
        yield CounterMetricFamily(f"{prefix}_{name}", help_text, value=value)
    rejected = CounterMetricFamily(
        f"{prefix}_disk_files_rejected",
        "Files named like snapshot files that were not used, by reason",
        labels=["reason"],
    )
    for reason in FileRejection:
        rejected.add_metric([reason.value], io.files_rejected.get(reason, 0))
    yield rejected


def _breaker(breaker: CircuitBreaker) -> Iterator[Metric]:
    """The storage breaker's state as a one-hot gauge (one series per state, 1 for the present one), and its trips."""
    state = GaugeMetricFamily(
        "courier_storage_breaker_state",
        "Storage circuit breaker: closed (calls reach the database), open (unreachable: calls refused at once), "
        "probing (a probe is connecting)",
        labels=["state"],
    )
    for each in BreakerState:
        state.add_metric([each.value], 1.0 if breaker.state is each else 0.0)
    yield state
    yield CounterMetricFamily(
        "courier_storage_breaker_trips",
        "Times the database was found unreachable and the breaker opened",
        value=breaker.trips,
    )
