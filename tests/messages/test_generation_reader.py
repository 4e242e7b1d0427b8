"""`events_or_idle`: a generation's events, and an `Idle` whenever none came for `idle_s` (a keep-alive cue)."""

from __future__ import annotations

import anyio
import pytest

from courier.engine.generation import FinishReason, GenerationEvent, GenerationFinished, RequestId, TokensGenerated
from courier.messages.generation_reader import Idle, events_or_idle, generated_events
from courier.messages.ingress import Admitted

FINISHED = GenerationFinished(reason=FinishReason.STOP, prompt_tokens=3, completion_tokens=1)
TOKEN = TokensGenerated(text="Hi", token_ids=(7,))


def admitted(receive: anyio.abc.ObjectReceiveStream[GenerationEvent]) -> Admitted:
    return Admitted(request_id=RequestId("r"), prompt_tokens=3, max_tokens=4, events=receive)  # type: ignore[arg-type]


@pytest.mark.anyio
async def test_idle_marks_each_silence_then_the_events_come() -> None:
    send, receive = anyio.create_memory_object_stream[GenerationEvent](4)
    seen: list[object] = []
    async with anyio.create_task_group() as group:

        async def engine() -> None:
            await anyio.sleep(0.25)  # a prefill: the reader is told it is idle meanwhile
            await send.send(TOKEN)
            await send.send(FINISHED)

        group.start_soon(engine)
        async for event in events_or_idle(admitted(receive), timeout_s=10, idle_s=0.05):
            seen.append(event)
    idles = [event for event in seen if isinstance(event, Idle)]
    assert len(idles) >= 2 and all(idle.seconds >= 0.05 for idle in idles)
    assert seen[-2:] == [TOKEN, FINISHED]
    assert all(isinstance(event, Idle) for event in seen[:-2])
    send.close()


@pytest.mark.anyio
async def test_without_idle_s_there_is_no_idle_and_the_stream_is_closed_after() -> None:
    send, receive = anyio.create_memory_object_stream[GenerationEvent](4)
    await send.send(TOKEN)
    await send.send(FINISHED)
    assert [event async for event in generated_events(admitted(receive), timeout_s=10)] == [TOKEN, FINISHED]
    with send, pytest.raises(anyio.BrokenResourceError):
        send.send_nowait(TOKEN)  # the reader closed its end: the engine's next send finds no one
