from __future__ import annotations

from pathlib import Path

import orjson
import pytest
from tokenizers import Tokenizer

from courier.model.gguf_convert import (
    MARKER_FILE,
    GGUFConversionError,
    converted_model_dir,
    ensure_converted,
    mlx_tensor_name,
)
from courier.model.progress import Progress
from courier.model.source import embedded_gguf_path


@pytest.mark.parametrize(
    ("gguf", "mlx"),
    [
        ("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight"),
        ("blk.12.attn_k.scales", "model.layers.12.self_attn.k_proj.scales"),
        ("blk.3.attn_v.biases", "model.layers.3.self_attn.v_proj.biases"),
        ("blk.29.attn_output.weight", "model.layers.29.self_attn.o_proj.weight"),
        ("blk.1.ffn_gate.weight", "model.layers.1.mlp.gate_proj.weight"),
        ("blk.1.ffn_up.weight", "model.layers.1.mlp.up_proj.weight"),
        ("blk.1.ffn_down.weight", "model.layers.1.mlp.down_proj.weight"),
        ("blk.7.attn_norm.weight", "model.layers.7.input_layernorm.weight"),
        ("blk.7.ffn_norm.weight", "model.layers.7.post_attention_layernorm.weight"),
        ("token_embd.weight", "model.embed_tokens.weight"),
        ("output_norm.weight", "model.norm.weight"),
        ("output.weight", "lm_head.weight"),
    ],
)
def test_tensor_names_map_onto_mlx_lm_llama(gguf: str, mlx: str) -> None:
    assert mlx_tensor_name(gguf) == mlx


@pytest.mark.parametrize("name", ["blk.0.attn_qkv.weight", "rope_freqs.weight", "blk.x.attn_q.weight"])
def test_unknown_tensors_are_refused(name: str) -> None:
    with pytest.raises(GGUFConversionError, match="unexpected GGUF tensor"):
        mlx_tensor_name(name)


def test_embedded_model_converts_to_a_llama_config(smollm2_dir: Path) -> None:
    config = orjson.loads((smollm2_dir / "config.json").read_bytes())
    assert config["model_type"] == "llama"
    assert (config["hidden_size"], config["num_hidden_layers"], config["intermediate_size"]) == (576, 30, 1536)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (9, 3, 64)
    assert config["rope_traditional"] is True
    assert config["tie_word_embeddings"] is True
    assert config["max_position_embeddings"] == 8192
    assert config["quantization"] == {"group_size": 32, "bits": 4}
    assert (smollm2_dir / MARKER_FILE).is_file()


def test_tokenizer_round_trips_and_keeps_special_tokens_whole(smollm2_dir: Path) -> None:
    tokenizer = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    text = "Hello world, 2024! <|im_start|>user\nçà va?<|im_end|>"
    ids = tokenizer.encode(text).ids
    assert tokenizer.decode(ids, skip_special_tokens=False) == text
    im_start = tokenizer.token_to_id("<|im_start|>")
    assert im_start is not None
    assert ids.count(im_start) == 1
    assert tokenizer.encode("2024").ids == [tokenizer.token_to_id(digit) for digit in "2024"]


def test_tokenizer_config_carries_the_chat_template(smollm2_dir: Path) -> None:
    config = orjson.loads((smollm2_dir / "tokenizer_config.json").read_bytes())
    assert "<|im_start|>" in config["chat_template"]
    assert config["eos_token"] == "<|im_end|>"
    assert config["add_bos_token"] is False


def test_second_conversion_reuses_the_first(smollm2_dir: Path, cache_dir: Path) -> None:
    before = (smollm2_dir / "model.safetensors").stat().st_mtime_ns
    assert ensure_converted(embedded_gguf_path(), cache_dir, Progress(enabled=False)) == smollm2_dir
    assert (smollm2_dir / "model.safetensors").stat().st_mtime_ns == before


def test_conversion_dir_changes_when_the_source_file_changes(tmp_path: Path) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"one")
    first = converted_model_dir(gguf, tmp_path)
    gguf.write_bytes(b"three")
    assert converted_model_dir(gguf, tmp_path) != first


def test_unreadable_gguf_is_a_clear_error_and_leaves_nothing(tmp_path: Path) -> None:
    gguf = tmp_path / "broken.gguf"
    gguf.write_bytes(b"this is not a gguf file")
    with pytest.raises(GGUFConversionError, match="cannot read GGUF file"):
        ensure_converted(gguf, tmp_path / "cache", Progress(enabled=False))
    assert list((tmp_path / "cache" / "models").iterdir()) == []
