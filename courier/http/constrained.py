"""A request's output spec as the constraint its generation follows, compiled before it is admitted.

Parsing (`grammar/output_spec.py`) refuses what is malformed; here the spec meets the served model (how it writes
tool calls, whether its tokenizer serves grammars), and the grammar is built, checked against the limits and
compiled in a worker thread, so a schema that does not compile is a 400 naming its parameter and the request
carries its compiled grammar to the engine. None of it runs on the event loop (building and checking the grammar
of 128 tools takes up to a second on a small CPU), and at most `GRAMMAR_WORKERS` grammars are worked on at once:
a burst of hostile schemas waits its turn instead of taking the cores the batch steps on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TypeVar

import anyio.to_thread

from courier.engine.generation import SamplingParams
from courier.grammar import output_spec
from courier.grammar.constraint import Constraint, GrammarError
from courier.grammar.output_spec import OutputSpec
from courier.http.context import AppContext
from courier.http.errors import ApiError

T = TypeVar("T")

GRAMMAR_WORKERS = 2  # grammars built and compiled at once, server-wide
_GRAMMAR_LIMITER = anyio.CapacityLimiter(GRAMMAR_WORKERS)


def refusing(parse: Callable[[], T]) -> T:
    """`parse()`, its `GrammarError` a 400 naming the parameter."""
    try:
        return parse()
    except GrammarError as error:
        raise ApiError.invalid(error.message, param=error.param) from None


async def constrain(
    context: AppContext, sampling: SamplingParams, output: OutputSpec, tenant: str, *, continuing: bool = False
) -> SamplingParams:
    """`sampling` with the constraint `output` asks for, compiled (unchanged when it asks for none), from `tenant`'s
    own grammar caches (another key's must not answer faster). `continuing`: for a request already in flight,
    which a draining server lets finish (`generation.admit`)."""
    if not output.constrained:
        return sampling
    if not continuing:
        context.require_ready()
    state = context.state
    tool_grammar = state.tool_format.grammar if state.tool_format is not None else None
    grammars = state.grammars
    param = output.format.param if output.format.kind != "text" else "tools"

    def build() -> Constraint | None:
        if grammars is None:
            return refusing(lambda: output_spec.constraint(output, tool_grammar))
        return refusing(lambda: grammars.output_constraint(output, tool_grammar, param, tenant))

    constraint = await anyio.to_thread.run_sync(build, limiter=_GRAMMAR_LIMITER)
    if constraint is None:
        return sampling
    if grammars is None:
        message = "this model's tokenizer cannot serve constrained decoding (structured outputs, forced tool calls)"
        raise ApiError.invalid(message, param=param)
    return replace(sampling, constraint=constraint)
