"""The machine-readable reason of every failure the server answers with: `error.code` in OpenAI's envelope.

One enum for all of them, so control flow compares members rather than strings and
a client-facing code is spelled in one place. Every error envelope carries one (`http/errors.py` gives a failure
raised without its own the status's), never `null`. A `StrEnum`: it serializes, formats
and compares as its value (`FailureCode.SHUTTING_DOWN == "shutting_down"`).
"""

from __future__ import annotations

from enum import StrEnum


class FailureCode(StrEnum):
    # The request itself
    INVALID_REQUEST = "invalid_request"  # a 400 with no more particular code: `param` names the field
    INVALID_JSON = "invalid_json"
    INVALID_IMAGE_URL = "invalid_image_url"  # an image part whose URL cannot be read (to a vision model)
    INVALID_API_KEY = "invalid_api_key"
    INSUFFICIENT_PERMISSIONS = "insufficient_permissions"
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    MODEL_NOT_FOUND = "model_not_found"
    MODEL_NOT_MULTIMODAL = "model_not_multimodal"
    # The route asks what the model does not do: an embedding model to generate, a generative one to embed.
    MODEL_NOT_SUPPORTED = "model_not_supported"
    INVALID_COMPACTION_ITEM = "invalid_compaction_item"
    INVALID_ENCRYPTED_CONTENT = "invalid_encrypted_content"  # a sealed reasoning item this server did not seal
    RESPONSE_NOT_CANCELLABLE = "response_not_cancellable"
    STORAGE_BUDGET_EXCEEDED = "storage_budget_exceeded"
    UNSTORABLE_CONTENT = "unstorable_content"  # a record the store cannot hold at all (a NUL in a PostgreSQL id)
    REQUEST_TOO_LARGE = "request_too_large"
    BODY_TIMEOUT = "body_timeout"
    # What it names is not there
    NOT_FOUND = "not_found"
    PREVIOUS_RESPONSE_NOT_FOUND = "previous_response_not_found"
    UNKNOWN_ROUTE = "unknown_route"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    # The server cannot take it now: retry
    QUEUE_FULL = "queue_full"
    OVERLOADED = "overloaded"
    MODEL_LOADING = "model_loading"
    MODEL_NOT_LOADED = "model_not_loaded"  # a figure asked of a model that is not loaded (nothing loads it)
    MODEL_LOAD_FAILED = "model_load_failed"  # a model a request named could not be loaded (tried again later)
    MODEL_TOO_LARGE = "model_too_large"  # it cannot fit --models-memory-bytes beside the models that must stay
    SHUTTING_DOWN = "shutting_down"
    SERVICE_UNAVAILABLE = "service_unavailable"
    STORAGE_UNAVAILABLE = "storage_unavailable"  # the database cannot be written (a full disk, an I/O error)
    # It was taken and failed
    GENERATION_FAILED = "generation_failed"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    COMPACTION_FAILED = "compaction_failed"
    INTERNAL_ERROR = "internal_error"
    STORED_RECORD_DAMAGED = "stored_record_damaged"  # this one record cannot be read back; others can
