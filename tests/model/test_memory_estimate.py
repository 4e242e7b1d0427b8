from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import orjson
import pytest
from mlx import nn
from mlx.utils import tree_flatten

from courier.model.memory_estimate import estimate_weight_bytes
from courier.model.source import ModelSource, SourceKind, resolve_model_source


def saved(model: nn.Module, directory: Path, config: dict[str, object]) -> Path:
    directory.mkdir()
    mx.save_safetensors(str(directory / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (directory / "config.json").write_bytes(orjson.dumps(config))
    return directory


@pytest.mark.parametrize("bits", [4, 8])
def test_a_quantized_directory_served_dense_counts_its_unpacked_weights(tmp_path: Path, bits: int) -> None:
    model = nn.Sequential(nn.Linear(256, 128), nn.Embedding(64, 256))
    nn.quantize(model, group_size=64, bits=bits)
    directory = saved(model, tmp_path / "q", {"quantization": {"group_size": 64, "bits": bits}})
    source = resolve_model_source(str(directory))
    dense_elements = 256 * 128 + 128 + 64 * 256  # weights, the linear's bias, the embedding
    assert estimate_weight_bytes(source, tmp_path, 4) == dense_elements * 4
    assert estimate_weight_bytes(source, tmp_path, None) == (directory / "model.safetensors").stat().st_size


def test_a_dense_directory_at_another_dtype(tmp_path: Path) -> None:
    model = nn.Linear(64, 32, bias=False)
    model.set_dtype(mx.float16)
    directory = saved(model, tmp_path / "d", {})
    assert estimate_weight_bytes(resolve_model_source(str(directory)), tmp_path, 4) == 64 * 32 * 4


def test_an_unconverted_gguf_is_estimated_from_its_size_and_name(tmp_path: Path) -> None:
    file = tmp_path / "tiny.Q8_0.gguf"
    file.write_bytes(b"\0" * 8500)
    estimate = estimate_weight_bytes(resolve_model_source(str(file)), tmp_path / "cache", 4)
    assert estimate == 8500 * 32 // 8.5
    assert estimate_weight_bytes(resolve_model_source(str(file)), tmp_path / "cache", None) == 8500


def test_nothing_is_known_of_a_hub_id(tmp_path: Path) -> None:
    source = ModelSource(kind=SourceKind.HUB_REPO, location="owner/repo", default_id="owner/repo")
    assert estimate_weight_bytes(source, tmp_path, 4) is None
