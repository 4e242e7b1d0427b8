"""GET /v1/cache/stats and POST /v1/cache/reset: the snapshot store, observed and cleared, by message."""

from __future__ import annotations

from typing import Any

from quart import Blueprint

from courier.http.auth import require_admin
from courier.http.context import AppContext
from courier.http.errors import ApiError
from courier.messages.asking import call
from courier.messages.snapshot_store import ResetSnapshots


def blueprint(context: AppContext) -> Blueprint:
    routes = Blueprint("cache", __name__)

    @routes.get("/v1/cache/stats")
    async def stats() -> dict[str, Any]:
        store = await context.snapshot_stats()
        if store is None:
            return {"enabled": False}
        counters, limits = store.counters, store.limits
        hits, lookups = counters.hits, counters.lookups
        scheduler = context.state.scheduler
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
            "snapshot_bytes_per_entry": store.nbytes // store.entries if store.entries else 0,
            "tokens_reused": counters.tokens_reused,
            "snapshot_warmups_run": scheduler.warmups_run,
            "snapshot_warmups_skipped": scheduler.warmups_skipped,
            "snapshot_warmups_pending": scheduler.warmups_pending,
            "snapshot_warmups_queued": scheduler.warmups_queued,
            "snapshot_lookups_timed_out": scheduler.lookups_timed_out,
        }

    @routes.post("/v1/cache/reset")
    async def reset() -> dict[str, Any]:
        outbox = context.outboxes.snapshot_store
        require_admin(context.caller())
        context.require_ready()
        if outbox is None:
            raise ApiError.invalid("the prompt cache is disabled (--no-prompt-cache)")
        freed_entries, freed_bytes = await call(outbox, lambda reply: ResetSnapshots(reply=reply))
        return {"cleared": True, "freed_bytes": freed_bytes, "freed_entries": freed_entries}

    return routes
