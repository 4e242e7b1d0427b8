"""Requests whose grammars are as large as a client may make them (issue 30, items 7 and 8), for the tests and the
bench.

Three schemas no generation can follow (item 7, `SCHEMA_SHAPES`): a `$ref` that requires itself (no finite
instance), `anyOf` nested 8 x 8 x 8 over distinct objects, and an object of 2,000 properties; each made llguidance
fail on the reply's first token while compiling had passed.

Four tool shapes (item 8, `SHAPES`), each a chat body's fields beside `model`, `messages` and `max_tokens`: 128
functions with `tool_choice: "required"`, one function of 600 optional properties, 128 functions whose parameter is
a regular expression whose automaton explodes (a "pattern bomb": `(a|b)*a(a|b){N}` needs 2^N states as a DFA), and
a JSON schema answer offered beside 128 tools in `auto`. The functions carry no descriptions, so the prompt that
describes them (generic mode) stays inside SmolLM2's 8K window, except the 128 pattern bombs (about 9K tokens: a
400 there, served on a wider window).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models import llama

from courier.core.tools import generic as generic_tools
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
JSON_QUESTION = "Reply with JSON."
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


def anyof_8x8x8() -> dict[str, Any]:
    leaves = iter(range(8**3))

    def level(depth: int) -> dict[str, Any]:
        if depth == 0:
            leaf = next(leaves)
            properties = {f"x{leaf}": {"type": "integer"}, "y": {"type": "string"}}
            return {"type": "object", "properties": properties, "required": ["y"]}
        return {"anyOf": [level(depth - 1) for _ in range(8)]}

    return level(3)


NO_FINITE_INSTANCE: dict[str, Any] = {
    "$defs": {
        "node": {
            "type": "object",
            "properties": {"next": {"$ref": "#/$defs/node"}},
            "required": ["next"],
            "additionalProperties": False,
        }
    },
    "$ref": "#/$defs/node",
}
PROPERTIES_2000: dict[str, Any] = {"type": "object", "properties": {f"p{index}": {} for index in range(2000)}}
UNSATISFIABLE: dict[str, dict[str, Any]] = {
    "no finite instance": NO_FINITE_INSTANCE,
    "anyOf 8x8x8": anyof_8x8x8(),
    "2000 properties": PROPERTIES_2000,
}


def json_schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


# Item 7's shapes: a JSON schema answer, asked for as such.
SCHEMA_SHAPES: dict[str, dict[str, Any]] = {
    f"a schema: {name}": {
        "messages": [{"role": "user", "content": JSON_QUESTION}],
        "response_format": json_schema_format(schema),
    }
    for name, schema in UNSATISFIABLE.items()
}

# Item 8's shapes: each one's body fields beside model, messages and max_tokens, named as in reliability.md.
SHAPES: dict[str, dict[str, Any]] = {
    "128 functions with tool_choice required": {"tools": ordinary_tools(), "tool_choice": "required"},
    "a function of 600 optional properties": {"tools": wide_function(), "tool_choice": "required"},
    "128 functions with pattern bombs": {"tools": pattern_bombs(), "tool_choice": "required"},
    "a json_schema beside 128 tools in auto": {
        "tools": ordinary_tools(),
        "tool_choice": "auto",
        "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA}},
    },
}
# The control for item 8 (no grammar): the prompt the 128 functions' shapes render to in generic mode, sent as plain
# messages with no `tools`, so it is as long and nothing is constrained. Its system message begins with a word of its
# own, so neither it nor the shapes after it start from the other's prompt in the prompt cache.
CONTROL = "control: a plain prompt as long as the 128 functions' (no grammar)"
CONTROL_SHAPES: dict[str, dict[str, Any]] = {
    CONTROL: {
        "messages": generic_tools.render(
            [{"role": "system", "content": "Control."}, {"role": "user", "content": QUESTION}], ordinary_tools()
        )
    }
}
ALL_SHAPES: dict[str, dict[str, Any]] = {**SCHEMA_SHAPES, **CONTROL_SHAPES, **SHAPES}


def hostile_body(model: str, shape: str, max_tokens: int) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": max_tokens,
        **ALL_SHAPES[shape],
    }


def small_chat_body(model: str) -> dict[str, Any]:
    """Another client's two-token chat."""
    return {"model": model, "messages": [{"role": "user", "content": SMALL_CHAT}], "max_tokens": 2}


def build_wide_window_llama(tokenizer_dir: Path, out_dir: Path, context: int = WIDE_CONTEXT) -> Path:
    """The tiny random llama with a window the 128 tools' prompts fit in (they are 5-9K tokens)."""
    mx.random.seed(0)
    config = {**LLAMA_CONFIG, "max_position_embeddings": context}
    return _save(llama.Model(llama.ModelArgs.from_dict(config)), config, tokenizer_dir, out_dir)
