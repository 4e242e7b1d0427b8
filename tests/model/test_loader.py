from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from mlx import nn
from mlx_lm import generate

from courier.model.device import CPU, active_device
from courier.model.loader import LoadedModel, ModelLoadError, load_model
from courier.model.progress import Progress
from courier.model.source import ModelSource, SourceKind, embedded_gguf_path, resolve_model_source


def load(source: ModelSource, cache_dir: Path, weight_format: str = "auto", first_pass: bool = False) -> LoadedModel:
    return load_model(
        source,
        served_model_name=None,
        cache_dir=cache_dir,
        weight_format=weight_format,
        first_pass=first_pass,
        progress=Progress(enabled=False),
    )


def quantized_layers(model: nn.Module) -> int:
    return sum(isinstance(m, nn.QuantizedLinear | nn.QuantizedEmbedding) for _, m in model.named_modules())


def test_quantized_dense_model_is_served_dequantized_to_float32_on_cpu(tiny_llama_dir: Path, cache_dir: Path) -> None:
    loaded = load(resolve_model_source(str(tiny_llama_dir)), cache_dir, first_pass=True)
    info = loaded.info
    assert info.device == "cpu"
    assert info.stored_format == "4-bit affine, group size 32"
    assert info.weight_format == "float32 (from 4-bit affine, group size 32)"
    assert info.prompt_cache_trimmable is True
    assert info.context_length == 2048
    assert info.model_id == tiny_llama_dir.name
    assert quantized_layers(loaded.model) == 0


def test_dequantized_weights_match_the_quantized_model(tiny_llama_dir: Path, cache_dir: Path) -> None:
    source = resolve_model_source(str(tiny_llama_dir))
    native = load(source, cache_dir, weight_format="native")
    dense = load(source, cache_dir, weight_format="float32")
    assert quantized_layers(native.model) > 0
    tokens = mx.array([[1, 2, 3, 4, 5]])
    expected = native.model(tokens).astype(mx.float32)
    actual = dense.model(tokens)
    assert actual.dtype == mx.float32
    assert mx.allclose(actual, expected, atol=1e-2, rtol=1e-2).item()


def test_native_keeps_quantized_weights(tiny_llama_dir: Path, cache_dir: Path) -> None:
    info = load(resolve_model_source(str(tiny_llama_dir)), cache_dir, weight_format="native").info
    assert info.weight_format == "4-bit affine, group size 32"


def test_hybrid_model_reports_a_cache_that_cannot_be_trimmed(tiny_qwen3_next_dir: Path, cache_dir: Path) -> None:
    info = load(resolve_model_source(str(tiny_qwen3_next_dir)), cache_dir, first_pass=True).info
    assert info.architecture == "qwen3_next"
    assert info.prompt_cache_trimmable is False
    assert info.weight_format == "float32"


def test_unloadable_directory_is_a_model_load_error(tmp_path: Path, cache_dir: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "no-such-architecture"}')
    with pytest.raises(ModelLoadError, match="cannot load model"):
        load(ModelSource(kind=SourceKind.MLX_DIRECTORY, location=str(tmp_path), default_id="x"), cache_dir)


@pytest.mark.real_model
def test_embedded_smollm2_knows_the_capital_of_france(cache_dir: Path) -> None:
    loaded = load(resolve_model_source(None), cache_dir, first_pass=True)
    tokenizer = loaded.tokenizer
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True
    )
    answer = generate(loaded.model, tokenizer, prompt, max_tokens=20)
    assert "Paris" in answer
    # `auto`: dequantized to float32 on a CPU (BLAS is fast there), kept as stored (4-bit) on a GPU.
    expected = "float32" if active_device() == CPU else "4-bit"
    assert loaded.info.weight_format.startswith(expected)


@pytest.mark.real_model
def test_a_gguf_path_goes_through_the_same_converter(cache_dir: Path) -> None:
    source = resolve_model_source(str(embedded_gguf_path()))
    assert source.kind is SourceKind.GGUF_FILE
    info = load(source, cache_dir, weight_format="native").info
    assert info.model_id == "SmolLM2-135M-Instruct.Q4_1"
    assert info.architecture == "llama"
    assert Path(info.path).parent == cache_dir / "models"
