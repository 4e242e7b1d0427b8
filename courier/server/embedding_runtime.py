"""Embeddings for a model at work: an embedding model's actors (its embedder alone), and the embedder a generative
model gets when the operator enables pooling for it (`--embedding-pooling`).

An embedding model has no scheduler, KV or prompt cache: it is charged its weights alone and answers
`/v1/embeddings` only (the generation routes answer 400). Its forward passes run on the one MLX thread, as every
model's do. The vectors' width is measured by one forward pass at load, whatever the config says.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import anyio.to_thread
from anyio.streams.memory import MemoryObjectSendStream
from mlx.utils import tree_flatten

from courier.actors.embedder import EmbedderActor
from courier.engine.embedding import EmbeddingModel, Pooling, embed_batch, encoder_forward, pooled_forward
from courier.messages.embedder import EmbedderMessage
from courier.model.catalog import ModelDeclaration
from courier.model.embedding_models import is_embedding_model, load_embedding_model
from courier.model.hub import fetch_repo
from courier.model.loader import LoadedModel
from courier.model.source import ModelSource, SourceKind
from courier.runtime.mlx_thread import MlxThread
from courier.status.models import ModelStatus

EMBEDDER_INBOX = 64
Embedder = MemoryObjectSendStream[EmbedderMessage]
StartActor = Callable[[EmbedderActor, int], Awaitable[Embedder]]  # `Runtime.start`


def embeds_only(declaration: ModelDeclaration) -> bool:
    """Whether the declared model is an embedding model (an MLX directory whose files say so)."""
    source = declaration.source
    return source.kind is SourceKind.MLX_DIRECTORY and is_embedding_model(Path(source.location))


async def as_embedding_model(declaration: ModelDeclaration, status: ModelStatus) -> ModelDeclaration | None:
    """The declaration of an embedding model, with a hub repo's files fetched to a local directory (only its files
    tell an encoder from a generative model); None for a generative model, left to mlx-lm as declared."""
    source = declaration.source
    if source.kind is SourceKind.HUB_REPO:
        status.progress = f"fetching {source.location} from the Hugging Face hub"
        local = await anyio.to_thread.run_sync(fetch_repo, source.location)
        source = ModelSource(kind=SourceKind.MLX_DIRECTORY, location=str(local), default_id=source.default_id)
        declaration = replace(declaration, source=source)
    return declaration if embeds_only(declaration) else None


async def start_embedding_model(
    start: StartActor, mlx: MlxThread, declaration: ModelDeclaration, status: ModelStatus
) -> tuple[Embedder, int]:
    """Load the embedding model and start its embedder: the embedder's inbox and the weights' bytes."""
    status.progress = "loading the embedding model"
    loaded = await mlx.call(partial(load_embedding_model, Path(declaration.source.location)))
    model = EmbeddingModel(
        forward=encoder_forward(loaded.model),
        dimensions=loaded.dimensions,
        max_tokens=loaded.max_tokens,
        pooling="model",
        pad_id=loaded.pad_id,
    )
    embedder = await _start_embedder(start, mlx, model, status, encode=loaded.encode, vocabulary=loaded.vocabulary)
    return embedder, await mlx.call(partial(_weights_bytes, loaded.model))


async def start_pooled_embedder(
    start: StartActor, mlx: MlxThread, loaded: LoadedModel, pooling: str, status: ModelStatus
) -> Embedder:
    """The embedder of a generative model whose hidden states the operator lets answer `/v1/embeddings`."""
    model = EmbeddingModel(
        forward=pooled_forward(loaded.model, Pooling(pooling)),
        dimensions=0,
        max_tokens=loaded.info.usable_context_length,
        pooling=pooling,
    )
    tokenizer = loaded.tokenizer
    vocabulary = len(tokenizer.get_vocab())
    encode: Callable[[str], list[int]] = lambda text: list(tokenizer.encode(text))  # noqa: E731
    return await _start_embedder(start, mlx, model, status, encode=encode, vocabulary=vocabulary)


async def _start_embedder(
    start: StartActor,
    mlx: MlxThread,
    model: EmbeddingModel,
    status: ModelStatus,
    *,
    encode: Callable[[str], list[int]],
    vocabulary: int,
) -> Embedder:
    status.progress = "measuring its embeddings"
    (probe,) = await mlx.call(partial(embed_batch, model, [[model.pad_id]]))
    status.state.embeddings = {"dimensions": len(probe), "pooling": model.pooling, "max_input_tokens": model.max_tokens}
    measured = EmbeddingModel(
        forward=model.forward,
        dimensions=len(probe),
        max_tokens=model.max_tokens,
        pooling=model.pooling,
        pad_id=model.pad_id,
    )
    return await start(EmbedderActor(mlx, measured, encode, vocabulary), EMBEDDER_INBOX)


def _weights_bytes(model: Any) -> int:
    """On the MLX thread: the loaded weights' bytes."""
    return sum(array.nbytes for _, array in tree_flatten(model.parameters()))
