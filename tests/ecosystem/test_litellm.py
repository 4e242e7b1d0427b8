"""Ecosystem contract: the LiteLLM Python SDK against a real `courier serve` on the embedded SmolLM2.

Courier is reached the way LiteLLM documents for any OpenAI-compatible server: the `openai/` provider prefix on
the served model name, `api_base` at Courier's `/v1` and a placeholder `api_key` (the `openai` provider insists on
one; Courier ignores it). `openai/` hands the request to the official openai client with OpenAI's parameters as
they are, and answers `litellm.responses` with a native call to `/v1/responses`. The vLLM-specific
`hosted_vllm/` prefix would rewrite requests for vLLM (it strips `strict` and `additionalProperties: false` from
tool schemas, which Courier honours), so it is not what a Courier user should pick.

SmolLM2's chat template has no tool support, so tool calls go through Courier's generic mode (grammar-constrained
`<tool_call>` JSON) and structured output through constrained decoding: values are the model's, the assertions
are on shapes, types and the consistency of the numbers, which the grammars and Courier guarantee. Every request
body LiteLLM sends is recorded through its `CustomLogger` hook, and a failure shows the last one with the server
log. LiteLLM is kept offline (its cost map and other catalogs come from the copies bundled with it; its SDK has
no telemetry to turn off, that belongs to its proxy): the CI machine reaches package registries only.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import jsonschema
import openai
import pytest
from openai.types.responses import ResponseOutputMessage, ResponseOutputText
from pydantic import BaseModel

from tests.support.server import RunningServer

# Before LiteLLM is loaded: it would otherwise fetch its model cost map from the internet at import.
os.environ["LITELLM_OFFLINE_MODE"] = "true"  # every catalog and tokenizer LiteLLM fetches on its own
os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"  # the cost map, in LiteLLM releases before offline mode


# LiteLLM takes ~4 s to import, which every pytest-xdist worker would spend collecting this module (though only one
# runs it): it is imported when the module's first test starts (`imported_litellm`), and named here for the types.
if TYPE_CHECKING:
    import litellm

pytestmark = [
    pytest.mark.real_model,
    # LiteLLM's own modules, imported on first use, declare ReadOnly TypedDict items that pydantic warns about.
    pytest.mark.filterwarnings(r"ignore:Items? .* (is|are) using the `ReadOnly` qualifier:UserWarning"),
    # Its stream handler reads every attribute of a delta, `model_fields` too (deprecated on instances, pydantic 2.11).
    pytest.mark.filterwarnings(
        r"ignore:Accessing the 'model_\w+' attribute on the instance:pydantic.PydanticDeprecatedSince211"
    ),
]

SERVED = "SmolLM2-135M-Instruct"
MODEL = f"openai/{SERVED}"
MAX_TOKENS = 48  # a tool call or a City object ends well within it
# A free answer is cut here, a few tokens in: more would prove nothing more, and each free token costs the server
# what a whole grammar-led call does.
ANSWER_TOKENS = 16  # the least `max_output_tokens` the Responses API takes (OpenAI's minimum)
LOG_TAIL_LINES = 40


class City(BaseModel):
    name: str
    country: str


CITY_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "country": {"type": "string"}},
    "required": ["name", "country"],
    "additionalProperties": False,
}


def function_tool(name: str, description: str, argument: str) -> dict[str, Any]:
    parameters = {"type": "object", "properties": {argument: {"type": "string"}}, "required": [argument]}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


GET_WEATHER = function_tool("get_weather", "Get the current weather in a city.", "city")
GET_TIME = function_tool("get_time", "Get the current local time in a timezone.", "timezone")


def get_weather(city: str) -> str:
    return f"It is sunny and 22 degrees Celsius in {city}."


class Recorder:
    """The request bodies LiteLLM sent (its pre-call hook sees the complete body), for assertions and failures."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []

    def record(self, kwargs: dict[str, Any]) -> None:
        additional = kwargs.get("additional_args") or {}
        self.bodies.append(dict(additional.get("complete_input_dict") or {}))

    def last(self) -> dict[str, Any]:
        assert self.bodies, "LiteLLM sent nothing"
        return self.bodies[-1]


@pytest.fixture(scope="module")
def server(smollm2_server: RunningServer) -> RunningServer:
    return smollm2_server  # the session's shared default SmolLM2 server (tests/conftest.py)


@pytest.fixture(scope="module", autouse=True)
def imported_litellm() -> None:
    global litellm
    import litellm


@pytest.fixture(scope="module")
def recorder() -> Iterator[Recorder]:
    recording = Recorder()

    class Hook(litellm.integrations.custom_logger.CustomLogger):  # type: ignore[misc]
        def log_pre_api_call(self, model: str, messages: Any, kwargs: dict[str, Any]) -> None:
            recording.record(kwargs)

    saved = litellm.callbacks, litellm.suppress_debug_info
    litellm.callbacks = [*litellm.callbacks, Hook()]
    litellm.suppress_debug_info = True  # no "Give Feedback / Get Help" banner printed with each error
    yield recording
    litellm.callbacks, litellm.suppress_debug_info = saved


@pytest.fixture(scope="module", autouse=True)
def main_thread_loop() -> Iterator[None]:
    """An event loop for LiteLLM's blocking calls, closed when the module ends.

    A blocking call hands its service hooks to `asyncio.get_event_loop()`, which in a main thread without a loop
    makes one that nothing closes: garbage later, it is an unclosed-loop ResourceWarning in whatever runs then.
    """
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    yield
    asyncio.set_event_loop(None)
    loop.close()


def connection(server: RunningServer) -> dict[str, Any]:
    """What a user passes to point LiteLLM at Courier."""
    return {"api_base": f"{server.base_url}/v1", "api_key": "unused", "timeout": 120, "max_retries": 0}


def chat_arguments(server: RunningServer, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "temperature": 0, "max_completion_tokens": MAX_TOKENS, **connection(server), **extra}


def evidence(server: RunningServer, recorder: Recorder) -> str:
    """The last request sent and the end of the server's log."""
    sent = json.dumps(recorder.bodies[-1], default=str) if recorder.bodies else "(nothing sent)"
    log = "".join(server.lines[-LOG_TAIL_LINES:])
    return f"\nlast request body:\n{sent}\nserver log (last {LOG_TAIL_LINES} lines):\n{log}"


def complete(server: RunningServer, recorder: Recorder, **arguments: Any) -> litellm.ModelResponse:
    """`litellm.completion` without streaming, any error reported with the request and the server log."""
    try:
        response = litellm.completion(**chat_arguments(server, **arguments))
    except Exception as error:
        raise AssertionError(f"{type(error).__name__}: {error}{evidence(server, recorder)}") from error
    assert isinstance(response, litellm.ModelResponse), f"{response!r}{evidence(server, recorder)}"
    return response


def only_choice(response: litellm.ModelResponse, shown: str) -> litellm.Choices:
    assert len(response.choices) == 1, shown
    (choice,) = response.choices
    assert isinstance(choice, litellm.Choices), shown
    return choice


def assert_usage(usage: Any, finish_reason: str | None, shown: str, limit: int = MAX_TOKENS) -> tuple[int, int]:
    """Courier's counts, as LiteLLM reports them: positive, summed, and the cut at `limit` exact."""
    assert isinstance(usage, litellm.Usage), shown
    prompt, completion, total = usage.prompt_tokens, usage.completion_tokens, usage.total_tokens
    assert all(isinstance(count, int) for count in (prompt, completion, total)), shown
    assert prompt > 0 and 0 < completion <= limit and total == prompt + completion, shown
    if finish_reason == "length":
        assert completion == limit, shown
    return prompt, completion


QUESTION = [{"role": "user", "content": "Name a large city in Italy."}]


def test_completion(server: RunningServer, recorder: Recorder) -> None:
    response = complete(server, recorder, messages=QUESTION, max_completion_tokens=ANSWER_TOKENS)
    shown = f"{response!r}{evidence(server, recorder)}"
    choice = only_choice(response, shown)
    assert choice.message.role == "assistant", shown
    assert isinstance(choice.message.content, str) and choice.message.content.strip(), shown
    assert not choice.message.tool_calls, shown
    assert choice.finish_reason in ("stop", "length"), shown
    assert isinstance(response.id, str) and response.id, shown
    assert response.model == SERVED, shown
    assert_usage(response.usage, choice.finish_reason, shown, ANSWER_TOKENS)
    sent = recorder.last()
    assert sent["model"] == SERVED and sent["messages"] == QUESTION, sent


@pytest.mark.anyio
async def test_streamed_completion_assembles(server: RunningServer, recorder: Recorder) -> None:
    plain = complete(server, recorder, messages=QUESTION, max_completion_tokens=ANSWER_TOKENS)
    try:
        stream = await litellm.acompletion(
            **chat_arguments(
                server,
                messages=QUESTION,
                max_completion_tokens=ANSWER_TOKENS,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        assert isinstance(stream, litellm.CustomStreamWrapper), f"{stream!r}"
        chunks = [chunk async for chunk in stream]
    except Exception as error:
        raise AssertionError(f"{type(error).__name__}: {error}{evidence(server, recorder)}") from error
    shown = f"{chunks!r}{evidence(server, recorder)}"
    assert recorder.last()["stream"] is True, shown
    deltas = [chunk.choices[0].delta.content for chunk in chunks if chunk.choices and chunk.choices[0].delta.content]
    assert len(deltas) > 1, shown
    assembled = litellm.stream_chunk_builder(chunks, messages=QUESTION)
    assert isinstance(assembled, litellm.ModelResponse), shown
    choice = only_choice(assembled, shown)
    assert choice.message.content == "".join(deltas), shown
    assert choice.finish_reason in ("stop", "length"), shown
    prompt, _ = assert_usage(assembled.usage, choice.finish_reason, shown, ANSWER_TOKENS)
    # Courier's count for the same prompt, not an estimate LiteLLM made with a tokenizer of its own.
    assert isinstance(plain.usage, litellm.Usage)
    assert prompt == plain.usage.prompt_tokens, f"{plain.usage!r}{shown}"


def tool_calls(message: litellm.Message, name: str, shown: str) -> list[Any]:
    """At least one call, each to `name`, with an id and arguments valid for the function's parameters."""
    calls = message.tool_calls
    assert calls, shown
    validator = jsonschema.Draft202012Validator(GET_WEATHER["function"]["parameters"])
    for call in calls:
        assert call.type == "function" and call.function.name == name, shown
        assert isinstance(call.id, str) and call.id, shown
        arguments = json.loads(call.function.arguments)
        errors = [error.message for error in validator.iter_errors(arguments)]
        assert not errors, f"{arguments!r}: {errors}{shown}"
    return list(calls)


def test_named_tool_choice_forces_the_call(server: RunningServer, recorder: Recorder) -> None:
    # The question is about the time: only the forcing makes it a call to get_weather.
    named = {"type": "function", "function": {"name": "get_weather"}}
    question = [{"role": "user", "content": "What time is it in Tokyo?"}]
    response = complete(server, recorder, messages=question, tools=[GET_TIME, GET_WEATHER], tool_choice=named)
    shown = f"{response!r}{evidence(server, recorder)}"
    assert recorder.last()["tool_choice"] == named, shown
    choice = only_choice(response, shown)
    assert choice.finish_reason == "tool_calls", shown
    tool_calls(choice.message, "get_weather", shown)
    assert_usage(response.usage, choice.finish_reason, shown)


def test_tool_result_round_trip(server: RunningServer, recorder: Recorder) -> None:
    messages: list[Any] = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    response = complete(
        server, recorder, messages=messages, tools=[GET_WEATHER], tool_choice="required", parallel_tool_calls=False
    )
    shown = f"{response!r}{evidence(server, recorder)}"
    choice = only_choice(response, shown)
    assert choice.finish_reason == "tool_calls", shown
    (call,) = tool_calls(choice.message, "get_weather", shown)

    # As LiteLLM's function-calling guide does it: the assistant message as returned, then the tool's result.
    result = get_weather(**json.loads(call.function.arguments))
    messages += [choice.message, {"role": "tool", "tool_call_id": call.id, "name": "get_weather", "content": result}]
    answer = complete(server, recorder, messages=messages, tools=[GET_WEATHER], max_completion_tokens=ANSWER_TOKENS)
    shown = f"{answer!r}{evidence(server, recorder)}"
    sent = recorder.last()["messages"]
    assert [message["role"] for message in sent] == ["user", "assistant", "tool"], shown
    assert sent[1]["tool_calls"][0]["id"] == call.id and sent[2]["tool_call_id"] == call.id, shown
    final = only_choice(answer, shown)
    assert isinstance(final.message.content, str) and final.message.content.strip(), shown
    assert not final.message.tool_calls, shown
    assert final.finish_reason in ("stop", "length"), shown
    assert_usage(answer.usage, final.finish_reason, shown, ANSWER_TOKENS)


JSON_SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "City", "schema": CITY_SCHEMA, "strict": True}}


@pytest.mark.parametrize("response_format", [JSON_SCHEMA_FORMAT, City], ids=["dict", "pydantic"])
def test_structured_output_json_schema(server: RunningServer, recorder: Recorder, response_format: Any) -> None:
    question = [{"role": "user", "content": "Name a large city in Italy and its country."}]
    response = complete(server, recorder, messages=question, response_format=response_format)
    shown = f"{response!r}{evidence(server, recorder)}"
    sent = recorder.last()["response_format"]
    assert sent["type"] == "json_schema" and sent["json_schema"]["name"] == "City", shown
    choice = only_choice(response, shown)
    assert choice.finish_reason == "stop", shown
    assert isinstance(choice.message.content, str), shown
    city = json.loads(choice.message.content)
    jsonschema.validate(city, CITY_SCHEMA)
    assert city["name"].strip() and city["country"].strip(), shown
    assert_usage(response.usage, choice.finish_reason, shown)


def test_courier_refusal_is_a_bad_request_error(server: RunningServer, recorder: Recorder) -> None:
    with pytest.raises(litellm.exceptions.BadRequestError) as refused:
        litellm.completion(**chat_arguments(server, messages=QUESTION, presence_penalty=9))
    shown = f"{refused.value!r}{evidence(server, recorder)}"
    # Courier's refusal, not LiteLLM's: the parameter was sent, and the message is Courier's.
    assert recorder.last()["presence_penalty"] == 9, shown
    assert refused.value.status_code == 400, shown
    assert refused.value.llm_provider == "openai", shown
    assert isinstance(refused.value, openai.BadRequestError), shown  # what code written for the openai SDK catches
    assert "'presence_penalty' must be in [-2, 2]" in str(refused.value), shown


def test_responses_api(server: RunningServer, recorder: Recorder) -> None:
    try:
        response = litellm.responses(
            model=MODEL,
            input="Name a large city in Italy.",
            temperature=0,
            max_output_tokens=ANSWER_TOKENS,
            **connection(server),
        )
    except Exception as error:
        raise AssertionError(f"{type(error).__name__}: {error}{evidence(server, recorder)}") from error
    shown = f"{response!r}{evidence(server, recorder)}"
    # A native Responses call to /v1/responses, not one LiteLLM bridged to chat completions.
    sent = recorder.last()
    assert sent["input"] == "Name a large city in Italy." and "messages" not in sent, shown
    assert isinstance(response, litellm.types.llms.openai.ResponsesAPIResponse), shown
    assert response.status in ("completed", "incomplete"), shown
    assert isinstance(response.id, str) and response.id, shown
    assert len(response.output) == 1, shown
    (message,) = response.output
    assert isinstance(message, ResponseOutputMessage) and message.role == "assistant", shown
    texts = [part.text for part in message.content if isinstance(part, ResponseOutputText)]
    assert len(texts) == 1 and texts[0].strip(), shown
    usage = response.usage
    assert usage is not None, shown
    assert usage.input_tokens > 0 and 0 < usage.output_tokens <= ANSWER_TOKENS, shown
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens, shown
    if response.status == "incomplete":
        assert usage.output_tokens == ANSWER_TOKENS, shown
