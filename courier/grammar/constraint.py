"""What a request constrains its output to, as an llguidance grammar, checked where the request enters.

A `Constraint` is plain data: the grammar text (llguidance's JSON form), the key its compiled form is cached
under, and, for a tool call in `auto` mode, the text that triggers it. Building one checks the grammar without a
tokenizer (unknown schema keywords, bad `$ref`s, regexes that do not parse) and bounds its size, so a request
that cannot be honoured is refused with a 400 naming its parameter before any work is queued.

`oneOf` is honoured exactly or refused, never loosened: llguidance accepts it where it can prove its alternatives
exclude each other (different types, or a `const` / `enum` property each requires), so an output matches exactly
one; otherwise the refusal says to make them exclusive or to write `anyOf` (`ONE_OF_OVERLAPS`). Generation keeps
to the schema it was given, so a request never gets output its own validator would reject.

JSON is generated in the shape `json.dumps` writes (`", "` between items, `": "` after keys, no other
whitespace): a small model cannot wander into endless whitespace, and tool calls look like the ones chat
templates render.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
from llguidance import LLMatcher, LLParserLimits

MAX_SCHEMA_BYTES = 64 * 1024
MAX_SCHEMA_DEPTH = 32
MAX_TOOLS = 128
# What llguidance says of a oneOf whose alternatives it cannot prove exclusive (naming an option no request sets),
# and what the client is told instead.
_LLGUIDANCE_ONE_OF = "oneOf constraints are not supported"
ONE_OF_OVERLAPS = (
    "its oneOf alternatives may overlap, so an output could match more than one: make them exclusive (different "
    "types, or a const or enum property each requires) or write anyOf"
)
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Bounds on one grammar's size and on the lexer work a mask may take (llguidance's defaults, lexer fuel lowered):
# a schema over them is refused as too complex, never compiled for seconds.
LIMITS = LLParserLimits(
    max_items_in_row=2000,
    initial_lexer_fuel=1_000_000,
    step_lexer_fuel=200_000,
    step_max_items=50_000,
    max_lexer_states=250_000,
    max_grammar_size=500_000,
)


class GrammarError(ValueError):
    """A constraint the server cannot honour; `param` names the request field that asked for it."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


@dataclass(frozen=True, slots=True, kw_only=True)
class Constraint:
    """Generation constrained by `grammar` (llguidance's grammar text).

    With no `trigger` the whole output follows the grammar. With one, text is free until it appears in the output;
    what follows must match the grammar, after which text is free again (`repeat`) or the output ends.
    """

    grammar: str
    key: str  # the canonical grammar's digest: compiled grammars are cached under it
    label: str  # what it constrains, for logs and errors ("json_schema 'person'")
    trigger: str = ""
    repeat: bool = True
    # Its compiled grammar, once `GrammarCompiler.compile` has made it (off the MLX thread): the engine copies this
    # one, so a grammar the cache has dropped since is never compiled again on the step's thread.
    compiled: LLMatcher | None = field(default=None, compare=False, repr=False)


def json_schema(schema: Any, *, name: str, param: str) -> Constraint:
    """Output that is one JSON value valid against `schema`."""
    if not isinstance(schema, dict):
        raise GrammarError(f"{param} must be a JSON Schema object", param)
    _check_size(schema, param)
    return _constraint(_schema_grammar(schema, param), label=f"json_schema {name!r}", param=param)


def json_object() -> Constraint:
    """Output that is one JSON object, of any shape (`response_format: {"type": "json_object"}`)."""
    return _constraint(_schema_grammar({"type": "object"}, "response_format"), label="json_object", param="")


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolGrammar:
    """How tool calls are written: `start` + a JSON object {"name", "arguments"} + `end` (a `json_tools` format)."""

    start: str
    end: str
    separator: str = "\n"  # between the markers and the JSON, and between calls
    # A marker that is one special token of the vocabulary is matched as that token (text never spells it).
    start_token: int | None = None
    end_token: int | None = None

    @property
    def start_lark(self) -> str:
        return f"<[{self.start_token}]>" if self.start_token is not None else _lark_string(self.start)

    @property
    def end_lark(self) -> str:
        return f"<[{self.end_token}]>" if self.end_token is not None else _lark_string(self.end)


def tool_calls(
    tools: Sequence[Mapping[str, Any]],
    form: ToolGrammar,
    *,
    forced: bool,
    parallel: bool,
    param: str,
    answer_schema: dict[str, Any] | None = None,
    answer_param: str = "response_format",
) -> Constraint:
    """Calls to `tools` (each the OpenAI function object: name, parameters, strict).

    `forced`: the output is the call(s) and nothing else (`tool_choice` "required" or a named function);
    otherwise text is free until the model opens a call, and the call is then constrained. `parallel`: more than
    one call may follow; without it the grammar ends the output after one call (a named function's one call).
    Arguments are valid against the function's `parameters` (as vLLM and llama.cpp do, strict or not); parameters
    that cannot be compiled are a `GrammarError` for a `strict` function, and any JSON object for another.
    `answer_schema`: instead of calling, the model may answer with JSON valid against it (a JSON response format
    offered beside tools).
    """
    if not tools:
        raise GrammarError("no tools to call", param)
    if len(tools) > MAX_TOOLS:
        raise GrammarError(f"at most {MAX_TOOLS} tools can be constrained, not {len(tools)}", param)
    if any(tool.get("type") == "custom" for tool in tools):
        return _with_custom_tools(tools, form, forced=forced, parallel=parallel, param=param)
    choices = [_call_schema(tool, f"tools[{index}]") for index, tool in enumerate(tools)]
    schema = choices[0] if len(choices) == 1 else {"anyOf": choices}
    _check_size(schema, param)
    body = "%json " + orjson.dumps({**schema, "x-guidance": JSON_OPTIONS}).decode()
    sep = _lark_string(form.separator)
    call = f"{form.start_lark} {sep} call_body {sep} {form.end_lark}"
    names = ", ".join(str(tool.get("name")) for tool in tools)
    if forced:
        calls = "call" if not parallel else f"call ({sep} call)*"
        lark = f"start: {calls}\ncall: {call}\ncall_body: {body}\n"
        label = f"tool call ({names})"
        if answer_schema is not None:
            _check_size(answer_schema, answer_param)
            answer = "%json " + orjson.dumps({**answer_schema, "x-guidance": JSON_OPTIONS}).decode()
            lark = f"start: calls | answer\ncalls: {calls}\ncall: {call}\ncall_body: {body}\nanswer: {answer}\n"
            label = f"JSON answer or {label}"
        return _constraint(_lark_grammar(lark, param), label=label, param=param)
    # Triggered by the start marker: what follows it is the call's body and end marker.
    lark = f"start: {sep} call_body {sep} {form.end_lark}\ncall_body: {body}\n"
    grammar = _lark_grammar(lark, param)
    return _constraint(grammar, label=f"tool call ({names})", param=param, trigger=form.start, repeat=parallel)


def _with_custom_tools(
    tools: Sequence[Mapping[str, Any]], form: ToolGrammar, *, forced: bool, parallel: bool, param: str
) -> Constraint:
    """`tool_calls` when some tools are custom (Responses' free-form tools, `core/tools/custom.py`): a custom call is
    `{"name": ...}` on its own line, then its input, verbatim: any text up to the end marker, or text its grammar
    (Lark or regex, each a grammar of its own that the call refers to) accepts."""
    sep, end = _lark_string(form.separator), form.end_lark
    rests: list[str] = []
    rules: list[str] = []
    subgrammars: list[dict[str, str]] = []
    # Every call opens with its own text (`{"name": ...`), so the alternatives part at a lexeme: a function's
    # arguments are JSON after its name, as the whole object would be (name first, `json.dumps` separators).
    schemas = [
        _call_schema(tool, f"tools[{index}]") for index, tool in enumerate(tools) if tool.get("type") != "custom"
    ]
    _check_size(schemas, param)
    for index, schema in enumerate(schemas):
        opening = json.dumps({"name": schema["properties"]["name"]["const"]}, ensure_ascii=False)[:-1]
        arguments = orjson.dumps({**schema["properties"]["arguments"], "x-guidance": JSON_OPTIONS}).decode()
        rests.append(f"{sep} function_{index} {sep} {end}")
        opening_lark = _lark_string(opening + ', "arguments": ')
        rules.append(f'function_{index}: {opening_lark} %json {arguments} "}}"')
    for index, tool in enumerate(tools):
        if tool.get("type") != "custom":
            continue
        header = _lark_string(json.dumps({"name": tool.get("name")}, ensure_ascii=False) + "\n")
        shape = tool.get("format")
        if isinstance(shape, Mapping) and shape.get("type") == "grammar":
            definition = str(shape.get("definition"))
            lark = definition if shape.get("syntax") == "lark" else f"start: /{_regex_literal(definition)}/\n"
            subgrammars.append({"name": f"custom_{index}", "lark_grammar": lark})
            rests.append(f"{sep} {header} @custom_{index} {sep} {end}")
        elif form.end_token is not None:  # the end marker is a token text never spells: any text up to it
            rests.append(f"{sep} {header} custom_text {end}")
            rules.append("custom_text: /(.|\\n)*/")
        else:  # any text, up to the end marker (which the rule writes)
            rests.append(f"{sep} {header} custom_text_{index}")
            rules.append(f"custom_text_{index}[suffix={_lark_string(form.separator + form.end)}]: /(.|\\n)*/")
    rest = "call_rest: " + " | ".join(rests) + "\n" + "".join(f"{rule}\n" for rule in dict.fromkeys(rules))
    names = ", ".join(str(tool.get("name")) for tool in tools)
    if forced:
        calls = "call" if not parallel else f"call ({sep} call)*"
        lark = f"start: {calls}\ncall: {form.start_lark} call_rest\n{rest}"
        grammar = _grammar_with(lark, subgrammars, param)
        return _constraint(grammar, label=f"tool call ({names})", param=param)
    grammar = _grammar_with(f"start: call_rest\n{rest}", subgrammars, param)
    return _constraint(grammar, label=f"tool call ({names})", param=param, trigger=form.start, repeat=parallel)


def _grammar_with(lark: str, subgrammars: Sequence[Mapping[str, str]], param: str) -> str:
    """A Lark grammar and the grammars it refers to (`@name`), in llguidance's JSON form, checked."""
    grammar = orjson.dumps({"grammars": [{"lark_grammar": lark}, *subgrammars]}).decode()
    _validate(grammar, param)
    return grammar


def _regex_literal(regex: str) -> str:
    """`regex` inside a Lark `/.../` literal: each `/` it does not escape already, escaped."""
    out: list[str] = []
    escaped = False
    for char in regex:
        out.append("\\/" if char == "/" and not escaped else char)
        escaped = char == "\\" and not escaped
    return "".join(out)


def _call_schema(tool: Mapping[str, Any], where: str) -> dict[str, Any]:
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise GrammarError(f"{where}: a function needs a name", where)
    parameters = tool.get("parameters")
    arguments: Any = {"type": "object"}
    if isinstance(parameters, dict) and parameters:
        arguments = parameters
        problem = _schema_problem(parameters)
        if problem and tool.get("strict") is True:
            raise GrammarError(f"{where} ({name}): its strict parameters cannot constrain generation: {problem}", where)
        if problem:  # not strict: arguments that are a JSON object of any shape
            arguments = {"type": "object"}
    return {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": arguments},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _schema_problem(schema: dict[str, Any]) -> str:
    """Why `schema` cannot be compiled ("" when it can)."""
    try:
        grammar = LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)  # type: ignore[arg-type]
    except ValueError as error:
        return str(error)
    return _explained(LLMatcher.validate_grammar(grammar, None, limits=LIMITS))


def _schema_grammar(schema: dict[str, Any], param: str) -> str:
    try:
        grammar = LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)  # type: ignore[arg-type]
    except ValueError as error:
        raise GrammarError(f"{param}: {error}", param) from None
    _validate(grammar, param)
    return grammar


def lark_constraint(grammar: str, *, label: str, param: str) -> Constraint:
    """Output that is exactly what the Lark `grammar` (llguidance's dialect) accepts, checked against the limits."""
    return _constraint(_lark_grammar(grammar, param), label=label, param=param)


def _lark_grammar(lark: str, param: str) -> str:
    grammar = LLMatcher.grammar_from_lark(lark)
    _validate(grammar, param)
    return grammar


def _validate(grammar: str, param: str) -> None:
    error = _explained(LLMatcher.validate_grammar(grammar, None, limits=LIMITS))
    if error:
        raise GrammarError(f"{param} cannot be used to constrain generation: {error}", param)


def _explained(error: str) -> str:
    """llguidance's complaint in the client's terms ("" stays "")."""
    return ONE_OF_OVERLAPS if error.startswith(_LLGUIDANCE_ONE_OF) else error


def _constraint(grammar: str, *, label: str, param: str, trigger: str = "", repeat: bool = True) -> Constraint:
    key = hashlib.sha256(f"{trigger}\x00{repeat}\x00{grammar}".encode()).hexdigest()
    return Constraint(grammar=grammar, key=key, label=label, trigger=trigger, repeat=repeat)


def _check_size(schema: Any, param: str) -> None:
    try:
        size = len(orjson.dumps(schema, option=orjson.OPT_SORT_KEYS))
    except (TypeError, orjson.JSONEncodeError) as error:
        raise GrammarError(f"{param} is not JSON: {error}", param) from None
    if size > MAX_SCHEMA_BYTES:
        raise GrammarError(f"{param} is {size} bytes of JSON; the most a schema may take is {MAX_SCHEMA_BYTES}", param)
    if _depth(schema) > MAX_SCHEMA_DEPTH:
        raise GrammarError(f"{param} nests deeper than {MAX_SCHEMA_DEPTH} levels", param)


def _depth(value: Any) -> int:
    """How many objects and arrays deep `value` nests (as `core/json_text.py` counts)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if not isinstance(item, dict | list):
            continue
        deepest = max(deepest, level)
        if deepest > MAX_SCHEMA_DEPTH:
            return deepest
        children = item.values() if isinstance(item, dict) else item
        stack.extend((child, level + 1) for child in children)
    return deepest


def _lark_string(text: str) -> str:
    """`text` as a Lark string literal."""
    return orjson.dumps(text).decode()
