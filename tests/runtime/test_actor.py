"""The actor base and `ask`, wired with real streams to a small echo actor."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from functools import partial
from typing import Any

import anyio
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from courier.runtime.actor import Actor, ActorBusy, ActorStopped, ask, discard_unreceived
from courier.runtime.faults import BrokenInvariant, FaultCounter
from courier.runtime.message import Message, ReplyStream
from courier.runtime.tracing import tracer


@dataclass(frozen=True, slots=True, kw_only=True)
class Echo(Message):
    text: str
    reply: ReplyStream[str]


@dataclass(frozen=True, slots=True, kw_only=True)
class Explode(Message):
    reply: ReplyStream[str] | None = None
    broken_invariant: bool = False

    def failed(self, error: Exception, actor: str) -> str:
        """What the asker hears when handling this raised (the runtime's contract with a message)."""
        return f"{actor} failed: {type(error).__name__}"


class EchoActor(Actor[Echo | Explode]):
    name = "echo"

    def __init__(self) -> None:
        self.gate = anyio.Event()
        self.set_up = False

    async def setup(self) -> None:
        self.set_up = True

    async def handle(self, message: Echo | Explode) -> None:
        match message:
            case Echo():
                await self.gate.wait()
                async with message.reply:
                    await message.reply.send(message.text.upper())
            case Explode(broken_invariant=True):
                raise BrokenInvariant("the process cannot go on")
            case Explode():
                raise RuntimeError("actor bug")


def echo(text: str) -> object:
    return lambda reply: Echo(text=text, reply=reply)


@pytest.mark.anyio
async def test_ask_gets_the_reply_after_setup() -> None:
    actor = EchoActor()
    actor.gate.set()
    send, receive = anyio.create_memory_object_stream[Echo | Explode](4)
    async with anyio.create_task_group() as task_group:
        await task_group.start(actor.run, receive)
        assert actor.set_up
        assert await ask(send, echo("hi")) == "HI"  # type: ignore[arg-type]
        send.close()


@pytest.mark.anyio
async def test_full_inbox_answers_busy_at_once() -> None:
    send, receive = anyio.create_memory_object_stream[Echo | Explode](1)
    reply_send, reply_receive = anyio.create_memory_object_stream[str](1)
    send.send_nowait(Echo(text="queued", reply=reply_send))
    with pytest.raises(ActorBusy):
        await ask(send, echo("one too many"))  # type: ignore[arg-type]
    for stream in (send, receive, reply_send, reply_receive):
        stream.close()


@pytest.mark.anyio
async def test_messages_left_in_the_inbox_are_answered_with_actor_stopped() -> None:
    actor = EchoActor()  # gate closed: the first message blocks the actor
    send, receive = anyio.create_memory_object_stream[Echo | Explode](4)
    outcomes: list[str] = []

    async def asker(text: str) -> None:
        try:
            outcomes.append(await ask(send, echo(text)))  # type: ignore[arg-type]
        except ActorStopped:
            outcomes.append("stopped")

    async with anyio.create_task_group() as askers, anyio.create_task_group() as actor_group:
        await actor_group.start(actor.run, receive)
        for text in ("a", "b", "c"):
            askers.start_soon(asker, text)
        await anyio.wait_all_tasks_blocked()  # "a" is in the handler, "b" and "c" queued
        actor_group.cancel_scope.cancel()
    assert sorted(outcomes) == ["stopped", "stopped", "stopped"]
    send.close()


@pytest.mark.anyio
async def test_ask_after_the_actor_ended_raises_actor_stopped() -> None:
    send, receive = anyio.create_memory_object_stream[Echo | Explode](4)
    receive.close()
    with pytest.raises(ActorStopped):
        await ask(send, echo("late"))  # type: ignore[arg-type]
    send.close()


@pytest.mark.anyio
async def test_a_handler_fault_fails_that_message_only(span_exporter: InMemorySpanExporter) -> None:
    send, receive = anyio.create_memory_object_stream[Echo | Explode](4)
    actor, faults = EchoActor(), FaultCounter()
    actor.gate.set()
    async with anyio.create_task_group() as task_group:
        await task_group.start(partial(actor.run, faults=faults), receive)
        with send:
            answer: str = await ask(send, lambda reply: Explode(reply=reply))
            await send.send(Explode())  # a tell that fails: nobody to answer, the actor goes on
            after: str = await ask(send, lambda reply: Echo(text="still serving", reply=reply))
    assert answer == "echo failed: RuntimeError"
    assert after == "STILL SERVING"
    assert faults.by_actor() == {"echo": 2}
    failed = [span for span in span_exporter.get_finished_spans() if span.name == "echo.Explode"]
    assert len(failed) == 2 and all(span.status.status_code is StatusCode.ERROR for span in failed)


@pytest.mark.anyio
async def test_a_broken_invariant_stops_the_actor_loudly() -> None:
    send, receive = anyio.create_memory_object_stream[Echo | Explode](4)
    with pytest.raises(ExceptionGroup) as group:
        async with anyio.create_task_group() as task_group:
            await task_group.start(partial(EchoActor().run, faults=FaultCounter()), receive)
            await send.send(Explode(broken_invariant=True))
    assert group.group_contains(BrokenInvariant, match="cannot go on")
    send.close()


def test_messages_capture_the_current_trace_context(span_exporter: InMemorySpanExporter) -> None:
    with tracer().start_as_current_span("outer") as span:
        message = Explode()
    trace_id = format(span.get_span_context().trace_id, "032x")
    assert trace_id in message.trace["traceparent"]


class HeldResource:
    """A reply that holds something (as an admitted generation holds its event stream)."""

    def __init__(self) -> None:
        self.discarded = False

    def discard(self) -> None:
        self.discarded = True


def test_a_reply_nobody_received_is_discarded_and_other_values_are_left_alone() -> None:
    send, receive = anyio.create_memory_object_stream[object](1)
    with send, receive:
        held = HeldResource()
        send.send_nowait(held)
        discard_unreceived(receive)
        assert held.discarded
        send.send_nowait("plain")  # nothing to release
        discard_unreceived(receive)
        discard_unreceived(receive)  # an empty buffer


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.anyio
async def test_a_reply_handed_over_just_before_a_native_cancel_is_discarded(anyio_backend: str) -> None:
    """Quart cancels a request's handler with `Task.cancel()` when its client leaves. Landing after the actor handed
    the reply to the waiting asker but before the asker resumed, it must not lose the reply: a lease would never be
    given back, an admitted generation would run for nobody."""
    inbox_send, inbox_receive = anyio.create_memory_object_stream[Any](1)
    with inbox_send, inbox_receive:
        held = HeldResource()
        got: list[HeldResource] = []

        async def asker() -> None:
            got.append(await ask(inbox_send, lambda reply: reply))

        task = asyncio.ensure_future(asker())
        with anyio.fail_after(5):
            reply = await inbox_receive.receive()  # the actor's inbox: here the message is its reply stream
            while not reply.statistics().tasks_waiting_receive:
                await asyncio.sleep(0)  # until the asker waits for it
        with reply:
            reply.send_nowait(held)  # handed to the waiting receiver...
            task.cancel()  # ...and the client went away in the same turn of the loop
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not got and held.discarded
