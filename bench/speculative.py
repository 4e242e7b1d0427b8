"""Multi-token decode steps ("speculation": prompt-lookup drafts verified in one forward pass, and tokens a grammar
forces) on the embedded SmolLM2-135M-Instruct, side by side with Courier without them and with mlx-lm.

Four workloads, their prompts written out below, each one user message (the same `messages` everywhere, rendered by
each server's own chat template), greedy (temperature 0) throughout:

- (a) code edit: a ~400-token Python module and "Rewrite this file with <small change>. Keep everything else the
  same." (eight different changes; `max_tokens` 448, enough for the whole file);
- (b) quote: a ~400-token policy document and "Quote the paragraph about <topic> from this document exactly, word
  for word." (`max_tokens` 192);
- (c) free chat: short stories and explanations, nothing to copy (`max_tokens` 160);
- (d) extraction: an invoice, a contact card, an order or a booking, and "Extract the details above as a JSON
  object with the keys ..." (`max_tokens` 224); constrained, the request also carries a `response_format` json_schema
  (strict: every field required, no others, strings of at most 80 characters, lists of 1 to 4 items) whose fields
  echo those values.

`--max-tokens N` replaces every workload's cap (for a quick run). The model is tiny: it copies for a while and then
wanders or loops; completion tokens and the share of reply lines found verbatim in the source are reported, so
short or wandering answers are visible.

Four parts (`--parts`, all by default):

1. `single`: workloads (a), (b) and (c) (`--workloads` picks some), one stream at a time, `--repeats` (2) requests
   each (repeat i takes the i-th change, topic or story). First, before any server starts, mlx-lm's
   `stream_generate` in this process on the weights Courier serves on this device (`--weights auto`; on a CPU the
   4-bit conversion of the embedded GGUF dequantized to float32, OpenBLAS loaded before MLX with the kernels
   Courier's loader picks; on a GPU that conversion as stored); its memory is released before the servers start.
   Then each request goes to each server in turn (the first server rotating): `courier` (speculation on, the
   default), `courier-no-spec` (`--no-speculation`) and `mlx-lm-f32-kernels` (`mlx_lm.server` on the same float32
   weights with `LD_PRELOAD=<OpenBLAS>` and `OPENBLAS_CORETYPE` set to the kernels Courier picks, as
   `bench/throughput.py` runs it; `--no-peer` leaves it out). Over HTTP: streamed chat completions with the
   `openai` client (`stream_options.include_usage`); decode tok/s = (completion tokens - 1) / (last content chunk -
   first content chunk) (a chunk may carry several tokens); in process the same formula over mlx-lm's responses.
   Per workload, medians: Courier / mlx-lm in process and Courier / mlx_lm.server (target >= 1.8x on (a) and (b)),
   Courier / Courier without speculation, and whether both Courier servers returned the same text for every prompt
   (the lossless check over HTTP).
2. `aggregate`: workload (a), `--streams` (8) different changes at once, Courier against Courier without
   speculation, `--rounds` (2) rounds, the order of the two servers reversed every round. A round's aggregate
   tok/s is its completion tokens (`usage`) / wall time (first request sent .. last stream done). Target:
   pooled ratio >= 1.3.
3. `chat`: workload (c), the same two servers, at 1 stream and at `--streams`, rounds as in `aggregate`.
   Target: ratio >= 0.97 at each (drafts that miss must not cost; verify steps are reported).
4. `json`: workload (d) on Courier (speculation on), at 1 stream and at `--streams`: constrained (the
   `response_format` json_schema) against the same messages as free text; arms alternate as above. Target:
   constrained tok/s >= free tok/s at each. Forced (fast-forwarded) tokens per request and the constrained replies
   valid against their schema are reported.

In parts 2-4 both arms get the same requests in a round; at 1 stream each round takes the next prompt, at
`--streams` the same prompts come round again. Before the rounds every prompt is sent once to each arm with
`max_tokens` 1, so both arms' rounds start from a warm prompt cache (what is measured is decode, not prefill).

The servers start one after another before the first part (each gets one warm-up request) and stay up until the
last; before each measured request or round the script waits until every server process is idle (its CPU time
flat for 0.5 s, at most 20 s), so that no server's work after a request lands in the next measurement.

Acceptance rate (accepted / drafted draft tokens) and tokens per forward pass (tokens the decode steps emitted /
decode steps of the generation batch, all sequences of the batch together: at 8 streams without speculation it is
about 8) come from the growth of Courier's `courier_speculative_*` counters on GET /metrics over each measured
request or round ("n/a" where the server does not export them).

Courier servers run `courier serve --port P --cache-dir C` plus a private `--prompt-cache-dir` (emptied at start)
and `--data-dir` each, so that two of them never share files. From the repository root:

    .venv/bin/python -m bench.speculative [--parts single,aggregate,chat,json] [--repeats 2] [--streams 8]
        [--rounds 2] [--max-tokens N] [--no-peer] [--cache-dir DIR] [--openblas PATH] [--json PATH]
        [--workloads a,b,c] [--weights auto|float32|stored]

Markdown goes to stdout, progress to stderr, server logs to CACHE/bench-logs (kept when --cache-dir is given). The
exit code is 1 when a server failed (did not start, or a request to it failed), else 0; missed targets are
reported, not failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import statistics
import sys
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, ExitStack, asynccontextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import openai
from openai.types import CompletionUsage
from openai.types.chat import ChatCompletionMessageParam
from prometheus_client.parser import text_string_to_metric_families

from bench.structured import RoundResult, check_reply, inline, positive_int, response_format, shown
from bench.throughput import (
    COURIER,
    COURIER_MODEL_ID,
    FLOAT32,
    HOST,
    MLX_LM_F32_KERNELS,
    MLX_LM_MODEL_ID,
    OPENBLAS_PATH,
    WARMUP_PROMPT,
    WEIGHT_LABELS,
    BenchmarkError,
    InProcessReference,
    StreamResult,
    add_weights_argument,
    cache_directory,
    environment,
    free_port,
    load_average,
    load_float32,
    load_reference,
    make_client,
    percentile,
    prepare_4bit_dir,
    progress,
    reference_weights,
    release_mlx_memory,
    running_server,
    save_float32_dir,
    server_command,
    server_env,
    server_extra_env,
    server_line,
    stop_server,
    wait_until_ready,
)
from courier.platform.blas import BlasReport, load_optimized_blas

PARTS = ("single", "aggregate", "chat", "json")
NO_SPEC = "courier-no-spec"
PEER = MLX_LM_F32_KERNELS
IN_PROCESS = "mlx-lm in process"
RUN_ERRORS = (BenchmarkError, openai.OpenAIError, httpx.HTTPError, OSError)

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


# ---------------------------------------------------------------- results


@dataclass(frozen=True, slots=True, kw_only=True)
class Counters:
    """Courier's `courier_speculative_*` counters (names as exported, `_total` included), or their growth."""

    values: dict[str, float] = field(default_factory=dict)

    def since(self, before: Counters) -> Counters:
        return Counters(values={name: value - before.values.get(name, 0.0) for name, value in self.values.items()})

    def plus(self, other: Counters) -> Counters:
        names = self.values.keys() | other.values.keys()
        return Counters(values={name: self.values.get(name, 0.0) + other.values.get(name, 0.0) for name in names})

    def get(self, name: str) -> float | None:
        return self.values.get(f"{SPECULATIVE_PREFIX}{name}_total")

    def ratio(self, numerator: str, denominator: str) -> float | None:
        top, bottom = self.get(numerator), self.get(denominator)
        return top / bottom if top is not None and bottom else None

    @property
    def acceptance(self) -> float | None:
        return self.ratio("accepted_tokens", "drafted_tokens")

    @property
    def tokens_per_pass(self) -> float | None:
        return self.ratio("emitted_tokens", "steps")


@dataclass(frozen=True, slots=True, kw_only=True)
class Answer:
    """One streamed chat completion (`stream.prompt` holds the request's label)."""

    server: str
    stream: StreamResult
    text: str
    finish_reason: str | None
    prompt_tokens: int | None
    counters: Counters = field(default_factory=Counters)

    @property
    def decode_tps(self) -> float:
        return self.stream.decode_tps


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
    """One single-stream request to one server, for the report."""

    server: str
    workload: str
    label: str
    completion_tokens: int
    prompt_tokens: int | None
    ttft_s: float
    decode_tps: float
    finish_reason: str | None
    verbatim_share: float | None
    counters: Counters
    text: str


@dataclass(frozen=True, slots=True, kw_only=True)
class MeasuredRound:
    """One arm's requests sent together: `totals` as bench/structured.py counts a round (aggregate tok/s over the
    round's wall time; `valid_json` for a constrained arm), plus the streams' decode rate, TTFT and the counters."""

    totals: RoundResult
    decode_tps_median: float
    ttft_p50_s: float
    counters: Counters
    texts: list[str]


@dataclass(frozen=True, slots=True, kw_only=True)
class Comparison:
    """Two arms (`arms[0]` / `arms[1]`) over the same requests, rounds alternating."""

    part: str
    streams: int
    arms: tuple[str, str]
    target: float
    rounds: list[MeasuredRound] = field(default_factory=list)

    def pooled_tps(self, arm: str) -> float:
        mine = [r.totals for r in self.rounds if r.totals.arm == arm]
        wall = sum(r.wall_s for r in mine)
        return sum(r.completion_tokens for r in mine) / wall if wall > 0 else float("nan")

    @property
    def ratio(self) -> float:
        theirs = self.pooled_tps(self.arms[1])
        return self.pooled_tps(self.arms[0]) / theirs if theirs else math.nan

    def counters(self, arm: str) -> Counters:
        return summed([result.counters for result in self.rounds if result.totals.arm == arm])


@dataclass(slots=True, kw_only=True)
class ServerRecord:
    name: str
    command: list[str]
    extra_env: dict[str, str]
    log_path: str
    ready_s: float | None = None
    error: str | None = None


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


# ---------------------------------------------------------------- servers and clients


@dataclass(frozen=True, slots=True, kw_only=True)
class Live:
    """A running server: where to reach it and its process (whose CPU time says when it is idle)."""

    name: str
    port: int
    model: str
    pid: int

    @property
    def is_courier(self) -> bool:
        return self.name != PEER


@dataclass(frozen=True, slots=True, kw_only=True)
class Link:
    """A server with its clients: the `openai` one, and plain HTTP for /metrics."""

    live: Live
    client: openai.AsyncOpenAI
    http: httpx.AsyncClient


def launch(name: str, port: int, cache_dir: Path, dir_f32: Path | None, args: argparse.Namespace) -> list[str]:
    """The command that starts `name`. Each Courier server gets a prompt-cache directory (emptied) and a data
    directory of its own: two servers never share a file."""
    if name == PEER:
        return server_command(PEER, port, cache_dir, dir_f32, args.streams)
    prompt_cache = cache_dir / "bench-prompt-cache" / name
    shutil.rmtree(prompt_cache, ignore_errors=True)
    prompt_cache.mkdir(parents=True)
    data_dir = cache_dir / "bench-data" / name
    data_dir.mkdir(parents=True, exist_ok=True)
    command = server_command(COURIER, port, cache_dir, None, args.streams)
    command += ["--prompt-cache-dir", str(prompt_cache), "--data-dir", str(data_dir)]
    return [*command, "--no-speculation"] if name == NO_SPEC else command


def start_servers(
    stack: ExitStack, names: Sequence[str], cache_dir: Path, dir_f32: Path | None, args: argparse.Namespace
) -> tuple[list[ServerRecord], dict[str, Live]]:
    """Start each server in turn, waiting until it is ready before the next; `stack` stops them. A server that
    fails to start is stopped and recorded, and the others go on."""
    records: list[ServerRecord] = []
    live: dict[str, Live] = {}
    for name in names:
        port = free_port()
        command = launch(name, port, cache_dir, dir_f32, args)
        kind = PEER if name == PEER else COURIER
        extra_env = server_extra_env(kind, args.openblas, cache_dir, args.kernels)
        log_path = cache_dir / "bench-logs" / f"speculative-{name}.log"
        record = ServerRecord(name=name, command=command, extra_env=extra_env, log_path=str(log_path))
        records.append(record)
        env_text = " ".join(f"{key}={value}" for key, value in extra_env.items())
        progress(f"{name}: starting {env_text + ' ' if env_text else ''}{' '.join(command)} (log: {log_path})")
        path = "/v1/models" if name == PEER else "/health"
        process = None
        try:
            process = stack.enter_context(running_server(command, server_env(extra_env), log_path))
            record.ready_s = wait_until_ready(process, f"http://{HOST}:{port}{path}", log_path)
        except (BenchmarkError, OSError) as error:
            record.error = f"{type(error).__name__}: {error}"
            progress(f"{name}: FAILED: {record.error}")
            if process is not None:
                stop_server(process)
            continue
        progress(f"{name}: ready after {record.ready_s:.1f} s")
        model = MLX_LM_MODEL_ID if name == PEER else COURIER_MODEL_ID
        live[name] = Live(name=name, port=port, model=model, pid=process.pid)
    return records, live


@asynccontextmanager
async def links(live: dict[str, Live]) -> AsyncIterator[dict[str, Link]]:
    async with AsyncExitStack() as stack:
        found: dict[str, Link] = {}
        for name, server in live.items():
            client = await stack.enter_async_context(make_client(server.port))
            http = await stack.enter_async_context(httpx.AsyncClient(base_url=f"http://{HOST}:{server.port}"))
            found[name] = Link(live=server, client=client, http=http)
        yield found


async def read_counters(link: Link) -> Counters:
    """The server's speculative counters now; none when it is not Courier or does not export them."""
    if not link.live.is_courier:
        return Counters()
    try:
        response = await link.http.get("/metrics", timeout=30.0)
    except httpx.HTTPError:
        return Counters()
    if response.status_code != 200:
        return Counters()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if sample.name.startswith(SPECULATIVE_PREFIX) and sample.name.endswith("_total"):
                values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return Counters(values=values)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, all its threads (0 when it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def settle(servers: Sequence[Live]) -> float:
    """Wait until every server process is idle (a server's work after a request must not land in the next
    measurement); the seconds waited. Gives up after SETTLE_LIMIT_S."""
    started = time.monotonic()
    while time.monotonic() - started < SETTLE_LIMIT_S:
        before = [cpu_seconds(server.pid) for server in servers]
        await asyncio.sleep(SETTLE_WINDOW_S)
        grown = max((cpu_seconds(s.pid) - b for s, b in zip(servers, before, strict=True)), default=0.0)
        if grown < SETTLE_SHARE * SETTLE_WINDOW_S:
            break
    return time.monotonic() - started


async def stream_chat(link: Link, request: Request, max_tokens: int, *, constrained: bool = False) -> Answer:
    """One streamed chat completion at temperature 0; a constrained one carries the request's json_schema."""
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": request.prompt}]
    schema_format = response_format(request.schema_name, request.schema) if constrained and request.schema else None
    text: list[str] = []
    stamps: list[float] = []
    finish_reason: str | None = None
    usage: CompletionUsage | None = None
    sent = time.perf_counter()
    stream = await link.client.chat.completions.create(
        model=link.live.model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        response_format=schema_format if schema_format is not None else openai.omit,
    )
    async for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            finish_reason = choice.finish_reason or finish_reason
            if choice.delta.content:
                stamps.append(time.perf_counter())
                text.append(choice.delta.content)
    done = time.perf_counter()
    timed = StreamResult(
        prompt=request.label,
        completion_tokens=usage.completion_tokens if usage is not None else len(stamps),
        content_deltas=len(stamps),
        sent=sent,
        first_token=stamps[0] if stamps else done,
        last_token=stamps[-1] if stamps else done,
        done=done,
    )
    prompt_tokens = usage.prompt_tokens if usage is not None else None
    return Answer(
        server=link.live.name,
        stream=timed,
        text="".join(text),
        finish_reason=finish_reason,
        prompt_tokens=prompt_tokens,
    )


async def counted(link: Link, request: Request, max_tokens: int) -> Answer:
    """`stream_chat`, with the growth of the server's speculative counters over it."""
    before = await read_counters(link)
    answer = await stream_chat(link, request, max_tokens)
    return replace(answer, counters=(await read_counters(link)).since(before))


def finite_median(values: Sequence[float]) -> float:
    finite = [value for value in values if math.isfinite(value)]
    return statistics.median(finite) if finite else math.nan


# ---------------------------------------------------------------- rounds: two arms over the same requests


@dataclass(frozen=True, slots=True, kw_only=True)
class Arm:
    name: str
    link: Link
    constrained: bool = False


async def run_round(arm: Arm, requests: Sequence[Request], max_tokens: int, round_index: int) -> MeasuredRound:
    """All of `requests` at once on one arm; the counters' growth over the round."""
    before = await read_counters(arm.link)
    answers = await asyncio.gather(
        *(stream_chat(arm.link, request, max_tokens, constrained=arm.constrained) for request in requests)
    )
    counters = (await read_counters(arm.link)).since(before)
    wall_s = max(a.stream.done for a in answers) - min(a.stream.sent for a in answers)
    tokens = [a.stream.completion_tokens for a in answers]
    valid = None
    if arm.constrained:
        valid = sum(
            1
            for answer, request in zip(answers, requests, strict=True)
            if request.schema is not None and check_reply(answer.text, request.schema)[1]
        )
    totals = RoundResult(
        arm=arm.name,
        round=round_index,
        streams=len(requests),
        completion_tokens=sum(tokens),
        tokens_per_stream=tokens,
        capped=sum(1 for answer in answers if answer.finish_reason == "length"),
        wall_s=wall_s,
        tps=sum(tokens) / wall_s if wall_s > 0 else math.nan,
        valid_json=valid,
    )
    return MeasuredRound(
        totals=totals,
        decode_tps_median=finite_median([answer.decode_tps for answer in answers]),
        ttft_p50_s=percentile([answer.stream.ttft_s for answer in answers], 0.50),
        counters=counters,
        texts=[answer.text for answer in answers],
    )


async def compare(
    comparison: Comparison,
    arms: tuple[Arm, Arm],
    rounds: Sequence[Sequence[Request]],
    servers: Sequence[Live],
    *,
    max_tokens: int,
) -> None:
    """Both arms on each round's requests, the arms' order reversed every round; the rounds go into `comparison` as
    they end. Every distinct prompt is first sent once to each arm with max_tokens 1, so both arms' rounds start
    from a warm prompt cache (and compiled grammars)."""
    distinct = list({request.prompt: request for requests in rounds for request in requests}.values())
    for arm in arms:
        await asyncio.gather(*(stream_chat(arm.link, request, 1, constrained=arm.constrained) for request in distinct))
    for round_index, requests in enumerate(rounds, start=1):
        for arm in arms if round_index % 2 else arms[::-1]:
            await settle(servers)
            result = await run_round(arm, requests, max_tokens, round_index)
            comparison.rounds.append(result)
            totals = result.totals
            progress(
                f"{comparison.part}, {comparison.streams} stream(s), round {round_index}, {arm.name}: "
                f"{totals.completion_tokens} tokens in {totals.wall_s:.2f} s = {totals.tps:.1f} tok/s"
            )


# ---------------------------------------------------------------- parts


def cap(args: argparse.Namespace, workload: str) -> int:
    """max_tokens for a workload's requests: `--max-tokens` when given, else the workload's own."""
    return int(args.max_tokens or WORKLOADS[workload].max_tokens)


def measure_in_process(dir4: Path, cache_dir: Path, args: argparse.Namespace, report: Report) -> Path | None:
    """mlx-lm's `stream_generate` on the single part's requests, in this process on the weights `--weights` names;
    writes float32 weights as a model directory for mlx_lm.server when it runs (returned)."""
    weights = reference_weights(args.weights)
    progress(f"single, {IN_PROCESS}: loading {dir4}: {WEIGHT_LABELS[weights]}")
    model, tokenizer = load_reference(dir4, weights)
    dir_f32 = None
    if args.peer:
        dense = model if weights == FLOAT32 else load_float32(dir4)[0]
        dir_f32 = save_float32_dir(dense, dir4, cache_dir / "bench-models" / f"{COURIER_MODEL_ID}-float32")
        progress(f"float32 directory for {PEER}: {dir_f32}")
    reference = InProcessReference(model, tokenizer)
    for repeat in range(args.repeats):
        for key in args.workloads:
            request = requests_for(key, 1, repeat)[0]
            generation_tps, decode_tps, tokens = reference.run(request.prompt, cap(args, key))
            report.in_process.append(
                InProcessRun(
                    workload=key,
                    label=request.label,
                    decode_tps=decode_tps,
                    generation_tps=generation_tps,
                    completion_tokens=tokens,
                )
            )
            progress(f"single, {IN_PROCESS}, {request.label}: {tokens} tokens, {decode_tps:.1f} tok/s")
    return dir_f32


def single_run(workload: str, answer: Answer) -> SingleRun:
    return SingleRun(
        server=answer.server,
        workload=workload,
        label=answer.stream.prompt,
        completion_tokens=answer.stream.completion_tokens,
        prompt_tokens=answer.prompt_tokens,
        ttft_s=answer.stream.ttft_s,
        decode_tps=answer.decode_tps,
        finish_reason=answer.finish_reason,
        verbatim_share=verbatim_share(answer.text, WORKLOADS[workload].source),
        counters=answer.counters,
        text=answer.text,
    )


async def part_single(found: dict[str, Link], args: argparse.Namespace, report: Report) -> None:
    """Each request to each server in turn, the first server rotating, every server idle before each."""
    names = [name for name in (COURIER, NO_SPEC, PEER) if name in found]
    servers = [link.live for link in found.values()]
    for repeat in range(args.repeats):
        for position, key in enumerate(args.workloads):
            request = requests_for(key, 1, repeat)[0]
            shift = (repeat * len(args.workloads) + position) % len(names)
            for name in names[shift:] + names[:shift]:
                await settle(servers)
                run = single_run(key, await counted(found[name], request, cap(args, key)))
                report.single.append(run)
                progress(
                    f"single, {name}, {request.label}: {run.completion_tokens} tokens, {run.decode_tps:.1f} tok/s, "
                    f"TTFT {run.ttft_s:.2f} s"
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


async def part_compared(part: str, found: dict[str, Link], args: argparse.Namespace, report: Report) -> None:
    """`aggregate` at --streams, `chat` and `json` at 1 stream and at --streams: Courier against Courier without
    speculation, or (json) constrained against free text on Courier; `--rounds` rounds."""
    workload, target = COMPARED_PARTS[part]
    if part == "json":
        arms = (Arm(name="constrained", link=found[COURIER], constrained=True), Arm(name="free", link=found[COURIER]))
    else:
        arms = (Arm(name=COURIER, link=found[COURIER]), Arm(name=NO_SPEC, link=found[NO_SPEC]))
    servers = [link.live for link in found.values()]
    for streams in [args.streams] if part == "aggregate" else sorted({1, args.streams}):
        # Round r takes the requests after round r-1's: at 1 stream each round has another prompt; at 8 the
        # workload's prompts come round again (8 changes, 8 stories, 4 extraction cases).
        rounds = [requests_for(workload, streams, index * streams) for index in range(args.rounds)]
        comparison = Comparison(part=part, streams=streams, arms=(arms[0].name, arms[1].name), target=target)
        report.comparisons.append(comparison)  # kept with the rounds it has when a later one fails
        await compare(comparison, arms, rounds, servers, max_tokens=cap(args, workload))


async def run_parts(live: dict[str, Live], args: argparse.Namespace, report: Report) -> None:
    """Warm each server up, then the parts in order; a part whose request fails is recorded and the next goes on."""
    async with links(live) as found:
        for name, link in found.items():
            try:
                await stream_chat(link, Request(label="warm-up", prompt=WARMUP_PROMPT), 8)
            except RUN_ERRORS as error:
                report.errors.append(f"{name}: warm-up failed: {type(error).__name__}: {error}")
        for part in args.parts:
            missing = [name for name in PART_SERVERS[part] if name not in found]
            if missing:
                report.errors.append(f"{part}: not run, {', '.join(missing)} did not start")
                continue
            report.load_at_parts[part] = load_average()
            progress(f"part {part} (load {report.load_at_parts[part]})")
            try:
                if part == "single":
                    await part_single(found, args, report)
                else:
                    await part_compared(part, found, args, report)
            except RUN_ERRORS as error:
                report.errors.append(f"{part}: {type(error).__name__}: {error}")
                progress(f"{part}: FAILED: {report.errors[-1]}")


# ---------------------------------------------------------------- report


def num(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None or not math.isfinite(value) else f"{value:.{digits}f}"


def share(value: float | None) -> str:
    return "n/a" if value is None else f"{100.0 * value:.0f}%"


def verdict(value: float | None, target: float) -> str:
    if value is None or not math.isfinite(value):
        return "n/a"
    return f"**{value:.2f}x** ({'meets' if value >= target else 'misses'} target >= {target}x)"


def summed(counters: Sequence[Counters]) -> Counters:
    total = Counters()
    for each in counters:
        total = total.plus(each)
    return total


def print_report(report: Report) -> None:
    env = report.environment
    print("## Courier speculative decoding benchmark\n")
    print(f"- python {env['python']}, mlx {env['mlx']}, mlx-lm {env['mlx-lm']}, courier {env['courier']}")
    print(f"- machine: {env['platform']} ({env['machine']}), {env['cpu_count']} CPUs")
    print(f"- MLX device: {env['mlx_device']}")
    print(f"- settings: {report.settings}")
    print(f"- 1-minute load average at the start of each part: {report.load_at_parts}\n")
    print("### Servers\n")
    for record in report.servers:
        status = f"ready in {record.ready_s:.1f} s" if record.ready_s is not None else "not ready"
        failed = f"; FAILED: {record.error}" if record.error is not None else ""
        print(server_line(record.name, record.command, record.extra_env, status + failed))
    print()
    if report.in_process or report.single:
        print_single(report)
    for index, comparison in enumerate(report.comparisons):
        print_comparison(comparison, explain=index == 0)
    for error in report.errors:
        print(f"- FAILED: {error}")


def single_rows(report: Report, workload: str) -> list[tuple[str, list[float], list[int], list[SingleRun]]]:
    """Per server (mlx-lm in process first): decode rates, completion tokens, and the HTTP runs."""
    rows: list[tuple[str, list[float], list[int], list[SingleRun]]] = []
    own = [run for run in report.in_process if run.workload == workload]
    if own:
        rows.append((IN_PROCESS, [run.decode_tps for run in own], [run.completion_tokens for run in own], []))
    for name in (COURIER, NO_SPEC, PEER):
        runs = [run for run in report.single if run.server == name and run.workload == workload]
        if runs:
            rows.append((name, [run.decode_tps for run in runs], [run.completion_tokens for run in runs], runs))
    return rows


def measured_workloads(report: Report) -> list[str]:
    """The single part's workloads that have runs, in order."""
    measured = {run.workload for run in report.in_process} | {run.workload for run in report.single}
    return [key for key in SINGLE_WORKLOADS if key in measured]


def print_single(report: Report) -> None:
    print(f"### Single stream: {', '.join(f'({key}) {WORKLOADS[key].title}' for key in measured_workloads(report))}\n")
    print(
        "Decode tok/s = (completion tokens - 1) / (last - first content chunk), median over the requests. "
        "Acceptance and tokens per forward pass from Courier's /metrics around each request.\n"
    )
    print(
        "| workload | server | decode tok/s | per request | completion tokens | prompt tokens | TTFT s "
        "| verbatim lines | acceptance | tokens per pass |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for key in measured_workloads(report):
        for name, rates, tokens, runs in single_rows(report, key):
            counters = summed([run.counters for run in runs])
            prompt_tokens = sorted({run.prompt_tokens for run in runs if run.prompt_tokens is not None})
            verbatim = [run.verbatim_share for run in runs if run.verbatim_share is not None]
            print(
                f"| ({key}) {WORKLOADS[key].title} | {name} | {num(finite_median(rates))} "
                f"| {', '.join(num(rate) for rate in rates)} | {tokens} | {prompt_tokens or '-'} "
                f"| {num(finite_median([run.ttft_s for run in runs]), 2) if runs else '-'} "
                f"| {share(statistics.fmean(verbatim)) if verbatim else '-'} "
                f"| {share(counters.acceptance) if runs and name != PEER else '-'} "
                f"| {num(counters.tokens_per_pass, 2) if runs and name != PEER else '-'} |"
            )
    print()
    print_single_summary(report)


def median_tps(report: Report, name: str, workload: str) -> float | None:
    for row_name, rates, _, _ in single_rows(report, workload):
        if row_name == name:
            return finite_median(rates)
    return None


def identical(report: Report, workload: str) -> str:
    """Whether Courier with and without speculation returned the same text for every request of a workload."""
    ours = {run.label: run.text for run in report.single if run.server == COURIER and run.workload == workload}
    theirs = {run.label: run.text for run in report.single if run.server == NO_SPEC and run.workload == workload}
    pairs = [(text, theirs[label]) for label, text in ours.items() if label in theirs]
    if not pairs:
        return "n/a"
    same = sum(1 for a, b in pairs if a == b)
    return f"{'yes' if same == len(pairs) else 'NO'} ({same}/{len(pairs)})"


def over(top: float | None, bottom: float | None) -> float | None:
    return top / bottom if top is not None and bottom else None


def print_single_summary(report: Report) -> None:
    print(
        "| workload | Courier tok/s | / mlx-lm in process | / mlx_lm.server | / Courier without speculation "
        "| identical text with and without |"
    )
    print("|---|---|---|---|---|---|")
    for key in measured_workloads(report):
        ours = median_tps(report, COURIER, key)
        ratios = [num(over(ours, median_tps(report, name, key)), 2) for name in (IN_PROCESS, PEER, NO_SPEC)]
        print(f"| ({key}) {WORKLOADS[key].title} | {num(ours)} | {' | '.join(ratios)} | {identical(report, key)} |")
    print()
    for key in ("a", "b"):
        ours = median_tps(report, COURIER, key)
        for name, label in ((IN_PROCESS, "mlx-lm `stream_generate` in process"), (PEER, "mlx_lm.server")):
            ratio = over(ours, median_tps(report, name, key))
            if ratio is not None:
                print(f"- ({key}) Courier / {label}: {verdict(ratio, TARGET_SINGLE_VS_MLX_LM)}")
    for key in measured_workloads(report):
        sample = next((run for run in report.single if run.server == COURIER and run.workload == key), None)
        if sample is not None:
            print(f"- a Courier reply, {sample.label} ({sample.finish_reason}): {inline(shown(sample.text))}")
    print()


COMPARISON_TITLES = {
    "aggregate": "(a) code edit, Courier against Courier without speculation",
    "chat": "(c) free chat, Courier against Courier without speculation",
    "json": "(d) json extraction on Courier, constrained (json_schema) against free text",
}


def round_counters_cells(result: MeasuredRound) -> str:
    """Acceptance, tokens per pass, verify steps / steps and forced tokens per request, from /metrics."""
    counters = result.counters
    steps, verify, forced = counters.get("steps"), counters.get("verify_steps"), counters.get("forced_tokens")
    steps_text = f"{verify:.0f} / {steps:.0f}" if steps is not None and verify is not None else "n/a"
    forced_text = num(forced / result.totals.streams, 1) if forced is not None else "n/a"
    return f"{share(counters.acceptance)} | {num(counters.tokens_per_pass, 2)} | {steps_text} | {forced_text}"


def print_comparison(comparison: Comparison, *, explain: bool) -> None:
    first, second = comparison.arms
    print(f"### {COMPARISON_TITLES[comparison.part]}, {comparison.streams} stream(s)\n")
    if explain:
        print(
            "A round's tok/s = its completion tokens / (first request sent .. last stream done); decode tok/s is the "
            "median over its streams. Counters from Courier's /metrics around the round (tokens per forward pass "
            "counts all sequences of the batch).\n"
        )
    print(
        "| round | arm | tokens | tokens per stream | capped | wall s | tok/s | decode tok/s | TTFT p50 s "
        "| acceptance | tokens per pass | verify steps / steps | forced per request | valid JSON |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for measured in comparison.rounds:
        r = measured.totals
        valid = f"{r.valid_json}/{r.streams}" if r.valid_json is not None else "-"
        print(
            f"| {r.round} | {r.arm} | {r.completion_tokens} | {min(r.tokens_per_stream)}-{max(r.tokens_per_stream)} "
            f"| {r.capped}/{r.streams} | {r.wall_s:.2f} | {r.tps:.1f} | {num(measured.decode_tps_median)} "
            f"| {measured.ttft_p50_s:.2f} | {round_counters_cells(measured)} | {valid} |"
        )
    print()
    for arm in comparison.arms:
        counters = comparison.counters(arm)
        print(
            f"- {arm}: pooled {num(comparison.pooled_tps(arm))} tok/s; acceptance {share(counters.acceptance)}, "
            f"tokens per forward pass {num(counters.tokens_per_pass, 2)}"
        )
    print(f"- {first} / {second}: {verdict(comparison.ratio, comparison.target)}")
    for arm in comparison.arms:
        sample = next((r for r in comparison.rounds if r.totals.arm == arm and r.texts), None)
        if sample is not None:
            print(f"- a reply of {arm}, {sample.totals.tokens_per_stream[0]} tokens: {inline(shown(sample.texts[0]))}")
    print()


def write_json(report: Report, path: Path) -> None:
    path.write_text(json.dumps(asdict(report), indent=2, default=str) + "\n")


# ---------------------------------------------------------------- main


def part_list(text: str) -> list[str]:
    parts = list(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    if not parts or not set(parts) <= set(PARTS):
        raise argparse.ArgumentTypeError(f"parts are {', '.join(PARTS)}, separated by commas; got {text!r}")
    return parts


def workload_list(text: str) -> list[str]:
    keys = list(dict.fromkeys(key.strip() for key in text.split(",") if key.strip()))
    if not keys or not set(keys) <= set(SINGLE_WORKLOADS):
        raise argparse.ArgumentTypeError(
            f"workloads are {', '.join(SINGLE_WORKLOADS)}, separated by commas; got {text!r}"
        )
    return [key for key in SINGLE_WORKLOADS if key in keys]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--parts", type=part_list, default=list(PARTS), help=f"{','.join(PARTS)} (all)")
    add("--repeats", type=positive_int, default=2, help="single: requests per workload and server (2)")
    add("--streams", type=positive_int, default=8, help="aggregate, chat, json: concurrent streams (8)")
    add("--rounds", type=positive_int, default=2, help="aggregate, chat, json: rounds of each arm (2)")
    add("--max-tokens", type=positive_int, default=None, help="max_tokens of every request (default: per workload)")
    add("--no-peer", dest="peer", action="store_false", help=f"single: leave out mlx_lm.server ({PEER})")
    add("--cache-dir", type=Path, default=None, help="model cache (default: a temporary directory)")
    add("--openblas", default=OPENBLAS_PATH, help=f"LD_PRELOAD for {PEER} ({OPENBLAS_PATH})")
    add("--json", type=Path, default=None, help="also write the raw results here")
    add("--workloads", type=workload_list, default=list(SINGLE_WORKLOADS), help="single: workloads, among a,b,c (all)")
    add_weights_argument(parser)
    args = parser.parse_args(argv)
    args.peer = args.peer and "single" in args.parts
    return args


def server_names(args: argparse.Namespace) -> list[str]:
    names = [COURIER]
    if {"single", "aggregate", "chat"} & set(args.parts):
        names.append(NO_SPEC)
    if args.peer:
        names.append(PEER)
    return names


def settings(args: argparse.Namespace, blas: BlasReport) -> dict[str, object]:
    keys = ("parts", "workloads", "repeats", "streams", "rounds", "max_tokens", "peer", "weights")
    caps = {key: cap(args, key) for key in WORKLOADS}
    return {**{key: getattr(args, key) for key in keys}, "max_tokens_by_workload": caps, "kernels": blas.kernels}


def prepare(cache_dir: Path, args: argparse.Namespace, report: Report) -> Path | None:
    """The single part's in-process reference, before any server starts, its memory released afterwards; the
    float32 directory for mlx_lm.server (None without it)."""
    if "single" not in args.parts:
        return None
    progress("converting the embedded GGUF to a 4-bit MLX directory")
    dir4 = prepare_4bit_dir(cache_dir)
    dir_f32 = measure_in_process(dir4, cache_dir, args, report)
    release_mlx_memory()
    return dir_f32


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.peer and not Path(args.openblas).is_file():
        progress(f"OpenBLAS not found at {args.openblas}; pass --openblas PATH or --no-peer")
        return 2
    # Before anything imports MLX, so the in-process model runs on OpenBLAS with the kernels Courier picks.
    os.environ.pop("OPENBLAS_CORETYPE", None)
    blas = load_optimized_blas()
    args.kernels = blas.kernels
    report = Report(environment=environment(blas), settings=settings(args, blas))
    with cache_directory(args.cache_dir) as cache_dir:
        dir_f32 = prepare(cache_dir, args, report)
        with ExitStack() as stack:
            report.servers, live = start_servers(stack, server_names(args), cache_dir, dir_f32, args)
            asyncio.run(run_parts(live, args, report))
    print_report(report)
    if args.json is not None:
        write_json(report, args.json)
        progress(f"raw results written to {args.json}")
    return 1 if report.errors or any(record.error for record in report.servers) else 0


if __name__ == "__main__":
    sys.exit(main())
