"""Server settings: every option is a CLI flag and a `COURIER_*` environment variable.

Precedence is CLI flag > environment variable > default. An environment value that
does not parse logs a warning naming the variable and keeps the default, so a typo
in a deployment's environment never stops the server from starting.
"""

from __future__ import annotations

import argparse
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import platformdirs

logger = logging.getLogger(__name__)

ENV_PREFIX = "COURIER_"
WEIGHT_FORMATS = ("auto", "native", "float32", "float16", "bfloat16")
LOG_LEVELS = ("debug", "info", "warning", "error")
_BYTE_UNITS = {"": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "ki": 1024, "mi": 1024**2, "gi": 1024**3}
_BYTES_PATTERN = re.compile(r"^\s*(\d+)\s*([kmg]i?)?b?\s*$", re.IGNORECASE)


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


def _choice(options: Sequence[str]) -> Callable[[str], str]:
    def parse(text: str) -> str:
        lowered = text.strip().lower()
        if lowered not in options:
            raise ValueError(f"{text!r} is not one of {', '.join(options)}")
        return lowered

    return parse


def _path(text: str) -> Path:
    return Path(text).expanduser()


def _optional_text(text: str) -> str | None:
    return text or None


def _optional_path(text: str) -> Path | None:
    return Path(text).expanduser() if text else None


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

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()


@dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    host: str = "127.0.0.1"
    port: int = 8000
    api_prefix: str = ""
    model: str | None = None
    served_model_name: str | None = None
    cache_dir: Path = Path(platformdirs.user_cache_dir("courier"))
    weight_format: str = "auto"
    blas: str = "auto"
    warmup: bool = True
    trust_remote_code: bool = False
    max_body_bytes: int = 32 * 1024**2
    max_batch: int = 16
    max_queue: int = 64
    prefill_step_size: int = 512
    mlx_cache_limit: int = 1024**3
    malloc_tuning: bool = True
    admission_window_ms: float = 20.0
    request_timeout: float = 600.0
    max_images: int = 16
    max_image_bytes: int = 64 * 1024**2
    max_image_pixels: int = 50_000_000
    media_path: Path | None = None
    allow_private_media_urls: bool = False
    prompt_cache: bool = True
    prompt_cache_snapshot_capacity_bytes: int | None = None
    prompt_cache_snapshot_max_entries: int = 4096
    prompt_cache_snapshot_ttl: float = 7200.0
    prompt_cache_min_prefix: int = 16
    data_dir: Path = Path(platformdirs.user_data_dir("courier"))
    storage_max_bytes: int = 1024**3
    storage_max_entries: int = 100_000
    storage_ttl: float = 30 * 24 * 3600.0
    compaction_key_file: Path | None = None
    shutdown_timeout: float = 30.0
    trace_file: Path | None = None
    log_level: str = "info"


_DEFAULTS = Settings()

OPTIONS: tuple[Option, ...] = (
    Option(name="host", parse=str, default=_DEFAULTS.host, help="interface to listen on", metavar="HOST"),
    Option(name="port", parse=parse_port, default=_DEFAULTS.port, help="TCP port; 0 picks a free one", metavar="PORT"),
    Option(
        name="api_prefix",
        parse=parse_api_prefix,
        default=_DEFAULTS.api_prefix,
        help="serve every route under this path (e.g. /courier -> /courier/v1/chat/completions)",
        metavar="PATH",
    ),
    Option(
        name="model",
        parse=_optional_text,
        default=None,
        help="MLX model directory, .gguf file or Hugging Face repo id (default: embedded SmolLM2-135M-Instruct)",
        metavar="MODEL",
    ),
    Option(
        name="served_model_name",
        parse=_optional_text,
        default=None,
        help="model id clients use (default: derived from --model)",
        metavar="NAME",
    ),
    Option(
        name="cache_dir",
        parse=_path,
        default=_DEFAULTS.cache_dir,
        help="where converted models are kept",
        metavar="DIR",
    ),
    Option(
        name="weight_format",
        parse=_choice(WEIGHT_FORMATS),
        default=_DEFAULTS.weight_format,
        help="serving weights: auto (float32 on CPU, as stored on GPU), native, float32, float16, bfloat16",
        metavar="FORMAT",
    ),
    Option(
        name="blas",
        parse=str,
        default=_DEFAULTS.blas,
        help="CPU BLAS for MLX: auto (find OpenBLAS), none, or a library path",
        metavar="BLAS",
    ),
    Option(
        name="warmup",
        parse=parse_bool,
        default=_DEFAULTS.warmup,
        help="run one short forward pass before reporting ready",
        is_flag=True,
    ),
    Option(
        name="trust_remote_code",
        parse=parse_bool,
        default=_DEFAULTS.trust_remote_code,
        help="allow a model directory's own architecture file (config.json `model_file`) to be imported and run",
        is_flag=True,
    ),
    Option(
        name="max_body_bytes",
        parse=parse_bytes,
        default=_DEFAULTS.max_body_bytes,
        help="largest request body accepted (413 beyond); accepts 64MiB, 1GB, ...",
        metavar="BYTES",
    ),
    Option(
        name="max_batch",
        parse=parse_positive_int,
        default=_DEFAULTS.max_batch,
        help="sequences generated together in one batch",
        metavar="N",
    ),
    Option(
        name="max_queue",
        parse=parse_non_negative_int,
        default=_DEFAULTS.max_queue,
        help="requests waiting for a batch slot; beyond it requests get 429 with Retry-After",
        metavar="N",
    ),
    Option(
        name="prefill_step_size",
        parse=parse_positive_int,
        default=_DEFAULTS.prefill_step_size,
        help="prompt tokens prefilled per step; smaller keeps running streams flowing during long prefills",
        metavar="TOKENS",
    ),
    Option(
        name="mlx_cache_limit",
        parse=parse_bytes,
        default=_DEFAULTS.mlx_cache_limit,
        help="most bytes of freed buffers MLX keeps for reuse (0 keeps none); bounds memory under varied traffic",
        metavar="BYTES",
    ),
    Option(
        name="malloc_tuning",
        parse=parse_bool,
        default=_DEFAULTS.malloc_tuning,
        help="pin glibc's mmap and trim thresholds at 128 KiB so freed memory goes back to the system",
        is_flag=True,
    ),
    Option(
        name="admission_window_ms",
        parse=parse_non_negative_float,
        default=_DEFAULTS.admission_window_ms,
        help=(
            "an idle scheduler waits for more arrivals so a burst is prefilled as one batch: while they keep "
            "coming at most this far apart, up to 5 times this in all; 0 disables"
        ),
        metavar="MS",
    ),
    Option(
        name="request_timeout",
        parse=parse_positive_float,
        default=_DEFAULTS.request_timeout,
        help="deadline in seconds for one generation request, queueing included (504 beyond)",
        metavar="SECONDS",
    ),
    Option(
        name="max_images",
        parse=parse_positive_int,
        default=_DEFAULTS.max_images,
        help="most image parts one request may hold (more is a 400, before anything is fetched)",
        metavar="N",
    ),
    Option(
        name="max_image_bytes",
        parse=parse_positive_bytes,
        default=_DEFAULTS.max_image_bytes,
        help="most bytes read for one image, enforced while it streams in (a vision model only)",
        metavar="BYTES",
    ),
    Option(
        name="max_image_pixels",
        parse=parse_positive_int,
        default=_DEFAULTS.max_image_pixels,
        help="most pixels (width x height) of one image, read from its header before decoding",
        metavar="N",
    ),
    Option(
        name="media_path",
        parse=_optional_path,
        default=_DEFAULTS.media_path,
        help="the directory file:// image URLs are confined to (unset: file:// URLs are refused)",
        metavar="DIR",
    ),
    Option(
        name="allow_private_media_urls",
        parse=parse_bool,
        default=_DEFAULTS.allow_private_media_urls,
        help="let image URLs reach loopback, private and link-local addresses (local use only: logs a warning)",
        is_flag=True,
    ),
    Option(
        name="prompt_cache",
        parse=parse_bool,
        default=_DEFAULTS.prompt_cache,
        help="keep model state snapshots so a conversation's next turn prefills only its new tokens",
        is_flag=True,
    ),
    Option(
        name="prompt_cache_snapshot_capacity_bytes",
        parse=parse_positive_bytes,
        default=None,
        help="byte budget of the snapshot store (default: sized from the model's state and the device's memory)",
        metavar="BYTES",
    ),
    Option(
        name="prompt_cache_snapshot_max_entries",
        parse=parse_positive_int,
        default=_DEFAULTS.prompt_cache_snapshot_max_entries,
        help="most snapshots kept",
        metavar="N",
    ),
    Option(
        name="prompt_cache_snapshot_ttl",
        parse=parse_positive_float,
        default=_DEFAULTS.prompt_cache_snapshot_ttl,
        help="seconds a snapshot is kept after its last use",
        metavar="SECONDS",
    ),
    Option(
        name="prompt_cache_min_prefix",
        parse=parse_positive_int,
        default=_DEFAULTS.prompt_cache_min_prefix,
        help="shortest cached prefix (tokens) worth reusing; shorter matches count as misses",
        metavar="TOKENS",
    ),
    Option(
        name="data_dir",
        parse=_path,
        default=_DEFAULTS.data_dir,
        help="where stored responses and conversations live (an SQLite database)",
        metavar="DIR",
    ),
    Option(
        name="storage_max_bytes",
        parse=parse_positive_bytes,
        default=_DEFAULTS.storage_max_bytes,
        help="byte budget of stored responses and conversations; the least recently updated go first",
        metavar="BYTES",
    ),
    Option(
        name="storage_max_entries",
        parse=parse_positive_int,
        default=_DEFAULTS.storage_max_entries,
        help="most stored responses plus conversations",
        metavar="N",
    ),
    Option(
        name="storage_ttl",
        parse=parse_positive_float,
        default=_DEFAULTS.storage_ttl,
        help="seconds a stored response or conversation is kept after its last update",
        metavar="SECONDS",
    ),
    Option(
        name="compaction_key_file",
        parse=_path,
        default=None,
        help="a file holding a secret key: compaction capsules are then authenticated (HMAC) and foreign or altered "
        "ones refused",
        metavar="PATH",
    ),
    Option(
        name="shutdown_timeout",
        parse=parse_positive_float,
        default=_DEFAULTS.shutdown_timeout,
        help="seconds in-flight requests get to finish after SIGTERM/SIGINT",
        metavar="SECONDS",
    ),
    Option(
        name="trace_file",
        parse=_path,
        default=None,
        help="also write finished OpenTelemetry spans to this file as JSON lines",
        metavar="PATH",
    ),
    Option(
        name="log_level",
        parse=_choice(LOG_LEVELS),
        default=_DEFAULTS.log_level,
        help="debug, info, warning or error",
        metavar="LEVEL",
    ),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one flag per option; help shows each flag's variable and default."""
    for option in OPTIONS:
        default = "unset" if option.default is None else option.default
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
            values[option.name] = given[option.name]
        elif option.env in environ:
            values[option.name] = _from_environment(option, environ[option.env])
        else:
            values[option.name] = option.default
    unknown = sorted(name for name in environ if name.startswith(ENV_PREFIX) and name not in _KNOWN_VARIABLES)
    for name in unknown:
        logger.warning("ignoring unknown environment variable %s", name)
    return Settings(**values)


_KNOWN_VARIABLES = frozenset(option.env for option in OPTIONS)
assert {option.name for option in OPTIONS} == {field.name for field in fields(Settings)}


def _from_environment(option: Option, raw: str) -> Any:
    try:
        return option.parse(raw)
    except ValueError as error:
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
