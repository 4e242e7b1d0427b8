"""Loading a vision-language model: mlx-vlm for the vision tower and processor, mlx-lm for the text model.

The text model is rebuilt as an ordinary mlx-lm model sharing the checkpoint's
weights, so batching, prompt caching and snapshots work for it as for any text
model; only a prompt's image-bearing prefill goes through the vision tower
(`embedder.py`). Runs on the MLX thread.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx import nn
from mlx.utils import tree_flatten
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import load_tokenizer

from courier.model.vision.embedder import ImageEmbedder
from courier.model.vision.model_dir import SUPPORTED_FAMILIES
from courier.model.vision.processing import ImageProcessor
from courier.model.weight_format import describe_weights, to_dense_dtype

INSTALL_HINT = "install the vision extra: pip install 'courier[vision]'"


class VisionLoadError(RuntimeError):
    """The vision model cannot be served; the message says why."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadedVision:
    text_model: nn.Module
    tokenizer: TokenizerWrapper
    embedder: ImageEmbedder
    processor: ImageProcessor


def load_vision_model(
    location: str, config: dict[str, Any], *, dtype: mx.Dtype | None, trust_remote_code: bool
) -> tuple[LoadedVision, str]:
    """The model ready to serve (weights in `dtype` when given), and how the checkpoint stores its weights."""
    family = str(config.get("model_type", "unknown"))
    if family not in SUPPORTED_FAMILIES:
        supported = ", ".join(sorted(SUPPORTED_FAMILIES))
        raise VisionLoadError(f"vision model family {family!r} is not supported (supported: {supported})")
    try:
        mlx_vlm = importlib.import_module("mlx_vlm")
    except ImportError as error:
        raise VisionLoadError(
            f"{location} is a vision model and mlx-vlm is missing ({error}); {INSTALL_HINT}"
        ) from None
    vlm, processor = mlx_vlm.load(location, trust_remote_code=trust_remote_code)
    stored_format = describe_weights(vlm, config)
    if dtype is not None:
        vlm = to_dense_dtype(vlm, dtype)
    text_model = _text_model(vlm, config)
    # The vision model embeds text tokens with the text model's own table from here on: one copy of the weights.
    vlm.language_model = text_model.model
    image_token_id = _image_token_id(vlm, config)
    tokenizer = load_tokenizer(location, {"trust_remote_code": trust_remote_code} if trust_remote_code else None)
    loaded = LoadedVision(
        text_model=text_model,
        tokenizer=tokenizer,
        embedder=ImageEmbedder(vlm, image_token_id),
        processor=ImageProcessor(processor),
    )
    return loaded, stored_format


def _text_model(vlm: Any, config: dict[str, Any]) -> nn.Module:
    """The checkpoint's language model as an mlx-lm model, holding the very same weight arrays."""
    text_config = dict(config.get("text_config") or {})
    text_type = str(text_config.get("model_type") or "llama")
    if text_type in SUPPORTED_FAMILIES:
        text_type = "llama"  # mlx-vlm's own name for the Idefics3/SmolVLM text model, a llama
    try:
        module = importlib.import_module(f"mlx_lm.models.{text_type}")
    except ImportError:
        raise VisionLoadError(f"the text model type {text_type!r} is not one mlx-lm knows") from None
    text_config["model_type"] = text_type
    text_config.setdefault("tie_word_embeddings", bool(config.get("tie_word_embeddings", False)))
    model: nn.Module = module.Model(module.ModelArgs.from_dict(text_config))
    weights = [(_text_weight_name(name), value) for name, value in tree_flatten(vlm.language_model.parameters())]
    if text_config["tie_word_embeddings"]:
        weights = [(name, value) for name, value in weights if not name.startswith("lm_head.")]
    _quantize_like(model, {name for name, _ in weights}, config)
    try:
        model.load_weights(weights, strict=True)
    except ValueError as error:
        raise VisionLoadError(f"the text model's weights do not fit mlx-lm's {text_type}: {error}") from None
    model.eval()
    return model


def _quantize_like(model: nn.Module, names: set[str], config: dict[str, Any]) -> None:
    """Quantize the layers the checkpoint stores quantized (kept so on Metal and CUDA), as mlx-lm's loader does."""
    if not any(name.endswith(".scales") for name in names):
        return
    quantization = config.get("quantization") or {}
    nn.quantize(
        model,
        group_size=int(quantization.get("group_size", 64)),
        bits=int(quantization.get("bits", 4)),
        mode=str(quantization.get("mode", "affine")),
        class_predicate=lambda path, _module: f"{path}.scales" in names,
    )


def _text_weight_name(name: str) -> str:
    """mlx-vlm's language model names its parts as the Hugging Face model does; mlx-lm nests all but the head."""
    return name if name.startswith("lm_head.") else f"model.{name}"


def _image_token_id(vlm: Any, config: dict[str, Any]) -> int:
    for value in (getattr(vlm.config, "image_token_index", None), config.get("image_token_id")):
        if isinstance(value, int):
            return value
    raise VisionLoadError("the model's config names no image token")
