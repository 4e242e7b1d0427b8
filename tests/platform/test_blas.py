from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from courier.platform import blas


def run_python(code: str) -> str:
    """Each BLAS choice needs a fresh process: a library, once loaded, stays loaded."""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    return result.stdout.strip()


def test_auto_loads_openblas_where_one_is_installed() -> None:
    if not any(Path(candidate).exists() for candidate in blas._SYSTEM_CANDIDATES):
        pytest.skip("no OpenBLAS on this machine (./dev installs it on Debian as root)")
    output = run_python(
        "from courier.platform.blas import load_optimized_blas; r = load_optimized_blas('auto');"
        "import mlx.core as mx; a = mx.ones((64, 64)); mx.eval(a @ a);"
        "print(r.library, r.optimized, r.path)"
    )
    library, optimized, path = output.split()
    assert (library, optimized) == ("OpenBLAS", "True")
    assert Path(path).exists()


def test_none_keeps_the_reference_blas() -> None:
    output = run_python("from courier.platform.blas import load_optimized_blas; print(load_optimized_blas('none'))")
    assert "library='reference'" in output
    assert "optimized=False" in output


def test_an_explicit_path_that_is_not_a_blas_fails_loudly(tmp_path: Path) -> None:
    bogus = tmp_path / "libnot-blas.so"
    bogus.write_bytes(b"not a library")
    code = f"from courier.platform.blas import load_optimized_blas; load_optimized_blas({str(bogus)!r})"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode != 0
    assert "cannot use BLAS library" in result.stderr


def test_report_is_remembered() -> None:
    report = blas.load_optimized_blas()  # conftest loaded it first; this returns the same report
    assert blas.current_report() is report
    assert set(report.as_dict()) == {"library", "path", "optimized", "detail", "kernels", "kernel_choice", "gemv"}
