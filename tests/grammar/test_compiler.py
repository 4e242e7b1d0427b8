"""The grammar compiler over the SmolLM2 vocabulary: copies per use, a bounded LRU, counters, compile failures."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from llguidance import LLMatcher, LLTokenizer
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask
from mlx_lm.tokenizer_utils import load as load_tokenizer

from courier.grammar.compiler import GrammarCompiler, build_tokenizer
from courier.grammar.constraint import Constraint, GrammarError, json_object, json_schema

VOCAB_SIZE = 49152
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"n": {"type": "integer"}},
    "required": ["n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def wrapper(smollm2_dir: Path) -> Any:
    return load_tokenizer(smollm2_dir)


@pytest.fixture(scope="module")
def tokenizer(wrapper: Any) -> LLTokenizer:
    return build_tokenizer(wrapper._tokenizer, VOCAB_SIZE, wrapper.eos_token_ids)


def schema(n: int) -> Constraint:
    """A distinct constraint per `n`."""
    return json_schema({**SCHEMA, "properties": {"n": {"type": "integer", "maximum": n}}}, name=f"s{n}", param="p")


def allowed(matcher: LLMatcher, vocab_size: int = VOCAB_SIZE) -> set[int]:
    bitmask = allocate_token_bitmask(1, vocab_size)
    fill_next_token_bitmask(matcher, bitmask, 0)
    bits = np.unpackbits(bitmask[0].view(np.uint8), bitorder="little")[:vocab_size]
    return {int(token) for token in np.flatnonzero(bits)}


def test_the_tokenizer_knows_the_vocabulary_and_its_end(wrapper: Any, tokenizer: LLTokenizer) -> None:
    assert tokenizer.vocab_size == VOCAB_SIZE
    assert list(tokenizer.eos_tokens) == sorted(wrapper.eos_token_ids) == [2]
    compiler = GrammarCompiler(tokenizer)
    assert compiler.vocab_size == VOCAB_SIZE and compiler.eos_tokens == (2,)


def test_a_cache_hit_is_a_fresh_copy_that_advances_on_its_own(tokenizer: LLTokenizer) -> None:
    compiler = GrammarCompiler(tokenizer)
    constraint = json_schema(SCHEMA, name="n", param="p")
    first = compiler.matcher(constraint)
    second = compiler.matcher(constraint)  # a hit
    assert first is not second
    opening = tokenizer.tokenize_str('{"n": ')
    assert first.consume_tokens(opening)
    assert allowed(second) == allowed(compiler.matcher(constraint))  # untouched by `first`'s progress
    assert allowed(first) != allowed(second)
    assert second.consume_tokens(tokenizer.tokenize_str('{"n": 12}')) and second.is_accepting()
    assert not first.is_accepting()
    assert first.consume_tokens(tokenizer.tokenize_str("7}")) and first.is_accepting()
    third = compiler.matcher(constraint)  # neither use reached the cached original
    assert not third.is_accepting() and third.consume_tokens(tokenizer.tokenize_str('{"n": 3}'))
    stats = compiler.stats()
    assert (stats.hits, stats.misses, stats.entries) == (3, 1, 1)
    assert stats.compile_seconds > 0


def test_the_cache_holds_at_most_its_capacity_least_recently_used_out(tokenizer: LLTokenizer) -> None:
    compiler = GrammarCompiler(tokenizer, capacity=2)
    a, b, c = schema(1), schema(2), schema(3)
    for constraint in (a, b, a, c):  # `a` used again after `b`: `b` is the least recently used when `c` comes
        compiler.matcher(constraint)
        assert compiler.stats().entries <= 2
    assert (compiler.stats().hits, compiler.stats().misses) == (1, 3)
    compiler.matcher(a)  # kept
    assert (compiler.stats().hits, compiler.stats().misses) == (2, 3)
    compiler.matcher(b)  # evicted: compiled again, and `c` goes
    assert (compiler.stats().hits, compiler.stats().misses) == (2, 4)
    compiler.matcher(c)
    stats = compiler.stats()
    assert (stats.hits, stats.misses, stats.entries, stats.capacity) == (2, 5, 2, 2)


def test_check_compiles_once_for_later_uses(tokenizer: LLTokenizer) -> None:
    compiler = GrammarCompiler(tokenizer)
    compiler.check(json_object(), "response_format")
    matcher = compiler.matcher(json_object())
    assert (compiler.stats().hits, compiler.stats().misses) == (1, 1)
    assert matcher.consume_tokens(tokenizer.tokenize_str("{}")) and matcher.is_accepting()


@pytest.mark.parametrize(
    "grammar",
    [
        LLMatcher.grammar_from_lark("start: <[99999999]>"),  # valid without a tokenizer, not with this one
        "not a grammar",
    ],
    ids=["token past the vocabulary", "not a grammar"],
)
def test_a_grammar_that_does_not_compile_is_a_grammar_error_and_is_not_cached(
    tokenizer: LLTokenizer, grammar: str
) -> None:
    compiler = GrammarCompiler(tokenizer)
    broken = Constraint(grammar=grammar, key="broken", label="broken grammar")
    with pytest.raises(GrammarError) as refused:
        compiler.check(broken, "response_format.json_schema.schema")
    assert refused.value.param == "response_format.json_schema.schema"
    assert "cannot be compiled" in refused.value.message
    with pytest.raises(GrammarError):
        compiler.matcher(broken)  # compiled again: a failure is never cached
    stats = compiler.stats()
    assert (stats.entries, stats.hits, stats.misses) == (0, 0, 2)


def test_concurrent_compilations_count_every_use(tokenizer: LLTokenizer) -> None:
    compiler = GrammarCompiler(tokenizer)
    constraints = [schema(n % 4) for n in range(32)]
    with ThreadPoolExecutor(max_workers=4) as pool:
        matchers = list(pool.map(compiler.matcher, constraints))
    stats = compiler.stats()
    assert stats.hits + stats.misses == 32
    assert stats.entries == 4
    assert all(not m.is_error() for m in matchers)


def test_tokens_past_the_tokenizer_in_a_padded_vocabulary_are_never_allowed(wrapper: Any) -> None:
    padded = VOCAB_SIZE + 64  # a model whose output is wider than its tokenizer
    compiler = GrammarCompiler(build_tokenizer(wrapper._tokenizer, padded, wrapper.eos_token_ids))
    matcher = compiler.matcher(json_schema({"type": "string"}, name="s", param="p"))
    assert matcher.consume_tokens(compiler.tokenizer.tokenize_str('"'))
    inside = allowed(matcher, padded)
    assert len(inside) > VOCAB_SIZE // 2  # almost anything goes inside a string
    assert max(inside) < VOCAB_SIZE


def test_a_slow_tokenizer_cannot_serve_grammars() -> None:
    class Slow:
        """A tokenizer without a `tokenizers` backend (a Python "slow" tokenizer)."""

    with pytest.raises(GrammarError, match="fast"):
        build_tokenizer(Slow(), VOCAB_SIZE, [2])
