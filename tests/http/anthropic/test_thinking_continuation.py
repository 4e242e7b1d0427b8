"""A budgeted message's second generation (its answer after the closed thinking block) is part of the message: it
ends by the message's own deadline, and a server that starts draining meanwhile lets it finish.

In-process, on the real route code (`MessageRun`) with the token counter and the ingress answered here: the
ingress records what each admission asked for and feeds the events the engine would.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import anyio
import pytest
from anyio.streams.memory import MemoryObjectReceiveStream

from courier.core.reasoning import ReasoningFormat
from courier.core.sampling_defaults import OPENAI
from courier.engine.generation import FinishReason, GenerationFinished, TokensGenerated
from courier.http.anthropic.request import parse_messages_request
from courier.http.anthropic.run import MessageRun
from courier.http.generation import admit, new_request_id
from courier.messages.ingress import AdmitGeneration, Admitted, ChatPrompt
from courier.messages.token_counter import TokenizeResult, TokenizeText
from courier.status.service_state import Phase
from tests.support.app import ready_context

THINK = ReasoningFormat(start="<think>", end="</think>", start_tokens=(7,), end_tokens=(8,))
BODY: dict[str, Any] = {
    "model": "m",
    "max_tokens": 50,
    "messages": [{"role": "user", "content": "Hi"}],
    "thinking": {"type": "enabled", "budget_tokens": 3},
}


@pytest.mark.anyio
async def test_the_answer_after_the_budget_keeps_the_messages_deadline_and_survives_a_drain() -> None:
    admissions: list[AdmitGeneration] = []
    with ready_context("m") as base:
        counter_send, counter_receive = anyio.create_memory_object_stream[Any](4)
        ingress_send, ingress_receive = anyio.create_memory_object_stream[Any](4)
        context = replace(base, outboxes=replace(base.outboxes, token_counter=counter_send, ingress=ingress_send))
        context.state.reasoning = THINK

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
                if len(admissions) == 1:  # thinking past its budget; the server starts draining meanwhile
                    for text in ("<think>", "one", " two", " three"):
                        send.send_nowait(TokensGenerated(text=text, token_ids=(1,)))
                    context.state.phase = Phase.DRAINING
                else:
                    send.send_nowait(TokensGenerated(text="Answer.", token_ids=(2,)))
                    send.send_nowait(GenerationFinished(reason=FinishReason.STOP, prompt_tokens=9, completion_tokens=1))
                send.close()
                reply = Admitted(request_id=message.request_id, prompt_tokens=5, max_tokens=50, events=receive)
                with message.reply:
                    await message.reply.send(reply)

        with counter_send, counter_receive, ingress_send, ingress_receive:
            async with anyio.create_task_group() as actors:
                actors.start_soon(token_counter, counter_receive)
                actors.start_soon(ingress, ingress_receive)
                request = parse_messages_request(BODY, OPENAI)
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
    assert len(admissions) == 2 and admissions[1].deadline == admissions[0].deadline == deadline
    assert "".join(getattr(part, "content", "") for part in parts) == "Answer."
    assert run.outcome.stop_reason == "end_turn"
