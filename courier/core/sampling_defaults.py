"""What `temperature` and `top_p` a request gets when it sends none.

In order: the server's flags (`--default-temperature`, `--default-top-p`), the model's own recommendation (its
`generation_config.json`, as vLLM reads it; for the embedded SmolLM2 its model card's), then OpenAI's 1.0.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

OPENAI_TEMPERATURE = 1.0
OPENAI_TOP_P = 1.0


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingDefaults:
    temperature: float = OPENAI_TEMPERATURE
    top_p: float = OPENAI_TOP_P
    source: str = "openai"  # where they come from: "flags", "generation_config.json", "model card", "openai"

    def as_dict(self) -> dict[str, Any]:
        return {"temperature": self.temperature, "top_p": self.top_p, "source": self.source}


OPENAI = SamplingDefaults()


def from_generation_config(model_dir: str | Path) -> SamplingDefaults | None:
    """The model's recommended temperature and top_p, when its `generation_config.json` gives either."""
    path = Path(model_dir) / "generation_config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    temperature, top_p = config.get("temperature"), config.get("top_p")
    usable_temperature = _number(temperature, 0.0, 2.0)
    usable_top_p = _number(top_p, 0.0, 1.0, open_low=True)
    if usable_temperature is None and usable_top_p is None:
        return None
    return SamplingDefaults(
        temperature=OPENAI_TEMPERATURE if usable_temperature is None else usable_temperature,
        top_p=OPENAI_TOP_P if usable_top_p is None else usable_top_p,
        source="generation_config.json",
    )


def resolve(
    flag_temperature: float | None, flag_top_p: float | None, model: SamplingDefaults | None
) -> SamplingDefaults:
    """The flags over the model's recommendation over OpenAI's defaults, field by field."""
    base = model or OPENAI
    if flag_temperature is None and flag_top_p is None:
        return base
    return SamplingDefaults(
        temperature=base.temperature if flag_temperature is None else flag_temperature,
        top_p=base.top_p if flag_top_p is None else flag_top_p,
        source="flags" if base is OPENAI else f"flags, then {base.source}",
    )


def _number(value: Any, low: float, high: float, *, open_low: bool = False) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if value > high or value < low or (open_low and value == low):
        return None
    return float(value)
