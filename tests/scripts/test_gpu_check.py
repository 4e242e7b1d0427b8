"""scripts/gpu-check.sh and scripts/gpu-wheels.sh, on a machine without a GPU, so that they cannot rot.

The GPU run itself needs a GPU. What CI can check is everything around it: both scripts parse (`bash -n`, and
shellcheck where it is installed), the usage errors, and the whole no-GPU path of gpu-check.sh: run with
`--venv` on this test's own environment, the preflight hands the benches' command lines to the benches' own
parsers and checks the test selection, MLX is asked for its device, and the script says "no GPU", exits 0 and
writes its summary. That takes a few seconds.

The install step is left out by default: a fresh `pip install -e '.[cuda,dev]'` downloads 2.9 GB (the CUDA build
of MLX and NVIDIA's libraries are 2.6 GB of it), takes minutes and 5 GB of disk, and the package index here
serves no wheel metadata, so even `pip install --dry-run` downloads every wheel. Set COURIER_GPU_CHECK_INSTALL=1
to run the script exactly as on a GPU machine, install included.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

ROOT = Path(__file__).resolve().parents[2]
GPU_CHECK = ROOT / "scripts" / "gpu-check.sh"
GPU_WHEELS = ROOT / "scripts" / "gpu-wheels.sh"
GPU_STAGES = ("tests-real-model", "tests-engine", "throughput", "speculative")

needs_no_gpu = pytest.mark.skipif(
    mx.default_device().type == mx.DeviceType.gpu, reason="MLX sees a GPU here: the no-GPU path cannot be checked"
)


def run(*args: str | Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(arg) for arg in args], capture_output=True, text=True, timeout=timeout, check=False, cwd=ROOT
    )


def stage_lines(summary: str) -> dict[str, list[str]]:
    """summary.txt's stage table: each stage's status and the rest of its line."""
    table = summary.split("\nstage ", 1)[1].split("\nresult: ", 1)[0]
    return {line.split()[0]: line.split()[1:] for line in table.splitlines()[1:] if line.strip()}


@pytest.mark.parametrize("script", [GPU_CHECK, GPU_WHEELS], ids=lambda path: path.name)
def test_the_script_parses_and_is_executable(script: Path) -> None:
    assert os.access(script, os.X_OK)
    result = run("bash", "-n", script)
    assert result.returncode == 0, result.stderr


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed (Debian: shellcheck)")
@pytest.mark.parametrize("script", [GPU_CHECK, GPU_WHEELS], ids=lambda path: path.name)
def test_shellcheck_finds_nothing(script: Path) -> None:
    result = run("shellcheck", script)
    assert result.returncode == 0, result.stdout


@pytest.mark.parametrize(
    "args",
    [
        pytest.param([GPU_CHECK], id="gpu-check without OUTDIR"),
        pytest.param([GPU_CHECK, "--wheels", "/nonexistent/wheels", "out"], id="gpu-check --wheels not a directory"),
        pytest.param([GPU_CHECK, "--budget", "soon", "out"], id="gpu-check --budget not a number"),
        pytest.param([GPU_WHEELS], id="gpu-wheels without DIR"),
        pytest.param([GPU_WHEELS, "--python-version", "eleven", "dir"], id="gpu-wheels --python-version"),
    ],
)
def test_usage_errors_exit_2(args: list[str | Path], tmp_path: Path) -> None:
    result = subprocess.run(
        [str(arg) for arg in args], capture_output=True, text=True, timeout=60, check=False, cwd=tmp_path
    )
    assert result.returncode == 2
    assert result.stderr
    assert not (tmp_path / "out").exists()


def check_no_gpu_run(result: subprocess.CompletedProcess[str], outdir: Path, install: str) -> None:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "no GPU: " in result.stdout
    summary = (outdir / "summary.txt").read_text()
    stages = stage_lines(summary)
    assert stages["install"][0] == install
    assert stages["preflight"][0] == "ok"
    assert stages["device"][0] == "ok"
    for stage in GPU_STAGES:
        assert stages[stage][0] == "skipped", summary
        assert "no GPU" in " ".join(stages[stage]), summary
    assert "result: no GPU: " in summary
    device = (outdir / "device.txt").read_text()
    assert "verdict: no GPU: " in device
    assert "nvidia-smi: " in device
    log = (outdir / "gpu-check.log").read_text()
    assert "bench.throughput: arguments ok" in log
    assert "bench.speculative: arguments ok" in log
    assert "the real_model marker is registered" in log


@needs_no_gpu
def test_without_a_gpu_it_says_so_and_exits_0(tmp_path: Path) -> None:
    venv = Path(sys.prefix)
    if not (venv / "bin" / "python").is_file():
        pytest.skip(f"the tests do not run in a virtual environment ({sys.prefix})")
    outdir = tmp_path / "out"
    result = run(GPU_CHECK, "--venv", venv, "--work", tmp_path / "work", outdir)
    check_no_gpu_run(result, outdir, install="skipped")
    assert sorted(path.name for path in outdir.iterdir()) == ["device.txt", "gpu-check.log", "summary.txt"]


@needs_no_gpu
@pytest.mark.skipif(
    os.environ.get("COURIER_GPU_CHECK_INSTALL") != "1",
    reason="the install step downloads 2.9 GB; set COURIER_GPU_CHECK_INSTALL=1 to run it",
)
def test_the_install_step_then_no_gpu(tmp_path: Path) -> None:
    outdir = tmp_path / "out"
    result = run(GPU_CHECK, "--work", tmp_path / "work", outdir, timeout=900)
    check_no_gpu_run(result, outdir, install="ok")
    assert "MLX backend wheel whose libmlx.so is installed: mlx-cuda-12" in result.stdout
