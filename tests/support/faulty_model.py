"""A tiny llama whose forward pass raises when its input holds a poison token: a generation fault on demand.

Served with `--trust-remote-code`: its `config.json` names its own architecture file (`model_file`), the way
custom architectures ship, so the fault happens inside the real engine's batched forward pass.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson

from tests.support.tiny_models import build_llama

POISON_TOKEN = 31337
MODEL_FILE = "faulty_llama.py"
_SOURCE = f'''"""A llama that raises on the poison token (a test fault)."""

import mlx.core as mx
from mlx_lm.models.llama import Model as Llama, ModelArgs

POISON_TOKEN = {POISON_TOKEN}


class Model(Llama):
    def __call__(self, inputs, cache=None, **kwargs):
        if mx.any(inputs == POISON_TOKEN).item():
            raise RuntimeError("poisoned input: a deliberate fault")
        return super().__call__(inputs, cache=cache, **kwargs)
'''


def build_faulty_llama(tokenizer_dir: Path, out_dir: Path) -> Path:
    build_llama(tokenizer_dir, out_dir, quantized=False)
    config = orjson.loads((out_dir / "config.json").read_bytes())
    config["model_file"] = MODEL_FILE
    (out_dir / "config.json").write_bytes(orjson.dumps(config))
    (out_dir / MODEL_FILE).write_text(_SOURCE)
    return out_dir


class FailingModel:
    """Wraps a real model; once armed, its next `failures` forward passes raise, as a fault inside MLX would."""

    def __init__(self, model: Any) -> None:
        self._model = model
        self.failures = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.failures > 0:
            self.failures -= 1
            raise RuntimeError("simulated kernel fault")
        return self._model(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)
