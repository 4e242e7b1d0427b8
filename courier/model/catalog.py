"""What a server serves: each model `--model` declares (with its names) and each one found under `--models-dir`.

A declaration is `[NAME[,ALIAS...]=]MODEL`: MODEL is what `model/source.py` resolves (a directory, a `.gguf` file,
a hub id) and the names, when given, are its id and aliases (`core/served_models/names.py`); without them the model is
named as `--model` alone names it. `--served-model-name` names the first declaration that names itself no other
way, so a one-model command line means what it always did. Under `--models-dir`, every directory holding a
`config.json` and every `.gguf` file, up to `MAX_SCAN_DEPTH` levels down, is a model named by its path below the
directory (`mlx-community/Qwen3-0.6B-4bit`, `tiny.Q4_0` for `tiny.Q4_0.gguf`). With nothing declared the embedded
SmolLM2 is served, as before. The first model is the default: a request that names none gets it.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from courier.core.served_models.names import ServedNames, named_by
from courier.model.embedding_models import embedding_problem, is_embedding_model, pooling_by_model
from courier.model.source import ModelSource, ModelSourceError, SourceKind, resolve_model_source

NAMES_SEPARATOR = "="
MAX_SCAN_DEPTH = 3
GGUF_SUFFIX = ".gguf"
GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelDeclaration:
    names: ServedNames
    source: ModelSource

    @property
    def model_id(self) -> str:
        return self.names.model_id


@dataclass(frozen=True, slots=True)
class ModelCatalog:
    models: tuple[ModelDeclaration, ...]  # the default first

    @property
    def default(self) -> ModelDeclaration:
        return self.models[0]

    @property
    def several(self) -> bool:
        return len(self.models) > 1

    def pooling(self, specs: tuple[str, ...]) -> dict[str, str]:
        """`--embedding-pooling` by model id; `ModelSourceError` for a name no model answers to."""

        def model_id(name: str | None) -> str | None:
            found = self.find(name)
            return found.model_id if found is not None else None

        try:
            return pooling_by_model(model_id, specs)
        except ValueError as error:
            raise ModelSourceError(str(error)) from None

    def find(self, requested: str | None) -> ModelDeclaration | None:
        """The model `requested` names (None: the default): an id first, then an exact alias, then a pattern, each
        in declaration order."""
        if requested is None:
            return self.default
        return named_by(self.models, requested, lambda model: model.names)

    def get(self, model_id: str) -> ModelDeclaration:
        for model in self.models:
            if model.model_id == model_id:
                return model
        raise KeyError(model_id)


def build_catalog(
    specs: Sequence[str], *, served_model_name: str | None = None, models_dir: Path | None = None
) -> ModelCatalog:
    """The declarations of `--model` (in order), then those found under `models_dir`; `ModelSourceError` names
    what cannot be served or a name two models share."""
    declared: list[ModelDeclaration] = []
    unnamed_taken = False
    for spec in specs:
        names, location = split_spec(spec)
        source = resolve_model_source(location)
        if names is None:
            given = served_model_name if not unnamed_taken else None
            unnamed_taken = True
            names = ServedNames.parse(given, source.default_id)
        declared.append(ModelDeclaration(names=names, source=source))
    if models_dir is not None:
        declared.extend(_not_declared(scan_models_dir(models_dir), declared))
        if not declared:
            raise ModelSourceError(f"--models-dir {models_dir} holds no MLX model directory or .gguf file")
    if not declared:
        source = resolve_model_source(None)
        declared.append(ModelDeclaration(names=ServedNames.parse(served_model_name, source.default_id), source=source))
    _check_distinct(declared)
    return ModelCatalog(tuple(declared))


def split_spec(spec: str) -> tuple[ServedNames | None, str]:
    """`name,alias=/models/x` -> (names, "/models/x"); a spec whose part before `=` could be a path (it holds a `/`
    or exists) is a location alone."""
    head, separator, tail = spec.partition(NAMES_SEPARATOR)
    if not separator or not head.strip() or "/" in head or Path(spec).exists():
        return None, spec
    if not tail.strip():
        raise ModelSourceError(f"--model {spec!r} names a model but gives no directory, .gguf file or repo id")
    return ServedNames.parse(head, head), tail.strip()


def scan_models_dir(root: Path) -> list[ModelDeclaration]:
    """Every MLX directory and `.gguf` file under `root`, named by its path below it, in name order."""
    root = root.expanduser()
    if not root.is_dir():
        raise ModelSourceError(f"--models-dir {root} is not a directory")
    found = []
    for path in sorted(_model_paths(root, 0)):
        name = path.relative_to(root).as_posix()
        if path.suffix.lower() == GGUF_SUFFIX:
            name = name[: -len(GGUF_SUFFIX)]
        source = resolve_model_source(str(path))
        found.append(ModelDeclaration(names=ServedNames((name,)), source=source))
    return found


def _model_paths(directory: Path, depth: int) -> Iterator[Path]:
    for entry in directory.iterdir():
        if entry.name.startswith("."):
            continue
        if entry.is_file() and entry.suffix.lower() == GGUF_SUFFIX:
            yield entry
        elif entry.is_dir():
            if (entry / "config.json").is_file():
                yield entry
            elif depth + 1 < MAX_SCAN_DEPTH:
                yield from _model_paths(entry, depth + 1)


def _not_declared(found: list[ModelDeclaration], declared: list[ModelDeclaration]) -> Iterator[ModelDeclaration]:
    """What the directory holds that no `--model` serves already (the same file or directory)."""
    locations = {model.source.location for model in declared if model.source.kind is not SourceKind.HUB_REPO}
    return (model for model in found if model.source.location not in locations)


def _check_distinct(models: list[ModelDeclaration]) -> None:
    owner: dict[str, str] = {}
    for model in models:
        for name in model.names.names:
            if name in owner:
                raise ModelSourceError(
                    f"two models are named {name!r} ({owner[name]} and {model.source.describe()}): give one another "
                    "name with NAME=MODEL"
                )
            owner[name] = model.source.describe()


def check_files(source: ModelSource) -> str | None:
    """Why `source` cannot load, as far as a glance at its files tells (a few reads, no weights): None when it may.
    The registry asks before it unloads anything to make room, so a broken model never pushes a working one out."""
    location = Path(source.location)
    if source.kind is SourceKind.HUB_REPO:
        return None
    if source.kind in (SourceKind.GGUF_FILE, SourceKind.EMBEDDED):
        return _gguf_problem(location)
    return _directory_problem(location)


def _gguf_problem(location: Path) -> str | None:
    try:
        with location.open("rb") as handle:
            magic = handle.read(len(GGUF_MAGIC))
    except OSError as error:
        return f"cannot read {location}: {error.strerror or error}"
    return None if magic == GGUF_MAGIC else f"{location} is not a GGUF file"


def _directory_problem(location: Path) -> str | None:
    config_file = location / "config.json"
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as error:
        return f"cannot read {config_file}: {error}"
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if not isinstance(model_type, str):
        return f"{config_file} names no model_type"
    if not any(location.glob("*.safetensors")):
        return f"{location} holds no .safetensors weights"
    if is_embedding_model(location):
        return embedding_problem(location)
    own_code = "model_file" in config  # its own architecture file (--trust-remote-code)
    if not own_code and "text_config" not in config and not _known_architecture(model_type):
        return f"mlx-lm has no '{model_type}' architecture (config.json model_type)"
    return None


def _known_architecture(model_type: str) -> bool:
    """Whether mlx-lm has a module for `model_type` (after its own remapping of a few names)."""
    from mlx_lm.utils import MODEL_REMAPPING  # late: this module is read before the CPU BLAS is chosen

    name = MODEL_REMAPPING.get(model_type, model_type).replace("-", "_")
    try:
        return importlib.util.find_spec(f"mlx_lm.models.{name}") is not None
    except (ImportError, ValueError):
        return False
