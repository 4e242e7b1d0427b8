"""Each tenant's share of the storage budget: what a write may evict, and when it is refused instead.

A tenant (an API key, `tenancy.py`) keeps at most `StorageLimits.tenant_bytes` bytes and
`tenant_entries` records; the store as a whole at most `max_bytes` and `max_entries`. A
write that leaves its tenant over its share, or the store over its budget, evicts that
tenant's own least recently updated records, never another tenant's, so one key writing
a lot cannot take what another key stored. When the tenant has nothing left to evict
(the rest of the store is other tenants' records, or its own record alone is past its
share), the write is refused and changes nothing. A record larger than its tenant's
byte share is refused before anything is evicted for it.

Pure: the backends count (SQLite in memory with `UsageBook`, PostgreSQL in SQL) and
delete; these functions decide.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from courier.storage.records import StorageLimits


@dataclass(slots=True)
class Usage:
    """Bytes and records stored (by one tenant, or by all)."""

    bytes: int = 0
    entries: int = 0

    def add(self, nbytes: int, entries: int) -> None:
        self.bytes += nbytes
        self.entries += entries


def over_budget(tenant: Usage, total: Usage, limits: StorageLimits) -> bool:
    """Whether the tenant is past its share, or the store past its budget."""
    return (
        tenant.bytes > limits.tenant_bytes
        or tenant.entries > limits.tenant_entries
        or total.bytes > limits.max_bytes
        or total.entries > limits.max_entries
    )


def too_large(what: str, nbytes: int, limits: StorageLimits) -> str | None:
    """Why a record of `nbytes` can never be stored (larger than its tenant's byte share), or None."""
    if nbytes <= limits.tenant_bytes:
        return None
    whose = "the storage budget" if limits.tenant_bytes == limits.max_bytes else "this API key's storage budget"
    return f"the {what} is {nbytes} bytes, more than {whose} of {limits.tenant_bytes}"


def no_room(tenant: Usage, limits: StorageLimits) -> str:
    """Why a write is refused once its tenant has nothing left to evict."""
    if tenant.bytes > limits.tenant_bytes or tenant.entries > limits.tenant_entries:
        return (
            f"this would take this API key past its storage budget of {limits.tenant_bytes} bytes and "
            f"{limits.tenant_entries} records, even with all its other records evicted; nothing was stored"
        )
    return (
        "response storage is full: the rest of it holds other API keys' records, which are never evicted for "
        "another key's; nothing was stored"
    )


@dataclass(slots=True)
class UsageBook:
    """What is stored, in total and by tenant, kept in step with a database by its one writer (SQLite's)."""

    total: Usage = field(default_factory=Usage)
    tenants: dict[str, Usage] = field(default_factory=dict)

    def add(self, tenant: str, nbytes: int, entries: int) -> None:
        """Count `nbytes` and `entries` (negative: freed) for `tenant`."""
        self.total.add(nbytes, entries)
        usage = self.tenants.setdefault(tenant, Usage())
        usage.add(nbytes, entries)
        if usage.bytes == 0 and usage.entries == 0:
            del self.tenants[tenant]

    def of(self, tenant: str) -> Usage:
        return self.tenants.get(tenant, Usage())
