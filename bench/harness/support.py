"""bench/'s one door to tests/support: the fixtures tests and benches share (tiny models, crafted images).

The imports are late: the tiny models import MLX, which must come after the bench has loaded its BLAS.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


def build_tiny(kind: str, tokenizer_dir: Path, target: Path) -> Path:
    """The tiny random-weight `llama` (float32, trimmable cache) or `qwen3_next` (hybrid) in `target`; `-wide`: with
    64-dimension attention heads, which quantized prompt-cache snapshots need."""
    from tests.support.tiny_models import build_llama, build_qwen3_next, build_wide_llama, build_wide_qwen3_next

    if kind == "llama-wide":
        return build_wide_llama(tokenizer_dir, target)
    if kind == "qwen3_next-wide":
        return build_wide_qwen3_next(tokenizer_dir, target)
    return (
        build_llama(tokenizer_dir, target, quantized=False)
        if kind == "llama"
        else build_qwen3_next(tokenizer_dir, target)
    )


def build_agent_model(tokenizer_dir: Path, target: Path) -> Path:
    """The tiny random-weight llama with a 64K window that ends its replies within a few tokens
    (tests/support/agent_model.py), in `target`."""
    from tests.support.agent_model import build_agent_model as build

    return build(tokenizer_dir, target)


def build_tiny_vision(target: Path) -> Path | None:
    """The tiny random-weight SmolVLM, or None without mlx-vlm (the `vision` extra)."""
    try:
        from tests.support.tiny_vision_model import build_tiny_vision_model
    except ImportError:
        return None
    return build_tiny_vision_model(target)


def crafted_images() -> dict[str, bytes]:
    """Images made to break decoders: a DDS Pillow fails on, a TIFF it raises TypeError on."""
    from tests.support.media_server import crafted_dds, crafted_tiff

    return {"dds": crafted_dds(), "tiff": crafted_tiff()}


def png_header(width: int, height: int) -> bytes:
    """A valid PNG header claiming `width` x `height`, and no pixels."""
    from tests.support.media_server import png_header as header

    return header(width, height)


def measure_drift(model: Any, prompt: Sequence[int], quantizations: Sequence[Any], count: int) -> dict[str, Any]:
    """tests/support/kv_drift.py's `measure`: per stored form, its drift against full precision after a restore."""
    from tests.support.kv_drift import measure

    return dict(measure(model, prompt, quantizations, count))


def hostile_grammars() -> Any:
    """tests/support/hostile_grammars.py: the hostile grammar requests, the small chat, the wide-window tiny llama."""
    from tests.support import hostile_grammars

    return hostile_grammars
