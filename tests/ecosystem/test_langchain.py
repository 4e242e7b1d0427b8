"""Ecosystem contract: LangChain's `ChatOpenAI` against a real `courier serve` on the embedded SmolLM2.

SmolLM2's chat template has no tool support, so tool calls go through Courier's generic mode (tools described in
the system prompt, calls written as grammar-constrained `<tool_call>` JSON); structured output goes through
constrained decoding. Values are the model's; the assertions are on shapes and types, which the grammars guarantee.
Every request LangChain sends is recorded, and a failure shows the last one with the server log.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, SecretStr

from tests.support.lazy_modules import lazily
from tests.support.server import RunningServer

# LangChain (langchain-core, langsmith, langchain-openai: ~1.3 s of CPU) is imported by the worker that runs these
# tests, not by every worker as it collects them (tests/support/lazy_modules.py).
if TYPE_CHECKING:
    import langchain_openai
    from langchain_core import messages, tools
    from langchain_core.language_models import LanguageModelInput
    from langchain_core.runnables import Runnable
    from langchain_core.utils import function_calling
else:
    langchain_openai = lazily("langchain_openai")
    messages = lazily("langchain_core.messages")
    tools = lazily("langchain_core.tools")
    function_calling = lazily("langchain_core.utils.function_calling")

pytestmark = pytest.mark.real_model

MODEL = "SmolLM2-135M-Instruct"
ANSWER_TOKENS = 16  # where a free answer is cut
LOG_TAIL_LINES = 40

Output = TypeVar("Output")


class City(BaseModel):
    name: str
    country: str


CITY_SCHEMA: dict[str, Any] = {
    "title": "City",
    "description": "A city and the country it is in.",
    "type": "object",
    "properties": {"name": {"type": "string"}, "country": {"type": "string"}},
    "required": ["name", "country"],
}


def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    return f"It is sunny and 22 degrees Celsius in {city}."


def get_time(timezone: str) -> str:
    """Get the current local time in a timezone."""
    return f"It is 10:00 in {timezone}."


class Recorder:
    """The JSON bodies LangChain sent, for failure messages."""

    def __init__(self) -> None:
        self.bodies: list[str] = []

    def __call__(self, request: httpx.Request) -> None:
        self.bodies.append(request.read().decode(errors="replace"))


@pytest.fixture(scope="module")
def server(smollm2_server: RunningServer) -> RunningServer:
    return smollm2_server  # the session's shared default SmolLM2 server (tests/conftest.py)


@pytest.fixture(scope="module")
def recorder() -> Recorder:
    return Recorder()


@pytest.fixture(scope="module")
def weather() -> tools.BaseTool:
    return tools.tool(get_weather)


@pytest.fixture(scope="module")
def clock() -> tools.BaseTool:
    return tools.tool(get_time)


@pytest.fixture(scope="module")
def chat(server: RunningServer, recorder: Recorder) -> Iterator[langchain_openai.ChatOpenAI]:
    with httpx.Client(timeout=120, event_hooks={"request": [recorder]}) as http_client:
        yield langchain_openai.ChatOpenAI(
            base_url=f"{server.base_url}/v1",
            api_key=SecretStr("unused"),
            model=MODEL,
            temperature=0,
            max_completion_tokens=96,
            max_retries=0,
            http_client=http_client,
        )


def evidence(server: RunningServer, recorder: Recorder) -> str:
    """The last request sent and the end of the server's log."""
    sent = recorder.bodies[-1] if recorder.bodies else "(nothing sent)"
    log = "".join(server.lines[-LOG_TAIL_LINES:])
    return f"\nlast request body:\n{sent}\nserver log (last {LOG_TAIL_LINES} lines):\n{log}"


def call(
    runnable: Runnable[LanguageModelInput, Output],
    prompt: LanguageModelInput,
    server: RunningServer,
    recorder: Recorder,
) -> Output:
    """`runnable.invoke(prompt)`, any error reported with the request and the server log."""
    try:
        return runnable.invoke(prompt)
    except Exception as error:
        raise AssertionError(f"{type(error).__name__}: {error}{evidence(server, recorder)}") from error


def last_body(recorder: Recorder) -> str:
    return recorder.bodies[-1]


def test_structured_output_json_schema(
    chat: langchain_openai.ChatOpenAI, server: RunningServer, recorder: Recorder
) -> None:
    structured = chat.with_structured_output(City, method="json_schema")
    city = call(structured, "Name a large city in Italy and its country.", server, recorder)
    assert isinstance(city, City), f"{city!r}{evidence(server, recorder)}"
    assert city.name.strip() and city.country.strip(), f"{city!r}{evidence(server, recorder)}"
    assert '"json_schema"' in last_body(recorder)


def test_structured_output_json_mode(
    chat: langchain_openai.ChatOpenAI, server: RunningServer, recorder: Recorder
) -> None:
    structured = chat.with_structured_output(CITY_SCHEMA, method="json_mode")
    prompt: list[messages.BaseMessage] = [
        messages.SystemMessage('Reply only with a JSON object of the form {"name": "<city>", "country": "<country>"}.'),
        messages.HumanMessage("Name a large city in Italy and its country, as JSON with the keys name and country."),
    ]
    city = call(structured, prompt, server, recorder)
    assert isinstance(city, dict), f"{city!r}{evidence(server, recorder)}"
    assert set(city) >= {"name", "country"}, f"{city!r}{evidence(server, recorder)}"
    assert isinstance(city["name"], str) and isinstance(city["country"], str), f"{city!r}"
    assert '"json_object"' in last_body(recorder)


@pytest.mark.parametrize("strict", [None, True], ids=["default", "strict"])
def test_structured_output_function_calling(
    chat: langchain_openai.ChatOpenAI, server: RunningServer, recorder: Recorder, strict: bool | None
) -> None:
    # LangChain forces the schema's function by name, one call; `strict` is only sent when set.
    structured = chat.with_structured_output(City, method="function_calling", strict=strict)
    city = call(structured, "Name a large city in Italy and its country.", server, recorder)
    assert isinstance(city, City), f"{city!r}{evidence(server, recorder)}"
    assert city.name.strip() and city.country.strip(), f"{city!r}{evidence(server, recorder)}"
    sent = last_body(recorder).replace(" ", "")
    assert '"tool_choice":{"type":"function","function":{"name":"City"}}' in sent
    assert '"parallel_tool_calls":false' in sent


def assert_calls(message: messages.AIMessage, tool_: tools.BaseTool, server: RunningServer, recorder: Recorder) -> None:
    """At least one call, each to `tool_` with arguments valid for its schema."""
    shown = f"{message!r}{evidence(server, recorder)}"
    assert isinstance(message, messages.AIMessage), shown
    assert message.tool_calls and not message.invalid_tool_calls, shown
    assert message.response_metadata.get("finish_reason") == "tool_calls", shown
    validator = jsonschema.Draft202012Validator(
        function_calling.convert_to_openai_tool(tool_)["function"]["parameters"]
    )
    for tool_call in message.tool_calls:
        assert tool_call["name"] == tool_.name, shown
        assert tool_call["id"], shown
        errors = [error.message for error in validator.iter_errors(tool_call["args"])]
        assert not errors, f"{tool_call['args']!r}: {errors}{shown}"


def test_bind_tools_any_forces_a_call_and_the_loop_completes(
    chat: langchain_openai.ChatOpenAI, server: RunningServer, recorder: Recorder, weather: tools.BaseTool
) -> None:
    question = messages.HumanMessage("What is the weather like in Paris today?")
    forced = chat.bind_tools([weather], tool_choice="any", parallel_tool_calls=False)
    message = call(forced, [question], server, recorder)
    assert '"tool_choice":"required"' in last_body(recorder).replace(" ", "")
    assert_calls(message, weather, server, recorder)
    assert len(message.tool_calls) == 1, f"{message!r}{evidence(server, recorder)}"

    (tool_call,) = message.tool_calls
    result = weather.invoke(tool_call["args"])
    assert isinstance(result, str)
    history: list[messages.BaseMessage] = [
        question,
        message,
        messages.ToolMessage(result, tool_call_id=tool_call["id"]),
    ]
    # The answer is cut a few tokens in (`length` passes): its free tokens cost the server most, and prove nothing more.
    answering = chat.bind_tools([weather], max_completion_tokens=ANSWER_TOKENS)
    answer = call(answering, history, server, recorder)
    sent = last_body(recorder).replace(" ", "")
    assert f'"max_completion_tokens":{ANSWER_TOKENS}' in sent, sent
    assert '"tool_calls":[{' in sent and '"role":"tool"' in sent and '"content":null' in sent, sent
    shown = f"{answer!r}{evidence(server, recorder)}"
    assert isinstance(answer, messages.AIMessage), shown
    assert isinstance(answer.content, str) and answer.content.strip(), shown
    assert not answer.tool_calls and not answer.invalid_tool_calls, shown
    assert answer.response_metadata.get("finish_reason") in ("stop", "length"), shown


@pytest.mark.parametrize("strict", [None, True], ids=["default", "strict"])
def test_bind_tools_named_tool_is_forced(
    chat: langchain_openai.ChatOpenAI,
    server: RunningServer,
    recorder: Recorder,
    weather: tools.BaseTool,
    clock: tools.BaseTool,
    strict: bool | None,
) -> None:
    # The question is about the time: only the forcing makes it a call to get_weather.
    forced = chat.bind_tools([clock, weather], tool_choice="get_weather", strict=strict)
    message = call(forced, [messages.HumanMessage("What time is it in Tokyo?")], server, recorder)
    assert '"tool_choice":{"type":"function","function":{"name":"get_weather"}}' in last_body(recorder).replace(" ", "")
    assert_calls(message, weather, server, recorder)
