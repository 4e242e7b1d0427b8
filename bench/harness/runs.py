"""A bench's run: its `Launcher`, in the cache directory `--cache-dir` names (or a temporary one), with the
OpenBLAS and the baseline tree its arguments give."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from contextlib import contextmanager

from bench.harness.models import cache_directory
from bench.harness.servers import OPENBLAS_PATH, Launcher


@contextmanager
def launching(bench: str, args: argparse.Namespace) -> Iterator[Launcher]:
    """A Launcher whose logs go to CACHE/bench-logs/`bench`-<server>.log."""
    with cache_directory(args.cache_dir) as cache_dir:
        log_dir, tree = cache_dir / "bench-logs", getattr(args, "baseline_tree", None)
        openblas = getattr(args, "openblas", OPENBLAS_PATH)
        yield Launcher(bench=bench, cache_dir=cache_dir, log_dir=log_dir, openblas=openblas, baseline_tree=tree)
