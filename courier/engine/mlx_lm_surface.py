"""The parts of mlx-lm the engine relies on beyond its public API, checked before the engine is built.

`speculative_batch.py` subclasses `GenerationBatch`, replaces `BatchGenerator`'s private `_generation_batch` and
reads and writes the batch's private per-row state; `ragged_cache.py` subclasses `BatchKVCache` and sets its `_idx`
and `_right_padding`. A release that renamed any of them would not fail by itself: a replaced batch nobody reads
decodes without drafts or forced tokens, a token vector set under an old name is never sampled from, a cache
built without a field breaks on its first step. `check_mlx_lm_surface` reads mlx-lm's classes (signatures, and the
attributes their methods store and load, from the bytecode: nothing is built, no MLX work is done) and raises
`MlxLmSurfaceError` naming each piece that moved, so the server stops at start-up instead of serving wrong output.

pyproject.toml pins the mlx-lm releases this was checked against (TESTED_MLX_LM); the check names the installed
version when it fails.
"""

from __future__ import annotations

import dataclasses
import dis
import functools
import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from importlib import metadata
from typing import Any

from mlx_lm.generate import BatchGenerator, GenerationBatch, PromptProcessingBatch, StopSequences, TokenBuffer
from mlx_lm.models import base as base_module
from mlx_lm.models import cache as cache_module
from mlx_lm.models.cache import BatchKVCache

# The releases tested; keep in step with the mlx-lm requirement in pyproject.toml.
TESTED_MLX_LM = ">=0.32.2,<0.33"


class MlxLmSurfaceError(RuntimeError):
    """The installed mlx-lm lacks, or has changed, something the engine uses."""


@dataclass(frozen=True, slots=True)
class Signature:
    """`owner.method` takes these parameters first, in this order (`self`/`cls` left out)."""

    owner: type
    method: str
    parameters: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Attributes:
    """`owner.method` stores (`stores=True`) or reads these attributes, by name, somewhere in its body."""

    owner: type
    method: str
    names: tuple[str, ...]
    stores: bool


@dataclass(frozen=True, slots=True)
class Fields:
    """The dataclass `owner` has these fields."""

    owner: type
    names: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Member:
    """`owner` (a module or class) has an attribute `name`."""

    owner: Any
    name: str


Expectation = Signature | Attributes | Fields | Member

# The batch's per-row state that SpeculativeGenerationBatch reads and rewrites on a verify step.
_BATCH_STATE = ("model", "uids", "prompt_cache", "tokens", "samplers", "fallback_sampler", "logits_processors")
_BATCH_PRIVATE = ("_next_tokens", "_next_logprobs", "_token_context", "_num_tokens", "_matchers")

SURFACE: tuple[Expectation, ...] = (
    # speculative_batch.py: the subclass, its overrides and the state it shares with mlx-lm's own step.
    Signature(GenerationBatch, "empty", ("model", "fallback_sampler")),
    Signature(GenerationBatch, "extend", ("batch",)),
    Signature(GenerationBatch, "filter", ("keep",)),
    Signature(GenerationBatch, "next", ()),
    Signature(GenerationBatch, "extract_cache", ("idx",)),
    Attributes(GenerationBatch, "__init__", (*_BATCH_STATE, "max_tokens", *_BATCH_PRIVATE), stores=True),
    Attributes(GenerationBatch, "_step", ("_next_tokens", "_next_logprobs", "_token_context"), stores=False),
    Attributes(GenerationBatch, "next", ("_num_tokens", "_matchers", "max_tokens", "_step"), stores=False),
    Attributes(GenerationBatch, "filter", _BATCH_PRIVATE, stores=True),
    Fields(GenerationBatch.Response, ("uid", "token", "logprobs", "finish_reason", "prompt_cache", "all_tokens")),
    Signature(TokenBuffer, "update_and_fetch", ("tokens",)),
    Signature(StopSequences, "matcher", ()),
    # The generator: its batch is replaced after __init__, so __init__ must set it and the step must use it.
    Signature(BatchGenerator, "__init__", ("model",)),
    Attributes(BatchGenerator, "__init__", ("model", "sampler", "_generation_batch"), stores=True),
    Attributes(BatchGenerator, "_next", ("_generation_batch",), stores=False),
    Signature(BatchGenerator, "next", ()),
    Signature(
        BatchGenerator,
        "insert_segments",
        ("segments", "max_tokens", "caches", "all_tokens", "samplers", "logits_processors"),
    ),
    Signature(BatchGenerator, "remove", ("uids",)),
    Signature(BatchGenerator, "extract_cache", ("uids",)),
    # batch_engine.py: how far each prompt is prefilled (its depth, which sizes the next prefill chunk).
    Fields(PromptProcessingBatch.Response, ("uid", "progress", "end_of_prompt")),
    # ragged_cache.py: a BatchKVCache built field by field (`adopt`) and overriding the methods the batch calls.
    Signature(BatchKVCache, "__init__", ("left_padding",)),
    Attributes(
        BatchKVCache, "__init__", ("keys", "values", "offset", "left_padding", "_idx", "_right_padding"), stores=True
    ),
    Signature(BatchKVCache, "make_mask", ("N", "return_array")),
    Signature(BatchKVCache, "update_and_fetch", ("keys", "values")),
    Signature(BatchKVCache, "filter", ("batch_indices",)),
    Signature(BatchKVCache, "extend", ("other",)),
    Signature(BatchKVCache, "extract", ("idx",)),
    # snapshot_codec.py: only subclasses of mlx-lm's cache base class are built back from a snapshot file.
    Member(cache_module, "_BaseCache"),
    # quantized_batch_cache.py: attention computes with packed KV when the cache has `bits` (`--kv-bits`).
    Member(base_module, "quantized_scaled_dot_product_attention"),
)


def surface_problems(surface: Iterable[Expectation] = SURFACE) -> list[str]:
    """One line per expectation the installed mlx-lm does not meet (none: the engine may use it)."""
    problems: list[str] = []
    for expected in surface:
        match expected:
            case Signature(owner=owner, method=method, parameters=parameters):
                problems.extend(_signature_problems(owner, method, parameters))
            case Attributes(owner=owner, method=method, names=names, stores=stores):
                problems.extend(_attribute_problems(owner, method, names, stores=stores))
            case Fields(owner=owner, names=names):
                problems.extend(_field_problems(owner, names))
            case Member(owner=owner, name=name):
                if not hasattr(owner, name):
                    problems.append(f"{getattr(owner, '__name__', owner)}.{name} is missing")
    return problems


def check_mlx_lm_surface(surface: Iterable[Expectation] | None = None) -> None:
    """Raise `MlxLmSurfaceError` naming every piece of mlx-lm's private surface that is missing or changed (SURFACE's
    verdict is read once per process: mlx-lm does not change under a running server)."""
    problems = list(_surface_verdict()) if surface is None else surface_problems(surface)
    if problems:
        raise MlxLmSurfaceError(
            f"mlx-lm {_installed_version()} does not have what Courier's engine relies on (tested: mlx-lm"
            f"{TESTED_MLX_LM}; install a tested release): " + "; ".join(problems)
        )


@functools.cache
def _surface_verdict() -> tuple[str, ...]:
    return tuple(surface_problems(SURFACE))


def _method(owner: type, name: str) -> Callable[..., Any] | None:
    found = inspect.getattr_static(owner, name, None)
    if isinstance(found, classmethod | staticmethod):
        found = found.__func__
    return found if callable(found) else None


def _signature_problems(owner: type, name: str, parameters: tuple[str, ...]) -> list[str]:
    method = _method(owner, name)
    where = f"{owner.__qualname__}.{name}"
    if method is None:
        return [f"{where} is missing"]
    names = [parameter for parameter in inspect.signature(method).parameters if parameter not in ("self", "cls")]
    if tuple(names[: len(parameters)]) != parameters:
        return [f"{where} takes ({', '.join(names)}), expected ({', '.join(parameters)}, ...)"]
    return []


def _attribute_problems(owner: type, name: str, attributes: tuple[str, ...], *, stores: bool) -> list[str]:
    method = _method(owner, name)
    where = f"{owner.__qualname__}.{name}"
    if method is None or not hasattr(method, "__code__"):
        return [f"{where} is missing"]
    wanted = {"STORE_ATTR"} if stores else {"LOAD_ATTR", "LOAD_METHOD"}
    seen = {instruction.argval for instruction in dis.get_instructions(method) if instruction.opname in wanted}
    missing = [attribute for attribute in attributes if attribute not in seen]
    if missing:
        return [f"{where} no longer {'sets' if stores else 'reads'} {', '.join(missing)}"]
    return []


def _field_problems(owner: type, names: tuple[str, ...]) -> list[str]:
    present = {field.name for field in dataclasses.fields(owner)} if dataclasses.is_dataclass(owner) else set()
    missing = [name for name in names if name not in present]
    return [f"{owner.__qualname__} has no field {', '.join(missing)}"] if missing else []


def _installed_version() -> str:
    try:
        return metadata.version("mlx-lm")
    except metadata.PackageNotFoundError:  # run from a source tree
        return "(version unknown)"
