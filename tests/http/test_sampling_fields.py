"""Every sampling field the chat and completions APIs accept is honoured, or refused naming it.

On the tiny random-weight llama: greedy decoding of random weights repeats itself, which makes penalties visible,
and filters that keep only the top token (top_k 1, min_p 1) must reproduce greedy decoding at any temperature.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.support.server import TINY_MODEL, RunningServer

MODEL = TINY_MODEL
PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]


@pytest.fixture(scope="module")
def server(tiny_server: RunningServer) -> RunningServer:
    return tiny_server  # the session's shared default server (tests/conftest.py)


def tokens(http: httpx.Client, **fields: Any) -> list[int]:
    """The token ids a completion generates (the prompt cache is off, so each request starts alike)."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "cache_prompt": False, **fields}
    reply = http.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    text = reply.json()["choices"][0]["text"]
    return list(http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"])


def repeats(ids: list[int]) -> int:
    return len(ids) - len(set(ids))


REFUSED: list[tuple[dict[str, Any], str]] = [
    ({"presence_penalty": 9}, "presence_penalty"),
    ({"presence_penalty": "high"}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": 1e-40}, "repetition_penalty"),
    ({"repetition_penalty": 11}, "repetition_penalty"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 1.5}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"logit_bias": [1, 2]}, "logit_bias"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"-1": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"5": True}}, "logit_bias"),
    ({"logit_bias": {"99999999": 5}}, "logit_bias"),  # past the vocabulary: refused by the ingress
]


@pytest.mark.parametrize(("fields", "param"), REFUSED)
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_field_out_of_range_is_a_400_naming_it(
    http: httpx.Client, path: str, fields: dict[str, Any], param: str
) -> None:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 2, **fields}
    body |= {"messages": [{"role": "user", "content": "Hi"}]} if "chat" in path else {"prompt": "Hi"}
    reply = http.post(path, json=body)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param
    assert http.get("/health").status_code == 200


def test_logit_bias_forces_and_forbids_tokens(http: httpx.Client) -> None:
    greedy = tokens(http)
    forced = tokens(http, logit_bias={"1000": 100})
    assert forced and set(forced) == {1000}
    forbidden = tokens(http, logit_bias={str(greedy[0]): -100})
    assert forbidden[0] != greedy[0]


def test_penalties_break_the_repetition_of_greedy_decoding(http: httpx.Client) -> None:
    greedy = tokens(http, max_tokens=24)
    assert repeats(greedy) > 0  # random weights repeat themselves: otherwise this test shows nothing
    for fields in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}, {"repetition_penalty": 3.0}):
        penalised = tokens(http, max_tokens=24, **fields)
        assert penalised != greedy, fields
        assert repeats(penalised) < repeats(greedy), fields


def test_filters_that_keep_only_the_top_token_reproduce_greedy_decoding(http: httpx.Client) -> None:
    greedy = tokens(http)
    for seed in (1, 2, 3):
        assert tokens(http, temperature=1.5, top_k=1, seed=seed) == greedy
        assert tokens(http, temperature=1.5, min_p=1.0, seed=seed) == greedy
    sampled = {tuple(tokens(http, temperature=1.5, seed=seed)) for seed in (1, 2, 3)}
    assert any(sample != tuple(greedy) for sample in sampled)  # unfiltered, the same temperature does sample


def test_penalties_and_a_constraint_combine(http: httpx.Client) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "JSON please"}],
        "response_format": {
            "type": "json_schema",
            "json_schema": {
                "name": "x",
                "schema": {
                    "type": "object",
                    "properties": {"ok": {"type": "boolean"}},
                    "required": ["ok"],
                    "additionalProperties": False,
                },
            },
        },
        "frequency_penalty": 1.0,
        "logit_bias": {"1000": -100},
        "max_tokens": 16,
        "temperature": 0,
    }
    reply = http.post("/v1/chat/completions", json=body).json()
    assert reply["choices"][0]["finish_reason"] == "stop"
    assert reply["choices"][0]["message"]["content"] in ('{"ok": true}', '{"ok": false}')


LARGEST = 1.7976931348623157e308
SMALLEST = 5e-324  # the smallest denormal double
VOCABULARY = 49152  # the tiny llama's (SmolLM2's tokenizer)

# Each sampling field at its edges: None where the request is served, else the param its 400 names.
EDGES: list[tuple[dict[str, Any], str | None]] = [
    *(({"temperature": value}, None) for value in (0, -0.0, 1, 2, SMALLEST, 2.2250738585072014e-308, 1e-300, 1e-45)),
    *(({"temperature": value}, "temperature") for value in (LARGEST, -1, -SMALLEST, "NaN", "1")),
    *(({"top_p": value}, None) for value in (1, SMALLEST, 1e-300, 0.5)),
    *(({"top_p": value}, "top_p") for value in (0, LARGEST, -1, "nan")),
    *(({"top_k": value}, None) for value in (0, 1, -1, VOCABULARY - 1, VOCABULARY, VOCABULARY + 1, 1_000_000)),
    *(({"top_k": value}, "top_k") for value in (1_000_001, -2, LARGEST, "NaN", 2**70)),
    *(({"min_p": value}, None) for value in (0, 1, SMALLEST, 0.99)),
    *(({"min_p": value}, "min_p") for value in (LARGEST, -1, "Infinity")),
    *(({key: value}, None) for key in ("presence_penalty", "frequency_penalty") for value in (-2, 2, SMALLEST)),
    *(({key: value}, key) for key in ("presence_penalty", "frequency_penalty") for value in (LARGEST, -LARGEST)),
    *(({"repetition_penalty": value}, None) for value in (1, 0.01, 10)),
    *(
        ({"repetition_penalty": value}, "repetition_penalty")
        for value in (0, 1e-40, 1e-300, SMALLEST, LARGEST, -1, 0.0099)
    ),
    *(({"seed": value}, None) for value in (0, 2**63 - 1)),
    *(({"seed": value}, "seed") for value in (-1, 2**63, 2**64, LARGEST)),
    ({"logit_bias": {str(VOCABULARY - 1): 100}}, None),
    ({"logit_bias": {str(VOCABULARY): 1}}, "logit_bias"),
    *(({"max_tokens": value}, "max_tokens") for value in (0, -1, LARGEST, 2**70 + 0.5)),
]


def ordinary_requests_succeed(http: httpx.Client) -> None:
    """Another client's everyday requests: default sampling, an unseeded temperature draw, a completion and a
    Responses turn. A fault one request left behind (a broken random state) would fail them."""
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 3}
    for body in (chat, {**chat, "temperature": 1.0}, {**chat, "temperature": 0.7, "top_p": 0.9, "top_k": 40}):
        reply = http.post("/v1/chat/completions", json=body)
        assert reply.status_code == 200, reply.text
    reply = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 3, "temperature": 1.0})
    assert reply.status_code == 200, reply.text
    reply = http.post("/v1/responses", json={"model": MODEL, "input": "Hi", "max_output_tokens": 3, "store": False})
    assert reply.status_code == 200, reply.text


@pytest.fixture(scope="module")
def other(server: RunningServer) -> Iterator[httpx.Client]:
    """A second client, on connections of its own (made once: each client costs an SSL context, ~25 ms CPU)."""
    with server.http() as other:
        yield other


@pytest.mark.parametrize(("fields", "param"), EDGES, ids=lambda value: repr(value)[:40])
def test_each_sampling_field_at_its_edges_is_served_or_refused_and_leaves_the_server_whole(
    http: httpx.Client, other: httpx.Client, fields: dict[str, Any], param: str | None
) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **fields}
    reply = http.post("/v1/chat/completions", json=body)
    if param is None:
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["finish_reason"] in ("stop", "length")
    else:
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["param"] == param
    ordinary_requests_succeed(other)


def chat_text(http: httpx.Client, **fields: Any) -> str:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 16, **fields}
    reply = http.post("/v1/chat/completions", json={**body, "cache_prompt": False})
    assert reply.status_code == 200, reply.text
    return str(reply.json()["choices"][0]["message"]["content"])


TINY_TEMPERATURES = [SMALLEST, 1e-300, 1e-45, 2.2250738585072014e-308]


@pytest.mark.parametrize("temperature", TINY_TEMPERATURES)
def test_a_tiny_temperature_writes_the_greedy_reply_plain_seeded_and_speculative(
    http: httpx.Client, temperature: float
) -> None:
    """The tiny llama's server speculates (prompt-lookup drafts verified in the batch), so both paths run here."""
    greedy = chat_text(http, temperature=0)
    assert chat_text(http, temperature=temperature) == greedy
    assert chat_text(http, temperature=temperature, seed=11) == greedy


def test_a_vanishing_top_p_and_a_full_min_p_write_the_greedy_reply(
    http: httpx.Client,
) -> None:
    greedy = chat_text(http, temperature=0)
    assert chat_text(http, temperature=1.0, top_p=1e-300) == greedy
    assert chat_text(http, temperature=1.0, top_p=SMALLEST, seed=3) == greedy
    assert chat_text(http, temperature=2.0, min_p=1.0) == greedy


@pytest.mark.parametrize("temperature", TINY_TEMPERATURES)
def test_a_tiny_temperature_writes_the_greedy_reply_under_a_grammar(http: httpx.Client, temperature: float) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}}, "required": ["name"]}
    constrained = {"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}}
    greedy = chat_text(http, temperature=0, **constrained)
    assert chat_text(http, temperature=temperature, **constrained) == greedy
    assert chat_text(http, temperature=temperature, seed=5, **constrained) == greedy
    assert chat_text(http, temperature=1.0, top_p=1e-300, **constrained) == greedy
