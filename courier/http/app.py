"""The Quart application: routes per API family, each family's error envelope, request spans."""

from __future__ import annotations

import logging
from typing import Any

from quart import Quart, Response, current_app, g, request, websocket
from werkzeug.exceptions import HTTPException

from courier.core.failure_codes import FailureCode
from courier.http.access_log import AccessLogMiddleware, note_route, note_tenant
from courier.http.anthropic import models as anthropic_models
from courier.http.anthropic import routes as anthropic_routes
from courier.http.context import AppContext
from courier.http.cors import CorsMiddleware, CorsPolicy
from courier.http.errors import ApiError, Envelope
from courier.http.model_leases import ModelLeaseScope
from courier.http.request_id import RequestIdMiddleware
from courier.http.routes import (
    cache,
    chat,
    completions,
    conversations,
    embeddings,
    health,
    metrics,
    models,
    openapi,
    responses,
    tokenize,
)
from courier.http.tracing_middleware import TracingMiddleware, name_request_span
from courier.messages.asking import Refused

logger = logging.getLogger(__name__)

REPLICA_HEADER = "X-Courier-Replica"
VERSION_PREFIX = "/v1"
UNVERSIONED_SUFFIX = "_unversioned"  # the name of a family's registration without /v1: `chat_unversioned`
MODEL_FAMILIES = (models.BLUEPRINT, models.LOADING_BLUEPRINT)


def create_app(context: AppContext) -> Any:
    """The ASGI application Hypercorn serves: the Quart app inside the request-span middleware, and inside the CORS
    layer when `--cors-allow-origins` lists any (so a preflight answered there has its span too); between them the
    request's id (on its span and response) and the access log, so each line carries both ids."""
    app: Any = ModelLeaseScope(create_quart_app(context))  # a request's models held until its response ends
    cors = CorsPolicy.from_setting(context.settings.cors_allow_origins)
    if cors is not None:
        app = CorsMiddleware(app, cors)
    root = context.settings.api_prefix
    app = AccessLogMiddleware(
        app,
        quiet_paths=(f"{root}/health", f"{root}/metrics"),
        counts=context.state.http_requests,
        write_lines=context.settings.access_log,
    )
    return TracingMiddleware(RequestIdMiddleware(app))


def create_quart_app(context: AppContext) -> Quart:
    app = Quart("courier", static_folder=None)
    app.config["MAX_CONTENT_LENGTH"] = context.settings.max_body_bytes
    # Streams run as long as the request deadline allows; Quart's own 60 s limit would cut them.
    app.config["RESPONSE_TIMEOUT"] = None
    # A body must arrive whole within --body-timeout, however slowly it trickles in (408 beyond).
    app.config["BODY_TIMEOUT"] = context.settings.body_timeout
    _register_routes(app, context)

    open_routes = {f"{context.settings.api_prefix}/health"}
    if context.settings.public_metrics:
        open_routes.add(f"{context.settings.api_prefix}/metrics")

    @app.before_request
    async def name_span_and_authenticate() -> None:
        rule = request.url_rule.rule if request.url_rule is not None else None
        if rule is not None:
            name_request_span(request.method, rule)
            note_route(rule)
        if rule not in open_routes:  # an unknown route too: no probing for routes without a key
            # Anthropic's clients send their key as `x-api-key`: taken where they are answered in Anthropic's shapes.
            api_key = request.headers.get("x-api-key") if _envelope() is Envelope.ANTHROPIC else None
            g.caller = context.api_keys.caller(request.headers.get("Authorization"), api_key)
            note_tenant(g.caller.tenant)

    @app.before_websocket
    async def note_the_websockets_route() -> None:
        if websocket.url_rule is not None:
            note_route(websocket.url_rule.rule)

    replica = context.settings.replica_id
    if replica is not None:

        @app.after_request
        async def name_the_replica(response: Response) -> Response:
            # Which replica answered, for an operator checking affinity through a front (errors and streams too).
            response.headers[REPLICA_HEADER] = replica
            return response

    @app.errorhandler(ApiError)
    async def api_error(error: ApiError) -> Response:
        return _for_the_model(error, context).response(_envelope())

    @app.errorhandler(Refused)
    async def refused(error: Refused) -> Response:
        return ApiError.from_failure(error.failure).response(_envelope())

    @app.errorhandler(HTTPException)
    async def http_error(error: HTTPException) -> Response:
        response = _from_http_exception(error, context).response(_envelope())
        if error.code in (408, 413):
            # The rest of the body is never read, so this connection cannot carry another request: say so, or a
            # keep-alive client would send its next request into a closed connection.
            response.headers["Connection"] = "close"
        return response

    @app.errorhandler(Exception)
    async def unexpected_error(error: Exception) -> Response:
        logger.exception("unhandled error in %s %s", request.method, request.path)
        return ApiError(
            500, f"internal server error: {type(error).__name__}", code=FailureCode.INTERNAL_ERROR
        ).response(_envelope())

    return app


def _register_routes(app: Quart, context: AppContext) -> None:
    """Every route is declared once, without `/v1`: here each family is put under `/v1`, beside it, or both, all
    beneath `--api-prefix`. A family served twice is registered twice, the second time under a name of its own."""
    root = context.settings.api_prefix
    versioned = f"{root}{VERSION_PREFIX}"
    # OpenAI's families: under /v1, and without it too, for OpenAI clients given a base URL that omits it.
    for routes in (
        models.blueprint(context),
        chat.blueprint(context),
        completions.blueprint(context),
        responses.blueprint(context),
        embeddings.blueprint(context),
        conversations.blueprint(context),
    ):
        app.register_blueprint(routes, url_prefix=versioned)
        app.register_blueprint(routes, url_prefix=root or None, name=f"{routes.name}{UNVERSIONED_SUFFIX}")
    # Under /v1 only: Anthropic's Messages API (its clients add /v1 themselves), an operator's loads and cache.
    for routes in (models.loading_blueprint(context), cache.blueprint(context), anthropic_routes.blueprint(context)):
        app.register_blueprint(routes, url_prefix=versioned)
    # Beside /v1 only: a prober's and a scraper's routes, vLLM's tokenizer routes, the API's document.
    for routes in (
        health.blueprint(context),
        metrics.blueprint(context),
        tokenize.blueprint(context),
        openapi.blueprint(context),
    ):
        app.register_blueprint(routes, url_prefix=root or None)


def _for_the_model(error: ApiError, context: AppContext) -> ApiError:
    """An image URL that cannot be read, sent to a model that takes no images: what matters is the latter."""
    if error.code is not FailureCode.INVALID_IMAGE_URL or context.state.model is None:
        return error
    if context.state.model.accepts_images:
        return error
    model = context.state.model.model_id
    message = f"The model '{model}' accepts text only, and {error.param} is an image ({error.message})"
    return ApiError.invalid(message, param=error.param, code=FailureCode.MODEL_NOT_MULTIMODAL)


def _envelope() -> Envelope:
    """Anthropic's error envelope on the Messages API's routes, and on the model routes and on no route (an unknown
    path or method: `messages.batches`, say) when an Anthropic client asks (it sends `anthropic-version`); OpenAI's
    on every other."""
    family = _family()
    if family == anthropic_routes.BLUEPRINT:
        return Envelope.ANTHROPIC
    if (family is None or family in MODEL_FAMILIES) and anthropic_models.wants_anthropic_shape(request.headers):
        return Envelope.ANTHROPIC
    return Envelope.OPENAI


def _family() -> str | None:
    """The API family of the request's route: its blueprint's own name, whichever of its registrations matched."""
    if request.blueprint is None:  # no route matched
        return None
    family: str = current_app.blueprints[request.blueprint].name
    return family


def _from_http_exception(error: HTTPException, context: AppContext) -> ApiError:
    status = error.code or 500
    if status == 404:
        return ApiError(404, f"Unknown route: {request.method} {request.path}", code=FailureCode.UNKNOWN_ROUTE)
    if status == 405:
        return ApiError(
            405, f"Method {request.method} is not allowed on {request.path}", code=FailureCode.METHOD_NOT_ALLOWED
        )
    if status == 413:
        limit = context.settings.max_body_bytes
        return ApiError(413, f"The request body exceeds the limit of {limit} bytes", code=FailureCode.REQUEST_TOO_LARGE)
    if status == 408:
        limit_s = context.settings.body_timeout
        message = f"The request body did not arrive within {limit_s:g} s (--body-timeout)"
        return ApiError(408, message, code=FailureCode.BODY_TIMEOUT)
    return ApiError(status, error.description or error.name)
