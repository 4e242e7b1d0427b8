"""The request-field audit: every field OpenAI defines for the generation, Responses and Conversations routes (and
every field docs/api.md lists) is honoured, or refused with a 400 naming it; none is accepted and ignored.

One test per field no other test covered. Where either answer would keep the rule (the field honoured, or a 400
naming it), a test accepts either and checks the one it gets. `n` and the reasoning fields are left to their own
tests (tests/http/test_choices.py, tests/http/test_reasoning.py). On the tiny random-weight llama, whose chat
template (SmolLM2's) writes a default system prompt when there is none: a test that reads `cached_tokens` opens
with instructions of its own, so no other test's prompt can share their prefix.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
from quart.typing import TestClientProtocol as QuartClient

from tests.support.app import validating_app
from tests.support.server import TINY_MODEL, RunningServer

MODEL = TINY_MODEL
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
RESPONSES = "/v1/responses"
INPUT_TOKENS = "/v1/responses/input_tokens"
COMPACT = "/v1/responses/compact"
CONVERSATIONS = "/v1/conversations"
# Greedy on the tiny llama, this question runs past 24 tokens without an end-of-sequence token.
QUESTION = [{"role": "user", "content": "Tell me a story about a lighthouse."}]
TOKEN_PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]
PNG = "https://example.com/cat.png"  # refused before any fetch
IMAGE_PART: dict[str, Any] = {"type": "image_url", "image_url": {"url": PNG}}
INPUT_IMAGE: dict[str, Any] = {"type": "input_image", "image_url": PNG}
FUNCTION = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


@pytest.fixture(scope="module")
def server(tiny_server: RunningServer) -> RunningServer:
    return tiny_server  # the session's shared default server (tests/conftest.py)


def body_for(path: str, fields: dict[str, Any]) -> dict[str, Any]:
    """A small valid body for `path` (the cheapest request the route serves), with `fields` on top."""
    bases: dict[str, dict[str, Any]] = {
        CHAT: {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1},
        COMPLETIONS: {"prompt": "Hi", "max_tokens": 1},
        RESPONSES: {"input": "Hi", "max_output_tokens": 1, "store": False},
        INPUT_TOKENS: {"input": "Hi"},
        COMPACT: {"input": "Just one message."},  # nothing to summarize: one compaction item keeping it
        CONVERSATIONS: {},
    }
    base = bases[path]
    return {"model": MODEL, **base, **fields} if path != CONVERSATIONS else {**base, **fields}


def error_of(reply: httpx.Response) -> dict[str, Any]:
    error: dict[str, Any] = reply.json()["error"]
    return error


def assert_refused(reply: httpx.Response, param: str) -> None:
    assert reply.status_code == 400, reply.text[:300]
    error = error_of(reply)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    assert error["message"]


def sse_data(text: str) -> list[dict[str, Any]]:
    """The JSON payloads of an SSE body (chat's `[DONE]` left out)."""
    return [
        orjson.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"
    ]


def output_text_part(response: dict[str, Any]) -> dict[str, Any]:
    """The `output_text` part of a response's message item."""
    message = next(item for item in response["output"] if item["type"] == "message")
    part: dict[str, Any] = message["content"][0]
    return part


def json_of(reply: httpx.Response) -> dict[str, Any]:
    assert reply.status_code == 200, reply.text[:300]
    body: dict[str, Any] = reply.json()
    return body


# --- Refusals: (path, fields, param). Known OpenAI fields the engine cannot honour, and the shapes of supported
# fields it cannot honour, are 400s naming them.
REFUSED: list[Any] = [
    # Chat Completions
    pytest.param(CHAT, {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    pytest.param(CHAT, {"modalities": ["text", "audio"]}, "modalities"),
    pytest.param(CHAT, {"prediction": {"type": "content", "content": "Hello"}}, "prediction"),
    pytest.param(
        CHAT,
        {"web_search_options": {"search_context_size": "low"}},
        "web_search_options",
    ),
    pytest.param(CHAT, {"moderation": {"model": "omni-moderation-latest"}}, "moderation"),
    pytest.param(CHAT, {"store": True}, "store"),  # no stored chat completions
    pytest.param(CHAT, {"metadata": {"project": "audit"}}, "metadata"),
    pytest.param(CHAT, {"verbosity": "low"}, "verbosity"),  # Responses refuses it
    pytest.param(CHAT, {"prompt_cache_retention": "24h"}, "prompt_cache_retention"),
    pytest.param(CHAT, {"prompt_cache_options": {"ttl": "24h"}}, "prompt_cache_options"),
    pytest.param(  # beside max_completion_tokens, max_tokens is not even checked
        CHAT,
        {"max_tokens": "many", "max_completion_tokens": 1},
        "max_tokens",
    ),
    pytest.param(
        CHAT,
        {"stream_options": {"include_usage": "yes"}},
        "stream_options.include_usage",
    ),
    pytest.param(
        CHAT,
        {
            "messages": [
                {"role": "user", "content": "Weather?"},
                {
                    "role": "assistant",
                    "content": "Looking.",
                    "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": 5}}],
                },
            ]
        },
        "messages[1].tool_calls[0].function.arguments",
    ),
    (CHAT, {"stream_options": "usage"}, "stream_options"),
    (CHAT, {"tools": [{"type": "custom", "custom": {"name": "grep"}}]}, "tools[0]"),
    (
        CHAT,
        {"tools": [{"type": "function", "function": FUNCTION}], "tool_choice": {"type": "allowed_tools"}},
        "tool_choice",
    ),
    pytest.param(  # Responses reads it (the last prompt-cache session fallback) and refuses a wrong type
        CHAT, {"safety_identifier": 5}, "safety_identifier"
    ),
    (CHAT, {"model": 5}, "model"),
    (CHAT, {"user": 5}, "user"),
    (CHAT, {"prompt_cache_key": 5}, "prompt_cache_key"),
    (CHAT, {"cache_prompt": "no"}, "cache_prompt"),
    (CHAT, {"parallel_tool_calls": "no"}, "parallel_tool_calls"),
    (CHAT, {"max_completion_tokens": 0}, "max_completion_tokens"),
    *(  # an image reaches the model as its processor takes it: low detail cannot be honoured
        (CHAT, {"messages": [{"role": "user", "content": [IMAGE_PART | {"image_url": image_url}]}]}, param)
        for image_url, param in (
            ({"url": PNG, "detail": "low"}, "messages[0].content[0].image_url.detail"),
            ({"url": PNG, "detail": 42}, "messages[0].content[0].image_url.detail"),
        )
    ),
    *(
        (RESPONSES, {"input": [{"role": "user", "content": [INPUT_IMAGE | {"detail": detail}]}]}, param)
        for detail, param in (("low", "input[0].content[0].detail"), ("ultra", "input[0].content[0].detail"))
    ),
    # Completions
    pytest.param(
        COMPLETIONS,
        {"stream_options": {"include_usage": "yes"}},
        "stream_options.include_usage",
    ),
    (COMPLETIONS, {"best_of": 1, "n": 2}, "best_of"),  # n samples chosen from best_of: fewer cannot be
    (COMPLETIONS, {"suffix": "the end"}, "suffix"),
    (COMPLETIONS, {"suffix": 5}, "suffix"),
    (COMPLETIONS, {"echo": "yes"}, "echo"),
    (COMPLETIONS, {"user": 5}, "user"),
    (COMPLETIONS, {"prompt_cache_key": 5}, "prompt_cache_key"),
    (COMPLETIONS, {"seed": 1.5}, "seed"),
    (COMPLETIONS, {"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    (COMPLETIONS, {"temperature": 2.5}, "temperature"),
    (COMPLETIONS, {"top_p": 0}, "top_p"),
    (COMPLETIONS, {"stream": "yes"}, "stream"),
    (COMPLETIONS, {"stream_options": "usage"}, "stream_options"),
    # Responses
    pytest.param(RESPONSES, {"include": "everything"}, "include"),
    pytest.param(RESPONSES, {"prompt": {"id": "pmpt_123", "version": "1"}}, "prompt"),
    pytest.param(RESPONSES, {"prompt_cache_retention": "24h"}, "prompt_cache_retention"),
    pytest.param(
        RESPONSES,
        {"prompt_cache_options": {"ttl": "24h"}},
        "prompt_cache_options",
    ),
    pytest.param(RESPONSES, {"moderation": {"model": "omni-moderation-latest"}}, "moderation"),
    pytest.param(RESPONSES, {"access_programs": {"cyber": "daybreak_red"}}, "access_programs"),
    pytest.param(
        RESPONSES,
        {"background_options": {"completion_window": "2h"}},
        "background_options",
    ),
    pytest.param(RESPONSES, {"image": {"context_compression": "enabled"}}, "image"),
    (RESPONSES, {"text": {"verbosity": "low"}}, "text.verbosity"),
    (RESPONSES, {"tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}, "tool_choice"),
    # A hosted tool merely declared is left out of what the model is offered; forcing one cannot be honoured.
    (RESPONSES, {"tools": [{"type": "mcp", "server_label": "x"}], "tool_choice": {"type": "mcp"}}, "tool_choice"),
    (RESPONSES, {"instructions": 5}, "instructions"),
    (RESPONSES, {"previous_response_id": 5}, "previous_response_id"),
    (RESPONSES, {"conversation": {"name": "x"}}, "conversation"),
    (RESPONSES, {"top_logprobs": 21}, "top_logprobs"),
    (RESPONSES, {"temperature": 2.5}, "temperature"),
    (RESPONSES, {"top_p": 0}, "top_p"),
    (RESPONSES, {"store": "no"}, "store"),
    (RESPONSES, {"stream": "no"}, "stream"),
    (RESPONSES, {"parallel_tool_calls": "no"}, "parallel_tool_calls"),
    (RESPONSES, {"user": 5}, "user"),
    (RESPONSES, {"safety_identifier": 5}, "safety_identifier"),
    (RESPONSES, {"prompt_cache_key": 5}, "prompt_cache_key"),
    (RESPONSES, {"cache_prompt": "no"}, "cache_prompt"),
    (RESPONSES, {"metadata": {"k": 1}}, "metadata.k"),
    # Responses input_tokens: create's parser, and OpenAI's count-only `personality`
    pytest.param(INPUT_TOKENS, {"personality": "friendly"}, "personality"),
    (INPUT_TOKENS, {"truncation": "auto"}, "truncation"),
    (INPUT_TOKENS, {"text": {"verbosity": "high"}}, "text.verbosity"),
    (INPUT_TOKENS, {"tool_choice": "required"}, "tool_choice"),
    (INPUT_TOKENS, {"conversation": "conv_x", "previous_response_id": "resp_x"}, "conversation"),
    (INPUT_TOKENS, {"instructions": 5}, "instructions"),
    # Compact
    pytest.param(COMPACT, {"image": {"context_compression": "enabled"}}, "image"),
    pytest.param(COMPACT, {"prompt_cache_retention": "24h"}, "prompt_cache_retention"),
    pytest.param(COMPACT, {"prompt_cache_options": {"ttl": "24h"}}, "prompt_cache_options"),
    pytest.param(COMPACT, {"service_tier": "priority"}, "service_tier"),
    # Read as the summary's prompt-cache session (docs/api.md says compact ignores them): wrong types are refused.
    (COMPACT, {"prompt_cache_key": 5}, "prompt_cache_key"),
    (COMPACT, {"user": 5}, "user"),
    (COMPACT, {"safety_identifier": 5}, "safety_identifier"),
    (COMPACT, {"instructions": 5}, "instructions"),
    # Conversations
    (CONVERSATIONS, {"items": [{"role": "user", "content": "hi"}] * 21}, "items"),
    (CONVERSATIONS, {"items": 5}, "items"),  # a string is taken as one user message, as Responses' `input` is
    (CONVERSATIONS, {"metadata": {"k": "v" * 513}}, "metadata.k"),
]


def _refusal_id(case: Any) -> str:
    path, fields, param = case.values if hasattr(case, "values") else case
    return f"{path.removeprefix('/v1/')}-{param}-{'+'.join(fields)}"


@pytest.fixture
def app() -> Iterator[QuartClient]:
    """The app in-process: each refusal is decided while the body is validated, before any actor is asked."""
    with validating_app(MODEL) as client:
        yield client


@pytest.mark.anyio
@pytest.mark.parametrize(("path", "fields", "param"), REFUSED, ids=[_refusal_id(case) for case in REFUSED])
async def test_a_field_that_cannot_be_honoured_is_a_400_naming_it(
    app: QuartClient, path: str, fields: dict[str, Any], param: str
) -> None:
    reply = await app.post(path, json=body_for(path, fields))
    body = await reply.get_json()
    assert reply.status_code == 400, body
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["param"] == param, body
    assert body["error"]["message"]


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("path", "fields"),
    [
        (COMPACT, {"input": [{"role": "user", "content": "hi"}, {"type": "compaction_trigger"}]}),
        (CONVERSATIONS, {"items": [{"type": "compaction_trigger"}]}),
    ],
)
async def test_a_compaction_trigger_anywhere_but_a_create_says_where_it_belongs(
    app: QuartClient, path: str, fields: dict[str, Any]
) -> None:
    """Last among its items, yet refused: the message says a create takes it, not that it must come last."""
    reply = await app.post(path, json=body_for(path, fields))
    body = await reply.get_json()
    assert reply.status_code == 400, body
    assert "POST /v1/responses" in body["error"]["message"] and "last input item" in body["error"]["message"], body


def test_a_real_server_refuses_as_the_app_does(http: httpx.Client) -> None:
    """The first refusal of each route again, through the shared server."""
    cases = [case.values if hasattr(case, "values") else case for case in REFUSED]
    firsts = {path: (fields, param) for path, fields, param in reversed(cases)}
    for path, (fields, param) in firsts.items():
        assert_refused(http.post(path, json=body_for(path, fields)), param)


def test_the_model_field_names_itself_on_every_route(http: httpx.Client) -> None:
    for path in (COMPLETIONS, INPUT_TOKENS, COMPACT):
        reply = http.post(path, json=body_for(path, {"model": "gpt-9"}))
        assert reply.status_code == 404, (path, reply.text[:300])
        assert error_of(reply)["param"] == "model"
        assert error_of(reply)["code"] == "model_not_found"


# --- Values whose meaning the server already delivers stay accepted (a fix for the rows above must not refuse them).
ACCEPTED: list[tuple[str, dict[str, Any]]] = [
    (CHAT, {"store": False}),
    (CHAT, {"modalities": ["text"]}),
    (CHAT, {"service_tier": "auto"}),
    (CHAT, {"prompt_cache_retention": "in_memory"}),
    (CHAT, {"stream_options": {"include_obfuscation": False}}),
    (COMPLETIONS, {"echo": False, "best_of": 1, "suffix": ""}),
    (RESPONSES, {"text": {"verbosity": "medium"}, "truncation": "disabled", "background": False}),
    (RESPONSES, {"service_tier": "default"}),
]


@pytest.mark.parametrize(("path", "fields"), ACCEPTED, ids=[f"{p}-{'+'.join(f)}" for p, f in ACCEPTED])
def test_values_already_honoured_are_accepted(http: httpx.Client, path: str, fields: dict[str, Any]) -> None:
    json_of(http.post(path, json=body_for(path, fields)))


# --- Unknown fields: the code ignores them everywhere (docs/api.md: "anything else | ignored").
@pytest.mark.parametrize("path", [COMPLETIONS, RESPONSES, INPUT_TOKENS, CONVERSATIONS])
def test_an_unknown_field_is_ignored(http: httpx.Client, path: str) -> None:
    json_of(http.post(path, json=body_for(path, {"an_unknown_field": {"any": ["thing"]}})))


def test_an_unknown_field_on_compact_changes_nothing(http: httpx.Client) -> None:
    plain = http.post(COMPACT, json=body_for(COMPACT, {}))
    extra = http.post(COMPACT, json=body_for(COMPACT, {"an_unknown_field": True}))
    assert extra.status_code == plain.status_code == 200, extra.text
    assert [item["type"] for item in extra.json()["output"]] == [item["type"] for item in plain.json()["output"]]


# --- Chat Completions: fields honoured, with an observable effect


def chat_reply(http: httpx.Client, **fields: Any) -> dict[str, Any]:
    body = {"model": MODEL, "messages": QUESTION, "temperature": 0, **fields}
    return json_of(http.post(CHAT, json=body))


def test_max_completion_tokens_limits_the_reply_and_wins_over_max_tokens(http: httpx.Client) -> None:
    limited = chat_reply(http, max_completion_tokens=3)
    assert limited["usage"]["completion_tokens"] == 3
    assert limited["choices"][0]["finish_reason"] == "length"
    both = chat_reply(http, max_completion_tokens=2, max_tokens=9)
    assert both["usage"]["completion_tokens"] == 2


def test_chat_service_tier_is_reported_or_refused(http: httpx.Client) -> None:
    reply = http.post(CHAT, json=body_for(CHAT, {"service_tier": "priority"}))
    if reply.status_code == 400:
        assert error_of(reply)["param"] == "service_tier"
        return
    assert json_of(reply).get("service_tier") == "default"  # the tier actually used, as Responses reports it


def test_legacy_functions_are_called_or_refused(http: httpx.Client) -> None:
    body = body_for(CHAT, {"functions": [FUNCTION], "function_call": {"name": "get_weather"}, "max_tokens": 48})
    reply = http.post(CHAT, json=body)
    if reply.status_code == 400:
        assert error_of(reply)["param"] in ("functions", "function_call")
        return
    message = json_of(reply)["choices"][0]["message"]
    called = message.get("function_call") or (message.get("tool_calls") or [{}])[0].get("function") or {}
    assert called.get("name") == "get_weather", message


@pytest.mark.parametrize("path", [CHAT, RESPONSES])
def test_stream_obfuscation_is_sent_or_refused(http: httpx.Client, path: str) -> None:
    reply = http.post(path, json=body_for(path, {"stream": True, "stream_options": {"include_obfuscation": True}}))
    if reply.status_code == 400:
        assert error_of(reply)["param"] in ("stream_options", "stream_options.include_obfuscation")
        return
    assert reply.status_code == 200
    events = sse_data(reply.text)
    deltas = [e for e in events if e.get("object") == "chat.completion.chunk" or str(e.get("type")).endswith("delta")]
    assert deltas and all("obfuscation" in event for event in deltas)


# --- Completions


def completion(http: httpx.Client, **fields: Any) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": TOKEN_PROMPT, "temperature": 0, "cache_prompt": False, **fields}
    return json_of(http.post(COMPLETIONS, json=body))


def test_completions_max_tokens_defaults_to_16(http: httpx.Client) -> None:
    reply = completion(http)
    usage, reason = reply["usage"]["completion_tokens"], reply["choices"][0]["finish_reason"]
    if reason == "length":
        assert usage == 16
    else:
        assert usage < 16  # ended by the model before the default limit
    assert completion(http, max_tokens=3)["usage"]["completion_tokens"] <= 3


def test_completions_stop_cuts_the_text_before_it(http: httpx.Client) -> None:
    full = completion(http, max_tokens=24)["choices"][0]["text"]
    start = next(i for i in range(len(full) // 2, len(full) - 3) if full[i : i + 3].strip())
    stop = full[start : start + 3]
    cut = completion(http, max_tokens=24, stop=[stop, "never-appears-here"])["choices"][0]
    assert cut["finish_reason"] == "stop"
    assert cut["text"] == full[: full.index(stop)]


def test_completions_seed_makes_sampling_repeatable(http: httpx.Client) -> None:
    def sample(seed: int) -> str:
        return str(completion(http, max_tokens=12, temperature=1.0, seed=seed)["choices"][0]["text"])

    assert sample(7) == sample(7)
    assert len({sample(seed) for seed in range(4)}) > 1


def test_a_top_p_that_keeps_only_the_top_token_reproduces_greedy_decoding(http: httpx.Client) -> None:
    greedy = completion(http, max_tokens=8)["choices"][0]["text"]
    for seed in (1, 2):
        assert completion(http, max_tokens=8, temperature=1.5, top_p=1e-9, seed=seed)["choices"][0]["text"] == greedy


# --- Responses


def test_responses_echo_user_safety_identifier_and_prompt_cache_key(http: httpx.Client) -> None:
    fields = {"user": "u-1", "safety_identifier": "s-1", "prompt_cache_key": "k-1", "service_tier": "auto"}
    response = json_of(http.post(RESPONSES, json=body_for(RESPONSES, fields)))
    assert {key: response[key] for key in ("user", "safety_identifier", "prompt_cache_key")} == {
        "user": "u-1",
        "safety_identifier": "s-1",
        "prompt_cache_key": "k-1",
    }
    assert response["service_tier"] == "default"  # the tier used, whatever was asked


def cached_tokens(http: httpx.Client, system: str, **fields: Any) -> int:
    """How many prompt tokens a Responses turn opening with the instructions `system` took from the prompt cache."""
    body = {"model": MODEL, "instructions": system, "input": "Hello?", "max_output_tokens": 1, "store": False}
    return int(json_of(http.post(RESPONSES, json=body | fields))["usage"]["input_tokens_details"]["cached_tokens"])


def system_prompt(tag: str) -> str:
    """Instructions no other test sends, long enough (> --prompt-cache-min-prefix tokens) to be cached."""
    return f"{tag} " + "Keep the lighthouse log of every ship, with its name, flag and hour. " * 4


def test_responses_cache_prompt_false_skips_the_prompt_cache(http: httpx.Client) -> None:
    """`cache_prompt` is read on /v1/responses too, though docs/api.md lists it for chat and completions only."""
    system = system_prompt("Audit responses cache_prompt.")
    assert cached_tokens(http, system, cache_prompt=False) == 0
    assert cached_tokens(http, system, cache_prompt=False) == 0  # nothing was looked up or stored
    assert cached_tokens(http, system) == 0
    assert cached_tokens(http, system) > 0


def test_responses_top_logprobs_fill_output_text_logprobs(http: httpx.Client) -> None:
    body = body_for(RESPONSES, {"input": QUESTION, "top_logprobs": 2, "max_output_tokens": 3, "temperature": 0})
    response = json_of(http.post(RESPONSES, json=body))
    assert response["top_logprobs"] == 2
    logprobs = output_text_part(response)["logprobs"]
    assert len(logprobs) == response["usage"]["output_tokens"] == 3
    assert all(len(entry["top_logprobs"]) == 2 for entry in logprobs)


def test_responses_take_chats_sampling_extensions(http: httpx.Client) -> None:
    """`seed`, `stop`, `top_k`, penalties, `logit_bias` and `chat_template_kwargs` are not OpenAI Responses fields,
    but Courier takes them there as on chat rather than ignore them."""

    def text(**fields: Any) -> str:
        body = body_for(RESPONSES, {"input": QUESTION, "max_output_tokens": 12, **fields})
        return str(output_text_part(json_of(http.post(RESPONSES, json=body)))["text"])

    greedy = text(temperature=0)
    cut = greedy[len(greedy) // 2 :][:3]
    assert text(temperature=0, stop=[cut]) == greedy[: greedy.index(cut)]
    assert text(temperature=1, seed=5) == text(temperature=1, seed=5)
    assert text(temperature=1, top_k=1) == greedy  # only the top token left: greedy at any temperature
    assert_refused(http.post(RESPONSES, json=body_for(RESPONSES, {"presence_penalty": 9})), "presence_penalty")
    assert_refused(http.post(RESPONSES, json=body_for(RESPONSES, {"seed": -1})), "seed")


def test_an_include_value_this_server_does_not_know_is_refused(http: httpx.Client) -> None:
    body = body_for(RESPONSES, {"include": ["message.output_text.logprobs", "everything.else"]})
    assert_refused(http.post(RESPONSES, json=body), "include[1]")
    assert_refused(http.post(RESPONSES, json=body_for(RESPONSES, {"include": [{}]})), "include[0]")
    summary = body_for(RESPONSES, {"reasoning": {"generate_summary": "verbose"}})
    assert_refused(http.post(RESPONSES, json=summary), "reasoning.generate_summary")


def test_responses_include_logprobs_is_honoured_or_refused(http: httpx.Client) -> None:
    body = body_for(RESPONSES, {"include": ["message.output_text.logprobs"], "max_output_tokens": 2})
    reply = http.post(RESPONSES, json=body)
    if reply.status_code == 400:
        assert error_of(reply)["param"] in ("include", "include[0]")
        return
    assert output_text_part(json_of(reply))["logprobs"]  # OpenAI's way to ask for them; empty today


def test_input_tokens_count_the_tools(http: httpx.Client) -> None:
    bare = json_of(http.post(INPUT_TOKENS, json=body_for(INPUT_TOKENS, {})))["input_tokens"]
    tool = {"type": "function", **FUNCTION}
    with_tools = json_of(http.post(INPUT_TOKENS, json=body_for(INPUT_TOKENS, {"tools": [tool]})))["input_tokens"]
    assert with_tools > bare
    choice_none = body_for(INPUT_TOKENS, {"tools": [tool], "tool_choice": "none"})
    assert json_of(http.post(INPUT_TOKENS, json=choice_none))["input_tokens"] == bare  # left out of the prompt


def test_input_tokens_count_a_conversations_items(http: httpx.Client) -> None:
    items = [{"role": "user", "content": "The Aurora passed at nine."}, {"role": "assistant", "content": "Logged."}]
    conversation = json_of(http.post(CONVERSATIONS, json={"items": items}))["id"]
    bare = json_of(http.post(INPUT_TOKENS, json=body_for(INPUT_TOKENS, {})))["input_tokens"]
    spelled_out = body_for(INPUT_TOKENS, {"input": [*items, {"role": "user", "content": "Hi"}]})
    continued = body_for(INPUT_TOKENS, {"conversation": {"id": conversation}})
    counted = json_of(http.post(INPUT_TOKENS, json=continued))["input_tokens"]
    assert counted > bare
    assert counted == json_of(http.post(INPUT_TOKENS, json=spelled_out))["input_tokens"]


# --- Conversations and items


def test_conversation_update_needs_metadata_and_items_are_capped(http: httpx.Client) -> None:
    conversation = json_of(http.post(CONVERSATIONS, json={"metadata": {"k": "v"}}))["id"]
    assert_refused(http.post(f"{CONVERSATIONS}/{conversation}", json={}), "metadata")
    assert_refused(http.post(f"{CONVERSATIONS}/{conversation}/items", json={}), "items")
    many = {"items": [{"role": "user", "content": "hi"}] * 21}
    assert_refused(http.post(f"{CONVERSATIONS}/{conversation}/items", json=many), "items")
    assert json_of(http.get(f"{CONVERSATIONS}/{conversation}"))["metadata"] == {"k": "v"}


def test_conversation_items_include_logprobs_is_honoured_or_refused(http: httpx.Client) -> None:
    conversation = json_of(http.post(CONVERSATIONS, json={}))["id"]
    turn = {"model": MODEL, "input": "Hi", "conversation": conversation, "max_output_tokens": 2}
    json_of(http.post(RESPONSES, json=turn))
    reply = http.get(f"{CONVERSATIONS}/{conversation}/items", params={"include": "message.output_text.logprobs"})
    if reply.status_code == 400:
        assert error_of(reply)["param"] == "include"
        return
    answer = next(item for item in json_of(reply)["data"] if item.get("role") == "assistant")
    assert answer["content"][0]["logprobs"]  # not kept unless the turn asked for top_logprobs: empty today
