"""The snapshot store's limits and figures: `StoreLimits` (its budgets), `StoreCounters` (what it has done),
`DiskIoCounters` (what its disk tier's worker has done) and `StoreStats` (a copy of all of them at one moment)."""

from __future__ import annotations

from dataclasses import dataclass, field

from courier.core.prompt_cache.divergence import DivergenceReport
from courier.core.prompt_cache.quantization import KvQuantization
from courier.core.prompt_cache.rejections import FileRejection


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreLimits:
    capacity_bytes: int
    max_entries: int
    ttl_s: float
    min_prefix: int
    disk_capacity_bytes: int = 0  # 0: no disk tier
    # How the snapshots it holds store attention KV (None: as computed): reported, never needed by the store.
    quantization: KvQuantization | None = None

    def __post_init__(self) -> None:
        if self.capacity_bytes <= 0 or self.max_entries <= 0 or self.ttl_s <= 0 or self.min_prefix < 1:
            raise ValueError(f"snapshot store limits must be positive: {self}")
        if self.disk_capacity_bytes < 0:
            raise ValueError(f"the disk budget must not be negative: {self.disk_capacity_bytes}")


@dataclass(slots=True)
class StoreCounters:
    lookups: int = 0
    hits: int = 0
    tokens_reused: int = 0
    inserts: int = 0
    supersedes: int = 0
    replacements: int = 0
    evictions_lru: int = 0
    evictions_ttl: int = 0
    rejections_oversized: int = 0
    self_evictions: int = 0
    divergences: int = 0  # lookups that missed, or left their conversation's cached history, at a point found
    # The disk tier (all zero without one).
    disk_hits: int = 0  # lookups answered with an entry read back from disk (counted in `hits` too)
    spills: int = 0  # memory LRU evictions that kept the entry on disk
    restores: int = 0  # entries read back from disk into memory
    evictions_disk: int = 0  # entries the disk tier evicted by LRU while memory did not hold them: gone
    disk_copies_evicted: int = 0  # files the disk tier evicted of entries memory still holds
    disk_write_failures: int = 0
    disk_write_losses: int = 0  # write failures of entries memory no longer held: gone
    disk_unreadable: int = 0  # corrupt, truncated or foreign files found on reading: entry gone, file deleted
    adopted: int = 0  # entries indexed from the files of an earlier run


@dataclass(slots=True)
class DiskIoCounters:
    """What the disk tier's worker has done (kept by the store's owner, which does the I/O)."""

    writes: int = 0
    write_bytes: int = 0
    write_seconds: float = 0.0
    writes_skipped: int = 0  # asked for, but the entry was superseded or evicted before its turn came
    writes_refused: int = 0  # the writer had too many bytes waiting: memory only, counted, never a stall
    write_errors: int = 0  # a full disk, an I/O error
    reads: int = 0
    read_bytes: int = 0
    read_seconds: float = 0.0
    read_errors: int = 0  # unreadable, corrupt or vanished files
    restores_refused: int = 0  # every reader busy: answered as a miss
    # Files named like snapshot files not used (at start-up or read back), by reason: deleted, a miss.
    files_rejected: dict[FileRejection, int] = field(default_factory=dict)
    pending: int = 0  # writes and deletes queued or under way, at the moment the figures were read


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreStats:
    """What the store holds and has done, at one moment (a copy: the store's owner hands it out)."""

    entries: int
    nbytes: int
    limits: StoreLimits
    counters: StoreCounters
    memory_entries: int = 0
    disk_entries: int = 0
    disk_nbytes: int = 0
    disk_io: DiskIoCounters = field(default_factory=DiskIoCounters)
    disk_directory: str = ""
    divergences: tuple[DivergenceReport, ...] = ()  # the last few, oldest first (kept by the store's owner)
