"""The parsers that turn a setting's text (a flag's value or an environment variable's) into its value, each
raising `ValueError` with a message that says what was expected."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from pathlib import Path

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


def int_between(text: str, low: int, high: int) -> int:
    value = int(text)
    if not low <= value <= high:
        raise ValueError(f"must be between {low} and {high}: {text!r}")
    return value


def choice(options: Sequence[str]) -> Callable[[str], str]:
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


def parse_kv_bits(text: str) -> int | None:
    """`8` or `4`; `off` (or empty, `none`, `0`) keeps the running batch's KV as the model computes it."""
    lowered = text.strip().lower()
    if lowered in ("", "off", "none", "0"):
        return None
    if lowered not in ("8", "4"):
        raise ValueError(f"KV bits are 8, 4 or off, not {text!r}")
    return int(lowered)


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


def expanded_path(text: str) -> Path:
    return Path(text).expanduser()


def optional_text(text: str) -> str | None:
    return text or None


def optional_number(text: str, low: float, high: float, what: str, *, open_low: bool = False) -> float | None:
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


def optional_path(text: str) -> Path | None:
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
