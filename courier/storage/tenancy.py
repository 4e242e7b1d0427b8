"""Records that belong to one API key: a tenant's ids are stored under its own key space.

With API keys, every stored response and conversation lives under the key of the
tenant that made it (`tenant/id`), so another tenant asking for the same id finds
nothing (a 404), and a `previous_response_id` chain can only follow its own tenant's
records. The anonymous tenant "" (no keys) stores ids as they are. An id holding the
separator is never a stored key, so no one can name another tenant's record.
"""

from __future__ import annotations

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
