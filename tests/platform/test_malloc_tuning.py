from __future__ import annotations

import subprocess
import sys

import pytest

from courier.platform.malloc_tuning import _glibc, malloc_usage, pin_malloc_thresholds


def test_an_operators_malloc_variables_are_left_alone() -> None:
    tuning = pin_malloc_thresholds({"MALLOC_TRIM_THRESHOLD_": "1000000"})
    assert not tuning.applied
    assert "MALLOC_TRIM_THRESHOLD_" in tuning.detail


def test_tuning_can_be_turned_off() -> None:
    assert not pin_malloc_thresholds({}, enabled=False).applied


def test_pinned_thresholds_give_freed_large_blocks_back() -> None:
    """In a fresh process: with the thresholds pinned, freeing a large block leaves malloc holding little."""
    if _glibc() is None:
        pytest.skip("glibc only")
    code = (
        "import ctypes, sys\n"
        "from courier.platform.malloc_tuning import malloc_usage, pin_malloc_thresholds\n"
        "if sys.argv[1] == 'pin': assert pin_malloc_thresholds({}).applied\n"
        "libc = ctypes.CDLL('libc.so.6')\n"
        "libc.malloc.restype = ctypes.c_void_p; libc.free.argtypes = [ctypes.c_void_p]\n"
        # Freeing a 16 MiB mapped block raises glibc's dynamic thresholds (mmap 16 MiB, trim 32 MiB) unless pinned.
        "big = libc.malloc(16 << 20); libc.free(big)\n"
        "blocks = [libc.malloc(1 << 20) for _ in range(20)]\n"
        "for block in blocks: libc.free(block)\n"
        "print(malloc_usage()['free_held_bytes'])\n"
    )
    held = {
        mode: int(subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True, check=True).stdout)
        for mode in ("pin", "default")
    }
    assert held["default"] >= 16 << 20  # most of the 20 MiB freed is kept
    assert held["pin"] < 4 << 20


def test_malloc_usage_reports_glibc_heap() -> None:
    usage = malloc_usage()
    if _glibc() is None:
        assert usage is None
        return
    assert usage is not None
    assert usage["in_use_bytes"] > 0
