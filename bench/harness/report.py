"""What a bench prints and writes: progress on stderr, Markdown on stdout, the raw results as JSON."""

from __future__ import annotations

import json
import math
import os
import platform
import sys
from collections.abc import Callable, Iterable
from dataclasses import asdict, is_dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from courier.platform.blas import BlasReport

SHOWN_CHARS = 240


def progress(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def _version(distribution: str) -> str:
    """A distribution's version; run from a checkout on PYTHONPATH (as on a GPU machine with no index), Courier has
    no installed metadata, and the report still gets written."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "not installed (run from a checkout)"


def environment(blas: BlasReport, *packages: str) -> dict[str, object]:
    """Versions, machine and MLX device, for the report's head and its JSON (`packages`: more versions)."""
    import mlx.core as mx

    from courier.platform.mlx_backend import installed_backend

    names = ("mlx", "mlx-lm", "courier", "openai", *packages)
    return {
        "python": platform.python_version(),
        **{name: _version(name) for name in names},
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor() or "unknown",
        "cpu_count": os.cpu_count(),
        "mlx_device": f"{mx.default_device().type.name} ({installed_backend() or 'mlx'})",
        "bench_process_blas": blas.as_dict(),
    }


def head(title: str, env: dict[str, object], settings: object, *packages: str, device: bool = True) -> None:
    """The report's title and its environment lines (`packages`: more versions than MLX's and Courier's)."""
    print(f"## {title}\n")
    versions = ", ".join(f"{name} {env[name]}" for name in ("mlx", "mlx-lm", "courier", *packages))
    print(f"- python {env['python']}, {versions}")
    print(f"- machine: {env['platform']} ({env['machine']}, {env['processor']}), {env['cpu_count']} CPUs")
    if device:
        print(f"- MLX device: {env['mlx_device']}")
    print(f"- settings: {settings}\n")


def table(headers: str, rows: Iterable[str]) -> None:
    """A Markdown table of "a | b" lines, then a blank line."""
    print(f"| {headers} |\n|" + "---|" * (headers.count(" | ") + 1))
    for row in rows:
        print(f"| {row} |")
    print()


def write_json(value: object, path: Path | None) -> None:
    """`value` (dataclasses, lists and dicts of them) as indented JSON at `path`, when one is given."""
    if path is None:
        return
    path.write_text(json.dumps(value, indent=2, default=_plain) + "\n")
    progress(f"raw results written to {path}")


def _plain(value: Any) -> Any:
    if is_dataclass(value) and not isinstance(value, type):
        return asdict(value)
    return str(value)


def percent(fraction: float | None, digits: int = 1, missing: str = "n/a") -> str:
    """A share as a percentage: 0.9712 -> "97.1%"."""
    return missing if fraction is None or not math.isfinite(fraction) else f"{100 * fraction:.{digits}f}%"


def ms(seconds: float | None, digits: int = 1, missing: str = "n/a") -> str:
    """Seconds in milliseconds."""
    return missing if seconds is None else f"{seconds * 1000:.{digits}f}"


def num(value: float | None, digits: int = 1, missing: str = "n/a") -> str:
    return missing if value is None or not math.isfinite(value) else f"{value:.{digits}f}"


def ratio_text(ours: float | None, theirs: float | None, show: Callable[[float | None], str]) -> str:
    """Both figures and their ratio, as in "97.1% / 97.0% = 1.001x"."""
    return f"{show(ours)} / {show(theirs)} = {'n/a' if ours is None or not theirs else f'{ours / theirs:.3f}x'}"


def verdict(value: float | None, target: float, *, at_most: bool = False) -> str:
    """`value`x against a target it must reach (or, `at_most`, stay under)."""
    if value is None or not math.isfinite(value):
        return "n/a"
    met = value <= target if at_most else value >= target
    return f"**{value:.2f}x** ({'meets' if met else 'misses'} target {'<=' if at_most else '>='} {target}x)"


def shown(text: str, most: int = SHOWN_CHARS) -> str:
    return text if len(text) <= most else text[: most - 3] + "..."


def inline(text: str) -> str:
    """`text` as Markdown inline code on one line."""
    return "`" + text.replace("\\", "\\\\").replace("\n", "\\n").replace("`", "'") + "`"


def counts(counter: dict[str, int]) -> str:
    """{"429": 3, "completed": 5} -> "429: 3, completed: 5"."""
    return ", ".join(f"{key}: {value}" for key, value in sorted(counter.items())) or "none"
