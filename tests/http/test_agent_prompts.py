"""Agent-sized prompts through a real server, on the OpenAI APIs (issue 31, item 4; the Messages API's own are in
tests/http/anthropic/test_routes.py).

On the tiny random-weight llama with a 64K window (tests/support/agent_model.py), whose 60K-token prompt prefills in
a few seconds here: a prompt past the window is refused with `context_length_exceeded` in OpenAI's envelope before
it reaches the scheduler; a stream sends SSE comments while a long prompt prefills (chat, completions, the Responses
API), which the openai client skips (its stream iterators and `responses.stream()`); a client that gives up in the
middle of a prefill and sends the request again starts from what the first had prefilled, and an identical request
sent while the first still prefills starts from the first's state instead of prefilling beside it.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import httpx2
import openai
import pytest

from tests.support.agent_model import build_agent_model
from tests.support.server import RunningServer, serving

MODEL = "agent-model"
# Far below any prefill of LONG (0.2 s on an idle machine, over a second on a busy one), so comments come whatever
# the machine's speed.
KEEPALIVE_S = 0.01
KEEPALIVE = ": keep-alive"
LONG = "hello " * 20_000  # ~20K tokens: 0.2-1 s of prefill here, several keep-alives
LONGER = "hello " * 60_000  # what a client gives up on: several seconds of prefill
TOO_LONG = "hello " * 70_000  # past the 64K window
# Counters that move once a request reaches the scheduler.
SCHEDULER_COUNTERS = ("running", "waiting", "completed", "cancelled", "failed", "generated_tokens")


@pytest.fixture(scope="module")
def server(smollm2_dir: Path, cache_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    model_dir = build_agent_model(smollm2_dir, tmp_path_factory.mktemp("agent-model"))
    with serving(model_dir, cache_dir, MODEL, "--stream-keepalive", str(KEEPALIVE_S)) as running:
        yield running


def chat_body(system: str, user: str = LONG, *, stream: bool = True, **fields: Any) -> dict[str, Any]:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    return {"model": MODEL, "messages": messages, "max_tokens": 8, "stream": stream, **fields}


def fresh() -> str:
    """A system prompt no other test sends, so no test starts from another's cached state."""
    return f"You are test {uuid.uuid4().hex}."


def scheduler_counts(http: httpx.Client) -> dict[str, int]:
    scheduler = http.get("/health").json()["scheduler"]
    return {name: scheduler[name] for name in SCHEDULER_COUNTERS}


REFUSED = [  # streamed: a refusal comes before the stream begins, as an HTTP error
    ("/v1/chat/completions", chat_body(fresh(), TOO_LONG)),
    ("/v1/completions", {"model": MODEL, "prompt": TOO_LONG, "max_tokens": 8, "stream": True}),
    ("/v1/responses", {"model": MODEL, "input": TOO_LONG, "max_output_tokens": 8, "stream": True}),
]


@pytest.mark.parametrize(("path", "body"), REFUSED, ids=[path for path, _ in REFUSED])
def test_a_prompt_past_the_window_is_refused_in_openais_envelope_before_any_prefill(
    http: httpx.Client, path: str, body: dict[str, Any]
) -> None:
    before = scheduler_counts(http)
    reply = http.post(path, json=body)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "context_length_exceeded")
    assert "65536" in error["message"]  # the window it did not fit
    assert scheduler_counts(http) == before  # counted by the ingress: it never reached the batch


def sse_lines(response: httpx.Response) -> list[str]:
    return [line for line in response.iter_lines() if line]


def before_data(lines: list[str], count: int) -> list[str]:
    """The lines after the first `count` data lines and before the next one."""
    data = [index for index, line in enumerate(lines) if line.startswith("data: ")]
    return lines[data[count - 1] + 1 if count else 0 : data[count]]


def test_a_chat_stream_sends_comments_while_a_long_prompt_prefills(http: httpx.Client) -> None:
    with http.stream("POST", "/v1/chat/completions", json=chat_body(fresh())) as response:
        lines = sse_lines(response)
    silent = before_data(lines, 1)  # after the role chunk, before the first text
    assert silent and all(line == KEEPALIVE for line in silent), lines[:5]
    assert lines[-1] == "data: [DONE]"


def test_a_completions_stream_sends_comments_while_a_long_prompt_prefills(http: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": fresh() + LONG, "max_tokens": 8, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as response:
        lines = sse_lines(response)
    silent = before_data(lines, 0)
    assert silent and all(line == KEEPALIVE for line in silent), lines[:5]


def test_a_responses_stream_sends_comments_while_a_long_prompt_prefills(http: httpx.Client) -> None:
    body = {"model": MODEL, "instructions": fresh(), "input": LONG, "max_output_tokens": 8, "stream": True}
    with http.stream("POST", "/v1/responses", json=body) as response:
        lines = sse_lines(response)
    events = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    assert events[:2] == ["response.created", "response.in_progress"]
    in_progress = lines.index("event: response.in_progress")
    assert lines[in_progress + 2] == KEEPALIVE  # its `data:` line, then the comments until the first item


class RawTap(httpx2.BaseTransport):
    """The openai client's transport, keeping the raw bytes of every response it reads."""

    def __init__(self) -> None:
        self._inner = httpx2.HTTPTransport()
        self.raw = bytearray()

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        response = self._inner.handle_request(request)
        return httpx2.Response(
            response.status_code,
            headers=response.headers,
            stream=_Recorded(response.stream, self.raw),
            extensions=response.extensions,
        )

    def close(self) -> None:
        self._inner.close()


class _Recorded(httpx2.SyncByteStream):
    def __init__(self, inner: Any, raw: bytearray) -> None:
        self._inner = inner
        self._raw = raw

    def __iter__(self) -> Iterator[bytes]:
        for chunk in self._inner:
            self._raw += chunk
            yield chunk

    def close(self) -> None:
        self._inner.close()


@pytest.fixture
def tapped(server: RunningServer) -> Iterator[tuple[openai.OpenAI, RawTap]]:
    tap = RawTap()
    http_client = openai.DefaultHttpxClient(transport=tap, timeout=120)
    with openai.OpenAI(
        base_url=f"{server.base_url}/v1", api_key="none", max_retries=0, http_client=http_client
    ) as client:
        yield client, tap


def test_the_openai_client_skips_the_comments(tapped: tuple[openai.OpenAI, RawTap]) -> None:
    client, tap = tapped
    messages: Any = [{"role": "system", "content": fresh()}, {"role": "user", "content": LONG}]
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens > 20_000
    assert tap.raw.count(KEEPALIVE.encode()) >= 1
    tap.raw.clear()
    texts = list(client.completions.create(model=MODEL, prompt=fresh() + LONG, max_tokens=8, stream=True))
    assert texts[-1].choices[0].finish_reason in ("stop", "length")
    assert tap.raw.count(KEEPALIVE.encode()) >= 1
    tap.raw.clear()
    # responses.stream() refuses a stream that does not open with response.created or has a stray event: the
    # comments are neither. At temperature 1 the model ends its reply within a few tokens, so it completes.
    with client.responses.stream(model=MODEL, instructions=fresh(), input=LONG, max_output_tokens=200) as events:
        final = events.get_final_response()
    assert final.status == "completed"
    assert tap.raw.count(KEEPALIVE.encode()) >= 1


def wait_for_keepalives(lines: Iterator[str], count: int) -> None:
    """Read a stream's lines until `count` keep-alives came (the prompt is prefilling), then stop reading (or until
    it ends: a fast machine may prefill it all first, and what the test checks holds either way)."""
    seen = 0
    for line in lines:
        seen += line == KEEPALIVE
        if seen == count:
            return


def cached(usage: dict[str, Any]) -> int:
    return int(usage["prompt_tokens_details"]["cached_tokens"])


def test_a_resend_after_the_client_gave_up_mid_prefill_starts_from_what_was_prefilled(
    server: RunningServer, http: httpx.Client
) -> None:
    body = chat_body(fresh(), LONGER)
    with (
        httpx.Client(base_url=server.base_url, timeout=120) as giving_up,
        giving_up.stream("POST", "/v1/chat/completions", json=body) as response,
    ):
        wait_for_keepalives(response.iter_lines(), round(0.6 / KEEPALIVE_S))  # 0.6 s of prefill
    # Leaving it unread closed the connection: the server cancels the generation at its next step.
    again = http.post("/v1/chat/completions", json={**body, "stream": False}).json()["usage"]
    assert cached(again) >= 512  # at least one prefill chunk of the first was kept, and read from the store


def test_an_identical_request_sent_while_the_first_prefills_starts_from_its_state(
    server: RunningServer, http: httpx.Client
) -> None:
    body = chat_body(fresh(), LONGER, stream_options={"include_usage": True})
    second: dict[str, Any] = {}

    def send_again() -> None:
        with httpx.Client(base_url=server.base_url, timeout=120) as other:
            second.update(other.post("/v1/chat/completions", json={**body, "stream": False}).json()["usage"])

    sender = threading.Thread(target=send_again)
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        lines = response.iter_lines()
        wait_for_keepalives(lines, round(0.4 / KEEPALIVE_S))  # 0.4 s of prefill
        sender.start()
        last = [line for line in lines if line.startswith("data: {")][-1]
    sender.join()
    first = httpx.Response(200, content=last.removeprefix("data: ")).json()["usage"]
    assert cached(first) == 0
    assert cached(second) == second["prompt_tokens"] - 1  # the first's state at the end of its prompt
