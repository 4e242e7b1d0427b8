"""Which backend wheel provides the MLX library that `import mlx.core` will load, read without importing mlx.

On Linux, MLX's compiled library `mlx/lib/libmlx.so` comes from a backend wheel: `mlx-cpu`, `mlx-cuda-12` or
`mlx-cuda-13`. Each of them installs that same path. Courier's own dependencies bring `mlx-cpu`, and its `cuda`
extra adds `mlx-cuda-12`, so both are installed side by side and the file on disk is the copy of whichever pip
unpacked last (pip installs `mlx-cuda-12` after the CUDA libraries it needs, so today that is the CUDA one).
The file is matched against each wheel's RECORD by size, which differs by far between the CPU library
(~21 MB) and the CUDA one (~126 MB).

Nothing is reported on macOS (MLX's Metal library comes from `mlx-metal` at another path), for MLX built from
source or for no MLX at all.

This module must not import mlx: the BLAS is chosen before mlx.core is loaded.
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

LIBRARY = "mlx/lib/libmlx.so"
CPU_DISTRIBUTION = "mlx-cpu"
CUDA_DISTRIBUTIONS = ("mlx-cuda-13", "mlx-cuda-12")


def installed_backend() -> str | None:
    """The distribution whose copy of libmlx.so is installed ("mlx-cpu", "mlx-cuda-12", ...), or None."""
    for name in (*CUDA_DISTRIBUTIONS, CPU_DISTRIBUTION):
        if _owns_installed_library(name):
            return name
    return None


def is_cuda(backend: str | None) -> bool:
    return backend in CUDA_DISTRIBUTIONS


def _owns_installed_library(name: str) -> bool:
    try:
        distribution = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return False
    for file in distribution.files or ():
        if file.as_posix() == LIBRARY and file.size is not None:
            try:
                return Path(str(distribution.locate_file(file))).stat().st_size == file.size
            except OSError:
                return False
    return False
