"""What `/health`, `/v1/models` and the startup log say about the served model."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from courier.core.sampling_defaults import SamplingDefaults

# When the model's config names no context length.
DEFAULT_CONTEXT_LENGTH = 4096


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelInfo:
    model_id: str
    source: str
    path: str
    architecture: str
    context_length: int | None
    device: str
    weight_format: str
    stored_format: str
    prompt_cache_trimmable: bool
    created: int
    accepts_images: bool = False  # a vision-language model (mlx-vlm)
    # The model's recommended sampling (generation_config.json, or the embedded model's card); None: none given.
    sampling: SamplingDefaults | None = None

    @property
    def usable_context_length(self) -> int:
        """The context admission enforces: the configured one, else `DEFAULT_CONTEXT_LENGTH`."""
        return self.context_length or DEFAULT_CONTEXT_LENGTH

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
