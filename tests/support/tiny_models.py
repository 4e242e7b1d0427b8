"""Tiny random-weight MLX models, built locally in milliseconds, for fast tests.

Two families: a dense llama (trimmable KV cache; optionally 4-bit quantized so
the dequantizing load path runs) and a hybrid `qwen3_next` (gated-delta plus
attention layers; its cache cannot be trimmed). Both reuse the tokenizer files
of the embedded SmolLM2 conversion, so they tokenize and template like it.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
import orjson
from mlx import nn
from mlx.utils import tree_flatten
from mlx_lm.models import llama, qwen3_next
from mlx_lm.utils import load as mlx_lm_load

from courier.model.weight_format import to_dense_dtype

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
VOCAB_SIZE = 49152
GROUP_SIZE = 32
BITS = 4

LLAMA_CONFIG: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-5,
    "vocab_size": VOCAB_SIZE,
    "max_position_embeddings": 2048,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "eos_token_id": 2,
}

QWEN3_NEXT_CONFIG: dict[str, Any] = {
    "model_type": "qwen3_next",
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "decoder_sparse_step": 1,
    "shared_expert_intermediate_size": 64,
    "mlp_only_layers": [],
    "moe_intermediate_size": 32,
    "rms_norm_eps": 1e-6,
    "vocab_size": VOCAB_SIZE,
    "rope_theta": 10000.0,
    "partial_rotary_factor": 0.5,
    "max_position_embeddings": 4096,
    "full_attention_interval": 2,
    "tie_word_embeddings": False,
    "eos_token_id": 2,
}


def build_llama(tokenizer_dir: Path, out_dir: Path, *, quantized: bool) -> Path:
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict(LLAMA_CONFIG))
    config = dict(LLAMA_CONFIG)
    if quantized:
        nn.quantize(model, group_size=GROUP_SIZE, bits=BITS)
        config["quantization"] = {"group_size": GROUP_SIZE, "bits": BITS}
    return _save(model, config, tokenizer_dir, out_dir)


def load_float32(model_dir: Path) -> tuple[Any, Any]:
    """The model and tokenizer in `model_dir` with any quantized weights made float32, as the server serves them on a
    CPU: the 4-bit tiny llama's matmul over its 49,152-token vocabulary is ~10x slower than the float32 one there."""
    model, tokenizer = mlx_lm_load(str(model_dir))[:2]
    return to_dense_dtype(model, mx.float32), tokenizer


def build_qwen3_next(tokenizer_dir: Path, out_dir: Path) -> Path:
    mx.random.seed(0)
    model = qwen3_next.Model(qwen3_next.ModelArgs.from_dict(QWEN3_NEXT_CONFIG))
    return _save(model, dict(QWEN3_NEXT_CONFIG), tokenizer_dir, out_dir)


def _save(model: nn.Module, config: dict[str, Any], tokenizer_dir: Path, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out_dir / "config.json").write_bytes(orjson.dumps(config))
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, out_dir / name)
    return out_dir


# Quantized prompt-cache snapshots need a head dimension MLX's group sizes (32, 64, 128) divide: the tiny models'
# 16 does not, so these variants have 64 (SmolLM2's).
WIDE_HEAD_DIM = 64


def build_wide_llama(tokenizer_dir: Path, out_dir: Path) -> Path:
    """The tiny float32 llama with 64-dimension attention heads."""
    mx.random.seed(0)
    config = {**LLAMA_CONFIG, "head_dim": WIDE_HEAD_DIM}
    return _save(llama.Model(llama.ModelArgs.from_dict(config)), config, tokenizer_dir, out_dir)


def build_wide_qwen3_next(tokenizer_dir: Path, out_dir: Path) -> Path:
    """The tiny hybrid qwen3_next with 64-dimension attention heads (its gated-delta layers as before)."""
    mx.random.seed(0)
    config = {**QWEN3_NEXT_CONFIG, "head_dim": WIDE_HEAD_DIM}
    return _save(qwen3_next.Model(qwen3_next.ModelArgs.from_dict(config)), config, tokenizer_dir, out_dir)
