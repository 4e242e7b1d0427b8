"""Compiling constraints against the served model's vocabulary, with a bounded cache of compiled grammars.

Compiling (grammar plus tokenizer into a matcher) takes about a millisecond for a typical schema and is bounded by
`constraint.LIMITS`; a grammar that fails on its first steps (`probe.py`: past a limit llguidance meets only while
parsing, or with no finite output) is refused like one that does not compile. The compiled matcher is kept, least
recently used first out, under the constraint's key, and each generation gets a copy (microseconds). The HTTP
layer (and the compactor) compiles a request's constraint in a worker thread before admitting it (`compile`), so a
grammar that does not compile is a 400, and the constraint then carries its compiled grammar: the engine, on the
MLX thread, copies that one and never compiles, even if the cache has dropped it meanwhile.
Thread-safe: compiled in worker threads, copied on the MLX thread.

Both caches (built specs, compiled grammars) are kept per scope, the caller's tenant: a key whose schema or tools
were built or compiled already would otherwise be answered faster (a compile of a large tool set takes up to a
second here) and count a hit in /metrics, telling another key that someone sent that exact schema.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from llguidance import LLMatcher, LLTokenizer

from courier.grammar import output_spec
from courier.grammar.built_constraints import BuiltConstraints
from courier.grammar.constraint import LIMITS, Constraint, GrammarError, ToolGrammar
from courier.grammar.output_spec import OutputSpec
from courier.grammar.probe import first_steps_failure, opener_tokens

DEFAULT_CAPACITY = 256


@dataclass(frozen=True, slots=True, kw_only=True)
class CompilerStats:
    entries: int
    capacity: int
    hits: int
    misses: int
    compile_seconds: float  # all compilations together
    built_entries: int  # requests' output specs kept built (`built_constraints.py`)
    built_hits: int  # specs whose grammar was not built again


class GrammarCompiler:
    def __init__(self, tokenizer: LLTokenizer, *, capacity: int = DEFAULT_CAPACITY) -> None:
        self.tokenizer = tokenizer
        self._openers = opener_tokens(tokenizer)
        self._capacity = max(1, capacity)
        self._compiled: OrderedDict[str, LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self._hits = 0
        self._misses = 0
        self._compile_seconds = 0.0
        self._built = BuiltConstraints(capacity=self._capacity)

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.vocab_size)

    @property
    def eos_tokens(self) -> tuple[int, ...]:
        return tuple(int(token) for token in self.tokenizer.eos_tokens)

    def matcher(self, constraint: Constraint, param: str = "") -> LLMatcher:
        """A fresh matcher for `constraint`: a copy of the grammar it carries compiled (`compile`), else of the
        cached one, compiled now on a miss. Raises `GrammarError`."""
        if constraint.compiled is not None:
            return constraint.compiled.deep_copy()
        return self._template(constraint, param).deep_copy()

    def output_constraint(
        self, output: OutputSpec, tool_grammar: ToolGrammar | None, param: str, scope: str = ""
    ) -> Constraint | None:
        """The compiled constraint of a request's `output` spec (None: it needs none), built once per distinct spec
        for a model writing tool calls as `tool_grammar`, within `scope` (the caller's tenant: see the module's
        note). Raises `GrammarError` naming the parameter."""
        build = lambda: output_spec.constraint(output, tool_grammar)  # noqa: E731
        constraint = self._built.get(output, tool_grammar, build, scope)
        return None if constraint is None else self.compile(constraint, param, scope)

    def compile(self, constraint: Constraint, param: str, scope: str = "") -> Constraint:
        """`constraint` carrying its compiled grammar (from `scope`'s cache, or compiled now), so that whoever
        generates from it copies that one and never compiles: call it off the MLX thread. Raises `GrammarError`
        naming `param` if it cannot be compiled or followed."""
        return replace(constraint, compiled=self._template(constraint, param, scope))

    def _template(self, constraint: Constraint, param: str, scope: str = "") -> LLMatcher:
        """The compiled grammar of `constraint`, cached within `scope` (never handed out: callers copy it)."""
        key = f"{scope}\x00{constraint.key}"
        with self._lock:
            cached = self._compiled.get(key)
            if cached is not None:
                self._compiled.move_to_end(key)
                self._hits += 1
                return cached
            self._misses += 1
        started = time.perf_counter()
        compiled = LLMatcher(self.tokenizer, constraint.grammar, log_level=0, limits=LIMITS)
        elapsed = time.perf_counter() - started
        if compiled.is_error():
            raise GrammarError(f"{param or constraint.label} cannot be compiled: {compiled.get_error()}", param)
        if failure := first_steps_failure(compiled, self._openers):
            raise GrammarError(
                f"{param or constraint.label} cannot be followed: generation would fail at its first steps "
                f"({failure}). A schema with no finite instance (a required property that refers back to its own "
                "object) or too many alternatives at one point (properties, anyOf branches) cannot be generated",
                param,
            )
        with self._lock:
            self._compile_seconds += elapsed
            self._compiled[key] = compiled
            self._compiled.move_to_end(key)
            while len(self._compiled) > self._capacity:
                self._compiled.popitem(last=False)
        return compiled

    def check(self, constraint: Constraint, param: str) -> None:
        """Compile `constraint` now (it is then cached), raising `GrammarError` naming `param` if it cannot be."""
        self.matcher(constraint, param)

    def stats(self) -> CompilerStats:
        with self._lock:
            return CompilerStats(
                entries=len(self._compiled),
                capacity=self._capacity,
                hits=self._hits,
                misses=self._misses,
                compile_seconds=self._compile_seconds,
                built_entries=len(self._built),
                built_hits=self._built.hits,
            )


def build_tokenizer(hf_tokenizer: Any, vocab_size: int, eos_tokens: Iterable[int]) -> LLTokenizer:
    """llguidance's view of a Hugging Face fast tokenizer (about half a second for a 49k vocabulary: build once).

    `vocab_size` is the model's output width (it may exceed the tokenizer's, padded); tokens past the tokenizer's
    own are never allowed.
    """
    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise GrammarError("constrained decoding needs a fast (tokenizers) tokenizer", "")
    serialized = backend.to_str()
    eos = [int(token) for token in eos_tokens]
    return LLTokenizer(serialized, n_vocab=vocab_size, eos_token=eos)
