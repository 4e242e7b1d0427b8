from __future__ import annotations

from pathlib import Path

import pytest

from courier.model.catalog import build_catalog, scan_models_dir, split_spec
from courier.model.source import EMBEDDED_MODEL_ID, ModelSourceError, SourceKind


def mlx_dir(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    return path


def gguf(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"GGUF")
    return path


def test_nothing_declared_is_the_embedded_model() -> None:
    catalog = build_catalog(())
    assert [model.model_id for model in catalog.models] == [EMBEDDED_MODEL_ID]
    assert catalog.default.source.kind is SourceKind.EMBEDDED
    assert not catalog.several


def test_served_model_name_names_the_one_model(tmp_path: Path) -> None:
    model = mlx_dir(tmp_path / "qwen")
    catalog = build_catalog((str(model),), served_model_name="chat,claude-*")
    assert catalog.default.names.names == ("chat", "claude-*")
    assert build_catalog((), served_model_name="small").default.model_id == "small"


def test_several_models_with_names_and_aliases(tmp_path: Path) -> None:
    a, b = mlx_dir(tmp_path / "a"), gguf(tmp_path / "b.Q4_0.gguf")
    catalog = build_catalog((f"first,one={a}", str(b)), served_model_name="second")
    assert [model.names.names for model in catalog.models] == [("first", "one"), ("second",)]
    assert catalog.several
    assert catalog.find(None) is catalog.default
    assert catalog.find("one") is catalog.models[0]
    assert catalog.find("second") is catalog.models[1]
    assert catalog.find("third") is None


def test_an_id_wins_over_a_pattern_and_patterns_go_in_order(tmp_path: Path) -> None:
    a, b = mlx_dir(tmp_path / "a"), mlx_dir(tmp_path / "b")
    catalog = build_catalog((f"a,claude-*={a}", f"claude-haiku={b}"))
    assert catalog.find("claude-haiku").model_id == "claude-haiku"  # type: ignore[union-attr]
    assert catalog.find("claude-opus").model_id == "a"  # type: ignore[union-attr]


def test_models_dir_names_each_model_by_its_path(tmp_path: Path) -> None:
    root = tmp_path / "models"
    mlx_dir(root / "mlx-community" / "Qwen3-0.6B-4bit")
    mlx_dir(root / "plain")
    gguf(root / "tiny.Q4_0.gguf")
    (root / "notes").mkdir()
    (root / "notes" / "readme.txt").write_text("not a model")
    mlx_dir(root / ".hidden")
    mlx_dir(root / "a" / "b" / "c" / "too-deep")
    names = [model.model_id for model in scan_models_dir(root)]
    assert names == ["mlx-community/Qwen3-0.6B-4bit", "plain", "tiny.Q4_0"]
    catalog = build_catalog((), models_dir=root)
    assert catalog.default.model_id == "mlx-community/Qwen3-0.6B-4bit"


def test_a_declared_model_is_not_listed_twice_from_the_directory(tmp_path: Path) -> None:
    root = tmp_path / "models"
    plain = mlx_dir(root / "plain")
    other = mlx_dir(root / "other")
    catalog = build_catalog((f"main={plain}",), models_dir=root)
    assert [model.model_id for model in catalog.models] == ["main", "other"]
    assert catalog.get("other").source.location == str(other.resolve())


def test_two_models_with_one_name_are_refused(tmp_path: Path) -> None:
    a, b = mlx_dir(tmp_path / "x" / "same"), mlx_dir(tmp_path / "y" / "same")
    with pytest.raises(ModelSourceError, match="two models are named 'same'"):
        build_catalog((str(a), str(b)))


@pytest.mark.parametrize(
    ("spec", "names", "location"),
    [
        ("name=/models/x", ("name",), "/models/x"),
        ("a, b ,claude-*=/models/x", ("a", "b", "claude-*"), "/models/x"),
        ("/models/x=y", None, "/models/x=y"),
        ("owner/repo", None, "owner/repo"),
        ("chat=owner/repo", ("chat",), "owner/repo"),
        ("=/models/x", None, "=/models/x"),
    ],
)
def test_split_spec(spec: str, names: tuple[str, ...] | None, location: str) -> None:
    parsed, rest = split_spec(spec)
    assert (parsed.names if parsed else None, rest) == (names, location)


def test_a_name_without_a_model_is_refused() -> None:
    with pytest.raises(ModelSourceError, match="gives no directory"):
        split_spec("name=")


def test_an_empty_models_dir_serves_nothing(tmp_path: Path) -> None:
    with pytest.raises(ModelSourceError, match="holds no MLX model"):
        build_catalog((), models_dir=tmp_path)
    with pytest.raises(ModelSourceError, match="not a directory"):
        build_catalog((), models_dir=tmp_path / "missing")
