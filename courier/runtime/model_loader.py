"""Loads the served model with mlx-lm and prepares it for the active device.

Runs synchronously on the MLX thread: resolve the source (converting a GGUF once
into the cache dir), load weights and tokenizer, pick the serving weight format,
and warm up with one short forward pass.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx import nn
from mlx.utils import tree_flatten
from mlx_lm import load as mlx_lm_load
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache
from mlx_lm.tokenizer_utils import TokenizerWrapper

from courier.core.tool_calls import ToolCallFormat
from courier.runtime.device import active_device, serving_dtype
from courier.runtime.gguf_convert import GGUFConversionError, ensure_converted
from courier.runtime.gguf_tokenizer import UnsupportedTokenizer
from courier.runtime.model_info import ModelInfo
from courier.runtime.model_source import ModelSource, SourceKind
from courier.runtime.progress import Progress
from courier.runtime.weight_format import to_dense_dtype

_WARMUP_TEXT = "Hello"


class ModelLoadError(RuntimeError):
    """The model could not be loaded; the message says why and what to try."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadedModel:
    model: nn.Module
    tokenizer: TokenizerWrapper
    info: ModelInfo


def load_model(
    source: ModelSource,
    *,
    served_model_name: str | None,
    cache_dir: Path,
    weight_format: str,
    warmup: bool,
    progress: Progress,
    trust_remote_code: bool = False,
) -> LoadedModel:
    location = _local_location(source, cache_dir, progress)
    with progress.step(f"loading {source.describe()}"):
        try:
            model, tokenizer, config = mlx_lm_load(location, return_config=True, trust_remote_code=trust_remote_code)
        except Exception as error:  # mlx-lm raises many types (hub, config, weights): report them all alike
            raise ModelLoadError(f"cannot load model from {location}: {type(error).__name__}: {error}") from error
    stored_format = _weights_format(model, config)
    device = active_device()
    dtype = serving_dtype(weight_format, device)
    served_format = stored_format
    if dtype is not None:
        with progress.step(f"preparing {_dtype_name(dtype)} weights for {device}"):
            model = to_dense_dtype(model, dtype)
        served_format = _dtype_name(dtype)
        if served_format != stored_format:
            served_format = f"{served_format} (from {stored_format})"
    if warmup:
        with progress.step("warming up"):
            _warm_up(model, tokenizer)
    info = ModelInfo(
        model_id=served_model_name or source.default_id,
        source=source.describe(),
        path=location,
        architecture=str(config.get("model_type", "unknown")),
        context_length=_context_length(config, tokenizer),
        device=device,
        weight_format=served_format,
        stored_format=stored_format,
        prompt_cache_trimmable=bool(can_trim_prompt_cache(make_prompt_cache(model))),
        created=int(time.time()),
    )
    return LoadedModel(model=model, tokenizer=tokenizer, info=info)


def _local_location(source: ModelSource, cache_dir: Path, progress: Progress) -> str:
    if source.kind not in (SourceKind.EMBEDDED, SourceKind.GGUF_FILE):
        return source.location
    try:
        return str(ensure_converted(Path(source.location), cache_dir, progress))
    except (GGUFConversionError, UnsupportedTokenizer, OSError) as error:
        raise ModelLoadError(f"cannot convert {source.location}: {error}") from error


def _warm_up(model: nn.Module, tokenizer: TokenizerWrapper) -> None:
    tokens = tokenizer.encode(_WARMUP_TEXT) or [0]
    cache = make_prompt_cache(model)
    logits = model(mx.array([tokens]), cache=cache)
    mx.eval(mx.argmax(logits[:, -1, :], axis=-1))


def _weights_format(model: nn.Module, config: dict[str, Any]) -> str:
    quantization = config.get("quantization")
    if isinstance(quantization, dict) and "bits" in quantization:
        mode = quantization.get("mode", "affine")
        return f"{quantization['bits']}-bit {mode}, group size {quantization.get('group_size', '?')}"
    for _, parameter in tree_flatten(model.parameters()):
        if isinstance(parameter, mx.array) and mx.issubdtype(parameter.dtype, mx.floating):
            return _dtype_name(parameter.dtype)
    return "unknown"


def _dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).removeprefix("mlx.core.")


def _context_length(config: dict[str, Any], tokenizer: TokenizerWrapper) -> int | None:
    for scope in (config, config.get("text_config") or {}):
        for key in ("max_position_embeddings", "max_seq_len", "n_ctx", "seq_length"):
            value = scope.get(key)
            if isinstance(value, int) and value > 0:
                return value
    limit = getattr(tokenizer, "model_max_length", None)
    return limit if isinstance(limit, int) and 0 < limit < 10**8 else None


def tool_call_format(tokenizer: TokenizerWrapper) -> ToolCallFormat | None:
    """The model's tool-call markers and parser, when its chat template supports tools."""
    start, end, parser = tokenizer.tool_call_start, tokenizer.tool_call_end, tokenizer.tool_parser
    if not (tokenizer.has_tool_calling and start and end and parser is not None):
        return None
    return ToolCallFormat(start=str(start), end=str(end), parser=parser)
