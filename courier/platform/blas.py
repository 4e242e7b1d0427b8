"""Puts an optimized BLAS under MLX's CPU backend before `mlx.core` is imported.

The Linux `mlx[cpu]` wheel links a reference BLAS that multiplies matrices about
50x slower than OpenBLAS. Loading OpenBLAS into the global symbol scope first makes
MLX resolve its `cblas_*` and LAPACK symbols there. On macOS MLX uses Accelerate
and nothing is loaded; nor is anything under MLX's CUDA backend, which runs the
model on the GPU (the kernel probe and the library would only cost start-up time).

This module must not import mlx: it runs before anything else does.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from courier.platform.gemv_forward import GemvForwarding, install
from courier.platform.mlx_backend import installed_backend, is_cuda
from courier.platform.openblas_core import ENV_VAR, CoreChoice, choose_core

logger = logging.getLogger(__name__)

# Debian/Ubuntu multiarch paths (package libopenblas0-pthread) and the common fallbacks.
_SYSTEM_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)
DISABLED = "none"
AUTO = "auto"


@dataclass(frozen=True, slots=True, kw_only=True)
class BlasReport:
    """What MLX's CPU matmuls run on, for the startup log and `/health`.

    `optimized` is False only where the model's matmuls run on the reference BLAS; under MLX's CUDA backend
    the library is "unused" and `optimized` True (they run on the GPU).
    """

    library: str
    path: str | None
    optimized: bool
    detail: str
    kernels: str | None = None  # OpenBLAS's core name, e.g. "Cooperlake"
    kernel_choice: str | None = None  # why those kernels: the library's own pick or OPENBLAS_CORETYPE
    gemv: str | None = None  # whether products of up to 3 rows go to cblas_sgemv (gemv_forward.py), or why not

    def as_dict(self) -> dict[str, object]:
        return {
            "library": self.library,
            "path": self.path,
            "optimized": self.optimized,
            "detail": self.detail,
            "kernels": self.kernels,
            "kernel_choice": self.kernel_choice,
            "gemv": self.gemv,
        }


_loaded: BlasReport | None = None
_gemv: GemvForwarding | None = None


def load_optimized_blas(choice: str = AUTO, *, forward_gemv: bool = True) -> BlasReport:
    """Load OpenBLAS globally (once per process) and say what MLX will use.

    `choice` is `auto` (search the usual places), `none` (keep MLX's own BLAS), or
    a path to a shared library exporting the standard `cblas_*` symbols. With
    `forward_gemv`, products of up to three rows go to OpenBLAS's gemv (`gemv_forward.py`).
    """
    global _loaded
    if _loaded is not None:
        return _loaded
    if "mlx.core" in sys.modules:
        logger.warning("mlx was imported before the BLAS was chosen; its CPU matmuls keep the bundled BLAS")
    _loaded = _choose(choice, forward_gemv)
    return _loaded


def gemv_forwarding() -> GemvForwarding | None:
    """This process's forwarding of few-row products to gemv, where OpenBLAS was loaded."""
    return _gemv


def current_report() -> BlasReport | None:
    return _loaded


def _choose(choice: str, forward_gemv: bool) -> BlasReport:
    if sys.platform == "darwin":
        return BlasReport(library="Accelerate", path=None, optimized=True, detail="MLX on macOS uses Accelerate")
    if choice == DISABLED:
        return _reference("disabled by configuration")
    if choice == AUTO and is_cuda(backend := installed_backend()):
        return BlasReport(
            library="unused",
            path=None,
            optimized=True,
            detail=f"MLX's CUDA backend ({backend}) runs the model on the GPU; no CPU BLAS is loaded",
            kernel_choice="not probed under a GPU backend",
        )
    candidates = [choice] if choice != AUTO else _auto_candidates()
    failures: list[str] = []
    for candidate in candidates:
        core = choose_core(candidate)
        try:
            # Local at first: the gemv forwarding's cblas_sgemm has to come before OpenBLAS's in the global scope.
            handle = ctypes.CDLL(candidate, mode=os.RTLD_LOCAL)
        except OSError as error:
            failures.append(f"{candidate}: {error}")
            _forget_choice(core)
            continue
        if not hasattr(handle, "cblas_sgemm"):
            failures.append(f"{candidate}: no cblas_sgemm symbol")
            _forget_choice(core)
            continue
        global _gemv
        _gemv = install(handle) if forward_gemv else GemvForwarding("off by configuration")
        ctypes.CDLL(candidate, mode=os.RTLD_GLOBAL | os.RTLD_NOLOAD)  # now global, behind the forwarding
        return BlasReport(
            library="OpenBLAS",
            path=candidate,
            optimized=True,
            detail=_openblas_config(handle),
            kernels=_openblas_corename(handle),
            kernel_choice=_describe(core),
            gemv=_gemv.detail,
        )
    if choice != AUTO:
        raise OSError(f"cannot use BLAS library {choice!r}: {'; '.join(failures)}")
    reason = "; ".join(failures) if failures else "no OpenBLAS found"
    return _reference(reason)


def _reference(reason: str) -> BlasReport:
    return BlasReport(library="reference", path=None, optimized=False, detail=reason)


def _auto_candidates() -> list[str]:
    candidates = [path for path in _SYSTEM_CANDIDATES if Path(path).exists()]
    found = ctypes.util.find_library("openblas")
    if found:
        candidates.append(found)
    return list(dict.fromkeys(candidates))


def _forget_choice(core: CoreChoice) -> None:
    """A candidate that could not be used leaves no OPENBLAS_CORETYPE of ours for the next one to mistake."""
    if core.chosen is not None and core.detected is not None:
        os.environ.pop(ENV_VAR, None)


def _describe(core: CoreChoice | None) -> str | None:
    if core is None:
        return None
    if core.chosen is None:
        return core.reason
    return f"OPENBLAS_CORETYPE={core.chosen}: {core.reason}"


def _openblas_corename(handle: ctypes.CDLL) -> str | None:
    try:
        get_corename = handle.openblas_get_corename
    except AttributeError:
        return None
    get_corename.restype = ctypes.c_char_p
    raw = get_corename()
    return raw.decode(errors="replace").strip() if isinstance(raw, bytes) else None


def _openblas_config(handle: ctypes.CDLL) -> str:
    try:
        get_config = handle.openblas_get_config
    except AttributeError:
        return "cblas symbols found"
    get_config.restype = ctypes.c_char_p
    raw = get_config()
    return raw.decode(errors="replace").strip() if isinstance(raw, bytes) else "OpenBLAS"
