"""HTTP requests answered, by route, method and status, for `/metrics` (`courier_http_requests_total`); written by
the access layer (`http/access_log.py`) as each request ends.

Bounded by construction: a route is the template the request matched (`/v1/responses/<response_id>`), or
`unmatched`; a method outside the ones HTTP clients use is `other`; a status is one the server answered (`none`:
no answer was begun).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

UNMATCHED = "unmatched"
OTHER_METHOD = "other"
NO_STATUS = "none"
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


@dataclass(slots=True)
class HttpRequestCounts:
    counts: Counter[tuple[str, str, str]] = field(default_factory=Counter)

    def count(self, route: str | None, method: str, status: int | None) -> None:
        key = (
            route or UNMATCHED,
            method if method in METHODS else OTHER_METHOD,
            str(status) if status is not None else NO_STATUS,
        )
        self.counts[key] += 1
