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
