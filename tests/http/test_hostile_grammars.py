"""Hostile grammars through the real server (issue 30, item 8): each gets its answer or a 400 naming the field, and
another client's small chat is answered while it runs.

The tiny llama here has a 32K window, so every shape's prompt fits (the 128 functions are described in the prompt:
5-9K tokens); its latency on the embedded SmolLM2 is measured by bench/hostile_grammars.py (docs/reliability.md,
"Grammars").
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest

from tests.support.hostile_grammars import (
    ANSWER_SCHEMA,
    SHAPES,
    build_wide_window_llama,
    hostile_body,
    small_chat_body,
)
from tests.support.server import RunningServer, error_lines, running_server

MODEL = "wide-window-llama"
MAX_TOKENS = 32
TIMEOUT_S = 300.0


@pytest.fixture(scope="module")
def server(smollm2_dir: Path, cache_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    model_dir = build_wide_window_llama(smollm2_dir, tmp_path_factory.mktemp("wide-window-llama"))
    args = ["--model", str(model_dir), "--cache-dir", str(cache_dir), "--served-model-name", MODEL]
    with running_server(args) as running:
        yield running
        assert not error_lines(running), running.log()


def answer_of(response: httpx.Response, shape: str) -> None:
    """A 200 whose calls name offered functions (or whose JSON answer fits its schema), or a 400 naming the field."""
    body = response.json()
    if response.status_code == 400:
        assert body["error"]["param"] == "tools" and body["error"]["code"], body
        return
    assert response.status_code == 200, body
    choice = body["choices"][0]
    names = {tool["function"]["name"] for tool in SHAPES[shape]["tools"]}
    for call in choice["message"].get("tool_calls") or ():
        assert call["function"]["name"] in names
        if choice["finish_reason"] == "tool_calls":
            assert isinstance(json.loads(call["function"]["arguments"]), dict)
    if choice["finish_reason"] == "stop" and "response_format" in SHAPES[shape]:
        jsonschema.validate(json.loads(choice["message"]["content"]), ANSWER_SCHEMA)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_hostile_grammar_gets_its_answer_and_a_small_chat_is_answered_meanwhile(
    server: RunningServer, shape: str
) -> None:
    outcome: dict[str, Any] = {}

    def hostile() -> None:
        with httpx.Client(base_url=server.base_url, timeout=TIMEOUT_S) as client:
            outcome["response"] = client.post("/v1/chat/completions", json=hostile_body(MODEL, shape, MAX_TOKENS))
            outcome["done"] = time.monotonic()

    sender = threading.Thread(target=hostile)
    sender.start()
    with httpx.Client(base_url=server.base_url, timeout=TIMEOUT_S) as client:
        small = client.post("/v1/chat/completions", json=small_chat_body(MODEL))
        answered = time.monotonic()
        sender.join(TIMEOUT_S)
        assert small.status_code == 200, small.text
        assert small.json()["choices"][0]["message"]["content"] is not None
        answer_of(outcome["response"], shape)
        if outcome["response"].status_code == 200:
            assert answered <= outcome["done"]  # not queued behind the hostile request's whole reply
        assert client.get("/health").status_code == 200
