"""Which kernels a `DYNAMIC_ARCH` OpenBLAS runs, and a better choice when it guesses low.

OpenBLAS picks its kernels once, when the library is loaded, from the CPU's model
number. A build that predates the CPU (Debian's 0.3.21 on a Sapphire Rapids VM,
measured here) falls back to its oldest x86-64 kernels, `Prescott`, and prefill then
runs 2-3x slower than it could. `OPENBLAS_CORETYPE` overrides the choice; it is
read by the library's constructor, so it must be in the environment before the
`dlopen`.

The decision is made without loading the library into this process: a child
process loads it with `OPENBLAS_CORETYPE` unset and reports the kernels it chose.
Only when they rank below what the CPU's feature flags support is the variable
set. A variable the operator set is never touched.

This module must not import mlx.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ENV_VAR = "OPENBLAS_CORETYPE"

# OpenBLAS core names (lower-cased, as `openblas_get_corename` reports them) ranked by
# the vector extensions their kernels use. A name missing here is never overridden.
_RANK = {
    "prescott": 0,
    "core2": 0,
    "penryn": 0,
    "dunnington": 0,
    "atom": 0,
    "nehalem": 1,
    "sandybridge": 2,
    "haswell": 3,
    "zen": 3,
    "skylakex": 4,
    "cooperlake": 5,
    "sapphirerapids": 6,
}
_AVX512_BASE = frozenset({"avx512f", "avx512vl", "avx512bw", "avx512dq", "avx512cd"})

_PROBE = (
    "import ctypes, sys\n"
    "handle = ctypes.CDLL(sys.argv[1])\n"
    "name = handle.openblas_get_corename\n"
    "name.restype = ctypes.c_char_p\n"
    "print(name().decode())\n"
)


@dataclass(frozen=True, slots=True, kw_only=True)
class CoreChoice:
    """What was decided about `OPENBLAS_CORETYPE`, for the startup log."""

    detected: str | None  # what the library picks by itself (None: not probed or no answer)
    chosen: str | None  # the value now in the environment (None: left unset)
    reason: str


def supported_core(flags: frozenset[str]) -> str | None:
    """The best OpenBLAS kernels these x86 feature flags can run, or None when unsure."""
    if flags >= _AVX512_BASE:
        return "Cooperlake" if "avx512_bf16" in flags else "SkylakeX"
    if flags >= {"avx2", "fma"}:
        return "Haswell"
    return None


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The feature flags of the first CPU in /proc/cpuinfo (empty when unreadable)."""
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def probe_corename(library: str, *, timeout: float = 20.0) -> str | None:
    """The kernels `library` picks when loaded with no override, asked of a child process."""
    environ = {key: value for key, value in os.environ.items() if key != ENV_VAR}
    try:
        result = subprocess.run(
            [sys.executable, "-S", "-c", _PROBE, library],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=environ,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    name = result.stdout.strip()
    return name if result.returncode == 0 and name else None


def choose_core(library: str, *, flags: frozenset[str] | None = None) -> CoreChoice:
    """Set `OPENBLAS_CORETYPE` when `library` would pick weaker kernels than the CPU runs.

    Call before loading `library` into this process.
    """
    preset = os.environ.get(ENV_VAR)
    if preset:
        return CoreChoice(detected=None, chosen=preset, reason=f"{ENV_VAR} set by the environment")
    if platform.machine().lower() not in {"x86_64", "amd64"}:
        return CoreChoice(detected=None, chosen=None, reason="not an x86-64 CPU")
    best = supported_core(cpu_flags() if flags is None else flags)
    if best is None:
        return CoreChoice(detected=None, chosen=None, reason="no AVX2 or AVX-512 flags")
    return _compare(probe_corename(library), best)


def _compare(detected: str | None, best: str) -> CoreChoice:
    if detected is None:
        return CoreChoice(detected=None, chosen=None, reason="the library did not report its kernels")
    detected_rank = _RANK.get(detected.lower())
    if detected_rank is None:
        return CoreChoice(detected=detected, chosen=None, reason="kernels unknown to Courier; kept")
    if detected_rank >= _RANK[best.lower()]:
        return CoreChoice(detected=detected, chosen=None, reason="the library's own choice matches the CPU")
    os.environ[ENV_VAR] = best
    return CoreChoice(
        detected=detected, chosen=best, reason=f"the library picked {detected}; the CPU's flags support {best}"
    )
