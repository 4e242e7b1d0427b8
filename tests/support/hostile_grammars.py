"""Requests whose grammars are as large as a client may make them (issue 30, item 8), for the tests and the bench.

Four shapes, each a chat body without `model` and `messages`: 128 functions with `tool_choice: "required"`, one
function of 600 optional properties, 128 functions whose parameter is a regular expression whose automaton
explodes (a "pattern bomb": `(a|b)*a(a|b){N}` needs 2^N states as a DFA), and a JSON schema answer offered beside
128 tools in `auto`. The functions carry no descriptions, so the prompt that describes them (generic mode) stays
inside SmolLM2's 8K window, except the 128 pattern bombs (about 9K tokens: a 400 there, served on a wider window).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models import llama

from tests.support.tiny_models import LLAMA_CONFIG, _save

TOOLS = 128
OPTIONAL_PROPERTIES = 600
BOMB = "^(a|b)*a(a|b){14}$"
WIDE_CONTEXT = 32768
ANSWER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"answer": {"type": "string"}, "confidence": {"type": "number"}},
    "required": ["answer", "confidence"],
}
QUESTION = "Call a tool for the weather in Paris."
SMALL_CHAT = "Hi"


def function(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def ordinary_tools(count: int = TOOLS) -> list[dict[str, Any]]:
    one_string = {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}
    return [function(f"t{index}", one_string) for index in range(count)]


def wide_function(properties: int = OPTIONAL_PROPERTIES) -> list[dict[str, Any]]:
    fields = {f"f{index}": {"type": "string"} for index in range(properties)}
    return [function("wide", {"type": "object", "properties": fields})]


def pattern_bombs(count: int = TOOLS, pattern: str = BOMB) -> list[dict[str, Any]]:
    bomb = {"type": "object", "properties": {"c": {"type": "string", "pattern": pattern}}, "required": ["c"]}
    return [function(f"b{index}", bomb) for index in range(count)]


# Each shape's body fields (beside model, messages and max_tokens), by the name the docs' table gives it.
SHAPES: dict[str, dict[str, Any]] = {
    "128 functions, tool_choice required": {"tools": ordinary_tools(), "tool_choice": "required"},
    "a function of 600 optional properties": {"tools": wide_function(), "tool_choice": "required"},
    "128 functions with pattern bombs": {"tools": pattern_bombs(), "tool_choice": "required"},
    "a json_schema beside 128 tools in auto": {
        "tools": ordinary_tools(),
        "tool_choice": "auto",
        "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA}},
    },
}


def hostile_body(model: str, shape: str, max_tokens: int) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": max_tokens,
        **SHAPES[shape],
    }


def small_chat_body(model: str) -> dict[str, Any]:
    """Another client's two-token chat."""
    return {"model": model, "messages": [{"role": "user", "content": SMALL_CHAT}], "max_tokens": 2}


def build_wide_window_llama(tokenizer_dir: Path, out_dir: Path, context: int = WIDE_CONTEXT) -> Path:
    """The tiny random llama with a window the 128 tools' prompts fit in (they are 5-9K tokens)."""
    mx.random.seed(0)
    config = {**LLAMA_CONFIG, "max_position_embeddings": context}
    return _save(llama.Model(llama.ModelArgs.from_dict(config)), config, tokenizer_dir, out_dir)
