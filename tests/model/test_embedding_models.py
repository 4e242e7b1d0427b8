"""Telling an embedding model from a generative one by its files, and `--embedding-pooling` resolved to model ids."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from courier.model.embedding_models import embedding_problem, is_embedding_model, pooling_by_model

CASES: list[tuple[dict[str, Any], tuple[str, ...], bool]] = [
    ({"model_type": "bert"}, (), True),
    ({"model_type": "modernbert", "architectures": ["ModernBertModel"]}, (), True),
    ({"model_type": "xlm-roberta"}, (), True),
    # Qwen3-Embedding names a causal LM head but ships sentence-transformers files.
    ({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}, ("modules.json",), True),
    ({"model_type": "qwen3", "architectures": ["Qwen3Model"]}, (), True),
    ({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}, (), False),
    ({"model_type": "llama"}, (), False),  # no architectures: mlx-lm's conversions often drop them
    ({"model_type": "idefics3", "architectures": ["Idefics3ForConditionalGeneration"]}, (), False),
]


@pytest.mark.parametrize(("config", "files", "embeds"), CASES)
def test_an_embedding_model_is_told_by_its_files(
    tmp_path: Path, config: dict[str, Any], files: tuple[str, ...], embeds: bool
) -> None:
    (tmp_path / "config.json").write_bytes(orjson.dumps(config))
    for name in files:
        (tmp_path / name).write_text("[]")
    assert is_embedding_model(tmp_path) is embeds


def test_an_architecture_mlx_embeddings_lacks_is_named(tmp_path: Path) -> None:
    pytest.importorskip("mlx_embeddings")
    (tmp_path / "config.json").write_bytes(orjson.dumps({"model_type": "t5encoder", "architectures": ["T5Model"]}))
    assert embedding_problem(tmp_path) == "mlx-embeddings has no 't5encoder' architecture (config.json model_type)"
    (tmp_path / "config.json").write_bytes(orjson.dumps({"model_type": "bert"}))
    assert embedding_problem(tmp_path) is None


def test_pooling_names_resolve_to_model_ids() -> None:
    ids = {None: "chat", "chat": "chat", "coder": "qwen-coder"}
    assert pooling_by_model(ids.get, ("=mean", "coder=last")) == {"chat": "mean", "qwen-coder": "last"}
    with pytest.raises(ValueError, match="no model is named 'nope'"):
        pooling_by_model(ids.get, ("nope=mean",))
