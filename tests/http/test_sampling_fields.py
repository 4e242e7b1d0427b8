"""Every sampling field the chat and completions APIs accept is honoured, or refused naming it.

On the tiny random-weight llama: greedy decoding of random weights repeats itself, which makes penalties visible,
and filters that keep only the top token (top_k 1, min_p 1) must reproduce greedy decoding at any temperature.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.server import RunningServer, running_server

MODEL = "tiny"
PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path, cache_dir: Path) -> Iterator[RunningServer]:
    args = ["--model", str(tiny_llama_dir), "--cache-dir", str(cache_dir), "--served-model-name", MODEL]
    with running_server(args) as running:
        yield running
        assert running.stop() == 0


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
