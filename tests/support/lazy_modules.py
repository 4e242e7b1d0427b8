"""Client SDKs imported by the tests that use them, not by every pytest-xdist worker as it collects them.

Each worker collects every module, and the anthropic SDK alone is 3,302 modules (~2.6 s of CPU a worker warm, ~4 s
on a fresh clone, where each is compiled first). `lazily(name)` stands in for the module and imports it on the first
use of one of its names, so only the worker that runs those tests imports it. Collecting reads every global of a
test module (pytest asks whether each is a class, the conftest what module it comes from): those questions are
answered by the stand-in itself, not by importing (`importlib.util.LazyLoader`'s modules import on any attribute,
`__class__` included). A module importing an SDK this way keeps the real import for type checkers:

    if TYPE_CHECKING:
        import anthropic
    else:
        anthropic = lazily("anthropic")
"""

from __future__ import annotations

import importlib
from typing import Any


class _StandIn:
    """`name`'s stand-in: a public name read from it is read from the module, imported then (a name beginning with
    `_` is not read through)."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attribute: str) -> Any:  # only for names the stand-in does not have itself
        if attribute.startswith("_"):
            raise AttributeError(attribute)  # pytest's and Python's own questions (`__test__`, `_mock_name`, ...)
        return getattr(importlib.import_module(self._name), attribute)

    def __repr__(self) -> str:
        return f"<module {self._name!r}, imported on first use>"


def lazily(name: str) -> Any:
    """A stand-in for the module `name`, which imports it on the first use of one of its names."""
    return _StandIn(name)
