"""mlx-lm's continuous batching with the generation batch's attention KV quantized (`--kv-bits`), without drafts.

`QuantizedGenerationBatch` is mlx-lm's `GenerationBatch` whose rows are quantized as they join it
(`quantized_batch_cache.as_generation_layer`); prompts are prefilled at full precision in mlx-lm's prompt batch.
The speculative generator does the same in its own batch (`speculative_batch.py`).
"""

from __future__ import annotations

from typing import Any, cast

from mlx_lm.generate import BatchGenerator, GenerationBatch

from courier.core.prompt_cache.quantization import KvQuantization
from courier.engine.quantized_batch_cache import as_generation_layer


class QuantizedGenerationBatch(GenerationBatch):  # type: ignore[misc]
    quantization: KvQuantization
    prompt_cache: list[Any]  # mlx-lm's attribute (its module is untyped)

    def extend(self, batch: GenerationBatch) -> None:
        super().extend(batch)
        self.prompt_cache = [as_generation_layer(layer, self.quantization) for layer in self.prompt_cache]


def quantized_generator(model: Any, quantization: KvQuantization, **options: Any) -> BatchGenerator:
    """mlx-lm's `BatchGenerator` whose generation batch keeps attention KV quantized with `quantization`."""
    generator = BatchGenerator(model, **options)
    batch = cast("QuantizedGenerationBatch", QuantizedGenerationBatch.empty(generator.model, generator.sampler))
    batch.quantization = quantization
    generator._generation_batch = batch
    return generator
