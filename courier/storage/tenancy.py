"""Records that belong to one API key: a tenant's ids are stored under its own key space.

With API keys, every stored response and conversation lives under the key of the
tenant that made it (`tenant/id`), so another tenant asking for the same id finds
nothing (a 404), and a `previous_response_id` chain can only follow its own tenant's
records. The anonymous tenant "" (no keys) stores ids as they are. An id holding the
separator is never a stored key, so no one can name another tenant's record.

Each tenant also has its own share of the storage budget (`shared_limits`), and a write
evicts only its own tenant's records (`tenant_budget.py`).
"""

from __future__ import annotations

from courier.storage.records import StorageLimits

SEPARATOR = "/"
_NEVER_STORED = "\x00"


def scoped(tenant: str, record_id: str) -> str:
    """The key `record_id` is stored under for `tenant`."""
    if SEPARATOR in record_id:
        return _NEVER_STORED + record_id
    return f"{tenant}{SEPARATOR}{record_id}" if tenant else record_id


def unscoped(tenant: str, key: str) -> str:
    """The id a tenant knows for its stored `key`."""
    prefix = f"{tenant}{SEPARATOR}"
    return key.removeprefix(prefix) if tenant else key


def tenant_of(key: str) -> str:
    """The tenant whose key space a stored key is in ("" for the anonymous tenant's). The backends' `tenant`
    columns compute the same in SQL."""
    tenant, separator, _ = key.partition(SEPARATOR)
    return tenant if separator else ""


def shared_limits(limits: StorageLimits, tenants: int, max_bytes: int | None, max_entries: int | None) -> StorageLimits:
    """Each tenant's budgets: `max_bytes` / `max_entries` where set, else an even share of the store's among
    `tenants` (the API keys; none: the one anonymous tenant, who may use it all)."""
    count = max(tenants, 1)
    return StorageLimits(
        max_bytes=limits.max_bytes,
        max_entries=limits.max_entries,
        ttl_s=limits.ttl_s,
        tenant_max_bytes=max_bytes if max_bytes is not None else max(1, limits.max_bytes // count),
        tenant_max_entries=max_entries if max_entries is not None else max(1, limits.max_entries // count),
    )


def oversubscribed(limits: StorageLimits, tenants: int) -> str | None:
    """Why shares that add up to more than the store let keys learn of each other (None: they do not)."""
    if tenants < 2:
        return None
    over = [
        f"{tenants} x {share} {unit} > {whole}"
        for share, whole, unit in (
            (limits.tenant_bytes, limits.max_bytes, "bytes"),
            (limits.tenant_entries, limits.max_entries, "records"),
        )
        if share * tenants > whole
    ]
    if not over:
        return None
    return (
        f"the API keys' storage shares add up to more than the store ({'; '.join(over)}): a key may find the store "
        "full while under its share, and by how much it can still store learn how much the other keys hold. Keep "
        "--storage-tenant-max-bytes/--storage-tenant-max-entries within the store's budget divided by the keys"
    )
