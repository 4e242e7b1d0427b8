"""What a request asks of its output's shape: a response format, a tool choice, and whether calls may be parallel.

Parsed from Chat Completions (`response_format`, `tool_choice`, `parallel_tool_calls`) and from Responses
(`text.format`, `tool_choice`, `parallel_tool_calls`), each refusal a `GrammarError` naming the parameter; then
`constraint` turns it into the grammar generation follows, given how the served model writes tool calls.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from courier.grammar import constraint as grammars
from courier.grammar.constraint import Constraint, GrammarError, ToolGrammar

FORMAT_TYPES = ("text", "json_object", "json_schema")
MAX_NAME = 64


@dataclass(frozen=True, slots=True, kw_only=True)
class OutputFormat:
    kind: str = "text"  # one of FORMAT_TYPES
    name: str = ""
    schema: Mapping[str, Any] | None = None
    strict: bool | None = None
    param: str = "response_format"
    description: str | None = None

    def echo(self) -> dict[str, Any]:
        """As the Responses object shows it (`text.format`)."""
        if self.kind != "json_schema":
            return {"type": self.kind}
        shown: dict[str, Any] = {"type": "json_schema", "name": self.name, "schema": self.schema}
        if self.description is not None:
            shown["description"] = self.description
        shown["strict"] = self.strict
        return shown


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolChoice:
    mode: str = "auto"  # auto, none, required, or function (then `name`)
    name: str | None = None

    @property
    def one_call(self) -> bool:
        """A named function: one call of it, then the end of the reply, whatever `parallel_tool_calls` says (as
        OpenAI answers it; Anthropic's `{"type": "tool", "name"}` means the same and parses to this choice)."""
        return self.mode == "function"

    def echo(self, responses: bool) -> str | dict[str, Any]:
        if self.mode != "function":
            return self.mode
        if responses:
            return {"type": "function", "name": self.name}
        return {"type": "function", "function": {"name": self.name}}


@dataclass(frozen=True, slots=True, kw_only=True)
class OutputSpec:
    format: OutputFormat = field(default_factory=OutputFormat)
    tool_choice: ToolChoice = field(default_factory=ToolChoice)
    parallel_tool_calls: bool = True
    max_tool_calls: int | None = None  # Responses' cap on the calls in one reply (1: as parallel_tool_calls false)
    # The request's functions, each {"name", "parameters", "strict"} (Chat's nested and Responses' flat tools alike).
    functions: tuple[Mapping[str, Any], ...] = ()

    @property
    def single_call(self) -> bool:
        """At most one call: a named function, no parallel calls, or `max_tool_calls` 1. The call grammar then
        ends the output after one call (native formats and generic mode alike), and a reply keeps one."""
        return self.tool_choice.one_call or not self.parallel_tool_calls or self.max_tool_calls == 1

    def kept_calls(self, calls: list[Any]) -> list[Any]:
        """The calls a reply may keep: one without parallel calls, at most `max_tool_calls`."""
        most = 1 if self.single_call else self.max_tool_calls
        return calls if most is None else calls[:most]

    @property
    def constrained(self) -> bool:
        return self.format.kind != "text" or self.tools_offered

    @property
    def tools_offered(self) -> bool:
        return bool(self.functions) and self.tool_choice.mode != "none"


def chat_response_format(value: Any) -> OutputFormat:
    """Chat's `response_format`: {"type": "text" | "json_object" | "json_schema", "json_schema": {...}}."""
    if value is None:
        return OutputFormat()
    if not isinstance(value, dict):
        raise GrammarError("'response_format' must be an object with a 'type'", "response_format")
    kind = value.get("type")
    if kind not in FORMAT_TYPES:
        raise GrammarError(
            f"'response_format.type' must be one of {', '.join(FORMAT_TYPES)}, not {_shown(kind)}",
            "response_format.type",
        )
    if kind != "json_schema":
        return OutputFormat(kind=kind)
    body = value.get("json_schema")
    if not isinstance(body, dict):
        raise GrammarError("'response_format.json_schema' must be an object", "response_format.json_schema")
    return _schema_format(body, "response_format.json_schema")


def responses_text_format(value: Any) -> OutputFormat:
    """Responses' `text`: {"format": {"type": "text" | "json_object" | "json_schema", "name", "schema", ...}}."""
    if value is None:
        return OutputFormat(param="text.format")
    if not isinstance(value, dict):
        raise GrammarError("'text' must be an object", "text")
    verbosity = value.get("verbosity")
    if verbosity not in (None, "medium"):
        raise GrammarError("'text.verbosity' other than 'medium' is not supported", "text.verbosity")
    text_format = value.get("format")
    if text_format is None:
        return OutputFormat(param="text.format")
    if not isinstance(text_format, dict):
        raise GrammarError("'text.format' must be an object with a 'type'", "text.format")
    kind = text_format.get("type")
    if kind not in FORMAT_TYPES:
        raise GrammarError(
            f"'text.format.type' must be one of {', '.join(FORMAT_TYPES)}, not {_shown(kind)}", "text.format.type"
        )
    if kind != "json_schema":
        return OutputFormat(kind=kind, param="text.format")
    return _schema_format(text_format, "text.format")


def _schema_format(body: Mapping[str, Any], param: str) -> OutputFormat:
    name = body.get("name", "response")
    if not isinstance(name, str) or not name or len(name) > MAX_NAME:
        raise GrammarError(f"'{param}.name' must be a string of 1 to {MAX_NAME} characters", f"{param}.name")
    schema = body.get("schema")
    if not isinstance(schema, dict):
        raise GrammarError(f"'{param}.schema' must be a JSON Schema object", f"{param}.schema")
    strict = body.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise GrammarError(f"'{param}.strict' must be a boolean", f"{param}.strict")
    description = body.get("description")
    if description is not None and not isinstance(description, str):
        raise GrammarError(f"'{param}.description' must be a string", f"{param}.description")
    return OutputFormat(
        kind="json_schema", name=name, schema=schema, strict=strict, param=f"{param}.schema", description=description
    )


def tool_choice(value: Any, *, responses: bool) -> ToolChoice:
    """ "auto", "none", "required", or a named function (Chat: {"type": "function", "function": {"name"}};
    Responses: {"type": "function", "name"})."""
    if value is None:
        return ToolChoice()
    if value in ("auto", "none", "required"):
        return ToolChoice(mode=value)
    if isinstance(value, dict) and value.get("type") == "function":
        holder = value if responses else value.get("function")
        name = holder.get("name") if isinstance(holder, dict) else None
        if isinstance(name, str) and name:
            return ToolChoice(mode="function", name=name)
    shape = '{"type": "function", "name": ...}' if responses else '{"type": "function", "function": {"name": ...}}'
    raise GrammarError(f"'tool_choice' must be 'auto', 'none', 'required' or {shape}", "tool_choice")


def functions(tools: Sequence[Mapping[str, Any]] | None) -> tuple[Mapping[str, Any], ...]:
    """Each tool's function as {"name", "parameters", "strict"} (Chat nests it under "function")."""
    found: list[Mapping[str, Any]] = []
    for tool in tools or ():
        function = tool.get("function")
        found.append(function if isinstance(function, dict) else tool)
    return tuple(found)


def spec(
    output_format: OutputFormat,
    choice: ToolChoice,
    parallel: bool,
    tools: Sequence[Mapping[str, Any]] | None,
    max_tool_calls: int | None = None,
) -> OutputSpec:
    """The request's output spec, checked for consistency (a named function must be one of the tools)."""
    offered = functions(tools)
    if choice.mode in ("required", "function") and not offered:
        raise GrammarError(f"'tool_choice' {choice.mode!r} needs at least one tool in 'tools'", "tool_choice")
    if choice.mode == "function" and all(f.get("name") != choice.name for f in offered):
        names = ", ".join(str(f.get("name")) for f in offered)
        raise GrammarError(
            f"'tool_choice' names {choice.name!r}, which is not one of the tools ({names})", "tool_choice"
        )
    return OutputSpec(
        format=output_format,
        tool_choice=choice,
        parallel_tool_calls=parallel,
        max_tool_calls=max_tool_calls,
        functions=offered,
    )


def constraint(output: OutputSpec, tool_grammar: ToolGrammar | None, tools_param: str = "tools") -> Constraint | None:
    """The grammar generation follows for `output`, given how the model writes tool calls (None: it cannot)."""
    answer = _answer(output.format)
    if not output.tools_offered:
        return answer
    choice = output.tool_choice
    called = (
        output.functions
        if choice.mode != "function"
        else tuple(f for f in output.functions if f["name"] == choice.name)
    )
    if tool_grammar is None:
        what = _needing_a_grammar(choice, answer is not None, called)
        if what is None:
            return None  # auto: the model's own format, parsed as it comes
        raise GrammarError(
            f"{what} cannot be combined with this model's own tool-call format, which Courier cannot constrain; "
            "use tool_choice 'auto' with non-strict functions",
            "tool_choice" if choice.mode != "auto" else tools_param,
        )
    forced = choice.mode in ("required", "function")
    if answer is not None and not forced:  # a JSON answer or tool calls, decided by the model from the start
        schema = dict(output.format.schema) if output.format.schema is not None else {"type": "object"}
        return grammars.tool_calls(
            called,
            tool_grammar,
            forced=True,
            parallel=not output.single_call,
            param=tools_param,
            answer_schema=schema,
            answer_param=output.format.param,
        )
    return grammars.tool_calls(called, tool_grammar, forced=forced, parallel=not output.single_call, param=tools_param)


def _needing_a_grammar(choice: ToolChoice, json_answer: bool, called: Sequence[Mapping[str, Any]]) -> str | None:
    """What in the request only a grammar over the tool-call format can honour (None: nothing)."""
    if choice.mode != "auto":
        return f"tool_choice {choice.mode!r}"
    if json_answer:
        return "a JSON response format"
    if any(function.get("strict") is True for function in called):
        return "strict functions"
    return None


def _answer(output_format: OutputFormat) -> Constraint | None:
    if output_format.kind == "json_object":
        return grammars.json_object()
    if output_format.kind == "json_schema":
        return grammars.json_schema(output_format.schema, name=output_format.name, param=output_format.param)
    return None


def _shown(value: Any) -> str:
    try:
        text = orjson.dumps(value).decode()
    except TypeError:
        text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
