"""Builds Hugging Face tokenizer files from a GGUF file's tokenizer metadata.

Only byte-level BPE vocabularies (`tokenizer.ggml.model == "gpt2"`) are supported;
that covers the llama-3, SmolLM, Qwen and most recent GGUF exports. The result is
a `tokenizer.json` plus a `tokenizer_config.json` holding the chat template, which
is what mlx-lm's loader reads offline.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import orjson
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

_CONTROL_TOKEN_TYPE = 3
_USER_DEFINED_TOKEN_TYPE = 4

# llama.cpp's pre-tokenizer names whose first pass splits every digit on its own.
_DIGIT_SPLITTING_PRE_TOKENIZERS = frozenset({"smollm", "codeshell"})
# The GPT-2 split that ByteLevel(use_regex=True) applies.
_GPT2_PRE_TOKENIZERS = frozenset({"default", "gpt2", "smollm", "codeshell", "mpt", "olmo"})


class UnsupportedTokenizer(ValueError):
    """The GGUF file's tokenizer cannot be rebuilt faithfully."""


def write_tokenizer_files(metadata: Mapping[str, Any], out_dir: Path, context_length: int) -> None:
    """Write `tokenizer.json` and `tokenizer_config.json` for `metadata` into `out_dir`."""
    tokenizer = build_tokenizer(metadata)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config = tokenizer_config(metadata, context_length)
    (out_dir / "tokenizer_config.json").write_bytes(orjson.dumps(config, option=orjson.OPT_INDENT_2))


def build_tokenizer(metadata: Mapping[str, Any]) -> Tokenizer:
    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise UnsupportedTokenizer(
            f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE 'gpt2'); "
            "convert the model to an MLX directory with mlx_lm.convert instead"
        )
    pre = str(metadata.get("tokenizer.ggml.pre", "default"))
    if pre not in _GPT2_PRE_TOKENIZERS:
        raise UnsupportedTokenizer(
            f"GGUF pre-tokenizer {pre!r} is not supported; supported: {sorted(_GPT2_PRE_TOKENIZERS)}"
        )
    tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
    merges = [tuple(pair.split(" ", 1)) for pair in metadata["tokenizer.ggml.merges"]]
    vocab = {token: index for index, token in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGIT_SPLITTING_PRE_TOKENIZERS:
        digits = pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated")
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([digits, byte_level])
    else:
        tokenizer.pre_tokenizer = byte_level
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    control, user_defined = _added_tokens(metadata, tokens)
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in control])
    tokenizer.add_tokens([AddedToken(token, special=False, normalized=False) for token in user_defined])
    return tokenizer


def tokenizer_config(metadata: Mapping[str, Any], context_length: int) -> dict[str, Any]:
    tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])

    def token_at(key: str) -> str | None:
        if key not in metadata:
            return None
        index = int(metadata[key])
        return tokens[index] if 0 <= index < len(tokens) else None

    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": context_length,
        "add_bos_token": bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
        "clean_up_tokenization_spaces": False,
    }
    for name, key in (
        ("bos_token", "tokenizer.ggml.bos_token_id"),
        ("eos_token", "tokenizer.ggml.eos_token_id"),
        ("unk_token", "tokenizer.ggml.unknown_token_id"),
        ("pad_token", "tokenizer.ggml.padding_token_id"),
    ):
        value = token_at(key)
        if value is not None:
            config[name] = value
    template = metadata.get("tokenizer.chat_template")
    if template:
        config["chat_template"] = str(template)
    return config


def _added_tokens(metadata: Mapping[str, Any], tokens: list[str]) -> tuple[list[str], list[str]]:
    """The control tokens and the user-defined tokens, which must never be split by BPE."""
    token_types = metadata.get("tokenizer.ggml.token_type")
    if token_types is None:
        return [], []
    types = [int(value) for value in (token_types.tolist() if hasattr(token_types, "tolist") else token_types)]
    pairs = list(zip(tokens, types, strict=True))
    control = [token for token, kind in pairs if kind == _CONTROL_TOKEN_TYPE]
    user_defined = [token for token, kind in pairs if kind == _USER_DEFINED_TOKEN_TYPE]
    return control, user_defined
