"""opencode and the OpenAI Agents SDK against a real server: the set-ups of docs/agents.md, run as written.

Both speak OpenAI's API: opencode 1.18 chat completions through the AI SDK's OpenAI-compatible provider (the
`opencode.json` of docs/agents.md, `opencode run` once, non-interactively, offline), the Agents SDK 0.24 either the
Responses API (`OpenAIResponsesModel`) or chat completions (`OpenAIChatCompletionsModel`): a plain answer, a tool
call run and answered (`tool_choice: "required"`, the run ending on the tool's result), a second turn from the
first's items (and, on the Responses API, from `previous_response_id`), and a streamed run. The model is the tiny
64K-window llama of tests/support/agent_model.py (opencode's first prompt is ~7,700 tokens on SmolLM2's tokenizer:
its system prompt and 10 tools), behind an API key. `scripts/dev.sh test` installs opencode into .npm-agents/ where
npm is found; without it its test is skipped.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
from openai import AsyncOpenAI

from tests.support.agent_model import CONTEXT_LENGTH, build_agent_model
from tests.support.lazy_modules import lazily
from tests.support.npm_agents import agent_binary
from tests.support.server import RunningServer, serving

if TYPE_CHECKING:
    import agents
else:
    agents = lazily("agents")  # the Agents SDK: imported by the worker that runs these tests, not at collection

ROOT = Path(__file__).resolve().parents[2]
MODEL = "qwen3-coder"  # any id: opencode and the SDK name the one their configuration gives
API_KEY = "sk-agents-test"
RUN_TIMEOUT_S = 50
# opencode's switches for a machine that reaches nothing but the server: no models.dev catalogue (it falls back to
# the configuration's models), no update check, no LSP downloads, no sharing, no default plugins to install.
OPENCODE_OFFLINE = {
    "OPENCODE_DISABLE_MODELS_FETCH": "1",
    "OPENCODE_DISABLE_AUTOUPDATE": "1",
    "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
    "OPENCODE_DISABLE_SHARE": "1",
    "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1",
}
# Room for the model to end its reply: the SDK raises on a Responses turn cut by its limit (`response.incomplete`).
# Seeded: unseeded, about one reply in four is empty (the model's first token is its end), and the SDK streams no
# message item for an empty chat reply. Seed 0 starts both APIs' replies with text.
BRIEF = {"max_tokens": 200, "extra_body": {"seed": 0}}


@pytest.fixture(scope="module")
def server(smollm2_dir: Path, cache_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    model_dir = build_agent_model(smollm2_dir, tmp_path_factory.mktemp("agent-model"))
    with serving(model_dir, cache_dir, MODEL, "--api-key", API_KEY) as running:
        yield running


def completed(server: RunningServer) -> int:
    health = httpx.get(f"{server.base_url}/health").json()
    return int(health["scheduler"]["completed"])


def opencode_config(base_url: str) -> dict[str, Any]:
    """docs/agents.md's opencode.json."""
    return {
        "$schema": "https://opencode.ai/config.json",
        "provider": {
            "courier": {
                "npm": "@ai-sdk/openai-compatible",
                "name": "Courier",
                "options": {"baseURL": f"{base_url}/v1", "apiKey": API_KEY},
                "models": {MODEL: {"name": MODEL, "limit": {"context": CONTEXT_LENGTH, "output": 4096}}},
            }
        },
        "model": f"courier/{MODEL}",
        "small_model": f"courier/{MODEL}",
        "autoupdate": False,
        "share": "disabled",
    }


def test_opencode_runs_against_the_server(server: RunningServer, tmp_path: Path) -> None:
    opencode = agent_binary("opencode", "opencode-ai")
    work, home = tmp_path / "work", tmp_path / "home"
    work.mkdir()
    home.mkdir()
    (work / "opencode.json").write_text(json.dumps(opencode_config(server.base_url)))
    before = completed(server)
    run = subprocess.run(
        [str(opencode), "run", "--format", "json", "Say hello in one word."],
        check=False,
        cwd=work,
        env={"PATH": "/usr/bin:/bin", "HOME": str(home), **OPENCODE_OFFLINE},
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    assert run.returncode == 0, f"stdout: {run.stdout}\nstderr: {run.stderr}"
    events = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    finishes = [event["part"] for event in events if event["type"] == "step_finish"]
    assert finishes and finishes[-1]["reason"] == "stop", run.stdout
    assert finishes[-1]["tokens"]["input"] + finishes[-1]["tokens"]["cache"]["read"] > 1000  # its whole prompt
    assert completed(server) >= before + 2  # the session's title and the answer, both answered here


def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    return f"It is sunny in {city}."


@pytest.fixture
async def openai_client(server: RunningServer) -> AsyncIterator[AsyncOpenAI]:
    async with AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0) as client:
        yield client


MODELS = {"responses": "OpenAIResponsesModel", "chat": "OpenAIChatCompletionsModel"}  # the SDK's model classes


def no_tracing() -> agents.RunConfig:
    return agents.RunConfig(tracing_disabled=True)  # the SDK would export traces to OpenAI


def brief_agent(api: str, client: AsyncOpenAI) -> agents.Agent:
    model = getattr(agents, MODELS[api])(MODEL, client)
    settings = agents.ModelSettings(**BRIEF)
    return agents.Agent(name="brief", instructions="Answer in one word.", model=model, model_settings=settings)


@pytest.mark.anyio
@pytest.mark.parametrize("api", list(MODELS))
async def test_the_agents_sdk_runs_a_turn_a_tool_and_a_second_turn(openai_client: AsyncOpenAI, api: str) -> None:
    brief = brief_agent(api, openai_client)
    first = await agents.Runner.run(brief, "Say hello.", run_config=no_tracing())
    assert isinstance(first.final_output, str)
    second = await agents.Runner.run(
        brief, [*first.to_input_list(), {"role": "user", "content": "Again."}], run_config=no_tracing()
    )
    assert isinstance(second.final_output, str)
    if api == "responses":  # stored by default: the next turn may name the last response instead
        chained = await agents.Runner.run(
            brief, "Again.", previous_response_id=first.last_response_id, run_config=no_tracing()
        )
        assert isinstance(chained.final_output, str)
    weather = agents.Agent(
        name="weather",
        instructions="Use the tool.",
        model=brief.model,
        tools=[agents.function_tool(get_weather)],
        model_settings=agents.ModelSettings(tool_choice="required", max_tokens=64),
        tool_use_behavior="stop_on_first_tool",  # the tool's result is the answer: no loop on a random model
    )
    called = await agents.Runner.run(weather, "What is the weather in Paris?", run_config=no_tracing())
    assert str(called.final_output).startswith("It is sunny in ")
    assert [item.type for item in called.new_items] == ["tool_call_item", "tool_call_output_item"]


@pytest.mark.anyio
@pytest.mark.parametrize("api", list(MODELS))
async def test_the_agents_sdk_streams_a_run(openai_client: AsyncOpenAI, api: str) -> None:
    streamed = agents.Runner.run_streamed(brief_agent(api, openai_client), "Say hello.", run_config=no_tracing())
    kinds = {event.type async for event in streamed.stream_events()}
    assert {"raw_response_event", "run_item_stream_event"} <= kinds
    assert isinstance(streamed.final_output, str)
