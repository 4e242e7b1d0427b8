"""Telling a vision-language model directory from a text-only one, without importing mlx-vlm."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# Families whose text model numbers every position, images included, one after another (plain 1-D RoPE): their
# decode is an ordinary mlx-lm model's, so they batch with everything else. Families with multimodal rotary
# positions (Qwen2-VL's M-RoPE) need per-sequence position offsets the batch generator cannot carry.
SUPPORTED_FAMILIES = frozenset({"idefics3", "smolvlm"})


def read_config(location: str) -> dict[str, Any] | None:
    """The model directory's config.json, or None when there is none (or it is not a JSON object)."""
    path = Path(location) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def is_vision_model(config: dict[str, Any] | None) -> bool:
    return config is not None and isinstance(config.get("vision_config"), dict)
