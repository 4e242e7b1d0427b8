"""Products of up to three rows through OpenBLAS's gemv (`courier/platform/gemv_forward.py`), each case in a fresh
process: a BLAS, once loaded, stays loaded. The products MLX computes are checked against numpy's, forwarded and
not."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from courier.platform import blas

pytestmark = pytest.mark.skipif(
    not any(Path(candidate).exists() for candidate in blas._SYSTEM_CANDIDATES),
    reason="no OpenBLAS on this machine (./dev installs it on Debian as root)",
)

# Loads the BLAS as the server does, then multiplies few-row and many-row products of every shape MLX hands to
# sgemm: a transposed weight, a stored one, with a bias through addmm, a column read as a row, and a batch of
# one-row products with weights of their own, as a decode step's attention scores are. It prints each product's
# largest difference from numpy's, and how many products went to gemv.
PRODUCTS = """
import json, sys
from courier.platform.blas import load_optimized_blas, gemv_forwarding
report = load_optimized_blas("auto", forward_gemv=sys.argv[1] == "on")
import mlx.core as mx
import numpy as np
forwarding = gemv_forwarding()
mx.random.seed(0)
weights = mx.random.normal((300, 70)); bias = mx.random.normal((300,)); stored = mx.contiguous(weights.T)
column = mx.random.normal((70, 1)); batch = mx.random.normal((4, 1, 70)); per_batch = mx.random.normal((4, 70, 300))
def reference(rows): return np.array(rows) @ np.array(weights).T
cases = {}
def check(name, got, expected):
    before = forwarding.forwarded()
    value = np.array(got)  # evaluates the product
    cases[name] = {"error": float(np.abs(value - expected).max()), "forwarded": forwarding.forwarded() - before}
for rows in (1, 2, 3, 4, 8):
    x = mx.random.normal((rows, 70)); mx.eval(x)
    check(f"x @ w.T {rows}", x @ weights.T, reference(x))
    check(f"x @ stored {rows}", x @ stored, reference(x))
    check(f"addmm {rows}", mx.addmm(bias, x, weights.T), reference(x) + np.array(bias))
check("column.T @ w.T", column.T @ weights.T, reference(column.T))
check("batch @ per-batch weights", batch @ per_batch, np.array(batch) @ np.array(per_batch))
print(json.dumps({"gemv": report.gemv, "cases": cases}))
"""


def products(forward: str, environment: dict[str, str]) -> dict[str, object]:
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", **environment}
    result = subprocess.run(
        [sys.executable, "-c", PRODUCTS, forward], capture_output=True, text=True, timeout=120, check=True, env=env
    )
    outcome: dict[str, object] = json.loads(result.stdout.strip().splitlines()[-1])
    return outcome


def assert_products_are_right(cases: object) -> None:
    assert isinstance(cases, dict) and len(cases) == 17
    for name, case in cases.items():
        assert case["error"] < 1e-3, (name, case)


def test_products_of_up_to_three_rows_go_to_gemv_and_every_product_is_right(tmp_path: Path) -> None:
    outcome = products("on", {"XDG_CACHE_HOME": str(tmp_path)})
    assert str(outcome["gemv"]).startswith("products of up to 3 rows through cblas_sgemv")
    assert str(tmp_path / "courier" / "native") in str(outcome["gemv"])
    cases = outcome["cases"]
    assert_products_are_right(cases)
    assert isinstance(cases, dict)
    few_rows = [f"{product} {rows}" for product in ("x @ w.T", "x @ stored", "addmm") for rows in (1, 2, 3)]
    assert all(cases[name]["forwarded"] == 1 for name in [*few_rows, "column.T @ w.T"]), cases
    assert cases["batch @ per-batch weights"]["forwarded"] == 4, cases
    many_rows = [f"{product} {rows}" for product in ("x @ w.T", "x @ stored", "addmm") for rows in (4, 8)]
    assert all(cases[name]["forwarded"] == 0 for name in many_rows), cases


def test_the_library_built_once_serves_a_process_without_a_compiler(tmp_path: Path) -> None:
    products("on", {"XDG_CACHE_HOME": str(tmp_path)})
    (built,) = (tmp_path / "courier" / "native").glob("libcourier_gemv_forward-*.so")
    modified = built.stat().st_mtime_ns
    outcome = products("on", {"XDG_CACHE_HOME": str(tmp_path), "CC": str(tmp_path / "no-such-compiler")})
    assert str(outcome["gemv"]).startswith("products of up to 3 rows through cblas_sgemv"), outcome
    assert built.stat().st_mtime_ns == modified


def test_without_a_compiler_it_is_off_saying_why_and_products_stay_right(tmp_path: Path) -> None:
    outcome = products("on", {"XDG_CACHE_HOME": str(tmp_path), "CC": str(tmp_path / "no-such-compiler")})
    assert str(outcome["gemv"]).startswith("off: ") and "could not run" in str(outcome["gemv"]), outcome
    cases = outcome["cases"]
    assert_products_are_right(cases)
    assert isinstance(cases, dict) and all(case["forwarded"] == 0 for case in cases.values())


def test_switched_off_it_builds_nothing(tmp_path: Path) -> None:
    outcome = products("off", {"XDG_CACHE_HOME": str(tmp_path)})
    assert outcome["gemv"] == "off by configuration"
    assert_products_are_right(outcome["cases"])
    assert not (tmp_path / "courier").exists()


# The shim's cblas_sgemm called directly on numpy arrays, as any caller in the process may: one row and three, every
# transpose combination, leading dimensions wider than the rows they hold (C's too), and a C full of NaN under beta 0
# (which must read as "ignore C", as sgemm does) and under beta 0.5.
DIRECT = """
import ctypes, json
import numpy as np
from courier.platform.blas import load_optimized_blas, gemv_forwarding
load_optimized_blas("auto")
forwarding = gemv_forwarding()
sgemm = forwarding.library.cblas_sgemm
I, F, P = ctypes.c_int, ctypes.c_float, ctypes.c_void_p
sgemm.argtypes = [I, I, I, I, I, I, F, P, I, P, I, F, P, I]
rng = np.random.default_rng(0)
k, n, pad = 37, 23, 5
errors = {}
for m in (1, 3):
  for trans_a in (111, 112):
    for trans_b in (111, 112):
        for beta, fill in ((0.0, np.nan), (0.5, 1.5)):
            a = rng.standard_normal((m, k + pad) if trans_a == 111 else (k, m + pad)).astype(np.float32)
            b = rng.standard_normal((k, n + pad) if trans_b == 111 else (n, k + pad)).astype(np.float32)
            c = np.full((m, n + pad), fill, np.float32)
            rows = a[:, :k] if trans_a == 111 else a[:k, :m].T
            op_b = b[:k, :n] if trans_b == 111 else b[:n, :k].T
            expected = 2.0 * rows @ op_b + (beta * c[:, :n] if beta else 0)
            padding, before = c[:, n:].copy(), forwarding.forwarded()
            sgemm(101, trans_a, trans_b, m, n, k, 2.0, a.ctypes.data, a.shape[1], b.ctypes.data, b.shape[1],
                  beta, c.ctypes.data, n + pad)
            name = f"{m} rows {trans_a}/{trans_b}/beta {beta}"
            errors[name] = [float(np.abs(c[:, :n] - expected).max()), forwarding.forwarded() - before]
            errors[name + ", C's padding kept"] = [0.0 if np.array_equal(c[:, n:], padding, equal_nan=True) else 1.0, 1]
print(json.dumps(errors))
"""


def test_the_shim_answers_every_transpose_and_stride_as_sgemm_would(tmp_path: Path) -> None:
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "XDG_CACHE_HOME": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, "-c", DIRECT], capture_output=True, text=True, timeout=120, check=True, env=env
    )
    errors = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(errors) == 32
    for name, (error, forwarded) in errors.items():
        assert error < 1e-4 and forwarded == 1, (name, error, forwarded)
