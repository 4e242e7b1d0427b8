"""A huge prompt under the body limit is refused by its size, before it is tokenized, and holds up no one.

It used to be tokenized whole before the context check, one message at a time, and
kept a two-token request behind it waiting for tens of seconds.
"""

from __future__ import annotations

import threading

import httpx
import pytest

from tests.support.server import TINY_MODEL, RunningServer

MODEL = TINY_MODEL
HUGE = "All work and no play makes a dull model. " * (12 * 1024 * 1024 // 41)  # 12 MiB, under the 32 MiB body limit


@pytest.fixture(scope="module")
def server(tiny_server: RunningServer) -> RunningServer:
    return tiny_server  # the session's shared default server (tests/conftest.py)


def test_a_small_request_is_answered_while_a_huge_one_is_refused(server: RunningServer) -> None:
    huge_replies: list[httpx.Response] = []

    def send_huge() -> None:
        with server.http() as client:
            body = {"model": MODEL, "messages": [{"role": "user", "content": HUGE}], "max_tokens": 2}
            huge_replies.append(client.post("/v1/chat/completions", json=body, timeout=120))

    sender = threading.Thread(target=send_huge)
    sender.start()
    with server.http() as client:
        small = client.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
        )
    sender.join()
    assert small.status_code == 200, small.text[:300]
    (huge,) = huge_replies
    assert huge.status_code == 400
    error = huge.json()["error"]
    assert (error["code"], error["param"]) == ("context_length_exceeded", "messages")
    assert "bytes" in error["message"]  # refused by its size, not after tokenizing it


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"model": MODEL, "prompt": HUGE, "max_tokens": 2}),
        ("/v1/responses", {"model": MODEL, "input": HUGE, "max_output_tokens": 2}),
        ("/v1/responses/input_tokens", {"model": MODEL, "input": HUGE}),
        ("/tokenize", {"model": MODEL, "prompt": HUGE}),
    ],
)
def test_every_route_that_tokenizes_refuses_a_huge_input_by_size(
    server: RunningServer, path: str, body: dict[str, object]
) -> None:
    with server.http() as client:
        reply = client.post(path, json=body, timeout=120)
        assert reply.status_code == 400, reply.text[:300]
        assert reply.json()["error"]["code"] == "context_length_exceeded"
        assert client.get("/health").json()["status"] == "ok"
