from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from courier.platform import openblas_core
from courier.platform.blas import _SYSTEM_CANDIDATES
from courier.platform.openblas_core import ENV_VAR, choose_core, cpu_flags, supported_core

AVX512 = frozenset({"avx512f", "avx512vl", "avx512bw", "avx512dq", "avx512cd", "avx2", "fma"})


def unset_for_the_test(monkeypatch: pytest.MonkeyPatch) -> None:
    """ENV_VAR absent while the test runs, and absent again after it, whatever `choose_core` set meanwhile: a
    variable left behind reaches every later subprocess of this worker, whose numpy OpenBLAS would then run kernels
    this CPU may not have (SIGILL). (`delenv` of an absent variable records nothing to undo; `setenv` does.)"""
    monkeypatch.setenv(ENV_VAR, "")
    monkeypatch.delenv(ENV_VAR)


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (AVX512 | {"avx512_bf16"}, "Cooperlake"),
        (AVX512, "SkylakeX"),
        (frozenset({"avx2", "fma", "sse4_2"}), "Haswell"),
        (frozenset({"avx2"}), None),
        (frozenset({"sse4_2", "avx"}), None),
        (frozenset(), None),
    ],
)
def test_supported_core_follows_the_feature_flags(flags: frozenset[str], expected: str | None) -> None:
    assert supported_core(flags) == expected


def test_cpu_flags_reads_the_first_flags_line(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx2 fma\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    assert cpu_flags(cpuinfo) == {"fpu", "avx2", "fma"}
    assert cpu_flags(tmp_path / "missing") == frozenset()


@pytest.mark.parametrize(
    ("detected", "chosen"),
    [("Prescott", "Cooperlake"), ("Haswell", "Cooperlake"), ("Cooperlake", None), ("SapphireRapids", None)],
)
def test_only_weaker_kernels_are_overridden(monkeypatch: pytest.MonkeyPatch, detected: str, chosen: str | None) -> None:
    unset_for_the_test(monkeypatch)
    monkeypatch.setattr(openblas_core, "probe_corename", lambda library: detected)
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    choice = choose_core("libopenblas.so.0", flags=AVX512 | {"avx512_bf16"})
    assert (choice.detected, choice.chosen) == (detected, chosen)
    assert os.environ.get(ENV_VAR) == chosen


def test_kernels_unknown_to_courier_are_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    unset_for_the_test(monkeypatch)
    monkeypatch.setattr(openblas_core, "probe_corename", lambda library: "NeoverseV2")
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    assert choose_core("libopenblas.so.0", flags=AVX512).chosen is None
    assert ENV_VAR not in os.environ


def test_an_operators_setting_is_never_touched(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, "Haswell")
    choice = choose_core("libopenblas.so.0", flags=AVX512 | {"avx512_bf16"})
    assert choice.chosen == "Haswell"
    assert "environment" in choice.reason


def test_the_loaded_library_runs_kernels_at_least_as_good_as_its_own_pick() -> None:
    """End to end in a fresh process: the report names the kernels the library actually runs."""
    library = next((path for path in _SYSTEM_CANDIDATES if Path(path).exists()), None)
    if library is None:
        pytest.skip("no OpenBLAS on this machine (./dev installs it on Debian as root)")
    own_pick = openblas_core.probe_corename(library)
    assert own_pick is not None
    code = (
        "import os; os.environ.pop('OPENBLAS_CORETYPE', None);"
        "from courier.platform.blas import load_optimized_blas; r = load_optimized_blas('auto');"
        "print(r.kernels); print(r.kernel_choice)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    kernels, reason = result.stdout.strip().splitlines()
    best = supported_core(cpu_flags())
    rank = openblas_core._RANK
    if own_pick.lower() in rank and best is not None and rank[own_pick.lower()] < rank[best.lower()]:
        assert kernels == best
        assert reason.startswith(f"{ENV_VAR}={best}")
    else:
        assert kernels == own_pick
