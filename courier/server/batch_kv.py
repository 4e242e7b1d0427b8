"""Whether the running batch keeps attention KV quantized (`--kv-bits`), checked against the model at load.

Refused (the model does not load, saying why): a group size that does not divide the model's attention head
dimension, and a model whose attention has sinks (mlx-lm's quantized attention has none). A vision model, or one
without plain attention layers, runs as computed, with a log line: there is nothing the flag can quantize.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any

from courier.core.prompt_cache.quantization import (
    BATCH_KV_FLAGS,
    KvQuantization,
    QuantizationRefused,
    check_head_dims,
    quantization_from_settings,
)
from courier.engine.model_state import attention_head_dims
from courier.model.loader import LoadedModel, ModelLoadError
from courier.runtime.mlx_thread import MlxThread
from courier.settings import Settings

logger = logging.getLogger(__name__)


async def batch_kv_quantization(settings: Settings, loaded: LoadedModel, mlx: MlxThread) -> KvQuantization | None:
    """How the generation batch holds attention KV (None: as computed). Raises `ModelLoadError` for what the
    model cannot do."""
    quantization = quantization_from_settings(settings.kv_bits, settings.kv_group_size)
    if quantization is None:
        return None
    if loaded.vision is not None:
        logger.info("--kv-bits: a vision model's batch KV runs as computed")
        return None
    if has_attention_sinks(loaded.model):
        raise ModelLoadError("--kv-bits: this model's attention has sinks, which quantized attention cannot take")
    head_dims = await mlx.call(partial(attention_head_dims, loaded.model))
    try:
        check_head_dims(head_dims, quantization, BATCH_KV_FLAGS)
    except QuantizationRefused as refused:
        raise ModelLoadError(str(refused)) from refused
    if not head_dims:
        logger.info("--kv-bits: the model has no attention KV to quantize; its batch runs as computed")
        return None
    logger.info("batch KV: attention KV kept %s while decoding", quantization.label)
    return quantization


def has_attention_sinks(model: Any) -> bool:
    """Whether an attention module of `model` has learned sinks (gpt-oss's), a parameter named `sinks`."""
    return any(hasattr(module, "sinks") for _, module in model.named_modules())
