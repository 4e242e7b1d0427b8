"""The constraints requests' output specs built, kept: an agent's tools are built into a grammar once, not every turn.

A coding agent sends the same tools on every turn (Codex's 9 functions, Claude Code's 24). Building their grammar
(`output_spec.constraint`: each function's parameters made a grammar and checked against the limits, then the
whole call grammar checked again) took 5-15 ms of every such turn's time to first token on a 2-core CPU, before the
compiled-grammar cache was even asked. What a spec builds depends only on the spec (its format, tool choice,
parallel calls, call cap and functions, each schema's key order included: it orders the generated properties) and
on how the model writes tool calls, so the built constraint is kept under a digest of those, least recently used
first out, bounded by count and by the grammars' characters; it is kept uncompiled (the compiled grammar is the
compiler's cache's to keep or drop). A spec whose build is refused is built (and refused) again each time: a
refusal costs its sender, not the cache's room.

Thread-safe: built in worker threads, at most two at once (`http/constrained.py`).
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from courier.grammar.constraint import Constraint, ToolGrammar
from courier.grammar.output_spec import OutputSpec

# The grammars kept, in characters (a request's tools are at most a body's worth; most agents' are 10-100 KB).
DEFAULT_MAX_CHARS = 64 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class _Built:
    constraint: Constraint | None  # None: the spec needs no grammar on this model
    chars: int


class BuiltConstraints:
    def __init__(self, *, capacity: int, max_chars: int = DEFAULT_MAX_CHARS) -> None:
        self._capacity = max(1, capacity)
        self._max_chars = max_chars
        self._built: OrderedDict[str, _Built] = OrderedDict()
        self._chars = 0
        self._hits = 0
        self._lock = threading.Lock()

    @property
    def hits(self) -> int:
        return self._hits

    def __len__(self) -> int:
        return len(self._built)

    def get(
        self,
        output: OutputSpec,
        tool_grammar: ToolGrammar | None,
        build: Callable[[], Constraint | None],
        scope: str = "",
    ) -> Constraint | None:
        """The constraint `build()` makes of `output` for a model writing calls as `tool_grammar`: kept from an
        earlier build of the same spec within `scope` (a tenant's), else built now (and kept unless `build` raises)."""
        key = spec_key(output, tool_grammar, scope)
        if key is not None:
            with self._lock:
                found = self._built.get(key)
                if found is not None:
                    self._built.move_to_end(key)
                    self._hits += 1
                    return found.constraint
        constraint = build()
        if key is not None:
            self._keep(key, _Built(constraint, len(constraint.grammar) if constraint is not None else 0))
        return constraint

    def _keep(self, key: str, built: _Built) -> None:
        if built.chars > self._max_chars:
            return
        with self._lock:
            replaced = self._built.pop(key, None)
            self._chars += built.chars - (replaced.chars if replaced is not None else 0)
            self._built[key] = built
            while len(self._built) > self._capacity or self._chars > self._max_chars:
                _, dropped = self._built.popitem(last=False)
                self._chars -= dropped.chars


def spec_key(output: OutputSpec, tool_grammar: ToolGrammar | None, scope: str = "") -> str | None:
    """A digest of what `output_spec.constraint` reads, within `scope` (None: a value that is not JSON, which is not
    kept)."""
    try:
        payload = orjson.dumps([scope, output, tool_grammar], default=_plain)
    except (TypeError, orjson.JSONEncodeError):
        return None
    return hashlib.sha256(payload).hexdigest()


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return dict(value)
    raise TypeError(type(value).__name__)
