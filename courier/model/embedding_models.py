"""Embedding models (BERT, ModernBERT, XLM-RoBERTa, Qwen3-Embedding, ...): told apart from generative models by
their files, loaded through mlx-embeddings (the `embeddings` extra).

Why mlx-embeddings: it is the maintained MLX library for these families (BERT, ModernBERT, XLM-RoBERTa, Qwen3,
Gemma3 text, LFM2, SigLIP and more), loads MLX-format directories as mlx-community publishes them, and gives each
model its own pooling and normalization recipe (mean for BERT, last token for Qwen3-Embedding), so Courier keeps no
model code of its own for them. It runs on Linux CPU with the MLX Courier already pins.

A directory is an embedding model when its `config.json` names an encoder (`model_type` bert, modernbert,
xlm-roberta), when it carries sentence-transformers files (`modules.json`, `config_sentence_transformers.json`: how
Qwen3-Embedding and most embedding repos ship), or when its `architectures` name no generating head.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ENCODER_TYPES = frozenset({"bert", "modernbert", "xlm-roberta", "xlm_roberta", "roberta"})
SENTENCE_TRANSFORMERS_FILES = ("modules.json", "config_sentence_transformers.json")
GENERATING_HEADS = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")
INSTALL_HINT = "install Courier's `embeddings` extra (pip install 'courier[embeddings]')"
# An input longer than this is refused when the model's config says nothing of its positions.
DEFAULT_MAX_TOKENS = 512


class EmbeddingModelError(RuntimeError):
    """The embedding model cannot be loaded; the message says why."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadedEmbeddingModel:
    model: Any  # an mlx-embeddings model: `model(ids, attention_mask=mask).text_embeds`
    encode: Callable[[str], list[int]]  # text -> token ids, special tokens included
    vocabulary: int
    dimensions: int
    max_tokens: int
    pad_id: int


def read_config(location: Path) -> dict[str, Any]:
    try:
        config = json.loads((location / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def is_embedding_model(location: Path) -> bool:
    """Whether the MLX directory `location` holds an embedding model rather than a generative one."""
    config = read_config(location)
    if str(config.get("model_type", "")).lower() in ENCODER_TYPES:
        return True
    if any((location / name).is_file() for name in SENTENCE_TRANSFORMERS_FILES):
        return True
    architectures = config.get("architectures")
    if isinstance(architectures, list) and architectures:
        return not any(str(name).endswith(GENERATING_HEADS) for name in architectures)
    return False


def embedding_problem(location: Path) -> str | None:
    """Why the embedding model at `location` cannot load, as far as its config tells (None: it may)."""
    if importlib.util.find_spec("mlx_embeddings") is None:
        return f"{location} is an embedding model: {INSTALL_HINT}"
    model_type = str(read_config(location).get("model_type", "")).replace("-", "_")
    try:
        known = importlib.util.find_spec(f"mlx_embeddings.models.{model_type}") is not None
    except (ImportError, ValueError):
        known = False
    return None if known else f"mlx-embeddings has no '{model_type}' architecture (config.json model_type)"


def load_embedding_model(location: Path) -> LoadedEmbeddingModel:
    """On the MLX thread: the model and its tokenizer, loaded by mlx-embeddings."""
    problem = embedding_problem(location)
    if problem is not None:
        raise EmbeddingModelError(problem)
    utils = importlib.import_module("mlx_embeddings.utils")
    try:
        model, tokenizer = utils.load(str(location))
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise EmbeddingModelError(f"{location}: mlx-embeddings could not load it ({error})") from error
    config = read_config(location)
    dimensions = int(config.get("hidden_size") or config.get("d_model") or 0)
    positions = config.get("max_position_embeddings")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return LoadedEmbeddingModel(
        model=model,
        encode=lambda text: list(tokenizer.encode(text)),
        vocabulary=int(config.get("vocab_size") or len(tokenizer.get_vocab())),
        dimensions=dimensions,
        max_tokens=int(positions) if isinstance(positions, int) and positions > 0 else DEFAULT_MAX_TOKENS,
        pad_id=int(pad_id),
    )


def pooling_by_model(find: Callable[[str | None], str | None], specs: tuple[str, ...]) -> dict[str, str]:
    """`--embedding-pooling` (`NAME=POOLING`, an empty NAME for the default model) resolved to model ids by `find`
    (a name to the id of the model it names, None: none); a NAME no model answers to is a ValueError."""
    pooling: dict[str, str] = {}
    for spec in specs:
        name, _, how = spec.rpartition("=")
        model_id = find(name or None)
        if model_id is None:
            raise ValueError(f"--embedding-pooling {spec}: no model is named {name!r}")
        pooling[model_id] = how
    return pooling
