"""EmbedderActor: one model's embeddings (an embedding model's, or a generative model's with pooling enabled).

Receives `EmbedInputs`; replies `Embedded` (a unit vector per input, in order, and the tokens counted) or a
`RequestFailed` naming the input at fault (empty, longer than the model takes, a token id outside its vocabulary).
Texts are tokenized on a worker thread (the tokenizer holds no MLX state); the forward passes run on the MLX thread,
in padded batches of inputs of similar length (at most `MAX_BATCH_INPUTS` inputs and `MAX_BATCH_TOKENS` padded
tokens each), so a request of many inputs is a few passes and a long input never pads many short ones.
Invariant: one reply per message; a bad input fails its request only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import anyio

from courier.engine.embedding import EmbeddingModel, embed_batch
from courier.messages.base import FailureKind, RequestFailed
from courier.messages.embedder import Embedded, EmbedderMessage, EmbeddingInput, EmbedInputs
from courier.runtime.actor import Actor
from courier.runtime.mlx_thread import MlxThread

MAX_BATCH_INPUTS = 32
MAX_BATCH_TOKENS = 16_384


class EmbedderActor(Actor[EmbedderMessage]):
    name = "embedder"

    def __init__(self, mlx: MlxThread, model: EmbeddingModel, encode: Callable[[str], list[int]], vocabulary: int):
        self._mlx = mlx
        self._model = model
        self._encode = encode
        self._vocabulary = vocabulary

    async def handle(self, message: EmbedderMessage) -> None:
        match message:
            case EmbedInputs():
                await self._on_embed_inputs(message)

    async def _on_embed_inputs(self, message: EmbedInputs) -> None:
        tokenized = await anyio.to_thread.run_sync(partial(_tokenize, message.inputs, self._encode))
        refused = self._refusal(tokenized)
        if refused is not None:
            await message.reply.send(refused)
            return
        vectors: list[list[float] | None] = [None] * len(tokenized)
        for batch in batches([len(tokens) for tokens in tokenized]):
            rows = await self._mlx.call(partial(embed_batch, self._model, [tokenized[index] for index in batch]))
            for index, row in zip(batch, rows, strict=True):
                vectors[index] = row
        embedded = Embedded(
            vectors=tuple(tuple(row or ()) for row in vectors), prompt_tokens=sum(len(tokens) for tokens in tokenized)
        )
        await message.reply.send(embedded)

    def _refusal(self, tokenized: Sequence[Sequence[int]]) -> RequestFailed | None:
        single = len(tokenized) == 1
        for index, tokens in enumerate(tokenized):
            param = "input" if single else f"input[{index}]"
            if not tokens:
                return _invalid(f"{param} is empty: there is nothing to embed", param)
            if len(tokens) > self._model.max_tokens:
                text = f"{param} has {len(tokens)} tokens; this model embeds at most {self._model.max_tokens}"
                return _invalid(text, param)
            outside = next((token for token in tokens if not 0 <= token < self._vocabulary), None)
            if outside is not None:
                return _invalid(
                    f"{param}: token id {outside} is outside the vocabulary (0-{self._vocabulary - 1})", param
                )
        return None


def batches(lengths: Sequence[int]) -> list[list[int]]:
    """The inputs' indexes in batches of similar length: by length, cut at `MAX_BATCH_INPUTS` inputs or when the
    padded batch would pass `MAX_BATCH_TOKENS` (an input alone is always a batch)."""
    order = sorted(range(len(lengths)), key=lambda index: lengths[index])
    result: list[list[int]] = []
    current: list[int] = []
    for index in order:
        padded = lengths[index] * (len(current) + 1)  # sorted: this input is the longest so far
        if current and (len(current) == MAX_BATCH_INPUTS or padded > MAX_BATCH_TOKENS):
            result.append(current)
            current = []
        current.append(index)
    if current:
        result.append(current)
    return result


def _tokenize(inputs: Sequence[EmbeddingInput], encode: Callable[[str], list[int]]) -> list[list[int]]:
    return [(list(encode(item)) if item else []) if isinstance(item, str) else list(item) for item in inputs]


def _invalid(text: str, param: str) -> RequestFailed:
    return RequestFailed(kind=FailureKind.INVALID_REQUEST, message=text, param=param)
