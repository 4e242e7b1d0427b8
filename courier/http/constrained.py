"""A request's output spec as the constraint its generation follows, compiled before it is admitted.

Parsing (`grammar/output_spec.py`) refuses what is malformed; here the spec meets the served model (how it writes
tool calls, whether its tokenizer serves grammars) and the grammar is compiled in a worker thread, so a schema
that does not compile is a 400 naming its parameter and the engine finds the compiled grammar cached.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TypeVar

import anyio.to_thread

from courier.engine.generation import SamplingParams
from courier.grammar import output_spec
from courier.grammar.constraint import GrammarError
from courier.grammar.output_spec import OutputSpec
from courier.http.context import AppContext
from courier.http.errors import ApiError

T = TypeVar("T")


def refusing(parse: Callable[[], T]) -> T:
    """`parse()`, its `GrammarError` a 400 naming the parameter."""
    try:
        return parse()
    except GrammarError as error:
        raise ApiError.invalid(error.message, param=error.param) from None


async def constrain(context: AppContext, sampling: SamplingParams, output: OutputSpec) -> SamplingParams:
    """`sampling` with the constraint `output` asks for (unchanged when it asks for none)."""
    if not output.constrained:
        return sampling
    context.require_ready()
    state = context.state
    tool_grammar = state.tool_format.grammar if state.tool_format is not None else None
    constraint = refusing(lambda: output_spec.constraint(output, tool_grammar))
    if constraint is None:
        return sampling
    grammars = state.grammars
    param = output.format.param if output.format.kind != "text" else "tools"
    if grammars is None:
        message = "this model's tokenizer cannot serve constrained decoding (structured outputs, forced tool calls)"
        raise ApiError.invalid(message, param=param)
    await anyio.to_thread.run_sync(lambda: refusing(lambda: grammars.check(constraint, param)))
    return replace(sampling, constraint=constraint)
