"""A served model's identity for state kept across restarts: what its weights, config and serving format are.

Two runs get the same identity only when they would compute the same model state for
the same tokens: the same weight files (name, size, modification time, and the
SHA-256 of their first and last MiB, so a file rewritten in place with other
weights of the same size is told apart without reading gigabytes), the same config
and tokenizer files, the same serving weight format, chat template and adapter, the
same mlx / mlx-lm versions (their cache layouts are what the files hold), and the
same prompt-cache quantization (`--prompt-cache-bits` and group size: a state
stored at other bits is another state). Stored as computed, the identity is what it
was before quantized snapshots existed, so those files stay usable.
"""

from __future__ import annotations

import hashlib
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

_SAMPLE = 1024**2
_WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".npz", ".bin")
_SMALL_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json")


def model_identity(
    location: str,
    *,
    weight_format: str,
    template_signature: str,
    adapter_id: str = "",
    stored_as: str = "",
    served_as: str = "",
) -> str:
    """A hex digest naming this model as served (`stored_as`: the snapshots' quantization, empty: as computed;
    `served_as`: the name it is served under, so the same files declared under two names never share state)."""
    digest = hashlib.sha256()
    for part in (weight_format, template_signature, adapter_id, _version("mlx"), _version("mlx-lm")):
        digest.update(part.encode() + b"\0")
    if served_as:
        digest.update(b"served " + served_as.encode() + b"\0")
    if stored_as:
        digest.update(b"snapshots " + stored_as.encode() + b"\0")
    path = Path(location)
    files = sorted(_model_files(path)) if path.exists() else []
    if not files:
        digest.update(location.encode())  # nothing local to read: the name is all there is
    for file in files:
        _fold_file(digest, file)
    return digest.hexdigest()


def _model_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    return [
        file
        for file in path.iterdir()
        if file.is_file() and (file.suffix in _WEIGHT_SUFFIXES or file.name in _SMALL_FILES)
    ]


def _fold_file(digest: Any, file: Path) -> None:
    stat = file.stat()
    digest.update(f"{file.name}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
    with file.open("rb") as handle:
        digest.update(handle.read(_SAMPLE))
        if stat.st_size > 2 * _SAMPLE:
            handle.seek(-_SAMPLE, 2)
            digest.update(handle.read(_SAMPLE))


def _version(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:
        return ""
