"""Ecosystem contract: smolagents' `ToolCallingAgent` against a real `courier serve` on the embedded SmolLM2.

smolagents reaches an OpenAI-compatible server through `OpenAIServerModel` (`api_base` at Courier's `/v1`); every
step of a `ToolCallingAgent` sends `tool_choice: "required"` with its stop strings, executes the calls of the reply
and, when the reply holds none, tries to read a call out of its text. So a reply that `max_tokens` cuts inside a
further call must keep the complete calls, be marked cut, and hold no text: a partial marker (`"\\n<tool"`) in the
content becomes the agent's "model output". smolagents runs offline here: it fetches nothing on its own.

SmolLM2's template has no tools (generic mode). For "Call get_weather for Paris." it writes one short call and, with
its end of sequence token held back (`logit_bias` -100), a second one: every token limit past the first call cuts
the second, at each of its pieces in turn.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import openai
import pytest

from tests.support.lazy_modules import lazily
from tests.support.server import RunningServer

if TYPE_CHECKING:
    import smolagents
else:
    smolagents = lazily("smolagents")  # imported by the worker that runs these tests (tests/support/lazy_modules.py)

pytestmark = pytest.mark.real_model

MODEL = "SmolLM2-135M-Instruct"
TASK = "Call get_weather for Paris."
HELD_BACK = {str(2): -100}  # SmolLM2's <|im_end|>
LOG_TAIL_LINES = 40


def get_weather(city: str) -> str:
    """Get the current weather in a city.

    Args:
        city: The city name.
    """
    return f"It is sunny in {city}."


def weather_tool() -> Any:
    return smolagents.tool(get_weather)  # smolagents reads its name, docstring and type hints


class Exchanges:
    """The JSON bodies sent and answered, in order."""

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


@pytest.fixture(scope="module")
def server(smollm2_server: RunningServer) -> RunningServer:
    return smollm2_server  # the session's shared default SmolLM2 server (tests/conftest.py)


@pytest.fixture
def exchanges() -> Exchanges:
    return Exchanges()


@pytest.fixture
def recorded(exchanges: Exchanges) -> Iterator[openai.DefaultHttpxClient]:
    with openai.DefaultHttpxClient(timeout=120, event_hooks=exchanges.hooks()) as client:
        yield client


def model(server: RunningServer, http: openai.DefaultHttpxClient, max_tokens: int) -> smolagents.OpenAIServerModel:
    return smolagents.OpenAIServerModel(
        model_id=MODEL,
        api_base=f"{server.base_url}/v1",
        api_key="unused",
        client_kwargs={"http_client": http, "max_retries": 0},
        temperature=0,
        max_tokens=max_tokens,
        logit_bias=HELD_BACK,
    )


def evidence(server: RunningServer, exchanges: Exchanges) -> str:
    log = "".join(server.lines[-LOG_TAIL_LINES:])
    return f"\nanswered: {json.dumps(exchanges.answered)[-2000:]}\nserver log (last {LOG_TAIL_LINES} lines):\n{log}"


@pytest.fixture(scope="module")
def first_step(server: RunningServer) -> tuple[dict[str, Any], int]:
    """What the agent's first step sends, and how many tokens its first call takes (the same request, allowed
    one call, less its end of sequence token)."""
    exchanges = Exchanges()
    with openai.DefaultHttpxClient(timeout=120, event_hooks=exchanges.hooks()) as http:
        smolagents.ToolCallingAgent(
            tools=[weather_tool()], model=model(server, http, 2), max_steps=1, verbosity_level=-1
        ).run(TASK)
    sent = exchanges.sent[0]
    assert sent["tool_choice"] == "required" and sent["stop"] == ["Observation:", "Calling tools:"]
    with openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0) as client:
        reply = client.chat.completions.create(**{**sent, "parallel_tool_calls": False, "max_tokens": 96})
    assert reply.choices[0].finish_reason == "tool_calls" and reply.usage is not None
    return sent, reply.usage.completion_tokens - 1


def test_a_step_cut_inside_a_further_call_keeps_its_calls_and_no_marker_text(
    server: RunningServer,
    recorded: openai.DefaultHttpxClient,
    exchanges: Exchanges,
    first_step: tuple[dict[str, Any], int],
) -> None:
    sent, one_call = first_step
    tools = list(smolagents.ToolCallingAgent(tools=[weather_tool()], model=model(server, recorded, 8)).tools.values())
    for max_tokens in range(one_call + 1, one_call + 5):  # the separator, then the second call's marker
        answered = len(exchanges.answered)
        message = model(server, recorded, max_tokens).generate(
            sent["messages"], stop_sequences=sent["stop"], tools_to_call_from=tools
        )
        (choice,) = exchanges.answered[answered]["choices"]
        shown = f"max_tokens {max_tokens}: {message!r}{evidence(server, exchanges)}"
        assert choice["finish_reason"] == "length", shown
        assert not message.content, shown
        assert [call.function.name for call in message.tool_calls or []] == ["get_weather"], shown


def test_the_agent_runs_the_complete_call_of_a_cut_step(
    server: RunningServer,
    recorded: openai.DefaultHttpxClient,
    exchanges: Exchanges,
    first_step: tuple[dict[str, Any], int],
) -> None:
    _, one_call = first_step
    agent = smolagents.ToolCallingAgent(
        tools=[weather_tool()], model=model(server, recorded, one_call + 3), max_steps=1, verbosity_level=-1
    )
    agent.run(TASK)
    step = agent.memory.steps[1]
    shown = f"{step!r}{evidence(server, exchanges)}"
    assert exchanges.answered[0]["choices"][0]["finish_reason"] == "length", shown
    assert not getattr(step, "model_output", None), shown  # no "\n<tool" as the model's output
    assert [call.name for call in getattr(step, "tool_calls", None) or []] == ["get_weather"], shown
    assert "It is sunny in Paris." in str(getattr(step, "observations", "")), shown
