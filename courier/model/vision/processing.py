"""Images into the prompt: the model's processor expands each image placeholder and prepares the pixels.

Runs in the token counter's worker thread (decoding, resizing and normalizing are
CPU work that must not stall the event loop). The images are decoded here a
second time (the fetcher decoded them once, to refuse what does not decode) and
held, under the image memory budget (`media/memory_budget.py`), until the
processor has built its arrays; then they are dropped. The arrays it returns go
to the engine, which feeds them to the vision tower on the MLX thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from courier.media.images import FetchedImage, decoded_pixels

# What the processor returns besides the tokens; everything else is a keyword of `get_input_embeddings`.
_TEXT_KEYS = frozenset({"input_ids", "attention_mask", "token_type_ids"})


class ImageProcessor:
    def __init__(self, processor: Any) -> None:
        self._processor = processor
        self.placeholder = str(getattr(processor, "image_token", "<image>"))

    def encode(self, text: str, images: Sequence[FetchedImage]) -> tuple[list[int], dict[str, Any]]:
        """The rendered prompt's tokens with every placeholder expanded, and the vision model's inputs.

        Raises ValueError when the placeholders the chat template wrote do not match the images.
        """
        found = text.count(self.placeholder)
        if found != len(images):
            raise ValueError(f"the chat template wrote {found} image placeholders for {len(images)} images")
        with decoded_pixels(images) as pictures:
            inputs = self._processor(text=[text], images=[pictures], add_special_tokens=False)
        tokens = [int(token) for token in _first_row(inputs["input_ids"])]
        arrays = {key: value for key, value in inputs.items() if key not in _TEXT_KEYS}
        return tokens, arrays


def _first_row(ids: Any) -> list[Any]:
    rows = ids.tolist()
    return list(rows[0]) if rows and isinstance(rows[0], list) else list(rows)
