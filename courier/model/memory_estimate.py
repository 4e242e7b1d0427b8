"""How much memory a model's weights will take once loaded, estimated before loading it.

The registry needs a figure before a model is loaded to decide what to unload for it. For an MLX directory the
safetensors headers say every tensor's dtype and shape, so the estimate is exact up to the serving format: a
quantized weight (packed `uint32` beside its `.scales`) served dense counts its unpacked elements at the dense
dtype's size, and its scales and biases go away. A `.gguf` file already converted under the cache directory is
read the same way; one not yet converted is estimated from its size and the bits per weight its name suggests. A
hub id has no local files: nothing is known until it loads. Once loaded, the registry weighs the model's
parameters and uses that instead.
"""

from __future__ import annotations

import json
import math
import re
import struct
from pathlib import Path
from typing import Any

from courier.model.gguf_convert import converted_model_dir
from courier.model.source import ModelSource, SourceKind

_HEADER_LENGTH = struct.Struct("<Q")
_MAX_HEADER_BYTES = 100 * 1024**2
# A GGUF's bits per weight by the quantization its file name carries (llama.cpp's naming), scales included.
_GGUF_BITS = (("BF16", 16.0), ("F16", 16.0), ("F32", 32.0), ("Q8", 8.5), ("Q6", 6.6), ("Q5", 5.5), ("Q4", 4.5))
_GGUF_DEFAULT_BITS = 4.5
DEFAULT_GROUP_SIZE = 64  # mlx-lm's
_QUANTIZED_SUFFIXES = (".scales", ".biases")


def estimate_weight_bytes(source: ModelSource, cache_dir: Path, dense_bytes: int | None) -> int | None:
    """The bytes the weights will take served with `dense_bytes` per parameter (None: as stored); None when
    nothing can be read before loading."""
    location = Path(source.location)
    if source.kind is SourceKind.HUB_REPO:
        return None
    if source.kind in (SourceKind.EMBEDDED, SourceKind.GGUF_FILE):
        try:
            converted = converted_model_dir(location, cache_dir)
        except OSError:
            return None
        if converted.is_dir():
            return _directory_bytes(converted, dense_bytes)
        return _gguf_bytes(location, dense_bytes)
    return _directory_bytes(location, dense_bytes)


def _directory_bytes(directory: Path, dense_bytes: int | None) -> int | None:
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        return None
    if dense_bytes is None:
        return sum(file.stat().st_size for file in files)
    group_size = _group_size(directory / "config.json")
    total = 0
    for file in files:
        tensors = _safetensors_header(file)
        if tensors is None:
            return None
        total += _dense_bytes(tensors, group_size, dense_bytes)
    return total


def _dense_bytes(tensors: dict[str, Any], group_size: int, dense_bytes: int) -> int:
    total = 0
    for name, tensor in tensors.items():
        if name == "__metadata__" or name.endswith(_QUANTIZED_SUFFIXES):
            continue
        elements = math.prod(int(size) for size in tensor.get("shape", ()))
        scales = tensors.get(f"{name.removesuffix('.weight')}.scales")
        if tensor.get("dtype") == "U32" and isinstance(scales, dict):
            # Packed: one scale per group of values, whatever the bits of this tensor.
            elements = math.prod(int(size) for size in scales.get("shape", ())) * group_size
        total += elements * dense_bytes
    return total


def _group_size(config: Path) -> int:
    try:
        quantization = json.loads(config.read_text()).get("quantization") or {}
    except (OSError, ValueError, AttributeError):
        return DEFAULT_GROUP_SIZE
    size = quantization.get("group_size") if isinstance(quantization, dict) else None
    return size if isinstance(size, int) and size > 0 else DEFAULT_GROUP_SIZE


def _safetensors_header(file: Path) -> dict[str, Any] | None:
    try:
        with file.open("rb") as handle:
            (length,) = _HEADER_LENGTH.unpack(handle.read(_HEADER_LENGTH.size))
            if length > _MAX_HEADER_BYTES:
                return None
            header = json.loads(handle.read(length))
    except (OSError, ValueError, struct.error):
        return None
    return header if isinstance(header, dict) else None


def _gguf_bytes(file: Path, dense_bytes: int | None) -> int | None:
    try:
        size = file.stat().st_size
    except OSError:
        return None
    if dense_bytes is None:
        return size
    name = file.name.upper()
    bits = next((bits for marker, bits in _GGUF_BITS if re.search(rf"\b{marker}", name)), _GGUF_DEFAULT_BITS)
    return int(size * dense_bytes * 8 / bits)
