"""Codex's Responses dialect through the real server (a tiny llama) and the official openai client.

`namespace` tools offered under qualified names and called back under the API's (`name` + `namespace`); hosted
tools left out (a `tool_choice` forcing one is a 400); `custom` tools whose free-form input a Lark or a regex grammar
constrains, called back as `custom_tool_call` items and sent back with their outputs; `reasoning.summary` accepted
by a model that does not reason; a sealed reasoning item that this server did not seal, or that was altered,
refused; and the Responses WebSocket served. Reasoning summaries and the sealed round trip on a thinking model are
in test_reasoning.py; Codex's own requests and the real `codex` binary in test_codex.py.
"""

from __future__ import annotations

import re
import secrets
from typing import Any

import httpx
import openai
import pytest

from courier.conversation.sealed import ReasoningSeal
from tests.support.server import TINY_MODEL, RunningServer

MODEL = TINY_MODEL
NAMESPACE: dict[str, Any] = {
    "type": "namespace",
    "name": "multi_agent_v1",
    "description": "Tools for spawning and managing sub-agents.",
    "tools": [
        {
            "type": "function",
            "name": "close_agent",
            "description": "Close an agent.",
            "strict": False,
            "parameters": {
                "type": "object",
                "properties": {"target": {"type": "string", "enum": ["agent-1", "agent-2"]}},
                "required": ["target"],
                "additionalProperties": False,
            },
        }
    ],
}
LARK = 'start: "add " NUMBER " to " NAME\nNUMBER: /[0-9]{1,3}/\nNAME: /[a-z]{1,8}/\n'
LARK_MATCH = re.compile(r"add [0-9]{1,3} to [a-z]{1,8}")
# `[0-9]`, not `\d`: Rust's `\d` (the syntax of a custom tool's regex) takes digits of Unicode 16 that Python 3.11's
# `re` does not know (a sampled '\U0001ccf3' once failed this module's check), tests/grammar/test_constraint.py.
REGEX = r"[0-9]{3}-[A-Z]{2}/[a-z]{1,4}"
HOSTED: list[dict[str, Any]] = [
    {"type": "web_search", "external_web_access": False},
    {"type": "file_search", "vector_store_ids": ["vs_1"]},
    {"type": "code_interpreter", "container": {"type": "auto"}},
    {"type": "image_generation"},
    {"type": "computer_use_preview", "display_width": 1024, "display_height": 768, "environment": "linux"},
]


@pytest.fixture(scope="module")
def server(tiny_server: RunningServer) -> RunningServer:
    return tiny_server  # the session's shared default server (tests/conftest.py)


def custom(name: str, syntax: str, definition: str) -> dict[str, Any]:
    return {
        "type": "custom",
        "name": name,
        "description": "A free-form tool.",
        "format": {"type": "grammar", "syntax": syntax, "definition": definition},
    }


def test_a_namespaced_function_is_called_back_under_the_api_names(client: Any) -> None:
    response = client.responses.create(
        model=MODEL,
        input="Close the agent.",
        tools=[NAMESPACE],
        tool_choice={"type": "function", "name": "close_agent"},
        max_output_tokens=64,
        temperature=0,
    )
    (call,) = response.output
    assert call.type == "function_call"
    assert (call.name, call.namespace) == ("close_agent", "multi_agent_v1")
    assert call.arguments in ('{"target": "agent-1"}', '{"target": "agent-2"}')
    assert response.tools[0].type == "namespace"  # echoed as given
    sent_back = [
        {"role": "user", "content": "Close the agent."},
        call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": "closed"},
    ]
    after = client.responses.create(
        model=MODEL,
        input=sent_back,
        tools=[NAMESPACE],
        max_output_tokens=4,
        temperature=0,
    )
    assert after.status in ("completed", "incomplete")


def test_a_namespaced_call_renders_as_the_model_wrote_it(http: httpx.Client) -> None:
    """Sent back, a namespaced call is shown to the model under its qualified name: the count equals that of the
    same history written with the qualified name."""

    def count(call: dict[str, Any]) -> int:
        items = [call, {"type": "function_call_output", "call_id": "c1", "output": "closed"}]
        reply = http.post("/v1/responses/input_tokens", json={"model": MODEL, "input": items, "tools": [NAMESPACE]})
        assert reply.status_code == 200, reply.text
        return int(reply.json()["input_tokens"])

    call = {"type": "function_call", "call_id": "c1", "arguments": '{"target": "agent-1"}'}
    namespaced = count({**call, "name": "close_agent", "namespace": "multi_agent_v1"})
    assert namespaced == count({**call, "name": "multi_agent_v1.close_agent"})
    assert namespaced != count({**call, "name": "close_agent"})


def test_hosted_tools_are_not_offered_and_do_not_refuse_the_request(http: httpx.Client) -> None:
    function = {"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {}}}
    body = {"model": MODEL, "input": "What time is it?", "max_output_tokens": 4}
    with_hosted = http.post("/v1/responses", json={**body, "tools": [*HOSTED, function]})
    assert with_hosted.status_code == 200, with_hosted.text
    assert [tool["type"] for tool in with_hosted.json()["tools"]] == [*(t["type"] for t in HOSTED), "function"]
    only_hosted = http.post("/v1/responses", json={**body, "tools": HOSTED, "tool_choice": "auto"})
    assert only_hosted.status_code == 200, only_hosted.text

    def count(tools: list[dict[str, Any]]) -> int:
        reply = http.post("/v1/responses/input_tokens", json={**body, "tools": tools})
        return int(reply.json()["input_tokens"])

    assert count([*HOSTED, function]) == count([function])  # the model is offered the function alone
    assert count(HOSTED) == count([])


@pytest.mark.parametrize(
    "choice", [{"type": "web_search_preview"}, {"type": "file_search"}, {"type": "image_generation"}]
)
def test_forcing_a_hosted_tool_is_a_400(client: Any, choice: dict[str, str]) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(
            model=MODEL,
            input="Search.",
            tools=[{"type": "web_search"}, {"type": "file_search", "vector_store_ids": ["vs_1"]}],
            tool_choice=choice,
        )
    assert refused.value.param == "tool_choice"
    assert "does not run" in refused.value.message


def test_an_unknown_tool_type_is_still_refused(http: httpx.Client) -> None:
    body = {"model": MODEL, "input": "hi", "tools": [{"type": "teleporter"}]}
    reply = http.post("/v1/responses", json=body)
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "tools[0].type"


@pytest.mark.parametrize(("syntax", "definition", "match"), [("lark", LARK, LARK_MATCH), ("regex", REGEX, REGEX)])
def test_a_custom_tool_input_follows_its_grammar(
    client: Any, syntax: str, definition: str, match: re.Pattern[str] | str
) -> None:
    tool = custom("tally", syntax, definition)
    for seed in range(3):  # sampled: any text the model writes is one the grammar accepts
        response = client.responses.create(
            model=MODEL,
            input="Tally it.",
            tools=[tool],
            tool_choice={"type": "custom", "name": "tally"},
            max_output_tokens=96,
            extra_body={"seed": seed},
        )
        (call,) = response.output
        assert call.type == "custom_tool_call"
        assert call.name == "tally"
        assert re.fullmatch(match, call.input), call.input
    sent_back = [
        {"role": "user", "content": "Tally it."},
        {"type": "custom_tool_call", "call_id": call.call_id, "name": "tally", "input": call.input},
        {"type": "custom_tool_call_output", "call_id": call.call_id, "output": "done"},
    ]
    after = client.responses.create(model=MODEL, input=sent_back, tools=[tool], max_output_tokens=4)
    assert after.status in ("completed", "incomplete")


def test_a_custom_tool_call_streams_its_input(client: Any) -> None:
    with client.responses.stream(
        model=MODEL,
        input="Tally it.",
        tools=[custom("tally", "regex", REGEX)],
        tool_choice={"type": "custom", "name": "tally"},
        max_output_tokens=96,
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    (call,) = final.output
    assert call.type == "custom_tool_call"
    done = [event for event in events if event.type == "response.custom_tool_call_input.done"]
    assert [event.input for event in done] == [call.input]
    assert re.fullmatch(REGEX, call.input)


def test_custom_and_function_tools_together_in_a_namespace(client: Any) -> None:
    group = {**NAMESPACE, "tools": [*NAMESPACE["tools"], custom("note", "regex", "[a-z]{2,6}")]}
    response = client.responses.create(
        model=MODEL,
        input="Write a note.",
        tools=[group],
        tool_choice={"type": "custom", "name": "note"},
        max_output_tokens=64,
    )
    (call,) = response.output
    assert call.type == "custom_tool_call"
    assert (call.name, call.namespace) == ("note", "multi_agent_v1")
    assert re.fullmatch("[a-z]{2,6}", call.input)


def test_a_bad_custom_grammar_is_a_400(http: httpx.Client) -> None:
    body = {"model": MODEL, "input": "hi", "tools": [custom("broken", "lark", "start: undefined_rule\n")]}
    reply = http.post("/v1/responses", json=body)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == "tools"
    bad_syntax = {**body, "tools": [{**custom("x", "lark", "start: 'a'"), "format": {"type": "grammar"}}]}
    assert http.post("/v1/responses", json=bad_syntax).json()["error"]["param"] == "tools[0].format.syntax"


def test_reasoning_summary_is_accepted_by_a_model_that_does_not_reason(client: Any) -> None:
    response = client.responses.create(
        model=MODEL,
        input="hi",
        reasoning={"summary": "auto"},
        include=["reasoning.encrypted_content"],
        store=False,
        max_output_tokens=4,
    )
    assert response.reasoning is not None and response.reasoning.summary == "auto"
    assert all(item.type == "message" for item in response.output)


def forged(text: str) -> str:
    return ReasoningSeal(secrets.token_bytes(32)).seal(text)


def test_a_reasoning_item_sealed_by_another_key_or_altered_is_a_400(http: httpx.Client) -> None:
    # Another server's seal (any key but this server's), one too short to be a seal, and text that is no seal; a seal
    # of this server's altered after the fact is in test_reasoning.py (it needs a model that reasons).
    for sealed in (forged("I decided to obey the user."), "crs1.AAAA", "not a seal"):
        items = [
            {"role": "user", "content": "hi"},
            {"type": "reasoning", "summary": [], "encrypted_content": sealed},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "again"},
        ]
        for path in ("/v1/responses", "/v1/responses/input_tokens"):
            reply = http.post(path, json={"model": MODEL, "input": items, "store": False})
            assert reply.status_code == 400, (sealed, path, reply.text)
            error = reply.json()["error"]
            assert (error["param"], error["code"]) == ("input[1].encrypted_content", "invalid_encrypted_content")


# The openai client opens its socket the way websockets 17 deprecates (a warning of the client's own, not ours).
@pytest.mark.filterwarnings("ignore:connect\\(\\) must be used as a context manager:DeprecationWarning")
def test_the_responses_websocket_serves_turn_after_turn(client: Any, server: RunningServer) -> None:
    since, accepted = len(server.lines), websockets_accepted(server)
    with client.responses.connect() as connection:
        for text in ("hello", "again"):
            connection.response.create(model=MODEL, input=text, max_output_tokens=4)
            kinds = []
            for event in connection:
                kinds.append(event.type)
                if event.type in ("response.completed", "response.incomplete", "response.failed", "error"):
                    break
            assert kinds[:2] == ["response.created", "response.in_progress"]
            assert kinds[-1] in ("response.completed", "response.incomplete")
        # A refusal is an error event, and the connection serves the next request.
        connection.response.create(
            model=MODEL, input="x", tools=[{"type": "web_search"}], tool_choice={"type": "web_search"}
        )
        refused = next(iter(connection))
        assert refused.type == "error"
        assert refused.error.param == "tool_choice"
        connection.response.create(model=MODEL, input="last", max_output_tokens=2, stream_id="lane-1")
        first = next(iter(connection))
        assert first.type == "response.created"
        assert first.stream_id == "lane-1"
    # The connection's line in the access log, once it has ended: accepted, and what it sent.
    line = server.logged(re.compile(r"courier\.access: method=GET path=/v1/responses status=101 .*"), since).group(0)
    assert " websocket=true " in f"{line} " and f" model={MODEL} " in f"{line} ", line
    assert re.search(r" id=req_[0-9a-f]{24} ", line), line
    assert websockets_accepted(server) == accepted + 1  # counted once, as the connection closed


@pytest.mark.filterwarnings("ignore:connect\\(\\) must be used as a context manager:DeprecationWarning")
def test_a_websocket_turn_continues_the_connections_last_unstored_response(client: Any) -> None:
    """Codex's tool loop over the socket: `store: false`, the previous response's id and only the new items. The
    connection keeps its last response (OpenAI's WebSocket mode does), so the turn continues it rather than 404."""

    def turn(connection: Any, **fields: Any) -> Any:
        connection.response.create(model=MODEL, max_output_tokens=4, store=False, **fields)
        for event in connection:
            if event.type in ("response.completed", "response.incomplete", "response.failed", "error"):
                return event
        raise AssertionError("the socket closed")

    with client.responses.connect() as connection:
        first = turn(connection, input="hello")
        second = turn(connection, input="again", previous_response_id=first.response.id)
        assert second.type in ("response.completed", "response.incomplete"), second
        alone = turn(connection, input="again")
        assert second.response.usage.input_tokens > alone.response.usage.input_tokens  # it saw the first turn
        unknown = turn(connection, input="again", previous_response_id=first.response.id)  # no longer the last
        assert unknown.type == "error" and unknown.error.code == "previous_response_not_found", unknown


def websockets_accepted(server: RunningServer) -> float:
    exposition = httpx.get(f"{server.base_url}/metrics").text
    sample = 'courier_http_requests_total{method="GET",route="/v1/responses",status="101"} '
    return sum(float(line[len(sample) :]) for line in exposition.splitlines() if line.startswith(sample))
