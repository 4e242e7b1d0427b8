"""Shared pieces of the constrained-decoding tests: a compiler on SmolLM2's vocabulary, a tool format, a tool."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mlx_lm.tokenizer_utils import load as load_tokenizer

from courier.grammar.compiler import GrammarCompiler, build_tokenizer
from courier.grammar.constraint import Constraint, ToolGrammar

VOCAB_SIZE = 49152
FORM = ToolGrammar(start="<tool_call>", end="</tool_call>")
WEATHER: dict[str, Any] = {
    "name": "get_weather",
    "strict": True,
    "parameters": {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Oslo"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


def smollm2_compiler(model_dir: Path) -> GrammarCompiler:
    """A grammar compiler on the vocabulary of SmolLM2 (whose tokenizer the tiny models share)."""
    wrapper = load_tokenizer(model_dir)
    return GrammarCompiler(build_tokenizer(wrapper._tokenizer, VOCAB_SIZE, wrapper.eos_token_ids))


def accepts(compiler: GrammarCompiler, constraint: Constraint, text: str) -> bool:
    """Whether `text` is a complete output of `constraint` (tokenized as the model's tokenizer would)."""
    matcher = compiler.matcher(constraint)
    return matcher.consume_tokens(compiler.tokenizer.tokenize_str(text)) and matcher.is_accepting()
