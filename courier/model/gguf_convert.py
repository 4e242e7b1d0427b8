"""Converts a llama-family GGUF file into an MLX model directory that mlx-lm loads.

MLX reads GGUF directly and hands legacy quantized tensors (Q4_0, Q4_1, Q8_0) over
in its own affine format (`weight` + `scales` + `biases`, group size 32), so the
conversion renames tensors to mlx-lm's module names, writes `config.json` from the
GGUF metadata, and rebuilds the tokenizer. Nothing is dequantized here: the loader
picks the serving weight format for the device.

The directory is written under a temporary name and renamed into place, so a
crash or a concurrent converter never leaves a half-written model behind.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import orjson

from courier.model.gguf_tokenizer import write_tokenizer_files
from courier.model.progress import Progress

# Bump when the output layout changes so stale conversions are redone.
CONVERTER_VERSION = 1
MARKER_FILE = "courier-conversion.json"
_GGUF_GROUP_SIZE = 32
_SUPPORTED_ARCHITECTURES = frozenset({"llama"})
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_LEVEL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_TENSOR = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|scales|biases|bias)$")
_TOP_TENSOR = re.compile(r"^([a-z_]+)\.(weight|scales|biases|bias)$")


class GGUFConversionError(ValueError):
    """The GGUF file cannot be converted; the message says why."""


def converted_model_dir(gguf_path: Path, cache_dir: Path) -> Path:
    """Where the conversion of `gguf_path` lives: keyed by name, size and mtime."""
    stat = gguf_path.stat()
    fingerprint = f"{gguf_path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{CONVERTER_VERSION}"
    digest = hashlib.sha256(fingerprint.encode()).hexdigest()[:16]
    return cache_dir / "models" / f"{gguf_path.stem}-{digest}"


def ensure_converted(gguf_path: Path, cache_dir: Path, progress: Progress) -> Path:
    """Return an MLX model directory for `gguf_path`, converting it on first use."""
    target = converted_model_dir(gguf_path, cache_dir)
    if (target / MARKER_FILE).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_name(f"{target.name}.partial-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        convert_gguf(gguf_path, staging, progress)
        try:
            staging.rename(target)
        except OSError:
            # Another process finished the same conversion first; theirs is as good.
            if not (target / MARKER_FILE).is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def convert_gguf(gguf_path: Path, out_dir: Path, progress: Progress) -> None:
    with progress.step(f"reading {gguf_path.name}"):
        try:
            loaded = mx.load(str(gguf_path), return_metadata=True)
        except (RuntimeError, ValueError) as error:
            raise GGUFConversionError(f"cannot read GGUF file {gguf_path}: {error}") from error
    tensors, metadata = cast("tuple[dict[str, mx.array], dict[str, Any]]", loaded)
    architecture = str(metadata.get("general.architecture", ""))
    if architecture not in _SUPPORTED_ARCHITECTURES:
        raise GGUFConversionError(
            f"GGUF architecture {architecture!r} is not supported (supported: {sorted(_SUPPORTED_ARCHITECTURES)}); "
            "use an MLX model directory instead"
        )
    config = model_config(metadata, tensors)
    with progress.step(f"converting {len(tensors)} tensors to MLX", total=len(tensors)) as step:
        weights: dict[str, mx.array] = {}
        for name, tensor in tensors.items():
            weights[mlx_tensor_name(name)] = tensor
            step.advance()
        mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    with progress.step("building tokenizer from GGUF metadata"):
        write_tokenizer_files(metadata, out_dir, int(config["max_position_embeddings"]))
    (out_dir / "config.json").write_bytes(orjson.dumps(config, option=orjson.OPT_INDENT_2))
    marker = {"source": str(gguf_path.resolve()), "converter_version": CONVERTER_VERSION}
    (out_dir / MARKER_FILE).write_bytes(orjson.dumps(marker, option=orjson.OPT_INDENT_2))


def mlx_tensor_name(gguf_name: str) -> str:
    if match := _BLOCK_TENSOR.match(gguf_name):
        layer, part, suffix = match.groups()
        if part in _BLOCK_NAMES:
            return f"model.layers.{layer}.{_BLOCK_NAMES[part]}.{suffix}"
    elif match := _TOP_TENSOR.match(gguf_name):
        part, suffix = match.groups()
        if part in _TOP_LEVEL_NAMES:
            return f"{_TOP_LEVEL_NAMES[part]}.{suffix}"
    raise GGUFConversionError(f"unexpected GGUF tensor {gguf_name!r} for a llama-family model")


def model_config(metadata: Mapping[str, Any], tensors: Mapping[str, mx.array]) -> dict[str, Any]:
    """mlx-lm's llama config from GGUF metadata (`<arch>.*` keys)."""
    arch = str(metadata["general.architecture"])

    def number(key: str, default: float | None = None) -> float:
        value = metadata.get(f"{arch}.{key}")
        if value is None:
            if default is None:
                raise GGUFConversionError(f"GGUF metadata lacks {arch}.{key}")
            return default
        return float(value.item()) if hasattr(value, "item") else float(value)

    hidden = int(number("embedding_length"))
    heads = int(number("attention.head_count"))
    vocab = metadata.get(f"{arch}.vocab_size")
    config: dict[str, Any] = {
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": int(number("block_count")),
        "intermediate_size": int(number("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(number("attention.head_count_kv", heads)),
        "head_dim": int(number("rope.dimension_count", hidden // heads)),
        "rms_norm_eps": number("attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": number("rope.freq_base", 10000.0),
        # GGUF stores Q/K rows permuted for llama.cpp's interleaved rotary layout.
        "rope_traditional": True,
        "max_position_embeddings": int(number("context_length", 4096)),
        "vocab_size": int(vocab.item()) if vocab is not None else len(metadata["tokenizer.ggml.tokens"]),
        "tie_word_embeddings": "output.weight" not in tensors,
    }
    eos = metadata.get("tokenizer.ggml.eos_token_id")
    if eos is not None:
        config["eos_token_id"] = int(eos.item()) if hasattr(eos, "item") else int(eos)
    if any(name.endswith(".scales") for name in tensors):
        # Per-layer bit widths are inferred by mlx-lm from each tensor's shapes.
        bits = _dominant_bits(tensors)
        config["quantization"] = {"group_size": _GGUF_GROUP_SIZE, "bits": bits}
    return config


def _dominant_bits(tensors: Mapping[str, mx.array]) -> int:
    counts: dict[int, int] = {}
    for name, scales in tensors.items():
        if name.endswith(".scales"):
            packed = tensors[name.removesuffix(".scales") + ".weight"]
            bits = packed.shape[-1] * 32 // (scales.shape[-1] * _GGUF_GROUP_SIZE)
            counts[bits] = counts.get(bits, 0) + 1
    return max(counts, key=lambda bits: counts[bits])
