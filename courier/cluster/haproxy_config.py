"""An HAProxy (2.6+) configuration for Courier replicas: conversation affinity, health checks, SSE-safe timeouts.

Routing, in order, in one backend whose servers are the replicas (named by their `--replica-id`):
(a) a response id's routing token (`resp_<replica>.<hex>`, `conversation/ids.py`), from a path
`/responses/{id}[/...]` or else the body's `previous_response_id`: `use-server` to that replica,
a rule HAProxy skips while the replica is down; (b) otherwise `balance hash` with `hash-type
consistent` on the first of the body's `prompt_cache_key`, `conversation` (its id), `user`, or
the response id itself, so a replica going down moves only its own keys, and
`hash-balance-factor` bounds any replica's load at that factor of the average; (c) a request
with no key has no hash data, and HAProxy then goes round robin, within the same load bound.
One backend rather than a hashing and a least-connection one: one server per replica means
one load count that keyed and unkeyed requests both see, and one health check per replica.

Replicas may serve different models (`Replica.models`). Then the front reads the body's `model` first: a model
some replica lists goes to a backend of its own whose servers are the replicas that serve it (those listing it,
and those listing nothing, which serve any), routed within it by (a) to (c) as above; exact names are matched
before names ending in `*` (prefixes), as a replica matches its own names. A request naming no model, or one no
replica lists, goes to the backend of every replica. A model backend's servers `track` the main backend's, so each
replica is still health-checked once.

The body is JSON, so the front reads it before routing (`option http-buffer-request`) into a buffer
(`tune.bufsize`) that holds the request's headers and the first `route_body_bytes` of its body; a field past them
is not seen. Every request pays for the buffer's size, whatever its body's: on Debian's HAProxy 2.6 about 1 ms of
HAProxy's CPU per MiB of buffer, and ~48 ms at Courier's 32 MiB body limit, which is past glibc's largest reused
allocation, so each request maps and faults in a fresh buffer (bench/front_buffer.py, docs/deploy.md). So by
default the front reads the first 2 MiB (DEFAULT_ROUTE_BODY_BYTES), more than agents' text bodies at a local
model's context: a key it does not see costs that request its replica's cache, not its answer. Where replicas
serve different models, the model decides which replica can answer at all, and the front reads the whole body (up
to --max-body-bytes) by default. Each log line says how much of the body routing read, of its Content-Length
(`body=READ/SIZE`; SIZE is - for a chunked body).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from courier.cluster.replicas import Replica
from courier.conversation.ids import RESPONSE_PREFIX, TOKEN_SEPARATOR
from courier.settings import Settings

COURIER_DEFAULTS = Settings()
# How much of a body the front reads to route it, where every replica serves every model (module docstring).
DEFAULT_ROUTE_BODY_BYTES = 2 * 1024 * 1024
# Room for a request's line and headers besides its body, and the part of a buffer HAProxy keeps back for
# rewriting headers (tune.maxrewrite, 1024 by default).
HEADER_ROOM_BYTES = 64 * 1024
REWRITE_ROOM_BYTES = 1024
# Past Courier's own request deadline, so Courier, not the front, is the one that times a request out.
TIMEOUT_MARGIN_S = 30.0
BACKEND = "courier_replicas"
# The body fields that name a conversation, best first; `$.conversation.id` before `$.conversation`, which is either
# the id or an object holding it.
KEY_FIELDS = ("prompt_cache_key", "conversation.id", "conversation", "user")


@dataclass(frozen=True, slots=True, kw_only=True)
class FrontOptions:
    bind: str = "0.0.0.0"
    port: int = 8080
    max_body_bytes: int = COURIER_DEFAULTS.max_body_bytes  # the replicas' --max-body-bytes
    # How much of a body the front reads for its routing fields (at most max_body_bytes); None: 2 MiB, or the whole
    # body where replicas serve different models (`routed_body_bytes`).
    route_body_bytes: int | None = None
    request_timeout_s: float = COURIER_DEFAULTS.request_timeout  # the replicas' --request-timeout
    body_timeout_s: float = COURIER_DEFAULTS.body_timeout  # the replicas' --body-timeout
    api_prefix: str = COURIER_DEFAULTS.api_prefix  # the replicas' --api-prefix: where /health is
    # hash-balance-factor: no replica takes more than this % of the average load; 0: no bound. Counted in requests
    # in flight, so 150 (HAProxy's suggestion) already moves a key whose replica serves one request at low load.
    balance_factor: int = 300
    check_interval_s: float = 2.0
    stats_socket: Path | None = None
    # False: plain round robin, no routing by id or key (the baseline bench/cluster.py measures affinity against).
    affinity: bool = True

    def __post_init__(self) -> None:
        if self.route_body_bytes is not None and self.route_body_bytes <= 0:
            raise ValueError(f"the front reads a positive number of body bytes to route, not {self.route_body_bytes}")
        if self.balance_factor != 0 and self.balance_factor <= 100:
            factor = self.balance_factor
            raise ValueError(
                f"a balance factor is a percentage of the average load above 100, or 0 for no bound: {factor}"
            )

    def routed_body_bytes(self, per_model: bool) -> int:
        """How much of a body the front reads to route it; `per_model`: replicas serve different models."""
        if self.route_body_bytes is not None:
            return min(self.route_body_bytes, self.max_body_bytes)
        return self.max_body_bytes if per_model else min(DEFAULT_ROUTE_BODY_BYTES, self.max_body_bytes)


# HAProxy's own id of a request: client and front address and port, accept time, request counter, pid, in hex.
UNIQUE_ID_FORMAT = "%{+X}o%ci:%cp_%fi:%fp_%Ts_%rt:%pid"
# `option httplog`'s format, to which each line's request id is added.
HTTP_LOG_FORMAT = (
    "%ci:%cp [%tr] %ft %b/%s %TR/%Tw/%Tc/%Tr/%Ta %ST %B %CC %CS %tsc %ac/%fc/%bc/%sc/%rc %sq/%bq %hr %hs %{+Q}r"
)


def haproxy_config(replicas: Sequence[Replica], options: FrontOptions) -> str:
    """The configuration text: `haproxy -f FILE` serves it on `options.bind:options.port`."""
    names = ", ".join(replica.name for replica in replicas)
    routes = model_routes(replicas)
    sections = [
        [
            f"# Courier front for {len(replicas)} replica(s): {names}.",
            "# Generated by `courier cluster haproxy-config`; docs/deploy.md, 'Replicas behind HAProxy'.",
        ],
        _global(options, per_model=bool(routes)),
        _defaults(options),
        [
            "frontend courier",
            f"    bind {options.bind}:{options.port}",
            "    # The request's id replaces any X-Request-Id the client sent: the replica keeps it as its own (its",
            "    # responses' x-request-id, its access log's id=), so this log's line and the replica's share it. An",
            "    # answer the front makes itself (no replica up, a timeout) carries it too.",
            "    http-request set-header X-Request-Id %[unique-id]",
            "    http-after-response set-header x-request-id %[unique-id] unless { res.hdr(x-request-id) -m found }",
            "    http-after-response set-header request-id %[unique-id] unless { res.hdr(request-id) -m found }",
            "    # How much of the body routing read, and its declared size, for the log line (body=READ/SIZE; SIZE is",
            "    # the Content-Length, - for a chunked body).",
            "    http-request set-var(txn.courier_body_read) req.body_len",
            "    http-request set-var(txn.courier_body_size) req.hdr(content-length)",
            *_model_rules(routes),
            f"    default_backend {BACKEND}",
        ],
        _backend(replicas, options),
        *(_model_backend(route, options) for route in routes),
    ]
    return "\n\n".join("\n".join(lines) for lines in sections) + "\n"


def _global(options: FrontOptions, *, per_model: bool) -> list[str]:
    routed = options.routed_body_bytes(per_model)
    whole = "--max-body-bytes: all of it" if routed == options.max_body_bytes else "a field past them is not seen"
    lines = [
        "global",
        "    log stdout format raw local0 info",
        f"    # Routing reads JSON fields in a body's first {routed} bytes ({whole}),",
        "    # held with the headers in one buffer, whose size every request pays for.",
        f"    tune.bufsize {_buffer_bytes(routed)}",
        f"    tune.maxrewrite {REWRITE_ROOM_BYTES}",
    ]
    if options.stats_socket is not None:
        lines.append(f"    stats socket {options.stats_socket} mode 600 level admin")
    return lines


def _buffer_bytes(routed_body_bytes: int) -> int:
    """A buffer for a request's headers and its routed body bytes, rounded up to HAProxy's 16-byte unit."""
    size = routed_body_bytes + HEADER_ROOM_BYTES + REWRITE_ROOM_BYTES
    return -(-size // 16) * 16


def _defaults(options: FrontOptions) -> list[str]:
    exchange_s = _seconds(options.request_timeout_s + TIMEOUT_MARGIN_S)
    return [
        "defaults",
        "    mode http",
        "    log global",
        "    # Each request's id (the frontend sends it on to the replica as X-Request-Id), in this log's lines.",
        f"    unique-id-format {UNIQUE_ID_FORMAT}",
        f'    log-format "{HTTP_LOG_FORMAT} id=%ID body=%[var(txn.courier_body_read)]/%[var(txn.courier_body_size)]"',
        "    option forwardfor",
        "    # Routing reads the body: wait for all of it (the client has --body-timeout to send it).",
        "    option http-buffer-request",
        f"    timeout http-request {_seconds(options.body_timeout_s)}s",
        "    # One connection to a replica per request: a replica that begins draining stops accepting at once, so a",
        "    # request sent after that is refused at connect and retried elsewhere, instead of reaching it on a",
        "    # connection kept from before and getting its 503. (A connect on a LAN costs far less than a prefill.)",
        "    option http-server-close",
        "    # Server-sent events go out as they come, not held back to fill packets.",
        "    option http-no-delay",
        "    # A non-streamed answer is silent until done (up to --request-timeout) and a stream lasts as long: the",
        "    # front never cuts either first. Keep-alive stays on; each request is routed on its own.",
        f"    timeout client {exchange_s}s",
        f"    timeout server {exchange_s}s",
        f"    timeout tunnel {exchange_s}s",
        "    timeout connect 5s",
        "    timeout queue 30s",
        "    timeout http-keep-alive 10s",
        "    timeout check 5s",
        "    # A request that reached no replica, or got nothing back, is sent again, each time to another replica.",
        "    # Never one that got an answer, a 503 included: the replica may have stored what it did.",
        "    retries 3",
        "    retry-on conn-failure empty-response",
        "    option redispatch 1",
    ]


def _backend(replicas: Sequence[Replica], options: FrontOptions) -> list[str]:
    routing = _affinity_rules(replicas, options) if options.affinity else ["    balance roundrobin"]
    return [
        f"backend {BACKEND}",
        *routing,
        "    # /health answers 200 only while the replica is ready: loading and draining replicas get nothing new.",
        "    option httpchk",
        f"    http-check send meth GET uri {options.api_prefix}/health ver HTTP/1.1 hdr Host courier-front",
        "    http-check expect status 200",
        f"    default-server check inter {_milliseconds(options.check_interval_s)}ms fall 2 rise 2",
        *(f"    server {r.name} {r.haproxy_address} id {r.ring_id}" for r in replicas),
    ]


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelRoute:
    """Requests naming `model` (a prefix when it ends in *) go to `backend`, whose servers are `replicas`."""

    model: str
    backend: str
    replicas: tuple[Replica, ...]


def model_routes(replicas: Sequence[Replica]) -> list[ModelRoute]:
    """A route per model some replica lists, exact names first, each in the order the replicas list them; none
    when no replica lists a model (every replica serves every model)."""
    listed = list(dict.fromkeys(model for replica in replicas for model in replica.models))
    ordered = [model for model in listed if not model.endswith("*")] + [
        model for model in listed if model.endswith("*")
    ]
    return [
        ModelRoute(
            model=model,
            backend=f"{BACKEND}_model_{index}",
            replicas=tuple(replica for replica in replicas if not replica.models or model in replica.models),
        )
        for index, model in enumerate(ordered, start=1)
    ]


def _model_rules(routes: Sequence[ModelRoute]) -> list[str]:
    if not routes:
        return []
    rules = [
        "    # Replicas serve different models: the body's model picks the backend of the replicas that serve it.",
        "    http-request set-var(txn.courier_model) req.body,json_query('$.model')",
    ]
    for route in routes:
        match = f"-m beg {route.model[:-1]}" if route.model.endswith("*") else f"-m str {route.model}"
        rules.append(f"    use_backend {route.backend} if {{ var(txn.courier_model) {match} }}")
    return rules


def _model_backend(route: ModelRoute, options: FrontOptions) -> list[str]:
    routing = _affinity_rules(route.replicas, options) if options.affinity else ["    balance roundrobin"]
    served_by = ", ".join(replica.name for replica in route.replicas)
    return [
        f"backend {route.backend}",
        f"    # model {route.model}: served by {served_by}; each server's state is its own in {BACKEND}",
        *routing,
        *(f"    server {r.name} {r.haproxy_address} id {r.ring_id} track {BACKEND}/{r.name}" for r in route.replicas),
    ]


def _affinity_rules(replicas: Sequence[Replica], options: FrontOptions) -> list[str]:
    token = f"^{RESPONSE_PREFIX}_[a-z0-9-]{{1,16}}[{TOKEN_SEPARATOR}]"
    return [
        "    # (a) A response id names the replica that made it: the path's /responses/{id}, else the body's",
        "    # previous_response_id. That replica gets the request while it is up (use-server skips a down server).",
        f"    http-request set-var(txn.courier_response) path,regsub(^.*/responses/,),field(1,/)"
        f" if {{ path -m reg /responses/{RESPONSE_PREFIX}_[^/]+ }}",
        "    http-request set-var(txn.courier_response) req.body,json_query('$.previous_response_id')"
        " unless { var(txn.courier_response) -m found }",
        f"    http-request set-var(txn.courier_replica) var(txn.courier_response),field(1,{TOKEN_SEPARATOR}),"
        f"regsub(^{RESPONSE_PREFIX}_,) if {{ var(txn.courier_response) -m reg {token} }}",
        "    # (b) Otherwise the conversation's key, hashed on a consistent ring: a replica that goes down gives up",
        "    # only its own keys, and none takes more than the balance factor times the average load. (c) A request",
        "    # with no key has no hash data: round robin, within the same bound.",
        *_key_rules(),
        *(f"    use-server {r.name} if {{ var(txn.courier_replica) -m str {r.name} }}" for r in replicas),
        "    balance hash var(txn.courier_key)",
        "    hash-type consistent",
        f"    hash-balance-factor {options.balance_factor}",
    ]


def _key_rules() -> list[str]:
    rules = []
    for position, field in enumerate(KEY_FIELDS):
        unless = "" if position == 0 else " unless { var(txn.courier_key) -m found }"
        rules.append(f"    http-request set-var(txn.courier_key) req.body,json_query('$.{field}'){unless}")
    rules.append(
        "    http-request set-var(txn.courier_key) var(txn.courier_response) unless { var(txn.courier_key) -m found }"
    )
    return rules


def _seconds(value: float) -> int:
    return max(1, math.ceil(value))


def _milliseconds(value: float) -> int:
    return max(1, math.ceil(value * 1000))
