"""A prompt's image embeddings, on the MLX thread: the vision tower's features in its image tokens' places."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import mlx.core as mx


class ImageEmbedder:
    """Wraps an mlx-vlm model: `embeddings` runs its vision tower and connector and merges the features into
    the text embeddings at the image tokens, as the model's own `get_input_embeddings` does."""

    def __init__(self, vision_language_model: Any, image_token_id: int) -> None:
        self._model = vision_language_model
        self.image_token_id = image_token_id

    def image_span_end(self, tokens: Sequence[int]) -> int:
        """One past the last image token in `tokens` (0: none)."""
        for index in range(len(tokens) - 1, -1, -1):
            if tokens[index] == self.image_token_id:
                return index + 1
        return 0

    def embeddings(self, tokens: Sequence[int], arrays: Mapping[str, Any]) -> mx.array:
        """Input embeddings for the whole prompt, shape (1, len(tokens), hidden)."""
        features = self._model.get_input_embeddings(mx.array([list(tokens)]), **arrays)
        embeddings: mx.array = features.inputs_embeds
        return embeddings
