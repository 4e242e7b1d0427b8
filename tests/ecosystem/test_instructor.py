"""Ecosystem contract: instructor against a real `courier serve` on the embedded SmolLM2.

instructor's default mode (`Mode.TOOLS`) offers the response model as one function and names it in `tool_choice`
(with `parallel_tool_calls` left to its default, true), then reads the reply's first call; a reply of several calls,
or one cut by the token limit, fails it. OpenAI answers a named choice with exactly one call, and so must Courier,
in generic mode (SmolLM2's template has no tools) as in a native format. `Mode.TOOLS_STRICT` is a deprecated alias
of `TOOLS` in instructor 1.17 (the same request); `Mode.JSON_SCHEMA` sends a `json_schema` response format;
`Mode.RESPONSES_TOOLS` names the function on the Responses API.

The model's end of sequence token is held back (`logit_bias` -100) so that only the grammar can end the reply: a
grammar that let a named function be called again would be caught, never hidden by a model that happened to stop.
Values are the model's; the assertions are on shapes and on how many calls came back. Every request and answer is
recorded, and a failure shows them with the server log.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import openai
import pytest
from pydantic import BaseModel

from tests.support.server import RunningServer

# scripts/dev.sh installs it without its dependencies' pins (see the dev extra in pyproject.toml); a plain
# `pip install -e '.[dev]'` has no instructor.
pytest.importorskip("instructor", reason="instructor is installed by ./dev test (pip install --no-deps instructor)")
import instructor

pytestmark = pytest.mark.real_model

MODEL = "SmolLM2-135M-Instruct"
END_OF_SEQUENCE = 2  # SmolLM2's <|im_end|>
HELD_BACK = {"logit_bias": {str(END_OF_SEQUENCE): -100}}
MAX_TOKENS = 96
LOG_TAIL_LINES = 40
MESSAGES: list[Any] = [{"role": "user", "content": "Paris is a city in which country? Name the city and the country."}]


class City(BaseModel):
    name: str
    country: str


class Exchanges:
    """The JSON bodies sent and answered, in order, for assertions and failure messages."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []
        self.answered: list[dict[str, Any]] = []

    # The openai client's transport is httpx2's (`openai.DefaultHttpxClient`): its requests and responses.
    def request(self, request: Any) -> None:
        self.sent.append(json.loads(request.read()))

    def response(self, response: Any) -> None:
        response.read()
        self.answered.append(response.json())

    def hooks(self) -> dict[str, list[Callable[[Any], None]]]:
        return {"request": [self.request], "response": [self.response]}

    def clear(self) -> None:
        self.sent.clear()
        self.answered.clear()


@pytest.fixture(scope="module")
def server(smollm2_server: RunningServer) -> RunningServer:
    return smollm2_server  # the session's shared default SmolLM2 server (tests/conftest.py)


@pytest.fixture(scope="module")
def exchanges() -> Exchanges:
    return Exchanges()


@pytest.fixture(scope="module")
def raw_client(server: RunningServer, exchanges: Exchanges) -> Iterator[openai.OpenAI]:
    with openai.DefaultHttpxClient(timeout=120, event_hooks=exchanges.hooks()) as http:
        yield openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, http_client=http)


def evidence(server: RunningServer, exchanges: Exchanges) -> str:
    log = "".join(server.lines[-LOG_TAIL_LINES:])
    return (
        f"\nsent: {json.dumps(exchanges.sent)[-2000:]}\nanswered: {json.dumps(exchanges.answered)[-2000:]}"
        f"\nserver log (last {LOG_TAIL_LINES} lines):\n{log}"
    )


def extract(client: instructor.Instructor, server: RunningServer, exchanges: Exchanges, **fields: Any) -> City:
    exchanges.clear()
    try:
        city = client.create(response_model=City, model=MODEL, temperature=0, max_retries=0, **fields)
    except Exception as error:
        raise AssertionError(f"{type(error).__name__}: {error}{evidence(server, exchanges)}") from error
    assert isinstance(city, City), f"{city!r}{evidence(server, exchanges)}"
    assert city.name.strip() and city.country.strip(), f"{city!r}{evidence(server, exchanges)}"
    assert len(exchanges.sent) == 1, evidence(server, exchanges)  # no retry, no reask
    return city


@pytest.mark.parametrize(
    "mode",
    [
        instructor.Mode.TOOLS,
        pytest.param(
            instructor.Mode.TOOLS_STRICT,
            marks=pytest.mark.filterwarnings("ignore:Mode.TOOLS_STRICT is deprecated:DeprecationWarning"),
        ),
    ],
    ids=["tools", "tools_strict"],
)
def test_a_named_tool_choice_gets_exactly_one_call(
    raw_client: openai.OpenAI, server: RunningServer, exchanges: Exchanges, mode: instructor.Mode
) -> None:
    client = instructor.from_openai(raw_client, mode=mode)
    extract(client, server, exchanges, messages=MESSAGES, max_tokens=MAX_TOKENS, extra_body=HELD_BACK)
    (sent,), (answered,) = exchanges.sent, exchanges.answered
    assert sent["tool_choice"] == {"type": "function", "function": {"name": "City"}}
    assert sent.get("parallel_tool_calls", True) is True  # instructor leaves it to the default
    choice = answered["choices"][0]
    assert choice["finish_reason"] == "tool_calls", evidence(server, exchanges)
    assert [call["function"]["name"] for call in choice["message"]["tool_calls"]] == ["City"]
    assert not choice["message"]["content"]


def test_json_schema_mode_gets_a_valid_object(
    raw_client: openai.OpenAI, server: RunningServer, exchanges: Exchanges
) -> None:
    client = instructor.from_openai(raw_client, mode=instructor.Mode.JSON_SCHEMA)
    extract(client, server, exchanges, messages=MESSAGES, max_tokens=MAX_TOKENS, extra_body=HELD_BACK)
    (sent,), (answered,) = exchanges.sent, exchanges.answered
    assert sent["response_format"]["type"] == "json_schema"
    choice = answered["choices"][0]
    assert choice["finish_reason"] == "stop", evidence(server, exchanges)
    assert set(json.loads(choice["message"]["content"])) == {"name", "country"}


def test_responses_tools_mode_gets_exactly_one_function_call(
    raw_client: openai.OpenAI, server: RunningServer, exchanges: Exchanges
) -> None:
    client = instructor.from_openai(raw_client, mode=instructor.Mode.RESPONSES_TOOLS)
    extract(client, server, exchanges, messages=MESSAGES, max_output_tokens=MAX_TOKENS, extra_body=HELD_BACK)
    (sent,), (answered,) = exchanges.sent, exchanges.answered
    assert sent["tool_choice"] == {"type": "function", "name": "City"}
    assert answered["status"] == "completed", evidence(server, exchanges)
    assert [(item["type"], item.get("name")) for item in answered["output"]] == [("function_call", "City")]
