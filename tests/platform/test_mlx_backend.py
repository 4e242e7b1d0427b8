"""Which backend wheel's libmlx.so is installed, and the BLAS choice that follows from it."""

from __future__ import annotations

import sys
from importlib import metadata
from pathlib import Path

import pytest

from courier.platform import blas, mlx_backend


class FakeDistribution(metadata.Distribution):
    def __init__(self, root: Path, files: dict[str, int]) -> None:
        self._root = root
        self._files = files

    def read_text(self, filename: str) -> str | None:
        if filename == "RECORD":
            return "".join(f"{path},sha256=x,{size}\n" for path, size in self._files.items())
        return None

    def locate_file(self, path: str | Path) -> Path:  # type: ignore[override]
        return self._root / path


def install(monkeypatch: pytest.MonkeyPatch, root: Path, wheels: dict[str, int], on_disk: int) -> None:
    """`wheels`: each installed backend distribution and the size its RECORD gives libmlx.so; `on_disk`: the
    size of the file actually there (the last one unpacked)."""
    library = root / mlx_backend.LIBRARY
    library.parent.mkdir(parents=True, exist_ok=True)
    library.write_bytes(b"\0" * on_disk)

    def distribution(name: str) -> metadata.Distribution:
        if name not in wheels:
            raise metadata.PackageNotFoundError(name)
        return FakeDistribution(root, {mlx_backend.LIBRARY: wheels[name]})

    monkeypatch.setattr(metadata, "distribution", distribution)


def test_the_wheel_whose_copy_is_on_disk_is_the_backend(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    install(monkeypatch, tmp_path, {"mlx-cpu": 21, "mlx-cuda-12": 126}, on_disk=126)
    assert mlx_backend.installed_backend() == "mlx-cuda-12"
    install(monkeypatch, tmp_path, {"mlx-cpu": 21, "mlx-cuda-12": 126}, on_disk=21)
    assert mlx_backend.installed_backend() == "mlx-cpu"


def test_no_backend_wheel_is_none(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    install(monkeypatch, tmp_path, {}, on_disk=5)
    assert mlx_backend.installed_backend() is None
    assert not mlx_backend.is_cuda(None)


def test_a_cpu_only_environment_reports_mlx_cpu() -> None:
    installed = {distribution.metadata["Name"] for distribution in metadata.distributions()}
    if "mlx-cpu" not in installed or installed & set(mlx_backend.CUDA_DISTRIBUTIONS):
        pytest.skip("not an environment with the CPU backend alone")
    assert mlx_backend.installed_backend() == "mlx-cpu"


def test_cuda_backend_loads_no_blas(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    install(monkeypatch, tmp_path, {"mlx-cpu": 21, "mlx-cuda-12": 126}, on_disk=126)
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(blas, "_auto_candidates", lambda: pytest.fail("no BLAS is looked for under CUDA"))
    report = blas._choose(blas.AUTO, True)
    assert (report.library, report.optimized, report.path) == ("unused", True, None)
    assert "mlx-cuda-12" in report.detail


def test_an_explicit_blas_is_still_honoured_under_cuda(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    install(monkeypatch, tmp_path, {"mlx-cuda-12": 126}, on_disk=126)
    monkeypatch.setattr(sys, "platform", "linux")
    assert blas._choose(blas.DISABLED, True).library == "reference"
    with pytest.raises(OSError, match="cannot use BLAS library"):
        blas._choose(str(tmp_path / "libnot-there.so"), True)
