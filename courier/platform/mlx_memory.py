"""MLX's own memory: what its arrays hold, and the cache of freed buffers it keeps for reuse.

MLX keeps freed buffers in a cache so later arrays of the same size skip the allocator; by default that cache
may grow up to the memory limit, which under varied traffic (prompt-cache snapshots and KV caches of every
length) looks like a slow leak in RSS. `--mlx-cache-limit` bounds it. Reading the figures takes the allocator's
lock only, so `/health` and `/metrics` read them from the event loop.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import mlx.core as mx


@dataclass(frozen=True, slots=True, kw_only=True)
class MlxMemory:
    active_bytes: int
    cache_bytes: int
    peak_bytes: int
    cache_limit_bytes: int

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


_cache_limit = 0


def limit_cache(limit_bytes: int) -> None:
    """Bound MLX's cache of freed buffers (process-wide)."""
    global _cache_limit
    mx.set_cache_limit(limit_bytes)
    _cache_limit = limit_bytes


def mlx_memory() -> MlxMemory:
    return MlxMemory(
        active_bytes=mx.get_active_memory(),
        cache_bytes=mx.get_cache_memory(),
        peak_bytes=mx.get_peak_memory(),
        cache_limit_bytes=_cache_limit,
    )
