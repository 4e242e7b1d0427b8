"""Multi-token decode steps (prompt-lookup drafts verified in one forward pass, and tokens a grammar forces) on the
embedded SmolLM2, side by side with Courier without them and with mlx-lm, on four greedy workloads."""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import statistics
import sys
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from bench.harness import cli
from bench.harness.clients import (
    Round,
    Streamed,
    async_client,
    burst,
    json_schema_format,
    pooled_tps,
    stream_chat,
    user,
)
from bench.harness.models import (
    FLOAT32,
    WARMUP_PROMPT,
    WEIGHT_LABELS,
    InProcessReference,
    cache_directory,
    float32_dir,
    load_float32,
    load_reference,
    prepare_4bit_dir,
    reference_weights,
    release_mlx_memory,
)
from bench.harness.report import environment, head, inline, num, percent, progress, shown, table, verdict, write_json
from bench.harness.servers import (
    COURIER,
    MLX_LM_F32_KERNELS,
    RUN_ERRORS,
    Launcher,
    Server,
    ServerRecord,
    ServerSpec,
    load_average,
    openblas_missing,
    tuned_flags,
)
from bench.harness.stats import finite_median, ratio
from bench.structured import check_reply
from courier.platform.blas import load_optimized_blas

PARTS = ("single", "aggregate", "chat", "json")
NO_SPEC = "courier-no-spec"
PEER = MLX_LM_F32_KERNELS
IN_PROCESS = "mlx-lm in process"

TARGET_SINGLE_VS_MLX_LM = 1.8  # on (a) and (b)
TARGET_AGGREGATE_VS_NO_SPEC = 1.3
TARGET_CHAT_VS_NO_SPEC = 0.97
TARGET_CONSTRAINED_VS_FREE = 1.0

# A server is idle once its CPU time grows by less than this share of one core over SETTLE_WINDOW_S.
SETTLE_WINDOW_S = 0.5
SETTLE_SHARE = 0.05
SETTLE_LIMIT_S = 20.0
SPECULATIVE_PREFIX = "courier_speculative_"
# Extraction schemas bound their strings and lists, as real ones do (the longest value in these texts: 52 characters).
MAX_STRING = 80
MAX_ITEMS = 4

# ---------------------------------------------------------------- workloads

SOURCE_FILE = '''"""Fetch JSON documents over HTTP, with retries and a simple rate limit."""

import json
import time
import urllib.request

MAX_RETRIES = 3
BASE_DELAY = 0.5
DEFAULT_TIMEOUT = 10.0


class RateLimiter:
    """Allow at most `rate` calls per second."""

    def __init__(self, rate):
        self.rate = rate
        self.last_call = 0.0

    def wait(self):
        interval = 1.0 / self.rate
        elapsed = time.monotonic() - self.last_call
        if elapsed < interval:
            time.sleep(interval - elapsed)
        self.last_call = time.monotonic()


def backoff_delay(attempt):
    """Seconds to wait before the given retry attempt."""
    return BASE_DELAY * (2 ** attempt)


def fetch_json(url, limiter, timeout=DEFAULT_TIMEOUT):
    """Download `url` and decode its body as JSON, retrying on errors."""
    last_error = None
    for attempt in range(MAX_RETRIES):
        limiter.wait()
        try:
            with urllib.request.urlopen(url, timeout=timeout) as response:
                return json.loads(response.read().decode("utf-8"))
        except OSError as error:
            last_error = error
            time.sleep(backoff_delay(attempt))
    raise RuntimeError(f"giving up on {url}: {last_error}")


def fetch_all(urls, rate=2.0):
    """Fetch every URL in order and return the decoded documents."""
    limiter = RateLimiter(rate)
    results = []
    for url in urls:
        results.append(fetch_json(url, limiter))
    return results
'''

EDITS = (
    "MAX_RETRIES = 5",
    "the function backoff_delay renamed to retry_delay",
    "DEFAULT_TIMEOUT changed to 30.0",
    "the class RateLimiter renamed to Throttle",
    "BASE_DELAY = 1.0",
    "the default rate of fetch_all changed to 5.0",
    "the function fetch_json renamed to get_json",
    "the variable last_error renamed to previous_error",
)

DOCUMENT = """Remote Work Policy

Purpose. This policy explains how employees of Harbour Analytics may work away from the office. It applies to \
every permanent and fixed-term employee after their first three months, and it replaces the guidance published in \
2021.

Working hours. Remote employees keep the same contracted hours as in the office. Everyone must be reachable between \
10:00 and 15:00 local time, the core hours, and must record any absence longer than one hour in the shared calendar \
before it starts.

Equipment. The company provides a laptop, a monitor and a headset to each remote employee. Equipment remains \
company property, must be returned within ten days of leaving, and may not be used by family members or for private \
business.

Expenses. Employees may claim up to 30 euros per month towards internet costs and a one-off allowance of 250 euros \
for office furniture. Claims are submitted through the finance portal with receipts, no later than the end of the \
following month.

Security. Work devices must use full-disk encryption and the company VPN at all times. Confidential documents may \
not be printed at home, and any lost or stolen device must be reported to the IT service desk within four hours.

Travel. Employees who work remotely may be asked to attend the office for team days up to twice a month. Travel \
costs for these days are reimbursed at second-class rail fares or 0.25 euros per kilometre by car, whichever is \
lower.

Health and safety. Employees are responsible for a safe workspace at home. The company offers a free video \
assessment of each home workstation, and any injury during working hours must be reported to the line manager the \
same day.

Review. Managers review each remote arrangement once a year with the employee. Either side may end the arrangement \
with one month of notice, after which the employee returns to the office schedule of their team.
"""

QUOTE_TOPICS = ("expenses", "security", "equipment", "working hours", "travel", "health and safety", "review")

CHAT_PROMPTS = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain to a ten-year-old why the sky turns red at sunset.",
    "Write a short story about a robot that learns to paint.",
    "Write a letter from a cat to its owner about the new dog in the house.",
    "Describe a walk through a forest on a cold autumn morning.",
    "Write a short story about a baker whose bread makes people tell the truth.",
    "Give some advice to someone who is starting to learn the piano.",
    "Write a short story about a night train that never reaches its last station.",
)


def code_prompt(index: int) -> str:
    edit = EDITS[index % len(EDITS)]
    return (
        f"Here is a file:\n\n```python\n{SOURCE_FILE}```\n\n"
        f"Rewrite this file with {edit}. Keep everything else the same."
    )


def quote_prompt(index: int) -> str:
    topic = QUOTE_TOPICS[index % len(QUOTE_TOPICS)]
    return f"Document:\n\n{DOCUMENT}\nQuote the paragraph about {topic} from this document exactly, word for word."


def chat_prompt(index: int) -> str:
    return CHAT_PROMPTS[index % len(CHAT_PROMPTS)]


def field_schema(kind: str | dict[str, Any]) -> dict[str, Any]:
    """A JSON type name as a schema (strings bounded, as an extraction schema would bound them), or `kind` itself."""
    if isinstance(kind, dict):
        return kind
    return {"type": kind, "maxLength": MAX_STRING} if kind == "string" else {"type": kind}


def closed_object(fields: dict[str, Any]) -> dict[str, Any]:
    """A strict object schema: every field required, no others; a field's value is a JSON type name or a schema."""
    return {
        "type": "object",
        "properties": {name: field_schema(kind) for name, kind in fields.items()},
        "required": list(fields),
        "additionalProperties": False,
    }


def list_of(fields: dict[str, Any]) -> dict[str, Any]:
    return {"type": "array", "minItems": 1, "maxItems": MAX_ITEMS, "items": closed_object(fields)}


@dataclass(frozen=True, slots=True, kw_only=True)
class ExtractionCase:
    """A text holding values, and a schema whose fields echo them."""

    name: str
    text: str
    schema: dict[str, Any]

    def prompt(self) -> str:
        keys = []
        for key, value in self.schema["properties"].items():
            items = value.get("items", {}).get("properties")
            keys.append(f"{key} (a list of objects with {', '.join(items)})" if items else key)
        return (
            f"{self.text}\n\nExtract the details above as a JSON object with the keys {', '.join(keys)}. "
            "Copy the values exactly as written. Answer with the JSON object only."
        )


EXTRACTION_CASES = (
    ExtractionCase(
        name="invoice",
        text=(
            "INVOICE\nInvoice number: INV-2024-0187\nIssue date: 2024-03-15\nDue date: 2024-04-14\n"
            "From: Northwind Traders Ltd, 8 Canal Wharf, Leeds LS11 5PS\n"
            "Bill to: Contoso Cafe, 42 Harbour Street, Whitby YO21 3PU\n\n"
            "3 x Espresso machine descaler at 12.50 GBP\n2 x Grinder burr set at 48.00 GBP\n"
            "1 x Service visit at 95.00 GBP\n\nSubtotal: 228.50 GBP\nVAT (20%): 45.70 GBP\nTotal due: 274.20 GBP"
        ),
        schema=closed_object(
            {
                "invoice_number": "string",
                "issue_date": "string",
                "due_date": "string",
                "seller": "string",
                "buyer": "string",
                "items": list_of({"description": "string", "quantity": "integer", "unit_price": "number"}),
                "subtotal": "number",
                "vat": "number",
                "total": "number",
                "currency": "string",
            }
        ),
    ),
    ExtractionCase(
        name="contact",
        text=(
            "Dr. Amelia Ortiz\nHead of Research, Lumen Biotech\n221 Kingsland Road, London E2 8AN\n"
            "Phone: +44 20 7946 0381\nMobile: +44 7700 900214\nEmail: amelia.ortiz@lumenbio.example\n"
            "Website: www.lumenbio.example"
        ),
        schema=closed_object(
            {
                "name": "string",
                "title": "string",
                "company": "string",
                "address": "string",
                "phone": "string",
                "mobile": "string",
                "email": "string",
                "website": "string",
            }
        ),
    ),
    ExtractionCase(
        name="order",
        text=(
            "Order #A-55213 placed 2024-06-02 by Jonas Weber (jonas.weber@example.de).\n"
            "Ship to: Jonas Weber, Lindenstrasse 14, 10969 Berlin, Germany.\n"
            "Items: 2 x Trail running shoes, size 44, 129.90 EUR each; 1 x Waterproof jacket, size L, 189.00 EUR; "
            "3 x Merino socks, size 43-46, 14.50 EUR each.\nShipping: express, 9.90 EUR. Order total: 502.20 EUR."
        ),
        schema=closed_object(
            {
                "order_id": "string",
                "date": "string",
                "customer_name": "string",
                "customer_email": "string",
                "shipping_address": "string",
                "items": list_of(
                    {"product": "string", "size": "string", "quantity": "integer", "unit_price": "number"}
                ),
                "shipping_method": "string",
                "shipping_cost": "number",
                "total": "number",
                "currency": "string",
            }
        ),
    ),
    ExtractionCase(
        name="booking",
        text=(
            "Booking reference: QX7P2L\nPassenger: Mei Tanaka\n"
            "Flight: NH 211, London Heathrow (LHR) to Tokyo Haneda (HND)\n"
            "Departure: 2024-09-18 19:15, Terminal 2\nArrival: 2024-09-19 15:40\nSeat: 34K, economy\n"
            "Checked bags: 2 x 23 kg\nFare paid: 1184.60 GBP"
        ),
        schema=closed_object(
            {
                "booking_reference": "string",
                "passenger": "string",
                "flight_number": "string",
                "from_airport": "string",
                "to_airport": "string",
                "departure": "string",
                "arrival": "string",
                "seat": "string",
                "cabin": "string",
                "checked_bags": "integer",
                "fare": "number",
                "currency": "string",
            }
        ),
    ),
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Workload:
    key: str
    title: str
    max_tokens: int
    source: str  # what a reply may copy (its lines count as verbatim); empty when nothing is there to copy


WORKLOADS = {
    "a": Workload(key="a", title="code edit", max_tokens=448, source=SOURCE_FILE),
    "b": Workload(key="b", title="quote", max_tokens=192, source=DOCUMENT),
    "c": Workload(key="c", title="free chat", max_tokens=160, source=""),
    "d": Workload(key="d", title="json extraction", max_tokens=224, source=""),
}
SINGLE_WORKLOADS = ("a", "b", "c")


@dataclass(frozen=True, slots=True, kw_only=True)
class Request:
    """One chat request: a single user message, and the schema a constrained arm sends with it."""

    label: str
    prompt: str
    schema: dict[str, Any] | None = None
    schema_name: str = ""


def requests_for(workload: str, count: int, start: int = 0) -> list[Request]:
    """`count` requests of a workload, the `start`-th first (each index takes the next change, topic or case)."""
    found: list[Request] = []
    for index in range(start, start + count):
        label = f"({workload}) #{index}"
        if workload == "a":
            found.append(Request(label=label, prompt=code_prompt(index)))
        elif workload == "b":
            found.append(Request(label=label, prompt=quote_prompt(index)))
        elif workload == "c":
            found.append(Request(label=label, prompt=chat_prompt(index)))
        else:
            case = EXTRACTION_CASES[index % len(EXTRACTION_CASES)]
            found.append(Request(label=label, prompt=case.prompt(), schema=case.schema, schema_name=case.name))
    return found


def verbatim_share(reply: str, source: str) -> float | None:
    """The share of the reply's non-blank lines that stand, stripped, as lines of `source` (None: nothing to copy)."""
    if not source:
        return None
    known = {line.strip() for line in source.splitlines() if line.strip()}
    lines = [line.strip() for line in reply.splitlines() if line.strip()]
    return sum(1 for line in lines if line in known) / len(lines) if lines else 0.0


# ---------------------------------------------------------------- measuring


@dataclass(frozen=True, slots=True, kw_only=True)
class Counters:
    """Courier's `courier_speculative_*` counters (names as exported, `_total` included), or their growth."""

    values: dict[str, float] = field(default_factory=dict)

    def since(self, before: Counters) -> Counters:
        return Counters(values={name: value - before.values.get(name, 0.0) for name, value in self.values.items()})

    def get(self, name: str) -> float | None:
        return self.values.get(f"{SPECULATIVE_PREFIX}{name}_total")

    @property
    def acceptance(self) -> float | None:
        return ratio(self.get("accepted_tokens"), self.get("drafted_tokens"))

    @property
    def tokens_per_pass(self) -> float | None:
        return ratio(self.get("emitted_tokens"), self.get("steps"))


def summed(counters: Sequence[Counters]) -> Counters:
    names = {name for each in counters for name in each.values}
    return Counters(values={name: sum(each.values.get(name, 0.0) for each in counters) for name in names})


@dataclass(frozen=True, slots=True, kw_only=True)
class Link:
    """A started server with its clients: the `openai` one, and plain HTTP for /metrics."""

    server: Server
    client: openai.AsyncOpenAI
    http: httpx.AsyncClient

    @property
    def name(self) -> str:
        return self.server.spec.name

    async def counters(self) -> Counters:
        """Its speculative counters now; none when it is not Courier or does not export them."""
        if not self.server.spec.is_courier:
            return Counters()
        try:
            response = await self.http.get("/metrics", timeout=30.0)
        except httpx.HTTPError:
            return Counters()
        values: dict[str, float] = {}
        for family in text_string_to_metric_families(response.text if response.status_code == 200 else ""):
            for sample in family.samples:
                if sample.name.startswith(SPECULATIVE_PREFIX) and sample.name.endswith("_total"):
                    values[sample.name] = values.get(sample.name, 0.0) + sample.value
        return Counters(values=values)

    async def ask(self, request: Request, max_tokens: int, *, constrained: bool = False) -> Streamed:
        """One streamed chat completion at temperature 0; a constrained one carries the request's json_schema."""
        schema = json_schema_format(request.schema_name, request.schema) if constrained and request.schema else None
        return await stream_chat(
            self.client,
            self.server.spec.model,
            user(request.prompt),
            max_tokens=max_tokens,
            label=request.label,
            response_format=schema or openai.omit,
        )


async def settle(links: Sequence[Link]) -> None:
    """Wait until every server process is idle (CPU time flat for SETTLE_WINDOW_S, at most SETTLE_LIMIT_S), so that
    no server's work after a request lands in the next measurement."""
    started = time.monotonic()
    while time.monotonic() - started < SETTLE_LIMIT_S:
        before = [link.server.cpu_seconds() for link in links]
        await asyncio.sleep(SETTLE_WINDOW_S)
        grown = max(link.server.cpu_seconds() - cpu for link, cpu in zip(links, before, strict=True))
        if grown < SETTLE_SHARE * SETTLE_WINDOW_S:
            return


@dataclass(frozen=True, slots=True, kw_only=True)
class InProcessRun:
    """mlx-lm's `stream_generate` in this process: the HTTP formula's decode rate, and mlx-lm's own figure."""

    workload: str
    label: str
    decode_tps: float
    generation_tps: float
    completion_tokens: int


@dataclass(frozen=True, slots=True, kw_only=True)
class SingleRun:
    """One single-stream request to one server."""

    server: str
    workload: str
    reply: Streamed
    counters: Counters


@dataclass(frozen=True, slots=True, kw_only=True)
class MeasuredRound:
    """One arm's requests sent together (`round.valid_json` for a constrained arm), and the counters' growth."""

    round: Round
    counters: Counters


@dataclass(frozen=True, slots=True, kw_only=True)
class Comparison:
    """Two arms (`arms[0]` / `arms[1]`) over the same requests, rounds alternating."""

    part: str
    streams: int
    arms: tuple[str, str]
    target: float
    rounds: list[MeasuredRound] = field(default_factory=list)

    def pooled_tps(self, arm: str) -> float:
        return pooled_tps([measured.round for measured in self.rounds], arm)

    @property
    def ratio(self) -> float:
        theirs = self.pooled_tps(self.arms[1])
        return self.pooled_tps(self.arms[0]) / theirs if theirs else math.nan

    def counters(self, arm: str) -> Counters:
        return summed([measured.counters for measured in self.rounds if measured.round.arm == arm])


@dataclass(slots=True, kw_only=True)
class Report:
    environment: dict[str, object]
    settings: dict[str, object]
    servers: list[ServerRecord] = field(default_factory=list)
    in_process: list[InProcessRun] = field(default_factory=list)
    single: list[SingleRun] = field(default_factory=list)
    comparisons: list[Comparison] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # parts that stopped on a failed request
    load_at_parts: dict[str, float | None] = field(default_factory=dict)


def cap(args: argparse.Namespace, workload: str) -> int:
    """max_tokens for a workload's requests: `--max-tokens` when given, else the workload's own."""
    return int(args.max_tokens or WORKLOADS[workload].max_tokens)


# ---------------------------------------------------------------- parts


def measure_in_process(dir4: Path, cache_dir: Path, args: argparse.Namespace, report: Report) -> Path | None:
    """mlx-lm's `stream_generate` on the single part's requests, in this process on the weights `--weights` names;
    writes float32 weights as a model directory for mlx_lm.server when it runs (returned)."""
    weights = reference_weights(args.weights)
    progress(f"single, {IN_PROCESS}: loading {dir4}: {WEIGHT_LABELS[weights]}")
    model, tokenizer = load_reference(dir4, weights)
    dir_f32 = None
    if args.peer:
        dir_f32 = float32_dir(dir4, cache_dir, model if weights == FLOAT32 else load_float32(dir4)[0])
        progress(f"float32 directory for {PEER}: {dir_f32}")
    reference = InProcessReference(model, tokenizer)
    for repeat in range(args.repeats):
        for key in args.workloads:
            request = requests_for(key, 1, repeat)[0]
            run = reference.run(request.prompt, cap(args, key))
            report.in_process.append(
                InProcessRun(
                    workload=key,
                    label=request.label,
                    decode_tps=run.decode_tps,
                    generation_tps=run.generation_tps,
                    completion_tokens=run.completion_tokens,
                )
            )
            progress(
                f"single, {IN_PROCESS}, {request.label}: {run.completion_tokens} tokens, {run.decode_tps:.1f} tok/s"
            )
    return dir_f32


async def part_single(links: dict[str, Link], args: argparse.Namespace, report: Report) -> None:
    """Each request to each server in turn, the first server rotating, every server idle before each."""
    names = [name for name in (COURIER, NO_SPEC, PEER) if name in links]
    for repeat in range(args.repeats):
        for position, key in enumerate(args.workloads):
            request = requests_for(key, 1, repeat)[0]
            shift = (repeat * len(args.workloads) + position) % len(names)
            for name in names[shift:] + names[:shift]:
                await settle(list(links.values()))
                before = await links[name].counters()
                reply = await links[name].ask(request, cap(args, key))
                counters = (await links[name].counters()).since(before)
                report.single.append(SingleRun(server=name, workload=key, reply=reply, counters=counters))
                progress(
                    f"single, {name}, {request.label}: {reply.completion_tokens} tokens, {reply.decode_tps:.1f} "
                    f"tok/s, TTFT {reply.ttft_s:.2f} s"
                )


COMPARED_PARTS: dict[str, tuple[str, float]] = {  # part: its workload and the target of its ratio
    "aggregate": ("a", TARGET_AGGREGATE_VS_NO_SPEC),
    "chat": ("c", TARGET_CHAT_VS_NO_SPEC),
    "json": ("d", TARGET_CONSTRAINED_VS_FREE),
}
PART_SERVERS: dict[str, tuple[str, ...]] = {
    "single": (COURIER, NO_SPEC),
    "aggregate": (COURIER, NO_SPEC),
    "chat": (COURIER, NO_SPEC),
    "json": (COURIER,),
}


async def part_compared(part: str, links: dict[str, Link], args: argparse.Namespace, report: Report) -> None:
    """`aggregate` at --streams, `chat` and `json` at 1 stream and at --streams: Courier against Courier without
    speculation, or (json) constrained against free text on Courier; `--rounds` rounds, the arms' order reversed
    every round. Every distinct prompt is first sent once to each arm with max_tokens 1 (a warm prompt cache, and
    compiled grammars)."""
    workload, target = COMPARED_PARTS[part]
    if part == "json":
        arms = (("constrained", links[COURIER], True), ("free", links[COURIER], False))
    else:
        arms = ((COURIER, links[COURIER], False), (NO_SPEC, links[NO_SPEC], False))
    for streams in [args.streams] if part == "aggregate" else sorted({1, args.streams}):
        # Round r takes the requests after round r-1's: at 1 stream each round has another prompt; at 8 the
        # workload's prompts come round again (8 changes, 8 stories, 4 extraction cases).
        rounds = [requests_for(workload, streams, index * streams) for index in range(args.rounds)]
        comparison = Comparison(part=part, streams=streams, arms=(arms[0][0], arms[1][0]), target=target)
        report.comparisons.append(comparison)  # kept with the rounds it has when a later one fails
        distinct = list({request.prompt: request for requests in rounds for request in requests}.values())
        for _, link, constrained in arms:
            await asyncio.gather(*(link.ask(request, 1, constrained=constrained) for request in distinct))
        for index, requests in enumerate(rounds, start=1):
            for arm, link, constrained in arms if index % 2 else arms[::-1]:
                await settle(list(links.values()))
                before = await link.counters()
                done = await burst(
                    [link.ask(request, cap(args, workload), constrained=constrained) for request in requests]
                )
                counters = (await link.counters()).since(before)
                valid = None
                if constrained:
                    valid = sum(
                        check_reply(s.text, r.schema)[1]
                        for s, r in zip(done.streams, requests, strict=True)
                        if r.schema
                    )
                comparison.rounds.append(
                    MeasuredRound(round=Round(arm=arm, index=index, burst=done, valid_json=valid), counters=counters)
                )
                progress(
                    f"{part}, {streams} stream(s), round {index}, {arm}: {done.completion_tokens} tokens in "
                    f"{done.wall_s:.2f} s = {done.tps:.1f} tok/s"
                )


async def run_parts(servers: dict[str, Server], args: argparse.Namespace, report: Report) -> None:
    """Warm each server up, then the parts in order; a part whose request fails is recorded and the next goes on."""
    links = {
        name: Link(
            server=server, client=async_client(server.base_url), http=httpx.AsyncClient(base_url=server.base_url)
        )
        for name, server in servers.items()
    }
    try:
        for name, link in links.items():
            try:
                await link.ask(Request(label="warm-up", prompt=WARMUP_PROMPT), 8)
            except RUN_ERRORS as error:
                report.errors.append(f"{name}: warm-up failed: {type(error).__name__}: {error}")
        for part in args.parts:
            if missing := [name for name in PART_SERVERS[part] if name not in links]:
                report.errors.append(f"{part}: not run, {', '.join(missing)} did not start")
                continue
            report.load_at_parts[part] = load_average()
            progress(f"part {part} (load {report.load_at_parts[part]})")
            try:
                if part == "single":
                    await part_single(links, args, report)
                else:
                    await part_compared(part, links, args, report)
            except RUN_ERRORS as error:
                report.errors.append(f"{part}: {type(error).__name__}: {error}")
                progress(f"{part}: FAILED: {report.errors[-1]}")
    finally:
        for link in links.values():
            await link.client.close()
            await link.http.aclose()


# ---------------------------------------------------------------- report


def single_rows(report: Report, workload: str) -> list[tuple[str, list[float], list[int], list[SingleRun]]]:
    """Per server (mlx-lm in process first): decode rates, completion tokens, and the HTTP runs."""
    rows: list[tuple[str, list[float], list[int], list[SingleRun]]] = []
    if own := [run for run in report.in_process if run.workload == workload]:
        rows.append((IN_PROCESS, [run.decode_tps for run in own], [run.completion_tokens for run in own], []))
    for name in (COURIER, NO_SPEC, PEER):
        if runs := [run for run in report.single if run.server == name and run.workload == workload]:
            rows.append(
                (name, [run.reply.decode_tps for run in runs], [run.reply.completion_tokens for run in runs], runs)
            )
    return rows


def measured_workloads(report: Report) -> list[str]:
    """The single part's workloads that have runs, in order."""
    measured = {run.workload for run in report.in_process} | {run.workload for run in report.single}
    return [key for key in SINGLE_WORKLOADS if key in measured]


def median_tps(report: Report, name: str, workload: str) -> float | None:
    return next((finite_median(rates) for row, rates, _, _ in single_rows(report, workload) if row == name), None)


def identical(report: Report, workload: str) -> str:
    """Whether Courier with and without speculation returned the same text for every request of a workload."""
    texts = {(run.server, run.reply.label): run.reply.text for run in report.single if run.workload == workload}
    pairs = [
        (text, texts[NO_SPEC, label])
        for (name, label), text in texts.items()
        if name == COURIER and (NO_SPEC, label) in texts
    ]
    if not pairs:
        return "n/a"
    same = sum(a == b for a, b in pairs)
    return f"{'yes' if same == len(pairs) else 'NO'} ({same}/{len(pairs)})"


def print_single(report: Report) -> None:
    print(f"### Single stream: {', '.join(f'({key}) {WORKLOADS[key].title}' for key in measured_workloads(report))}\n")
    print(
        "Decode tok/s = (completion tokens - 1) / (last - first content chunk), median over the requests. "
        "Acceptance and tokens per forward pass from Courier's /metrics around each request.\n"
    )
    rows = []
    for key in measured_workloads(report):
        for name, rates, tokens, runs in single_rows(report, key):
            counters = summed([run.counters for run in runs])
            prompt_tokens = sorted({run.reply.prompt_tokens for run in runs if run.reply.prompt_tokens is not None})
            verbatim = [v for run in runs if (v := verbatim_share(run.reply.text, WORKLOADS[key].source)) is not None]
            courier = bool(runs) and name != PEER
            rows.append(
                f"({key}) {WORKLOADS[key].title} | {name} | {num(finite_median(rates))} "
                f"| {', '.join(num(rate) for rate in rates)} | {tokens} | {prompt_tokens or '-'} "
                f"| {num(finite_median([run.reply.ttft_s for run in runs]), 2) if runs else '-'} "
                f"| {percent(statistics.fmean(verbatim), 0) if verbatim else '-'} "
                f"| {percent(counters.acceptance, 0) if courier else '-'} "
                f"| {num(counters.tokens_per_pass, 2) if courier else '-'}"
            )
    table(
        "workload | server | decode tok/s | per request | completion tokens | prompt tokens | TTFT s | verbatim lines "
        "| acceptance | tokens per pass",
        rows,
    )
    rows = []
    for key in measured_workloads(report):
        ours = median_tps(report, COURIER, key)
        ratios = [num(ratio(ours, median_tps(report, name, key)), 2) for name in (IN_PROCESS, PEER, NO_SPEC)]
        rows.append(f"({key}) {WORKLOADS[key].title} | {num(ours)} | {' | '.join(ratios)} | {identical(report, key)}")
    table(
        "workload | Courier tok/s | / mlx-lm in process | / mlx_lm.server | / Courier without speculation "
        "| identical text with and without",
        rows,
    )
    for key in ("a", "b"):
        ours = median_tps(report, COURIER, key)
        for name, label in ((IN_PROCESS, "mlx-lm `stream_generate` in process"), (PEER, "mlx_lm.server")):
            if (value := ratio(ours, median_tps(report, name, key))) is not None:
                print(f"- ({key}) Courier / {label}: {verdict(value, TARGET_SINGLE_VS_MLX_LM)}")
    for key in measured_workloads(report):
        if sample := next((run.reply for run in report.single if run.server == COURIER and run.workload == key), None):
            print(f"- a Courier reply, {sample.label} ({sample.finish_reason}): {inline(shown(sample.text))}")
    print()


COMPARISON_TITLES = {
    "aggregate": "(a) code edit, Courier against Courier without speculation",
    "chat": "(c) free chat, Courier against Courier without speculation",
    "json": "(d) json extraction on Courier, constrained (json_schema) against free text",
}


def round_row(measured: MeasuredRound) -> str:
    """A round's row: its totals, decode tok/s (median over its streams), TTFT p50, then from /metrics acceptance,
    tokens per pass, verify steps / steps and forced tokens per request."""
    done, counters = measured.round.burst, measured.counters
    steps, verify, forced = counters.get("steps"), counters.get("verify_steps"), counters.get("forced_tokens")
    steps_text = f"{verify:.0f} / {steps:.0f}" if steps is not None and verify is not None else "n/a"
    forced_text = num(forced / len(done.streams), 1) if forced is not None else "n/a"
    valid = measured.round.valid_json
    return (
        f"{measured.round.cells()} | {num(finite_median([s.decode_tps for s in done.streams]))} | {done.ttft(0.5):.2f} "
        f"| {percent(counters.acceptance, 0)} | {num(counters.tokens_per_pass, 2)} | {steps_text} | {forced_text} "
        f"| {f'{valid}/{len(done.streams)}' if valid is not None else '-'}"
    )


def print_comparison(comparison: Comparison, *, explain: bool) -> None:
    print(f"### {COMPARISON_TITLES[comparison.part]}, {comparison.streams} stream(s)\n")
    if explain:
        print(
            "A round's tok/s = its completion tokens / (first request sent .. last stream done); decode tok/s is the "
            "median over its streams. Counters from Courier's /metrics around the round (tokens per forward pass "
            "counts all sequences of the batch).\n"
        )
    table(
        "round | arm | tokens | tokens per stream | capped | wall s | tok/s | decode tok/s | TTFT p50 s "
        "| acceptance | tokens per pass | verify steps / steps | forced per request | valid JSON",
        (round_row(measured) for measured in comparison.rounds),
    )
    for arm in comparison.arms:
        counters = comparison.counters(arm)
        print(
            f"- {arm}: pooled {num(comparison.pooled_tps(arm))} tok/s; acceptance {percent(counters.acceptance, 0)}, "
            f"tokens per forward pass {num(counters.tokens_per_pass, 2)}"
        )
    print(f"- {comparison.arms[0]} / {comparison.arms[1]}: {verdict(comparison.ratio, comparison.target)}")
    for arm in comparison.arms:
        if sample := next((m.round.burst.streams[0] for m in comparison.rounds if m.round.arm == arm), None):
            print(f"- a reply of {arm}, {sample.completion_tokens} tokens: {inline(shown(sample.text))}")
    print()


def print_report(report: Report) -> None:
    head("Courier speculative decoding benchmark", report.environment, report.settings)
    print(f"- 1-minute load average at the start of each part: {report.load_at_parts}\n")
    print("### Servers\n")
    print("\n".join(record.line() for record in report.servers) + "\n")
    if report.in_process or report.single:
        print_single(report)
    for index, comparison in enumerate(report.comparisons):
        print_comparison(comparison, explain=index == 0)
    for error in report.errors:
        print(f"- FAILED: {error}")


# ---------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = cli.parser(__doc__)
    add = parser.add_argument
    add("--parts", type=cli.names(PARTS), default=list(PARTS), help=f"{','.join(PARTS)} (all)")
    add("--repeats", type=cli.positive_int, default=2, help="single: requests per workload and server (2)")
    add("--streams", type=cli.positive_int, default=8, help="aggregate, chat, json: concurrent streams (8)")
    add("--rounds", type=cli.positive_int, default=2, help="aggregate, chat, json: rounds of each arm (2)")
    add("--max-tokens", type=cli.positive_int, default=None, help="max_tokens of every request (default: per workload)")
    add("--no-peer", dest="peer", action="store_false", help=f"single: leave out mlx_lm.server ({PEER})")
    add(
        "--workloads",
        type=cli.names(SINGLE_WORKLOADS, in_given_order=False),
        default=list(SINGLE_WORKLOADS),
        help="single: among a,b,c (all)",
    )
    cli.add_results(parser, openblas=PEER)
    cli.add_weights(parser)
    args = parser.parse_args(argv)
    args.peer = args.peer and "single" in args.parts
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if openblas_missing(args.openblas, args.peer, "--no-peer"):
        return 2
    # Before anything imports MLX, so the in-process model runs on OpenBLAS with the kernels Courier picks.
    os.environ.pop("OPENBLAS_CORETYPE", None)
    blas = load_optimized_blas()
    keys = ("parts", "workloads", "repeats", "streams", "rounds", "max_tokens", "peer", "weights")
    settings = {key: getattr(args, key) for key in keys}
    settings |= {"max_tokens_by_workload": {key: cap(args, key) for key in WORKLOADS}, "kernels": blas.kernels}
    report = Report(environment=environment(blas), settings=settings)
    with cache_directory(args.cache_dir) as cache_dir:
        dir_f32 = None
        if "single" in args.parts:  # mlx-lm in process before any server starts, its memory released afterwards
            progress("converting the embedded GGUF to a 4-bit MLX directory")
            dir_f32 = measure_in_process(prepare_4bit_dir(cache_dir), cache_dir, args, report)
            release_mlx_memory()
        specs = [ServerSpec(name=COURIER)]
        if {"single", "aggregate", "chat"} & set(args.parts):
            specs.append(ServerSpec(name=NO_SPEC, kind=COURIER, flags=("--no-speculation",)))
        if args.peer:
            specs.append(ServerSpec(name=PEER, model_dir=dir_f32, flags=tuned_flags(args.streams)))
        launcher = Launcher(
            bench="speculative",
            cache_dir=cache_dir,
            log_dir=cache_dir / "bench-logs",
            openblas=args.openblas,
            kernels=blas.kernels,
        )
        with ExitStack() as stack:  # the servers start one after another and stay up until the last part
            live = {}
            for spec in specs:
                server = launcher.server(spec)
                try:
                    live[spec.name] = stack.enter_context(server)
                except RUN_ERRORS as error:
                    server.record.error = f"{type(error).__name__}: {error}"
                    progress(f"{spec.name}: FAILED: {server.record.error}")
            asyncio.run(run_parts(live, args, report))
        report.servers = launcher.records
    print_report(report)
    write_json(report, args.json)
    return 1 if report.errors or any(record.error for record in report.servers) else 0


if __name__ == "__main__":
    sys.exit(main())
