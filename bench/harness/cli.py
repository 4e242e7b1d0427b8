"""Arguments every bench parses alike: lists of names and numbers, where results go, the peers' OpenBLAS, the
baseline tree, and the weights of mlx-lm in process."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from pathlib import Path

from bench.harness.models import WEIGHT_CHOICES
from bench.harness.servers import COURIER, COURIER_BASELINE, OPENBLAS_PATH

METHOD = "docs/benchmarks.md"


def parser(doc: str | None) -> argparse.ArgumentParser:
    """A parser whose description is the bench's docstring; its method is in docs/benchmarks.md."""
    text = f"{(doc or '').strip()}\n\nHow it is run and what it measures: {METHOD}."
    return argparse.ArgumentParser(description=text, formatter_class=argparse.RawDescriptionHelpFormatter)


def names(allowed: Sequence[str], *, in_given_order: bool = True) -> Callable[[str], list[str]]:
    """A parser of comma-separated names among `allowed` (each once; in the order given, or in `allowed`'s)."""

    def parse(text: str) -> list[str]:
        found = list(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
        unknown = [name for name in found if name not in allowed]
        if not found or unknown:
            raise argparse.ArgumentTypeError(f"expected some of {', '.join(allowed)}, got {text!r}")
        return found if in_given_order else [name for name in allowed if name in found]

    return parse


def positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def positive_ints(text: str) -> list[int]:
    """Comma-separated positive integers."""
    try:
        return [positive_int(part) for part in text.split(",") if part.strip()] or positive_ints("0")
    except (ValueError, argparse.ArgumentTypeError):
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}") from None


def add_results(parser: argparse.ArgumentParser, *, openblas: str | None = None) -> None:
    """--cache-dir and --json; --openblas when a float32 mlx_lm.server (`openblas` names it) may run."""
    parser.add_argument("--cache-dir", type=Path, default=None, help="model cache (default: a temporary directory)")
    parser.add_argument("--json", type=Path, default=None, help="also write the raw results here")
    if openblas is not None:
        parser.add_argument("--openblas", default=OPENBLAS_PATH, help=f"LD_PRELOAD for {openblas} ({OPENBLAS_PATH})")


def add_baseline(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--baseline-tree",
        type=lambda text: Path(text).resolve(),
        default=None,
        metavar="DIR",
        help=f"a checkout of another commit: adds {COURIER_BASELINE}, Courier imported from DIR, beside {COURIER}",
    )


def add_weights(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--weights",
        choices=WEIGHT_CHOICES,
        default="auto",
        help="weights of mlx-lm in process: float32 (dequantized, as Courier serves them on a CPU), stored (as on "
        "a GPU) or auto (as Courier serves them on this device)",
    )


def in_run_order(servers: Sequence[str]) -> list[str]:
    """`servers` as given, but the two Courier servers next to each other, in the order given (list
    courier-baseline first to run it first), so drift on a noisy machine hits both alike."""
    if COURIER not in servers or COURIER_BASELINE not in servers:
        return list(servers)
    first, second = sorted((COURIER, COURIER_BASELINE), key=list(servers).index)
    ordered = [name for name in servers if name != second]
    ordered.insert(ordered.index(first) + 1, second)
    return ordered


def choose_servers(
    parser: argparse.ArgumentParser, flag: str, chosen: Sequence[str] | None, default: Sequence[str], tree: Path | None
) -> list[str]:
    """The servers `flag` chose, or `default` plus courier-baseline when there is a baseline tree, in run order."""
    if chosen is None:
        chosen = [*default, COURIER_BASELINE] if tree is not None else default
    if COURIER_BASELINE in chosen and tree is None:
        parser.error(f"{flag} {COURIER_BASELINE} needs --baseline-tree DIR")
    return in_run_order(chosen)
