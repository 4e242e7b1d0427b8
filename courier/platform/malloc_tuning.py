"""glibc malloc settings that keep freed memory from piling up, and malloc's own view of the heap.

glibc raises its mmap and trim thresholds (up to 32 MiB and twice that) the first
time a large block is freed, and model loading frees many. From then on MLX's
buffers of 128 KiB and more come from per-thread arenas, and freed space is kept
instead of returned: under a soak RSS climbs in steps (about 25-40 MiB here) while
the bytes in use stay flat. Pinning both thresholds at 128 KiB (`mallopt` also
stops the dynamic raise) keeps large buffers in their own mappings and trims the
heap tops, which held RSS flat in the same soak at the same throughput.

An operator's `MALLOC_MMAP_THRESHOLD_` / `MALLOC_TRIM_THRESHOLD_` is left alone.
Only glibc is tuned (musl and macOS have other allocators). Call before the model
loads and before threads start.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys
from collections.abc import Mapping
from dataclasses import dataclass

PINNED_THRESHOLD = 128 * 1024
# mallopt parameters (glibc malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
OPERATOR_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


@dataclass(frozen=True, slots=True)
class MallocTuning:
    applied: bool
    detail: str


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """glibc, once (finding it runs `ldconfig -p`; /health and /metrics ask on every call)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "gnu_get_libc_version") and hasattr(libc, "mallopt") else None


def pin_malloc_thresholds(environ: Mapping[str, str], enabled: bool = True) -> MallocTuning:
    """Pin glibc's mmap and trim thresholds at `PINNED_THRESHOLD` unless told otherwise."""
    if not enabled:
        return MallocTuning(applied=False, detail="disabled by configuration")
    preset = [name for name in OPERATOR_VARIABLES if name in environ]
    if preset:
        return MallocTuning(applied=False, detail=f"left to the environment ({', '.join(preset)})")
    libc = _glibc()
    if libc is None:
        return MallocTuning(applied=False, detail="not glibc")
    mallopt = libc.mallopt
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = mallopt(_M_MMAP_THRESHOLD, PINNED_THRESHOLD) == 1 and mallopt(_M_TRIM_THRESHOLD, PINNED_THRESHOLD) == 1
    if not ok:
        return MallocTuning(applied=False, detail="mallopt refused the thresholds")
    return MallocTuning(applied=True, detail=f"mmap and trim thresholds pinned at {PINNED_THRESHOLD} bytes")


def malloc_usage() -> dict[str, int] | None:
    """glibc's heap: bytes in use (small blocks and separate mappings) and free bytes it holds; None elsewhere."""
    libc = _glibc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        return None
    mallinfo2 = libc.mallinfo2
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    return {"in_use_bytes": int(info.uordblks + info.hblkhd), "free_held_bytes": int(info.fordblks)}
