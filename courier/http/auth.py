"""API keys: who is calling, checked on every route but `/health` (and `/metrics` with `--public-metrics`).

A key arrives as `Authorization: Bearer KEY` (OpenAI's clients; Anthropic's too with a bearer token), or on the
Messages API's routes as `x-api-key: KEY` (Anthropic's clients).

Keys come from `--api-key`, `--api-key-file` and `--admin-api-key`. Only their
SHA-256 digests are kept; a presented key is hashed and compared with every stored
digest in constant time (`hmac.compare_digest`, no early exit), so the answer's
timing says nothing about which key was close. A caller is known by its tenant: a
short digest of its key, under which its stored responses, conversations and
prompt-cache sessions live, so another key can neither read nor join them. Without
keys every caller is the one anonymous tenant "" and may do everything.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from dataclasses import dataclass

from courier.core.failure_codes import FailureCode
from courier.http.errors import ApiError

ANONYMOUS = ""
TENANT_DIGITS = 16
BEARER = "bearer "


@dataclass(frozen=True, slots=True, kw_only=True)
class Caller:
    tenant: str  # "" without keys
    admin: bool


ANYONE = Caller(tenant=ANONYMOUS, admin=True)


class ApiKeys:
    def __init__(self, client_keys: Iterable[str], admin_keys: Iterable[str] = ()) -> None:
        admins = {_digest(key) for key in admin_keys if key}
        clients = {_digest(key) for key in client_keys if key} | admins
        self._known = sorted((digest, digest in admins) for digest in clients)

    @property
    def enabled(self) -> bool:
        return bool(self._known)

    def __len__(self) -> int:
        return len(self._known)

    def caller(self, authorization: str | None, api_key: str | None = None) -> Caller:
        """The caller `Authorization: Bearer KEY` names, else the one `x-api-key: KEY` names (how Anthropic's clients
        send it; Claude Code sends Bearer only with ANTHROPIC_AUTH_TOKEN); a missing or unknown key raises a 401."""
        if not self.enabled:
            return ANYONE
        if authorization is not None and authorization.lower().startswith(BEARER):
            key = authorization[len(BEARER) :].strip()
        elif api_key is not None:
            key = api_key.strip()
        else:
            raise _unauthorized(
                "You didn't provide an API key. Send it in the Authorization header (`Authorization: Bearer KEY`) "
                "or in `x-api-key: KEY`."
            )
        presented = _digest(key)
        found: Caller | None = None
        for digest, admin in self._known:  # every digest compared: the time taken says nothing of a near match
            if hmac.compare_digest(digest, presented):
                found = Caller(tenant=digest[:TENANT_DIGITS], admin=admin)
        if found is None:
            raise _unauthorized("Incorrect API key provided.")
        return found


def parse_keys(text: str | None) -> list[str]:
    """`--api-key a,b` -> ["a", "b"] (spaces around each key dropped)."""
    return [key.strip() for key in (text or "").split(",") if key.strip()]


def keys_in_file(text: str) -> list[str]:
    """One key per line; blank lines and `#` comments ignored."""
    return [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]


def require_admin(caller: Caller) -> None:
    if not caller.admin:
        raise ApiError(
            403,
            "This operation needs an admin key (--admin-api-key).",
            code=FailureCode.INSUFFICIENT_PERMISSIONS,
            error_type="permission_error",
        )


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def _unauthorized(message: str) -> ApiError:
    return ApiError(401, message, code=FailureCode.INVALID_API_KEY, headers={"WWW-Authenticate": "Bearer"})
