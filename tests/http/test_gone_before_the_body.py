"""A streamed request whose client leaves while the response's headers or first chunk are being written: Quart
cancels it there, before the body generator reads any event (or before it starts), so only the request's end can
close the generation's events (`http/model_leases.py`). Closed, the scheduler sees the request abandoned and takes
it out of the batch; left open, it would generate up to its limit for nobody.

The real application (`create_app`: every ASGI layer Courier serves) driven in-process, with an ingress answered
here that keeps the scheduler's end of each admitted generation's events.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import anyio
import orjson
import pytest
from anyio.streams.memory import MemoryObjectSendStream

from courier.http.app import create_app
from courier.messages.ingress import AdmitGeneration, Admitted
from tests.support.app import ready_context

MODEL = "m"
BODIES = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 50},
    "/v1/completions": {"prompt": "hi", "max_tokens": 50},
    "/v1/messages": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 50},
    "/v1/responses": {"input": "hi", "max_output_tokens": 50, "store": False},
}


async def open_after_leaving(path: str, leaves_during: str) -> int:
    """How many readers the admitted generation's events still have once the request has ended (0: closed)."""
    kept: list[MemoryObjectSendStream[Any]] = []
    body = orjson.dumps({"model": MODEL, "stream": True, **BODIES[path]})
    with ready_context(MODEL) as base:
        ingress_send, ingress_receive = anyio.create_memory_object_stream[Any](4)
        context = replace(base, outboxes=replace(base.outboxes, ingress=ingress_send))
        app = create_app(context)
        gone = anyio.Event()

        async def ingress() -> None:
            async for message in ingress_receive:
                assert isinstance(message, AdmitGeneration)
                send, receive = anyio.create_memory_object_stream[Any](100)
                kept.append(send)
                with message.reply:
                    await message.reply.send(
                        Admitted(request_id=message.request_id, prompt_tokens=3, max_tokens=50, events=receive)
                    )

        requested = False

        async def receive() -> dict[str, Any]:
            nonlocal requested
            if not requested:
                requested = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == leaves_during and not gone.is_set():
                gone.set()  # the client closed: writing to its closing transport yields, and Quart cancels there
                await anyio.sleep_forever()

        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "query_string": b"",
            "root_path": "",
            "headers": [(b"content-type", b"application/json"), (b"host", b"test")],
            "client": ("127.0.0.1", 1),
            "server": ("127.0.0.1", 2),
        }
        with ingress_send, ingress_receive:
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(ingress)
                with anyio.fail_after(10):
                    await app(scope, receive, send)
                tasks.cancel_scope.cancel()
    assert len(kept) == 1, "admitted once"
    with kept[0]:
        return kept[0].statistics().open_receive_streams


@pytest.mark.anyio
@pytest.mark.parametrize("path", list(BODIES))
@pytest.mark.parametrize("leaves_during", ["http.response.start", "http.response.body"])
async def test_a_client_gone_while_the_first_bytes_are_written_leaves_no_generation_running(
    path: str, leaves_during: str
) -> None:
    assert await open_after_leaving(path, leaves_during) == 0
