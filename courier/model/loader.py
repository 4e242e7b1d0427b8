"""Loads the served model with mlx-lm and prepares it for the active device.

Runs synchronously on the MLX thread: resolve the source (converting a GGUF once
into the cache dir), load weights and tokenizer, pick the serving weight format,
and run one short forward pass before reporting ready (`--warmup`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx import nn
from mlx_lm import load as mlx_lm_load
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache
from mlx_lm.tokenizer_utils import TokenizerWrapper

from courier.core.reasoning import ReasoningFormat
from courier.core.sampling_defaults import SamplingDefaults, from_generation_config
from courier.core.tools import generic as generic_tools
from courier.core.tools.calls import ToolCallFormat
from courier.grammar.compiler import GrammarCompiler, build_tokenizer
from courier.grammar.constraint import ToolGrammar
from courier.model.device import active_device, serving_dtype
from courier.model.gguf_convert import GGUFConversionError, ensure_converted
from courier.model.gguf_tokenizer import UnsupportedTokenizer
from courier.model.info import ModelInfo
from courier.model.progress import Progress
from courier.model.source import EMBEDDED_TEMPERATURE, EMBEDDED_TOP_P, ModelSource, SourceKind
from courier.model.vision.loader import LoadedVision, VisionLoadError, load_vision_model
from courier.model.vision.model_dir import is_vision_model, read_config
from courier.model.weight_format import describe_weights, dtype_name, to_dense_dtype

logger = logging.getLogger(__name__)
_FIRST_PASS_TEXT = "Hello"


class ModelLoadError(RuntimeError):
    """The model could not be loaded; the message says why and what to try."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadedModel:
    model: nn.Module
    tokenizer: TokenizerWrapper
    info: ModelInfo
    vision: LoadedVision | None = None  # a vision-language model's image path


def load_model(
    source: ModelSource,
    *,
    served_model_name: str | None,
    cache_dir: Path,
    weight_format: str,
    first_pass: bool,
    progress: Progress,
    trust_remote_code: bool = False,
) -> LoadedModel:
    location = _local_location(source, cache_dir, progress)
    device = active_device()
    dtype = serving_dtype(weight_format, device)
    config = read_config(location)
    vision: LoadedVision | None = None
    if is_vision_model(config):
        assert config is not None
        with progress.step(f"loading vision-language model {source.describe()}"):
            vision, stored_format = _load_vision(location, config, dtype, trust_remote_code)
        model, tokenizer = vision.text_model, vision.tokenizer
    else:
        with progress.step(f"loading {source.describe()}"):
            try:
                model, tokenizer, config = mlx_lm_load(
                    location, return_config=True, trust_remote_code=trust_remote_code
                )
            except Exception as error:  # mlx-lm raises many types (hub, config, weights): report them all alike
                raise ModelLoadError(f"cannot load model from {location}: {type(error).__name__}: {error}") from error
        stored_format = describe_weights(model, config)
        if dtype is not None:
            with progress.step(f"preparing {dtype_name(dtype)} weights for {device}"):
                model = to_dense_dtype(model, dtype)
    served_format = stored_format
    if dtype is not None:
        served_format = dtype_name(dtype)
        if served_format != stored_format:
            served_format = f"{served_format} (from {stored_format})"
    if first_pass:
        with progress.step("warming up"):
            _first_pass(model, tokenizer)
    info = ModelInfo(
        model_id=served_model_name or source.default_id,
        source=source.describe(),
        path=location,
        architecture=str(config.get("model_type", "unknown")),
        context_length=_context_length(config, tokenizer),
        device=device,
        weight_format=served_format,
        stored_format=stored_format,
        prompt_cache_trimmable=bool(can_trim_prompt_cache(make_prompt_cache(model))),
        created=int(time.time()),
        accepts_images=vision is not None,
        sampling=_recommended_sampling(source, location),
    )
    return LoadedModel(model=model, tokenizer=tokenizer, info=info, vision=vision)


def _load_vision(
    location: str, config: dict[str, Any], dtype: mx.Dtype | None, trust_remote_code: bool
) -> tuple[LoadedVision, str]:
    """A vision-language model (mlx-vlm, the optional `courier[vision]` extra), and how it stores its weights."""
    try:
        return load_vision_model(location, config, dtype=dtype, trust_remote_code=trust_remote_code)
    except VisionLoadError as error:
        raise ModelLoadError(str(error)) from error
    except Exception as error:  # mlx-vlm raises many types (config, processor, weights): report them all alike
        raise ModelLoadError(f"cannot load vision model from {location}: {type(error).__name__}: {error}") from error


def _local_location(source: ModelSource, cache_dir: Path, progress: Progress) -> str:
    if source.kind not in (SourceKind.EMBEDDED, SourceKind.GGUF_FILE):
        return source.location
    try:
        return str(ensure_converted(Path(source.location), cache_dir, progress))
    except (GGUFConversionError, UnsupportedTokenizer, OSError) as error:
        raise ModelLoadError(f"cannot convert {source.location}: {error}") from error


def _first_pass(model: nn.Module, tokenizer: TokenizerWrapper) -> None:
    tokens = tokenizer.encode(_FIRST_PASS_TEXT) or [0]
    cache = make_prompt_cache(model)
    logits = model(mx.array([tokens]), cache=cache)
    mx.eval(mx.argmax(logits[:, -1, :], axis=-1))


def _recommended_sampling(source: ModelSource, location: str) -> SamplingDefaults | None:
    found = from_generation_config(location)
    if found is None and source.kind is SourceKind.EMBEDDED:
        return SamplingDefaults(temperature=EMBEDDED_TEMPERATURE, top_p=EMBEDDED_TOP_P, source="model card")
    return found


def _context_length(config: dict[str, Any], tokenizer: TokenizerWrapper) -> int | None:
    for scope in (config, config.get("text_config") or {}):
        for key in ("max_position_embeddings", "max_seq_len", "n_ctx", "seq_length"):
            value = scope.get(key)
            if isinstance(value, int) and value > 0:
                return value
    limit = getattr(tokenizer, "model_max_length", None)
    return limit if isinstance(limit, int) and 0 < limit < 10**8 else None


def reasoning_format(tokenizer: TokenizerWrapper) -> ReasoningFormat | None:
    """The model's reasoning markers, as mlx-lm's tokenizer wrapper recognises them (None: it does not think in
    tags)."""
    if not getattr(tokenizer, "has_thinking", False):
        return None
    start, end = tokenizer.think_start, tokenizer.think_end
    start_tokens, end_tokens = tokenizer.think_start_tokens, tokenizer.think_end_tokens
    if not (start and end and start_tokens and end_tokens):
        return None
    return ReasoningFormat(
        start=str(start),
        end=str(end),
        start_tokens=tuple(int(token) for token in start_tokens),
        end_tokens=tuple(int(token) for token in end_tokens),
    )


def tool_call_format(tokenizer: TokenizerWrapper) -> ToolCallFormat:
    """How the model calls tools: its chat template's own format ("native"), or, when the template has none, the
    generic one Courier describes in the prompt (`core/tools/generic.py`)."""
    start, end, parser = tokenizer.tool_call_start, tokenizer.tool_call_end, tokenizer.tool_parser
    if not (tokenizer.has_tool_calling and start and parser is not None):  # Mistral's format has no end marker
        return ToolCallFormat(
            start=generic_tools.START,
            end=generic_tools.END,
            parser=generic_tools.parse_call,
            mode="generic",
            grammar=ToolGrammar(start=generic_tools.START, end=generic_tools.END),
        )
    start, end = str(start), str(end or "")
    grammar: ToolGrammar | None = None
    if getattr(parser, "__module__", "").endswith(".json_tools"):  # a JSON object between the markers
        grammar = ToolGrammar(
            start=start, end=end, start_token=_special_token(tokenizer, start), end_token=_special_token(tokenizer, end)
        )
    return ToolCallFormat(start=start, end=end, parser=parser, grammar=grammar)


def _special_token(tokenizer: TokenizerWrapper, marker: str) -> int | None:
    """The id of `marker` when it is one special (added) token, which a grammar must match as that token."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    for token_id, token in added.items():
        if str(getattr(token, "content", token)) == marker:
            return int(token_id)
    return None


def grammar_compiler(loaded: LoadedModel, capacity: int) -> GrammarCompiler | None:
    """The model's grammar compiler (about half a second for a 49k vocabulary), or None when its tokenizer cannot
    serve one (then a constrained request is a 400 saying so)."""
    tokenizer = loaded.tokenizer
    vocabulary = len(tokenizer.get_vocab())
    width = getattr(getattr(loaded.model, "args", None), "vocab_size", None)
    vocab_size = max(vocabulary, width if isinstance(width, int) else 0)
    try:
        ll_tokenizer = build_tokenizer(getattr(tokenizer, "_tokenizer", tokenizer), vocab_size, tokenizer.eos_token_ids)
    except Exception as error:  # llguidance refuses some tokenizers (not fast, odd byte mappings): serve without
        logger.warning("constrained decoding is off: no grammar tokenizer (%s: %s)", type(error).__name__, error)
        return None
    return GrammarCompiler(ll_tokenizer, capacity=capacity)
