"""An operator's `POST /v1/models/{id}/load` (or `/unload`) waits at most `--request-timeout` for the registry: then a
504 says the work goes on, rather than a request held for as long as a download or a conversion takes.

In-process: the app with a registry inbox nobody answers (a load that has not finished).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import anyio
import pytest

from courier.http.app import create_quart_app
from courier.settings import Settings
from tests.support.app import ready_context


@pytest.mark.anyio
@pytest.mark.parametrize("action", ["load", "unload"])
async def test_a_load_or_unload_by_hand_that_takes_too_long_is_a_504_and_goes_on(action: str) -> None:
    settings = replace(Settings(), request_timeout=0.2)
    registry, unanswered = anyio.create_memory_object_stream[Any](4)
    with registry, unanswered, ready_context("m", settings) as base:
        client = create_quart_app(replace(base, registry=registry)).test_client()
        with anyio.fail_after(10):
            reply = await client.post(f"/v1/models/m/{action}")
        body = await reply.get_json()
        assert reply.status_code == 504, body
        assert (body["error"]["code"], body["error"]["param"]) == ("deadline_exceeded", "model")
        assert "goes on" in body["error"]["message"]
        assert unanswered.statistics().current_buffer_used == 1  # the registry was asked, and will carry it out
        unanswered.receive_nowait().reply.close()
