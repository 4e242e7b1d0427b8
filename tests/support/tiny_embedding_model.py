"""A tiny random-weight BERT embedding model in MLX format, built in milliseconds (needs mlx-embeddings, the
`embeddings` extra). It reuses the embedded SmolLM2's tokenizer files: any tokenizer serves a random model."""

from __future__ import annotations

import importlib
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
import orjson
from mlx.utils import tree_flatten

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
HIDDEN = 32
MAX_POSITIONS = 128

BERT_CONFIG: dict[str, Any] = {
    "model_type": "bert",
    "architectures": ["BertModel"],
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "hidden_size": HIDDEN,
    "intermediate_size": 64,
    "max_position_embeddings": MAX_POSITIONS,
    "type_vocab_size": 2,
    "vocab_size": 49152,
}


def build_bert(tokenizer_dir: Path, out_dir: Path) -> Path:
    bert = importlib.import_module("mlx_embeddings.models.bert")
    mx.random.seed(0)
    model = bert.Model(bert.ModelArgs.from_dict(BERT_CONFIG))
    out_dir.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out_dir / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (out_dir / "config.json").write_bytes(orjson.dumps(BERT_CONFIG))
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, out_dir / name)
    return out_dir
