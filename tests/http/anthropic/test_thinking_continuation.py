"""A message read from scripted generations, in-process, on the real route code (`MessageRun`) with the token
counter and the ingress answered here (the ingress records each admission and feeds the events the engine would).

- A budgeted message's second generation (its answer after the closed thinking block) is part of the message: it
  ends by the message's own deadline, and a server that starts draining meanwhile lets it finish, constrained
  (a JSON schema) or not.
- A continuation whose deadline comes before its first token ends the message cut, its thinking kept.
- A reply cut where the window capped `max_tokens` says `model_context_window_exceeded`; one cut at its deadline
  says `max_tokens`, capped or not.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import anyio
import pytest
from anyio.streams.memory import MemoryObjectReceiveStream

from courier.core.failure_codes import FailureCode
from courier.core.reasoning import ReasoningFormat
from courier.core.sampling_defaults import OPENAI
from courier.engine.generation import (
    FinishReason,
    GenerationEvent,
    GenerationFailed,
    GenerationFinished,
    TokensGenerated,
)
from courier.http.anthropic.request import parse_messages_request
from courier.http.anthropic.run import MessageRun
from courier.http.context import AppContext
from courier.http.generation import admit, new_request_id
from courier.messages.ingress import AdmitGeneration, Admitted, ChatPrompt
from courier.messages.token_counter import TokenizeResult, TokenizeText
from courier.status.service_state import Phase
from tests.support.app import ready_context
from tests.support.grammar import smollm2_compiler

THINK = ReasoningFormat(start="<think>", end="</think>", start_tokens=(7,), end_tokens=(8,))
USER = [{"role": "user", "content": "Hi"}]
BUDGETED: dict[str, Any] = {
    "model": "m",
    "max_tokens": 50,
    "messages": USER,
    "thinking": {"type": "enabled", "budget_tokens": 3},
}
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
ADMITTED_MAX = 50  # what the context leaves, as the scripted ingress admits every generation


def tokens(*texts: str) -> list[GenerationEvent]:
    return [TokensGenerated(text=text, token_ids=(1,)) for text in texts]


def finished(
    reason: FinishReason = FinishReason.STOP, *, deadline: bool = False, cached: int = 0
) -> GenerationFinished:
    return GenerationFinished(
        reason=reason, prompt_tokens=5, completion_tokens=1, deadline=deadline, cached_tokens=cached
    )


async def read_message(
    context: AppContext, body: dict[str, Any], scripts: Sequence[list[GenerationEvent]], *, drain_after_first: bool
) -> tuple[MessageRun, list[Any], list[AdmitGeneration], float]:
    """`body` read to its end, its generations' events `scripts` in order; the parts, the admissions, the deadline."""
    admissions: list[AdmitGeneration] = []
    counter_send, counter_receive = anyio.create_memory_object_stream[Any](4)
    ingress_send, ingress_receive = anyio.create_memory_object_stream[Any](4)
    context = replace(context, outboxes=replace(context.outboxes, token_counter=counter_send, ingress=ingress_send))

    async def token_counter(inbox: MemoryObjectReceiveStream[Any]) -> None:
        async for message in inbox:
            assert isinstance(message, TokenizeText)  # the block's end
            with message.reply:
                await message.reply.send(TokenizeResult(tokens=(9, 8, 9)))

    async def ingress(inbox: MemoryObjectReceiveStream[Any]) -> None:
        async for message in inbox:
            assert isinstance(message, AdmitGeneration)
            admissions.append(message)
            send, receive = anyio.create_memory_object_stream[Any](16)
            for event in scripts[len(admissions) - 1]:
                send.send_nowait(event)
            send.close()
            if drain_after_first and len(admissions) == 1:
                context.state.phase = Phase.DRAINING  # SIGTERM while the first generation runs
            reply = Admitted(request_id=message.request_id, prompt_tokens=5, max_tokens=ADMITTED_MAX, events=receive)
            with message.reply:
                await message.reply.send(reply)

    with counter_send, counter_receive, ingress_send, ingress_receive:
        async with anyio.create_task_group() as actors:
            actors.start_soon(token_counter, counter_receive)
            actors.start_soon(ingress, ingress_receive)
            request = parse_messages_request(body, OPENAI)
            prompt = request.generation.prompt
            assert isinstance(prompt, ChatPrompt)
            rendered = replace(prompt, rendered=TokenizeResult(tokens=(1, 2, 3, 4, 5)))
            request = replace(request, generation=replace(request.generation, prompt=rendered))
            deadline = time.monotonic() + context.settings.request_timeout
            admitted = await admit(context, request.generation, new_request_id(), "", deadline=deadline)
            run = MessageRun(context, request, admitted, "", deadline)
            with anyio.fail_after(10):
                parts = [part async for part in run.parts()]
            actors.cancel_scope.cancel()
    return run, parts, admissions, deadline


@pytest.mark.anyio
@pytest.mark.parametrize("constrained", [False, True])
async def test_the_answer_after_the_budget_keeps_the_messages_deadline_and_survives_a_drain(
    constrained: bool, smollm2_dir: Path
) -> None:
    body = (
        {**BUDGETED, "output_config": {"format": {"type": "json_schema", "schema": SCHEMA}}}
        if constrained
        else BUDGETED
    )
    with ready_context("m") as context:
        context.state.reasoning = THINK
        context.state.grammars = smollm2_compiler(smollm2_dir)
        # The continuation's prompt (the message's and the thinking) hits what the first generation prefilled.
        scripts = [tokens("<think>", "one", " two", " three"), [*tokens("Answer."), finished(cached=7)]]
        run, parts, admissions, deadline = await read_message(context, body, scripts, drain_after_first=True)
    assert len(admissions) == 2 and admissions[1].deadline == admissions[0].deadline == deadline
    assert (admissions[1].sampling.constraint is not None) == constrained
    assert "".join(getattr(part, "content", "") for part in parts) == "Answer."
    assert run.outcome.stop_reason == "end_turn"
    assert run.outcome.usage.cached_tokens == 0  # the continuation's own hit is not what the cache served the message


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("max_tokens", "deadline", "reason"),
    [
        (1_000_000, False, "model_context_window_exceeded"),  # capped to what the window leaves, and cut there
        (1_000_000, True, "max_tokens"),  # capped, but its deadline cut it first
        (ADMITTED_MAX, False, "max_tokens"),  # its own limit
    ],
)
async def test_a_cut_reply_names_what_cut_it(max_tokens: int, deadline: bool, reason: str) -> None:
    body = {"model": "m", "max_tokens": max_tokens, "messages": USER}
    with ready_context("m") as context:
        scripts = [[*tokens("Partial"), finished(FinishReason.LENGTH, deadline=deadline)]]
        run, _, _, _ = await read_message(context, body, scripts, drain_after_first=False)
    assert run.outcome.stop_reason == reason


@pytest.mark.anyio
async def test_a_continuation_late_for_its_first_token_ends_the_message_cut_with_its_thinking() -> None:
    """The scheduler fails a request whose deadline came before its first token (a 504): for a continuation the
    message has written its thinking already, which is kept, the message cut there as its deadline cuts any reply."""
    late = GenerationFailed(message="the deadline came first", code=FailureCode.DEADLINE_EXCEEDED)
    with ready_context("m") as context:
        context.state.reasoning = THINK
        scripts: list[list[GenerationEvent]] = [tokens("<think>", "one", " two", " three"), [late]]
        run, parts, admissions, _ = await read_message(context, BUDGETED, scripts, drain_after_first=False)
    assert len(admissions) == 2
    assert "".join(getattr(part, "reasoning", "") for part in parts).startswith("one")
    assert run.outcome.stop_reason == "max_tokens"
    assert run.outcome.usage.output_tokens == 3 + 3  # the budget's thinking tokens and the block's end, written
