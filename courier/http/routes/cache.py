"""GET /v1/cache/stats and POST /v1/cache/reset: the snapshot store, observed and cleared, by message.

Both are the default model's, or that of `?model=NAME`; stats of a model that is not loaded say so (asking for
figures never loads a model), a reset loads it."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from quart import Blueprint, request

from courier.core.prompt_cache.divergence import DivergenceReport
from courier.core.prompt_cache.rejections import FileRejection
from courier.core.prompt_cache.stats import StoreStats
from courier.http.auth import Caller, require_admin
from courier.http.context import AppContext
from courier.http.errors import ApiError
from courier.messages.asking import call
from courier.messages.snapshot_store import ResetSnapshots
from courier.messages.token_counter import ForgetRenders


def blueprint(context: AppContext) -> Blueprint:
    routes = Blueprint("cache", __name__)

    @routes.get("/cache/stats")
    async def stats() -> dict[str, Any]:
        # The scheduler's counters before the store's figures: a warm-up counted as run has already told the store
        # its snapshot, so the store, asked next, answers with it (read after, they could count a warm-up whose
        # snapshot the figures miss).
        bound = await context.for_loaded_model(request.args.get("model"))  # a figure never loads a model
        if bound is None:
            return {"enabled": context.settings.prompt_cache, "model_loaded": False}
        scheduler = replace(bound.state.scheduler)
        store = await bound.snapshot_stats()
        if store is None:
            return {"enabled": False}
        counters, limits = store.counters, store.limits
        hits, lookups = counters.hits, counters.lookups
        return {
            "enabled": True,
            "snapshot_entries": store.entries,
            "snapshot_bytes": store.nbytes,
            "snapshot_capacity_bytes": limits.capacity_bytes,
            "snapshot_max_entries": limits.max_entries,
            "snapshot_ttl_seconds": limits.ttl_s,
            "snapshot_min_prefix": limits.min_prefix,
            "snapshot_lookups": lookups,
            "snapshot_hits": hits,
            "snapshot_hit_rate": hits / lookups if lookups else 0.0,
            "snapshot_inserts": counters.inserts,
            "snapshot_supersedes": counters.supersedes,
            "snapshot_replacements": counters.replacements,
            "snapshot_evictions_lru": counters.evictions_lru,
            "snapshot_evictions_ttl": counters.evictions_ttl,
            "snapshot_rejections_oversized": counters.rejections_oversized,
            "snapshot_self_evictions": counters.self_evictions,
            "snapshot_bytes_per_entry": store.nbytes // store.memory_entries if store.memory_entries else 0,
            # Attention KV as stored: quantized to these bits in groups of this size, or null for as computed.
            "snapshot_bits": limits.quantization.bits if limits.quantization else None,
            "snapshot_group_size": limits.quantization.group_size if limits.quantization else None,
            # The running batch's attention KV (`--kv-bits`): these bits and group size, or null for as computed.
            "batch_kv_bits": scheduler.kv_bits,
            "batch_kv_group_size": scheduler.kv_group_size,
            "tokens_reused": counters.tokens_reused,
            "snapshot_warmups_run": scheduler.warmups_run,
            "snapshot_warmups_skipped": scheduler.warmups_skipped,
            "snapshot_warmups_paused": scheduler.warmups_paused,
            "snapshot_warmups_pending": scheduler.warmups_pending,
            "snapshot_warmups_queued": scheduler.warmups_queued,
            "snapshot_lookups_timed_out": scheduler.lookups_timed_out,
            "snapshot_divergences": counters.divergences,
            "snapshot_recent_divergences": _divergences(store.divergences, bound.caller()),
            **_tier_figures(store),
        }

    @routes.post("/cache/reset")
    async def reset() -> dict[str, Any]:
        require_admin(context.caller())
        bound = await context.for_model(request.args.get("model"))
        outbox = bound.outboxes.snapshot_store
        if outbox is None:
            raise ApiError.invalid("the prompt cache is disabled (--no-prompt-cache)")
        entries, memory, disk = await call(outbox, lambda reply: ResetSnapshots(reply=reply))
        renders = await call(bound.outboxes.token_counter, lambda reply: ForgetRenders(reply=reply))
        return {
            "cleared": True,
            "freed_bytes": memory,
            "freed_disk_bytes": disk,
            "freed_entries": entries,
            "forgotten_renders": renders,
        }

    return routes


def _divergences(kept: tuple[DivergenceReport, ...], caller: Caller) -> list[dict[str, object]]:
    """The latest first: a key's own only (they quote its prompts), every tenant's for an admin key or without keys."""
    return [found.view() for found in reversed(kept) if caller.admin or found.tenant == caller.tenant]


def _tier_figures(store: StoreStats) -> dict[str, Any]:
    """Both tiers apart: memory, and the disk tier (zeros and an empty directory without one)."""
    counters, io = store.counters, store.disk_io
    return {
        "snapshot_memory_entries": store.memory_entries,
        "snapshot_memory_hits": counters.hits - counters.disk_hits,
        "snapshot_spills": counters.spills,
        "snapshot_disk_directory": store.disk_directory,
        "snapshot_disk_entries": store.disk_entries,
        "snapshot_disk_bytes": store.disk_nbytes,
        "snapshot_disk_capacity_bytes": store.limits.disk_capacity_bytes,
        "snapshot_disk_hits": counters.disk_hits,
        "snapshot_disk_restores": counters.restores,
        "snapshot_disk_adopted": counters.adopted,
        "snapshot_disk_evictions_lru": counters.evictions_disk,
        "snapshot_disk_copies_evicted": counters.disk_copies_evicted,
        "snapshot_disk_unreadable": counters.disk_unreadable,
        "snapshot_disk_write_failures": counters.disk_write_failures,
        "snapshot_disk_write_losses": counters.disk_write_losses,
        "snapshot_disk_writes": io.writes,
        "snapshot_disk_write_bytes": io.write_bytes,
        "snapshot_disk_write_ms_mean": 1000 * io.write_seconds / io.writes if io.writes else 0.0,
        "snapshot_disk_writes_skipped": io.writes_skipped,
        "snapshot_disk_writes_refused": io.writes_refused,
        "snapshot_disk_write_errors": io.write_errors,
        "snapshot_disk_reads": io.reads,
        "snapshot_disk_read_bytes": io.read_bytes,
        "snapshot_disk_read_ms_mean": 1000 * io.read_seconds / io.reads if io.reads else 0.0,
        "snapshot_disk_read_errors": io.read_errors,
        "snapshot_disk_restores_refused": io.restores_refused,
        "snapshot_disk_files_rejected": {reason.value: io.files_rejected.get(reason, 0) for reason in FileRejection},
        "snapshot_disk_pending": io.pending,
    }
