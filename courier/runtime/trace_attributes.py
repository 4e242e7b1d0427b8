"""Span attribute names, in one place so traces stay consistent across actors."""

from __future__ import annotations

ACTOR = "courier.actor"
MESSAGE = "courier.message"
REQUEST_ID = "courier.request_id"
MODEL = "courier.model"
TOKEN_COUNT = "courier.token_count"
FAILURE = "courier.failure"
HTTP_METHOD = "http.request.method"
HTTP_ROUTE = "http.route"
HTTP_STATUS = "http.response.status_code"
URL_PATH = "url.path"
SNAPSHOT_MATCHED = "courier.snapshot.matched_tokens"
SNAPSHOT_ACCEPTED = "courier.snapshot.accepted"
SNAPSHOT_SUPERSEDED = "courier.snapshot.superseded"
SNAPSHOT_FREED_BYTES = "courier.snapshot.freed_bytes"
SNAPSHOT_EVICTED = "courier.snapshot.evicted_lru"
