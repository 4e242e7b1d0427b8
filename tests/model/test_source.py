from __future__ import annotations

from pathlib import Path

import pytest

from courier.model.source import (
    EMBEDDED_MODEL_ID,
    ModelSourceError,
    SourceKind,
    embedded_gguf_path,
    resolve_model_source,
)


def test_no_model_means_the_embedded_gguf() -> None:
    source = resolve_model_source(None)
    assert source.kind is SourceKind.EMBEDDED
    assert source.default_id == EMBEDDED_MODEL_ID
    assert Path(source.location) == embedded_gguf_path()
    assert embedded_gguf_path().stat().st_size > 50_000_000


def test_mlx_directory(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    source = resolve_model_source(str(tmp_path))
    assert (source.kind, source.default_id) == (SourceKind.MLX_DIRECTORY, tmp_path.name)


def test_gguf_file(tmp_path: Path) -> None:
    gguf = tmp_path / "Tiny.Q8_0.gguf"
    gguf.write_bytes(b"GGUF")
    source = resolve_model_source(str(gguf))
    assert (source.kind, source.default_id) == (SourceKind.GGUF_FILE, "Tiny.Q8_0")


def test_hub_repo_id() -> None:
    source = resolve_model_source("mlx-community/SmolLM2-135M-Instruct-4bit")
    assert source.kind is SourceKind.HUB_REPO


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (str, "no config.json"),
        (lambda root: str(root / "missing.gguf"), "does not exist"),
        (lambda root: str(root / "notes.txt"), "neither an MLX model directory"),
        (lambda root: "no such thing", "not an existing directory"),
    ],
)
def test_unusable_model_arguments(tmp_path: Path, make: object, message: str) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    spec = make(tmp_path)  # type: ignore[operator]
    with pytest.raises(ModelSourceError, match=message):
        resolve_model_source(spec)
