"""The embedder over a real inbox and a real MLX thread, with a tiny forward pass the test can check by hand: each
input's vector is its tokens' count and sum, so a batch's padding or order showing through would change it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial

import anyio
import mlx.core as mx
import pytest
from anyio.streams.memory import MemoryObjectSendStream

from courier.actors.embedder import MAX_BATCH_INPUTS, MAX_BATCH_TOKENS, EmbedderActor, batches
from courier.engine.embedding import EmbeddingModel
from courier.messages.asking import Refused, call
from courier.messages.embedder import Embedded, EmbedderMessage, EmbeddingInput, EmbedInputs
from courier.runtime.mlx_thread import MlxThread

pytestmark = pytest.mark.anyio
VOCABULARY = 100


def count_and_sum(ids: mx.array, mask: mx.array) -> mx.array:
    """Per input: (its real tokens' count, their ids' sum), unnormalized so the test reads them back."""
    weights = mask.astype(mx.float32)
    return mx.stack([weights.sum(axis=1), (ids.astype(mx.float32) * weights).sum(axis=1)], axis=1)


MODEL = EmbeddingModel(forward=count_and_sum, dimensions=2, max_tokens=8, pooling="model", pad_id=7)


def encode(text: str) -> list[int]:
    return [ord(letter) - ord("a") for letter in text]


@asynccontextmanager
async def embedder() -> AsyncIterator[MemoryObjectSendStream[EmbedderMessage]]:
    mlx = MlxThread()
    send, receive = anyio.create_memory_object_stream[EmbedderMessage](4)
    try:
        async with anyio.create_task_group() as tasks:
            await tasks.start(partial(EmbedderActor(mlx, MODEL, encode, VOCABULARY).run), receive)
            with send:
                yield send
    finally:
        mlx.close(5)


async def embed(send: MemoryObjectSendStream[EmbedderMessage], *inputs: EmbeddingInput) -> Embedded:
    return await call(send, lambda reply: EmbedInputs(inputs=inputs, reply=reply))


async def test_each_input_gets_its_own_vector_in_order_whatever_the_padding() -> None:
    async with embedder() as send:
        result = await embed(send, "abc", (5,), "ba", "abcdefgh")
    assert result.vectors == ((3.0, 3.0), (1.0, 5.0), (2.0, 1.0), (8.0, 28.0))
    assert result.prompt_tokens == 14


REFUSED: list[tuple[tuple[EmbeddingInput, ...], str, str]] = [
    (("",), "input", "empty"),
    (("ab", ()), "input[1]", "empty"),
    (("abcdefghi",), "input", "at most 8"),
    (((1, 100),), "input", "outside the vocabulary"),
    (("ab", (-1,)), "input[1]", "outside the vocabulary"),
]


@pytest.mark.parametrize(("inputs", "param", "says"), REFUSED)
async def test_an_input_it_cannot_embed_fails_its_request_only(
    inputs: tuple[EmbeddingInput, ...], param: str, says: str
) -> None:
    async with embedder() as send:
        with pytest.raises(Refused) as refused:
            await embed(send, *inputs)
        assert (refused.value.failure.param, says in refused.value.failure.message) == (param, True)
        assert (await embed(send, "a")).vectors == ((1.0, 0.0),)  # and it goes on serving


def test_batches_group_similar_lengths_within_the_caps() -> None:
    assert batches([5, 1, 3]) == [[1, 2, 0]]
    many = batches([1] * (MAX_BATCH_INPUTS + 1))
    assert [len(batch) for batch in many] == [MAX_BATCH_INPUTS, 1]
    long = MAX_BATCH_TOKENS // 3 + 1
    assert batches([long, long, 2]) == [[2, 0], [1]]  # a third, padded to the longest, would pass the cap
