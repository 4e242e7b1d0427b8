"""Float32 products of one to three rows through OpenBLAS's gemv, under MLX's CPU backend.

MLX multiplies every float32 product on the CPU with `cblas_sgemm`. A decode step's projections have one row, and
for one row OpenBLAS 0.3.21 (Debian 12's) and 0.3.31 (numpy's) both still pack the weights as for a product of
many rows: on the development machine that moves 4-8 GB/s of weights, where `cblas_sgemv` on the same shapes moves
14-30 GB/s. A decode step is those weights read once, so it waits on that rate.

`gemv_forward.c` defines `cblas_sgemm`: a product of at most three rows becomes one `cblas_sgemv` per row, every
other product goes on to OpenBLAS's own. Separate gemvs win up to three rows (a decode step of two or three
sequences, a short verify): on SmolLM2's shapes two rows take 1.4-2.4x less time than one 2-row sgemm, three rows
1.2-2.3x less, and from four rows OpenBLAS's sgemm is as fast or faster (576x576: 0.19 ms against 0.17 ms; the
49152x576 LM head: 30.8 ms against 21.8 ms). Each row is computed exactly as a one-row step computes it. Loaded
into the global symbol scope ahead of OpenBLAS, the library is what MLX binds to. It is compiled once per source text
and machine with the system C compiler (`CC`, else `cc`) into a cache directory, where every later process finds
it; without a compiler, or where the build fails, MLX keeps calling OpenBLAS's sgemm and the report says why.

Like `blas.py` this runs before `mlx.core` is imported, and must not import it.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

SOURCE = Path(__file__).with_name("gemv_forward.c")
BUILD_TIMEOUT_S = 60.0


@dataclass(frozen=True, slots=True)
class GemvForwarding:
    """Whether products of up to three rows go to gemv, and the library doing it or the reason they do not."""

    detail: str
    library: ctypes.CDLL | None = None  # the bound forwarding library; None when it is off

    @property
    def active(self) -> bool:
        return self.library is not None

    def forwarded(self) -> int:
        """How many products this process has sent to gemv so far (0 when inactive; one per product, whatever its
        rows)."""
        return 0 if self.library is None else int(self.library.courier_gemv_forward_count())


def cache_directory() -> Path:
    """Where the compiled library is kept: `courier/native` in the user's cache directory (`$XDG_CACHE_HOME`)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "courier" / "native"


def install(openblas: ctypes.CDLL, directory: Path | None = None) -> GemvForwarding:
    """Build (or find) the forwarding library and load it globally, bound to `openblas`'s sgemm and sgemv.

    Call it after loading OpenBLAS with RTLD_LOCAL and before making OpenBLAS global: the symbol MLX binds to is
    the first `cblas_sgemm` in the global scope.
    """
    if not hasattr(openblas, "cblas_sgemv"):
        return GemvForwarding("off: the BLAS has no cblas_sgemv")
    try:
        built = _build(directory or cache_directory())
        library = _bind(built, openblas)
    except RuntimeError as error:  # Path.home(): no home directory to keep the library in
        return GemvForwarding(f"off: no cache directory ({error})")
    except Unavailable as failure:
        return GemvForwarding(f"off: {failure}")
    return GemvForwarding(f"products of up to 3 rows through cblas_sgemv ({built})", library)


def _bind(built: Path, openblas: ctypes.CDLL) -> ctypes.CDLL:
    """The library loaded, bound to OpenBLAS's sgemm and sgemv, then made global and checked to come first."""
    try:
        # Local until it is bound: a global cblas_sgemm with no sgemm behind it would crash MLX's first product.
        library = ctypes.CDLL(str(built), mode=os.RTLD_LOCAL)
        init = library.courier_gemv_forward_init
    except (OSError, AttributeError) as error:  # a cached file that is not this library, or not for this machine
        raise Unavailable(f"the built library cannot be loaded ({error})") from error
    init.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    init.restype = ctypes.c_int
    library.courier_gemv_forward_count.restype = ctypes.c_ulong
    sgemm = ctypes.cast(openblas.cblas_sgemm, ctypes.c_void_p).value
    sgemv = ctypes.cast(openblas.cblas_sgemv, ctypes.c_void_p).value
    if not init(sgemm, sgemv):
        raise Unavailable("the BLAS's sgemm or sgemv has no address")
    ctypes.CDLL(str(built), mode=os.RTLD_GLOBAL | os.RTLD_NOLOAD)
    first = ctypes.cast(ctypes.CDLL(None).cblas_sgemm, ctypes.c_void_p).value
    if first != ctypes.cast(library.cblas_sgemm, ctypes.c_void_p).value:
        raise Unavailable("another cblas_sgemm comes first in the global scope (LD_PRELOAD?)")
    return library


class Unavailable(Exception):
    """The forwarding library could not be built or bound here (the message says why)."""


def _build(directory: Path) -> Path:
    compiler = shlex.split(os.environ.get("CC", "")) or [shutil.which("cc") or shutil.which("gcc") or ""]
    flags = ["-O2", "-shared", "-fPIC"]
    try:
        source = SOURCE.read_bytes()
    except OSError as error:
        raise Unavailable(f"cannot read {SOURCE} ({error.strerror})") from error
    key = b"\0".join([source, platform.machine().encode(), *(flag.encode() for flag in flags)])
    target = directory / f"libcourier_gemv_forward-{hashlib.sha256(key).hexdigest()[:16]}.so"
    if target.is_file():
        return target
    if not compiler[0]:
        raise Unavailable("no C compiler (set CC, or install one: Debian's build-essential)")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        descriptor, partial = tempfile.mkstemp(dir=directory, prefix=".build-", suffix=".so")
        os.close(descriptor)
    except OSError as error:
        raise Unavailable(f"cannot write to {directory} ({error.strerror})") from error
    command = [*compiler, *flags, "-o", partial, str(SOURCE)]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False)
        if result.returncode != 0:
            raise Unavailable(f"{shlex.join(compiler)} failed: {result.stderr.strip()[:300]}")
        os.replace(partial, target)  # processes building at once each write their own file; the last one stays
    except (OSError, subprocess.TimeoutExpired) as error:
        raise Unavailable(f"{shlex.join(compiler)} could not run ({error})") from error
    finally:
        Path(partial).unlink(missing_ok=True)
    return target
