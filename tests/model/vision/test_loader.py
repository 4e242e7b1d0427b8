"""The vision loader's text model: the checkpoint's own weights, dense or quantized, give the same logits."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx import nn

from courier.model.vision.loader import _text_model
from courier.model.vision.model_dir import read_config


def vision_language_model(directory: Path) -> Any:
    mlx_vlm = importlib.import_module("mlx_vlm")
    model, _ = mlx_vlm.load(str(directory))
    return model


@pytest.mark.parametrize("quantized", [False, True])
def test_the_text_model_matches_the_checkpoints_language_model(tiny_vision_dir: Path, quantized: bool) -> None:
    vlm = vision_language_model(tiny_vision_dir)
    config = read_config(str(tiny_vision_dir))
    assert config is not None
    if quantized:  # as a 4-bit checkpoint keeps it on Metal and CUDA
        nn.quantize(vlm.language_model, group_size=32, bits=4)
        config = {**config, "quantization": {"group_size": 32, "bits": 4}}
    text_model = _text_model(vlm, config)
    tokens = mx.array([[1, 2, 3, 40, 500]])
    expected = vlm.language_model(tokens).logits
    assert mx.allclose(text_model(tokens), expected, atol=1e-4).item()
    assert isinstance(text_model.model.layers[0].self_attn.q_proj, nn.QuantizedLinear) is quantized
