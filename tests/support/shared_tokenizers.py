"""Tokenizers parsed once in the test server launcher and shared with the servers it forks (forked_servers.py).

Most of a forked server's start (~1.4 s of CPU on the AMD CI machine) is its model's tokenizer: mlx-lm's
`load_tokenizer` (transformers and mlx-lm each parse the 3.5 MB tokenizer.json: ~0.5 s) and llguidance's
`LLTokenizer` (~0.35 s). The suite forks ~95 servers, most of them on a few session-wide model directories (~50 on
the tiny llama alone). So before it forks a server, the launcher loads the tokenizer of each model directory the
server names, once per directory's contents, through the same calls the server makes (`mlx_lm.utils.load_tokenizer`,
then Courier's `build_tokenizer`); in the child those two library calls return what the launcher loaded (the child's
copy, from the fork) instead of parsing again. Everything else of the load, and every other use of the tokenizer, is
the child's own. A directory whose tokenizer does not load in the launcher is left to the child, which then fails
as a server started afresh would; a call with other arguments than the launcher's loads anew.
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

# The files mlx-lm's `load_tokenizer` reads from a model directory (its download patterns): the key of a directory's
# tokenizer is their names, sizes and modification times, so a changed file loads afresh.
_TOKENIZER_FILES = ("*.json", "*.py", "tokenizer.model", "*.tiktoken", "tiktoken.model", "*.txt", "*.jsonl", "*.jinja")

# The most recently used are kept (~80 MB each for SmolLM2's vocabulary): the session-wide tiny models come back
# all through the run, a module's own model only within its module.
CAPACITY = 4
_tokenizers: dict[tuple[Any, ...], Any] = {}  # mlx-lm TokenizerWrappers, least recently used first
_grammar_tokenizers: dict[tuple[Any, ...], Any] = {}  # llguidance LLTokenizers, least recently used first
_grammar_key_of: dict[tuple[Any, ...], tuple[Any, ...]] = {}  # a shared tokenizer's key -> its LLTokenizer's


def install() -> None:
    """Route mlx-lm's `load_tokenizer` and llguidance's `LLTokenizer` through the shared ones: before Courier is
    imported (it binds `LLTokenizer` by name)."""
    import llguidance
    import mlx_lm.utils

    mlx_lm.utils.load_tokenizer = _remembering(mlx_lm.utils.load_tokenizer, _tokenizers, _tokenizer_key)
    shared = _remembering(llguidance.LLTokenizer, _grammar_tokenizers, _grammar_tokenizer_key)
    llguidance.LLTokenizer = shared  # type: ignore[misc,assignment]  # a function that returns the class's instances


def share(server_args: Sequence[str]) -> None:
    """In the launcher, before a fork: load the tokenizer of each model directory `courier serve <server_args>`
    names, as the server will (a tokenizer already loaded becomes the most recently used)."""
    for flag, value in itertools.pairwise(server_args):
        if flag == "--model":  # DIR, ID=DIR or ID,ALIAS=DIR
            with contextlib.suppress(Exception):  # the child loads it (and reports what is wrong) itself
                _share_directory(Path(value.rpartition("=")[2]))


def _share_directory(directory: Path) -> None:
    from mlx_lm.utils import MODEL_REMAPPING, load_config, load_tokenizer

    from courier.grammar.compiler import build_tokenizer
    from courier.model.vision.model_dir import is_vision_model

    if not directory.is_dir():
        return  # a hub id, a GGUF file
    config = load_config(directory)  # as mlx_lm.load reads it (generation_config.json's eos ids first)
    model_type = str(config.get("model_type"))
    if (
        is_vision_model(config)
        or importlib.util.find_spec(f"mlx_lm.models.{MODEL_REMAPPING.get(model_type, model_type)}") is None
    ):
        return  # mlx-vlm and mlx-embeddings load these, with other arguments
    eos_token_ids = config.get("eos_token_id")
    key = _tokenizer_key(directory, None, eos_token_ids=eos_token_ids)
    if key is None:
        return  # nothing the child could be given
    if _touch(_tokenizers, key) and _touch(_grammar_tokenizers, _grammar_key_of.get(key)):
        return  # loaded: now the most recently used, with its LLTokenizer (~1 ms, not a rebuild's ~80)
    tokenizer = load_tokenizer(directory, None, eos_token_ids=eos_token_ids)
    width = config.get("vocab_size")
    vocab_size = max(len(tokenizer.get_vocab()), width if isinstance(width, int) else 0)
    build_tokenizer(tokenizer._tokenizer, vocab_size, tokenizer.eos_token_ids)
    if _grammar_tokenizers:
        _grammar_key_of[key] = next(reversed(_grammar_tokenizers))  # the one just built or used
        for stale in _grammar_key_of.keys() - _tokenizers.keys():
            del _grammar_key_of[stale]


def _remembering(
    load: Callable[..., Any], loaded: dict[tuple[Any, ...], Any], key_of: Callable[..., tuple[Any, ...] | None]
) -> Callable[..., Any]:
    def remembered(*args: Any, **kwargs: Any) -> Any:
        try:
            key = key_of(*args, **kwargs)
        except (OSError, TypeError):  # an unreadable file, an argument this version does not know: no sharing
            key = None
        if key is None:
            return load(*args, **kwargs)
        if not _touch(loaded, key):
            loaded[key] = load(*args, **kwargs)
            while len(loaded) > CAPACITY:
                del loaded[next(iter(loaded))]
        return loaded[key]

    return remembered


def _touch(loaded: dict[tuple[Any, ...], Any], key: tuple[Any, ...] | None) -> bool:
    """Make `key` the most recently used of `loaded`; False where it is not there."""
    if key not in loaded:
        return False
    loaded[key] = loaded.pop(key)
    return True


def _tokenizer_key(
    model_path: Any, tokenizer_config_extra: Any = None, eos_token_ids: Any = None
) -> tuple[Any, ...] | None:
    directory = Path(model_path)
    if not directory.is_dir():
        return None  # a hub id: mlx-lm resolves it
    files = sorted(_signature(path) for pattern in _TOKENIZER_FILES for path in directory.glob(pattern))
    return (str(directory.resolve()), tuple(files), repr(tokenizer_config_extra), repr(eos_token_ids))


def _signature(path: Path) -> tuple[str, int, int]:
    stat = path.stat()
    return (path.name, stat.st_size, stat.st_mtime_ns)


def _grammar_tokenizer_key(serialized: Any, *args: Any, **kwargs: Any) -> tuple[Any, ...] | None:
    if not isinstance(serialized, str):
        return None
    return (serialized, repr(args), repr(sorted(kwargs.items())))
