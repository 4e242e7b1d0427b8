"""A tiny random-weight llama with a 64K window that ends its replies within a few tokens, for agents' prompts.

Claude Code's first prompt is ~12-30K tokens (past SmolLM2's 8K window) and it asks for 32,000-128,000 output
tokens on every call, which the server caps at what the window leaves. A random model almost never writes its
end-of-sequence token, so a reply would run for tens of thousands of tokens; this one is random everywhere except
that a few tokens always score `STOP_LOGIT`: the end of sequence, and the JSON string and object ends (`"`, `}`,
`"}`) that close a constrained answer (Claude Code's title request asks for `{"title": ...}`). Sampled at
temperature 1 each step ends the reply (or its string) with a probability of about a quarter; greedy, at once.

How: the residual stream's dimension 0 holds `RESIDUAL` for every token (the embeddings' column 0, which no layer
writes: row 0 of every output projection is zero), so after the final norm it is positive everywhere, and the
untied head's column 0 is zero except for the stopping tokens, whose logit it lifts.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
import orjson
from mlx.utils import tree_flatten
from mlx_lm.models import llama
from tokenizers import Tokenizer

from tests.support.tiny_models import LLAMA_CONFIG, TOKENIZER_FILES, VOCAB_SIZE

CONTEXT_LENGTH = 65536
EOS_TOKEN_ID = 2
RESIDUAL = 16.0
# e^STOP / (e^STOP + ~VOCAB_SIZE): about 1/4 per stopping token at temperature 1.
STOP_LOGIT = math.log(VOCAB_SIZE / 3)
STOP_TEXTS = ('"', "}", '"}')
# One layer and one attention head: prefill at 20K+ tokens is memory-bound attention on a CPU, and this keeps Claude
# Code's first prompt to seconds.
CONFIG: dict[str, Any] = {
    **LLAMA_CONFIG,
    "hidden_size": 32,
    "num_hidden_layers": 1,
    "intermediate_size": 64,
    "num_attention_heads": 1,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "max_position_embeddings": CONTEXT_LENGTH,
    "tie_word_embeddings": False,
}


def build_agent_model(tokenizer_dir: Path, out_dir: Path) -> Path:
    """Write the model to `out_dir` (loadable by `mlx_lm.load`, tokenized and templated like SmolLM2)."""
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict(CONFIG))
    weights = dict(tree_flatten(model.parameters()))
    embeddings = weights["model.embed_tokens.weight"]
    weights["model.embed_tokens.weight"] = mx.concatenate(
        [mx.full((embeddings.shape[0], 1), RESIDUAL), embeddings[:, 1:]], axis=1
    )
    for name in list(weights):
        if name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
            weights[name] = mx.concatenate([mx.zeros_like(weights[name][:1]), weights[name][1:]], axis=0)
    head = weights["lm_head.weight"]
    lift = mx.zeros((head.shape[0],))
    norm_scale = math.sqrt(CONFIG["hidden_size"])  # the most dimension 0 can be after the norm, nearly reached
    for token in _stopping_tokens(tokenizer_dir):
        lift[token] = STOP_LOGIT / norm_scale
    weights["lm_head.weight"] = mx.concatenate([lift[:, None], head[:, 1:]], axis=1)
    out_dir.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out_dir / "config.json").write_bytes(orjson.dumps(CONFIG))
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, out_dir / name)
    return out_dir


def _stopping_tokens(tokenizer_dir: Path) -> list[int]:
    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    tokens = [EOS_TOKEN_ID]
    for text in STOP_TEXTS:
        encoded = tokenizer.encode(text, add_special_tokens=False).ids
        if len(encoded) == 1:  # each is one token in SmolLM2's vocabulary
            tokens.append(encoded[0])
    return tokens
