"""Server settings: every option is a CLI flag and a `COURIER_*` environment variable.

A setting is declared once, as a field of `Settings` made with `setting(default, parse, help, ...)`: its name,
type and default are the field's, and its parser, help text, metavar and on/off-flag-ness ride in the field's
metadata. `OPTIONS` is derived from those fields, in declaration order, which is the order of `--help` and the docs.

Precedence is CLI flag > environment variable > default. An environment value that
does not parse logs a warning naming the variable and keeps the default, so a typo
in a deployment's environment never stops the server from starting; except for a
`strict` setting, where the default would be a different thing rather than a safe
one (`COURIER_STORAGE`: replicas meant to share PostgreSQL must not each fall back to
a SQLite file of their own; `COURIER_REPLICA_ID`: a replica behind a front must not
quietly mint ids that route nowhere), so its typo is a start-up error (`SettingsError`).
"""

from __future__ import annotations

import argparse
import logging
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, TypeVar

import platformdirs

logger = logging.getLogger(__name__)

ENV_PREFIX = "COURIER_"
WEIGHT_FORMATS = ("auto", "native", "float32", "float16", "bfloat16")
LOG_LEVELS = ("debug", "info", "warning", "error")
STORAGE_URL_SCHEMES = ("postgresql", "postgres")
_BYTE_UNITS = {"": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "ki": 1024, "mi": 1024**2, "gi": 1024**3}
_BYTES_PATTERN = re.compile(r"^\s*(\d+)\s*([kmg]i?)?b?\s*$", re.IGNORECASE)
# A replica id: the routing token its response ids carry, and its server's name in a front's configuration.
REPLICA_ID_PATTERN = re.compile(r"[a-z0-9-]{1,16}")


def parse_bytes(text: str) -> int:
    """`1048576`, `512KiB`, `32MiB`, `2GB`, `1G` -> bytes."""
    match = _BYTES_PATTERN.match(text)
    if match is None:
        raise ValueError(f"not a byte size: {text!r} (examples: 1048576, 64MiB, 2GB)")
    return int(match.group(1)) * _BYTE_UNITS[(match.group(2) or "").lower()]


def parse_positive_bytes(text: str) -> int:
    value = parse_bytes(text)
    if value <= 0:
        raise ValueError(f"must be positive: {text!r}")
    return value


def parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {text!r} (use 1/0, true/false, yes/no, on/off)")


def parse_port(text: str) -> int:
    port = int(text)
    if not 0 <= port <= 65535:
        raise ValueError(f"port out of range: {port}")
    return port


def parse_positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError(f"must be positive: {text!r}")
    return value


def parse_non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise ValueError(f"must not be negative: {text!r}")
    return value


def parse_positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise ValueError(f"must be positive: {text!r}")
    return value


def parse_non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError(f"must not be negative: {text!r}")
    return value


def _int_between(text: str, low: int, high: int) -> int:
    value = int(text)
    if not low <= value <= high:
        raise ValueError(f"must be between {low} and {high}: {text!r}")
    return value


def _choice(options: Sequence[str]) -> Callable[[str], str]:
    def parse(text: str) -> str:
        lowered = text.strip().lower()
        if lowered not in options:
            raise ValueError(f"{text!r} is not one of {', '.join(options)}")
        return lowered

    return parse


def parse_prompt_cache_bits(text: str) -> int | None:
    """`8` or `4`; `off` (or empty, `none`, `0`) stores snapshots as the model computes them."""
    lowered = text.strip().lower()
    if lowered in ("", "off", "none", "0"):
        return None
    if lowered not in ("8", "4"):
        raise ValueError(f"prompt-cache bits are 8, 4 or off, not {text!r}")
    return int(lowered)


def parse_prompt_cache_group_size(text: str) -> int:
    """32, 64 or 128: the group sizes MLX's affine quantization supports."""
    value = int(text)
    if value not in (32, 64, 128):
        raise ValueError(f"a group size is 32, 64 or 128, not {text!r}")
    return value


# Several `--model` declarations in one environment variable are separated by this (a path may hold a comma).
MODEL_SEPARATOR = ";"


def parse_model_specs(text: str) -> tuple[str, ...]:
    """`[NAME[,ALIAS...]=]MODEL`, several separated by `;` (one per `--model` flag does as well)."""
    return tuple(spec.strip() for spec in text.split(MODEL_SEPARATOR) if spec.strip())


def parse_names(text: str) -> tuple[str, ...]:
    """`a,b` -> ("a", "b"), spaces around each name dropped."""
    return tuple(name.strip() for name in text.split(",") if name.strip())


EMBEDDING_POOLINGS = ("mean", "last")


def parse_embedding_pooling(text: str) -> tuple[str, ...]:
    """`[NAME=]mean|last`, several separated by commas: kept as `NAME=POOLING` (no NAME: the default model)."""
    specs = []
    for spec in parse_names(text):
        name, _, pooling = spec.rpartition("=")
        if pooling.strip() not in EMBEDDING_POOLINGS:
            raise ValueError(f"{spec!r}: the pooling is one of {', '.join(EMBEDDING_POOLINGS)}")
        specs.append(f"{name.strip()}={pooling.strip()}")
    return tuple(specs)


def _path(text: str) -> Path:
    return Path(text).expanduser()


def _optional_text(text: str) -> str | None:
    return text or None


def _optional_number(text: str, low: float, high: float, what: str, *, open_low: bool = False) -> float | None:
    if not text.strip():
        return None
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"expected {what}, a number, not {text!r}") from None
    if not low <= value <= high or (open_low and value == low) or math.isnan(value):
        bounds = f"{'(' if open_low else '['}{low:g}, {high:g}]"
        raise ValueError(f"expected {what} in {bounds}, not {text!r}")
    return value


def _optional_path(text: str) -> Path | None:
    return Path(text).expanduser() if text else None


def parse_storage_url(text: str) -> str | None:
    """A postgresql:// (or postgres://) URL selects PostgreSQL; empty is SQLite under --data-dir. The error never
    repeats the text, which may hold a password."""
    url = text.strip()
    if not url:
        return None
    scheme, separator, _ = url.partition("://")
    if not separator:
        raise ValueError("expected a postgresql://user:password@host:port/dbname URL, or nothing for SQLite")
    if scheme.lower() not in STORAGE_URL_SCHEMES:
        raise ValueError(f"a {scheme!r} URL names no storage Courier has: use postgresql://, or nothing for SQLite")
    return url


def parse_replica_id(text: str) -> str | None:
    """1-16 of a-z, 0-9 and `-` (`r1`, `gpu-a`); empty for none."""
    replica = text.strip()
    if not replica:
        return None
    if REPLICA_ID_PATTERN.fullmatch(replica) is None:
        raise ValueError(f"a replica id is 1-16 of a-z, 0-9 and '-', not {text!r}")
    return replica


def parse_api_prefix(text: str) -> str:
    """`/courier` nests every route under it; empty for none. No trailing slash, no query or spaces."""
    prefix = text.strip().rstrip("/")
    if prefix and (not prefix.startswith("/") or any(char in prefix for char in "?# ")):
        raise ValueError(f"an API prefix is a path such as /courier, not {text!r}")
    return prefix


@dataclass(frozen=True, slots=True, kw_only=True)
class Option:
    name: str
    parse: Callable[[str], Any]
    default: Any
    help: str
    metavar: str | None = None
    is_flag: bool = False
    strict: bool = False
    repeated: bool = False  # the flag may be given several times; each value parses to a tuple, all joined

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()


@dataclass(frozen=True, slots=True, kw_only=True)
class _OptionMetadata:
    """What a `Settings` field carries besides its name, type and default: how it is parsed and described."""

    parse: Callable[[str], Any]
    help: str
    metavar: str | None
    is_flag: bool
    strict: bool
    repeated: bool


_METADATA_KEY = "courier.option"
_T = TypeVar("_T")


def setting(
    default: _T,
    parse: Callable[[str], _T],
    help: str,
    *,
    metavar: str | None = None,
    flag: bool = False,
    strict: bool = False,
    repeated: bool = False,
) -> _T:
    """Declare a `Settings` field with its option: default, parser, help text, and a metavar or on/off flag.
    `strict`: an environment value that does not parse stops the server instead of leaving the default.
    `repeated`: a tuple setting whose flag may be given several times (`parse` turns one value into a tuple)."""
    metadata = _OptionMetadata(parse=parse, help=help, metavar=metavar, is_flag=flag, strict=strict, repeated=repeated)
    return field(default=default, metadata={_METADATA_KEY: metadata})


# ruff's RUF009 takes `setting(...)` for a default computed by a call, not the `dataclasses.field` it returns:
# fields typed `str`, `int`, ... pass as immutable, and the `Path` fields carry a `noqa`.
@dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    host: str = setting("127.0.0.1", str, "interface to listen on", metavar="HOST")
    port: int = setting(8000, parse_port, "TCP port; 0 picks a free one", metavar="PORT")
    api_prefix: str = setting(
        "",
        parse_api_prefix,
        "serve every route under this path (e.g. /courier -> /courier/v1/chat/completions)",
        metavar="PATH",
    )
    model: tuple[str, ...] = setting(
        (),
        parse_model_specs,
        "MLX model directory, .gguf file or Hugging Face repo id, optionally named (NAME[,ALIAS...]=MODEL); repeat "
        "the flag to serve several, the first being the default (none and no --models-dir: embedded "
        "SmolLM2-135M-Instruct)",
        metavar="[NAME=]MODEL",
        repeated=True,
    )
    served_model_name: str | None = setting(
        None,
        _optional_text,
        "model id clients use (default: derived from --model); several comma-separated: the first is the id, the "
        "others aliases a request may name instead (one ending in * matches any name it begins, e.g. claude-*)",
        metavar="NAME[,ALIAS...]",
    )
    models_dir: Path | None = setting(  # noqa: RUF009
        None,
        _optional_path,
        "also serve every MLX model directory and .gguf file under this directory, each named by its path below it "
        "(mlx-community/Qwen3-0.6B-4bit, tiny.Q4_0), loaded when a request names it",
        metavar="DIR",
    )
    models_memory_bytes: int | None = setting(
        None,
        parse_positive_bytes,
        "memory the loaded models may take together (weights, live KV allowance, prompt-cache memory tier); a "
        "model that does not fit unloads the least recently used idle ones (default: three quarters of the memory "
        "available at start-up)",
        metavar="BYTES",
    )
    max_loaded_models: int = setting(
        0, parse_non_negative_int, "most models loaded at once (0: as many as the memory budget holds)", metavar="N"
    )
    model_ttl: float = setting(
        0.0,
        parse_non_negative_float,
        "seconds a model stays loaded after its last request ends (0: until its memory is needed); a request's "
        "keep_alive overrides it",
        metavar="SECONDS",
    )
    pin: tuple[str, ...] = setting(
        (),
        parse_names,
        "models never unloaded, by name (repeat the flag or separate by commas); loaded at start-up",
        metavar="NAME",
        repeated=True,
    )
    embedding_pooling: tuple[str, ...] = setting(
        (),
        parse_embedding_pooling,
        "let a generative model answer /v1/embeddings, its hidden states pooled by their mean or its last token "
        "(NAME=POOLING; no NAME: the default model; repeat the flag or separate by commas)",
        metavar="[NAME=]mean|last",
        repeated=True,
    )
    cache_dir: Path = setting(  # noqa: RUF009
        Path(platformdirs.user_cache_dir("courier")), _path, "where converted models are kept", metavar="DIR"
    )
    weight_format: str = setting(
        "auto",
        _choice(WEIGHT_FORMATS),
        "serving weights: auto (float32 on CPU, as stored on GPU), native, float32, float16, bfloat16",
        metavar="FORMAT",
    )
    blas: str = setting("auto", str, "CPU BLAS for MLX: auto (find OpenBLAS), none, or a library path", metavar="BLAS")
    warmup: bool = setting(True, parse_bool, "run one short forward pass before reporting ready", flag=True)
    trust_remote_code: bool = setting(
        False,
        parse_bool,
        "allow a model directory's own architecture file (config.json `model_file`) to be imported and run",
        flag=True,
    )
    max_body_bytes: int = setting(
        32 * 1024**2,
        parse_bytes,
        "largest request body accepted (413 beyond); accepts 64MiB, 1GB, ...",
        metavar="BYTES",
    )
    body_timeout: float = setting(
        60.0,
        parse_positive_float,
        "seconds a client gets to send a whole request body (408 beyond), however slowly it trickles",
        metavar="SECONDS",
    )
    max_connections: int = setting(
        1024,
        parse_positive_int,
        "most open client connections; beyond them a new connection is answered 503 and closed (kept below the "
        "open-file limit)",
        metavar="N",
    )
    max_batch: int = setting(16, parse_positive_int, "sequences generated together in one batch", metavar="N")
    speculation: bool = setting(
        True,
        parse_bool,
        "multi-token decode steps: drafts looked up in each sequence's own prompt and output, verified in one "
        "batched forward pass (lossless), and tokens a grammar forces (dense KV-cache models only)",
        flag=True,
    )
    speculative_ngram: int = setting(
        4,
        lambda text: _int_between(text, 2, 16),
        "longest run of a sequence's last tokens matched against its context for a draft (2-16; shorter runs "
        "down to 2 are tried next)",
        metavar="N",
    )
    speculative_tokens: int = setting(
        8,
        lambda text: _int_between(text, 1, 64),
        "draft tokens proposed per sequence (1-64); how many are verified in a step follows the measured cost of "
        "a wider pass and each sequence's acceptance",
        metavar="K",
    )
    max_queue: int = setting(
        64,
        parse_non_negative_int,
        "requests waiting for a batch slot; beyond it requests get 429 with Retry-After",
        metavar="N",
    )
    max_n: int = setting(
        8,
        parse_positive_int,
        "most samples ('n') one chat or completions request may ask for; each takes a batch slot, so the batch "
        "size caps it too",
        metavar="N",
    )
    prefill_step_size: int = setting(
        512,
        parse_positive_int,
        "prompt tokens prefilled per step; smaller keeps running streams flowing during long prefills",
        metavar="TOKENS",
    )
    prefill_stall_ms: float = setting(
        500.0,
        parse_non_negative_float,
        "while streams decode, how long a step's prefill of new prompts may hold up their next token: each "
        "prompt's chunk is sized to fit, from the measured cost of a token (0: a whole --prefill-step-size chunk)",
        metavar="MS",
    )
    mlx_cache_limit: int = setting(
        1024**3,
        parse_bytes,
        "most bytes of freed buffers MLX keeps for reuse (0 keeps none); bounds memory under varied traffic",
        metavar="BYTES",
    )
    malloc_tuning: bool = setting(
        True,
        parse_bool,
        "pin glibc's mmap and trim thresholds at 128 KiB so freed memory goes back to the system",
        flag=True,
    )
    admission_window_ms: float = setting(
        20.0,
        parse_non_negative_float,
        "an idle scheduler waits for more arrivals so a burst is prefilled as one batch: while they keep "
        "coming at most this far apart, up to 5 times this in all; 0 disables",
        metavar="MS",
    )
    request_timeout: float = setting(
        600.0,
        parse_positive_float,
        "deadline in seconds for one generation request, queueing included: a reply still running then ends as a "
        "length cut with what it wrote; one not started is a 504",
        metavar="SECONDS",
    )
    stream_keepalive: float = setting(
        5.0,
        parse_positive_float,
        "seconds a stream may stay silent (queued, or prefilling a long prompt) before a keep-alive is sent "
        "(an SSE comment on the OpenAI APIs, Anthropic's ping event), so clients and proxies do not give up on it",
        metavar="SECONDS",
    )
    default_max_tokens: int = setting(
        4096,
        parse_non_negative_int,
        "output tokens a reply may have when its request sets no limit, or fewer if the context leaves fewer "
        "(0: whatever the context leaves)",
        metavar="TOKENS",
    )
    grammar_cache: int = setting(
        256,
        parse_positive_int,
        "compiled grammars (JSON schemas, tool calls) kept for reuse, least recently used first out",
        metavar="N",
    )
    cors_allow_origins: str | None = setting(
        None,
        _optional_text,
        "origins browser UIs may call from, comma-separated (https://ui.example,http://localhost:3000), or * for "
        "any (unset: no CORS headers)",
        metavar="ORIGINS",
    )
    default_temperature: float | None = setting(
        None,
        lambda text: _optional_number(text, 0.0, 2.0, "a temperature"),
        "temperature for requests that send none (unset: the model's generation_config.json, else 1.0)",
        metavar="T",
    )
    default_top_p: float | None = setting(
        None,
        lambda text: _optional_number(text, 0.0, 1.0, "a top_p", open_low=True),
        "top_p for requests that send none (unset: the model's generation_config.json, else 1.0)",
        metavar="P",
    )
    max_images: int = setting(
        16,
        parse_positive_int,
        "most image parts one request may hold (more is a 400, before anything is fetched)",
        metavar="N",
    )
    max_image_bytes: int = setting(
        64 * 1024**2,
        parse_positive_bytes,
        "most bytes read for one image, enforced while it streams in (a vision model only)",
        metavar="BYTES",
    )
    max_image_pixels: int = setting(
        50_000_000,
        parse_positive_int,
        "most pixels (width x height) of one image, read from its header before decoding",
        metavar="N",
    )
    max_image_memory_bytes: int = setting(
        1024**3,
        parse_positive_bytes,
        "most bytes of decoded images held at once, across requests: a request needing more is a 400, one that "
        "would overrun what others hold waits its turn",
        metavar="BYTES",
    )
    media_path: Path | None = setting(  # noqa: RUF009
        None,
        _optional_path,
        "the directory file:// image URLs are confined to (unset: file:// URLs are refused)",
        metavar="DIR",
    )
    allow_private_media_urls: bool = setting(
        False,
        parse_bool,
        "let image URLs reach loopback, private and link-local addresses (local use only: logs a warning)",
        flag=True,
    )
    prompt_cache: bool = setting(
        True,
        parse_bool,
        "keep model state snapshots so a conversation's next turn prefills only its new tokens",
        flag=True,
    )
    prompt_cache_snapshot_capacity_bytes: int | None = setting(
        None,
        parse_positive_bytes,
        "byte budget of the snapshot store (default: sized from the model's state and the device's memory)",
        metavar="BYTES",
    )
    prompt_cache_snapshot_max_entries: int = setting(4096, parse_positive_int, "most snapshots kept", metavar="N")
    prompt_cache_snapshot_ttl: float = setting(
        7200.0, parse_positive_float, "seconds a snapshot is kept after its last use", metavar="SECONDS"
    )
    prompt_cache_dir: Path | None = setting(  # noqa: RUF009
        None,
        _optional_path,
        "where the prompt cache's disk tier keeps snapshot files, one private subdirectory per model (default: "
        "prompt-cache under --cache-dir)",
        metavar="DIR",
    )
    prompt_cache_disk_bytes: int | None = setting(
        None,
        parse_bytes,
        "byte budget of the prompt cache's disk tier, which keeps conversations warm through evictions and "
        "restarts; 0 turns it off (default: sized from the model's state, at most half the free disk space)",
        metavar="BYTES",
    )
    prompt_cache_bits: int | None = setting(
        None,
        parse_prompt_cache_bits,
        "store the prompt cache's attention KV quantized to 8 or 4 bits, in memory and on disk, so the same budgets "
        "hold about 2-6x the conversations (recurrent layers stay exact; see docs/prompt-cache.md for what it costs "
        "in quality); off: as the model computes it",
        metavar="BITS",
    )
    prompt_cache_group_size: int = setting(
        64,
        parse_prompt_cache_group_size,
        "values sharing one scale and bias in quantized snapshots (32, 64 or 128); it must divide the model's "
        "attention head dimension, or that model does not load",
        metavar="N",
    )
    prompt_cache_min_prefix: int = setting(
        16,
        parse_positive_int,
        "shortest cached prefix (tokens) worth reusing; shorter matches count as misses",
        metavar="TOKENS",
    )
    prompt_cache_normalize: bool = setting(
        True,
        parse_bool,
        "leave out system-prompt lines that change between requests and mean nothing to the model (Claude Code's "
        "x-anthropic-billing-header) before rendering, so they do not bust the prompt cache",
        flag=True,
    )
    data_dir: Path = setting(  # noqa: RUF009
        Path(platformdirs.user_data_dir("courier")),
        _path,
        "where stored responses and conversations live (an SQLite database), unless --storage names PostgreSQL",
        metavar="DIR",
    )
    storage: str | None = setting(
        None,
        parse_storage_url,
        "store responses and conversations in PostgreSQL, shared by every replica given the same URL "
        "(postgresql://user:password@host:port/dbname); unset: SQLite under --data-dir",
        metavar="URL",
        strict=True,
    )
    storage_max_bytes: int = setting(
        1024**3,
        parse_positive_bytes,
        "byte budget of stored responses and conversations; the least recently updated go first",
        metavar="BYTES",
    )
    storage_max_entries: int = setting(
        100_000, parse_positive_int, "most stored responses plus conversations", metavar="N"
    )
    storage_tenant_max_bytes: int | None = setting(
        None,
        parse_positive_bytes,
        "byte budget of each API key's stored responses and conversations; a write evicts only its own key's least "
        "recently updated records, never another key's (default: --storage-max-bytes shared evenly by the keys)",
        metavar="BYTES",
    )
    storage_tenant_max_entries: int | None = setting(
        None,
        parse_positive_int,
        "most stored responses plus conversations of each API key (default: --storage-max-entries shared evenly "
        "by the keys)",
        metavar="N",
    )
    storage_ttl: float = setting(
        30 * 24 * 3600.0,
        parse_positive_float,
        "seconds a stored response or conversation is kept after its last update",
        metavar="SECONDS",
    )
    replica_id: str | None = setting(
        None,
        parse_replica_id,
        "this replica's name behind a front (1-16 of a-z, 0-9, -): every response id then carries it "
        "(resp_ID.<hex>), so a front routes the next turn, GET, DELETE and cancel of a response to this replica",
        metavar="ID",
        strict=True,
    )
    api_key: str | None = setting(
        None,
        _optional_text,
        "keys clients must send as `Authorization: Bearer KEY` on every route but /health, comma-separated (unset: "
        "no key is asked for)",
        metavar="KEYS",
    )
    api_key_file: Path | None = setting(  # noqa: RUF009
        None,
        _path,
        "a file of client keys, one per line (blank lines and # comments ignored), added to --api-key",
        metavar="PATH",
    )
    admin_api_key: str | None = setting(
        None,
        _optional_text,
        "keys that may also do what only an operator may (POST /v1/cache/reset), comma-separated",
        metavar="KEYS",
    )
    public_metrics: bool = setting(
        False,
        parse_bool,
        "answer GET /metrics without a key even when keys are set (a scraper on a trusted network)",
        flag=True,
    )
    compaction_key_file: Path | None = setting(  # noqa: RUF009
        None,
        _path,
        "a file holding a secret key: compaction capsules are then authenticated (HMAC) and foreign or altered "
        "ones refused",
        metavar="PATH",
    )
    shutdown_timeout: float = setting(
        30.0,
        parse_positive_float,
        "seconds in-flight requests get to finish after SIGTERM/SIGINT",
        metavar="SECONDS",
    )
    trace_file: Path | None = setting(  # noqa: RUF009
        None, _path, "also write finished OpenTelemetry spans to this file as JSON lines", metavar="PATH"
    )
    log_level: str = setting("info", _choice(LOG_LEVELS), "debug, info, warning or error", metavar="LEVEL")


def options_of(settings_class: type[Any]) -> tuple[Option, ...]:
    """One `Option` per field of a settings dataclass, in field order, from each field's `setting(...)` metadata."""
    options = []
    for settings_field in fields(settings_class):
        metadata = settings_field.metadata.get(_METADATA_KEY)
        if not isinstance(metadata, _OptionMetadata):
            raise TypeError(
                f"{settings_class.__name__}.{settings_field.name} has no option metadata: "
                "declare it with setting(default, parse, help, ...)"
            )
        options.append(
            Option(
                name=settings_field.name,
                parse=metadata.parse,
                default=settings_field.default,
                help=metadata.help,
                metavar=metadata.metavar,
                is_flag=metadata.is_flag,
                strict=metadata.strict,
                repeated=metadata.repeated,
            )
        )
    return tuple(options)


OPTIONS: tuple[Option, ...] = options_of(Settings)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one flag per option; help shows each flag's variable and default."""
    for option in OPTIONS:
        default = "unset" if option.default in (None, ()) else option.default
        help_text = f"{option.help} [env {option.env}; default: {default}]"
        if option.is_flag:
            parser.add_argument(
                option.flag,
                dest=option.name,
                action=argparse.BooleanOptionalAction,
                default=argparse.SUPPRESS,
                help=help_text,
            )
        else:
            parser.add_argument(
                option.flag,
                dest=option.name,
                type=_argparse_type(option),
                action="extend" if option.repeated else "store",
                default=argparse.SUPPRESS,
                metavar=option.metavar,
                help=help_text,
            )


def resolve(arguments: argparse.Namespace, environ: Mapping[str, str]) -> Settings:
    """Combine parsed CLI arguments, the environment and the defaults."""
    values: dict[str, Any] = {}
    given = vars(arguments)
    for option in OPTIONS:
        if option.name in given:
            values[option.name] = tuple(given[option.name]) if option.repeated else given[option.name]
        elif option.env in environ:
            values[option.name] = _from_environment(option, environ[option.env])
        else:
            values[option.name] = option.default
    unknown = sorted(name for name in environ if name.startswith(ENV_PREFIX) and name not in _KNOWN_VARIABLES)
    for name in unknown:
        logger.warning("ignoring unknown environment variable %s", name)
    return Settings(**values)


_KNOWN_VARIABLES = frozenset(option.env for option in OPTIONS)


class SettingsError(ValueError):
    """A strict setting's environment variable does not parse: the server does not start."""


def _from_environment(option: Option, raw: str) -> Any:
    try:
        return option.parse(raw)
    except ValueError as error:
        if option.strict:  # the value itself is not repeated: it may hold a password
            raise SettingsError(f"{option.env}: {error}") from None
        logger.warning("ignoring %s=%r: %s; using the default %r", option.env, raw, error, option.default)
        return option.default


def _argparse_type(option: Option) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            return option.parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from error

    parse.__name__ = option.name
    return parse
