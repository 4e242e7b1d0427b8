"""mlx-lm's private surface the engine relies on: present in the installed release, pinned, and checked loudly."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import pytest
from mlx_lm.generate import BatchGenerator, GenerationBatch
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from courier.engine import mlx_lm_surface
from courier.engine.mlx_lm_surface import (
    SURFACE,
    TESTED_MLX_LM,
    Attributes,
    Fields,
    Member,
    MlxLmSurfaceError,
    Signature,
    check_mlx_lm_surface,
    surface_problems,
)

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def test_the_installed_mlx_lm_has_every_piece_the_engine_uses() -> None:
    assert surface_problems() == []
    check_mlx_lm_surface()


def test_pyproject_pins_the_tested_releases_and_the_installed_one_is_among_them() -> None:
    dependencies = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    (pin,) = [Requirement(text) for text in dependencies if Requirement(text).name == "mlx-lm"]
    assert pin.specifier == SpecifierSet(TESTED_MLX_LM)
    assert any(spec.operator == "<" for spec in pin.specifier), "an upper bound: the next release is untested"
    assert metadata.version("mlx-lm") in pin.specifier


class Renamed:
    """A release that renamed what the engine reads: each kind of expectation fails, named."""

    def __init__(self) -> None:
        self.next_token_ids = None

    def step(self, cache: object) -> None:
        del cache


@dataclass
class Reply:
    uid: int


@pytest.mark.parametrize(
    ("expectation", "problem"),
    [
        (Signature(Renamed, "filter", ("keep",)), "Renamed.filter is missing"),
        (Signature(Renamed, "step", ("batch",)), "Renamed.step takes (cache), expected (batch, ...)"),
        (Attributes(Renamed, "__init__", ("_next_tokens",), stores=True), "no longer sets _next_tokens"),
        (Attributes(Renamed, "step", ("_next_tokens",), stores=False), "no longer reads _next_tokens"),
        (Fields(Reply, ("uid", "token")), "Reply has no field token"),
        (Member(mlx_lm_surface, "_NotThere"), "courier.engine.mlx_lm_surface._NotThere is missing"),
    ],
)
def test_a_moved_piece_is_named(expectation: mlx_lm_surface.Expectation, problem: str) -> None:
    (found,) = surface_problems([expectation])
    assert problem in found


def test_a_release_without_the_generation_batch_stops_start_up_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A BatchGenerator whose batch lives elsewhere would leave the speculative batch unused: refused, not served."""

    def renamed_init(self: BatchGenerator, model: object, **options: object) -> None:
        self.model, self.sampler, self._batch = model, None, None

    monkeypatch.setattr(BatchGenerator, "__init__", renamed_init)
    monkeypatch.delattr(GenerationBatch, "extract_cache")
    with pytest.raises(MlxLmSurfaceError) as refused:
        check_mlx_lm_surface(SURFACE)  # read afresh (without an argument, the verdict is read once per process)
    message = str(refused.value)
    assert f"mlx-lm {metadata.version('mlx-lm')} does not have" in message
    assert "BatchGenerator.__init__ no longer sets _generation_batch" in message
    assert "GenerationBatch.extract_cache is missing" in message
    assert TESTED_MLX_LM in message
