"""`n` samples of one prompt as a request's choices, through the real server with the official client.

On the tiny random-weight llama: seeded sampling makes every choice reproducible, greedy decoding makes every
choice the same reply, and usage counts the prompt once.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.support.server import FIXED_PREFILL_CHUNKS, RunningServer, running_server

MODEL = "tiny"
MAX_N = 4
ASK: list[Any] = [{"role": "user", "content": "Tell me about the sea."}]


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path, cache_dir: Path) -> Iterator[RunningServer]:
    args = ["--model", str(tiny_llama_dir), "--cache-dir", str(cache_dir), "--served-model-name", MODEL]
    with running_server([*args, "--max-n", str(MAX_N), "--max-batch", "8", *FIXED_PREFILL_CHUNKS]) as running:
        yield running
        assert running.stop() == 0


def test_chat_choices_are_indexed_and_the_prompt_counted_once(client: openai.OpenAI) -> None:
    one = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=6, temperature=0)
    three = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=6, temperature=1, seed=3, n=3)
    assert [choice.index for choice in three.choices] == [0, 1, 2]
    assert all(choice.finish_reason == "length" for choice in three.choices)
    assert one.usage is not None and three.usage is not None
    assert three.usage.prompt_tokens == one.usage.prompt_tokens
    assert three.usage.completion_tokens == 3 * 6
    assert three.usage.total_tokens == three.usage.prompt_tokens + 18
    assert len({choice.message.content for choice in three.choices}) > 1  # each choice samples on its own

    again = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=6, temperature=1, seed=3, n=3)
    assert [c.message.content for c in again.choices] == [c.message.content for c in three.choices]
    # Choice i draws from seed + i: the second choice is what a single request with seed 4 gets.
    seeded = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=6, temperature=1, seed=4)
    assert seeded.choices[0].message.content == three.choices[1].message.content


def test_greedy_choices_are_the_same_reply(client: openai.OpenAI) -> None:
    one = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, temperature=0)
    two = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, temperature=0, n=2)
    assert [choice.message.content for choice in two.choices] == [one.choices[0].message.content] * 2


def test_streamed_choices_interleave_by_index(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=6, temperature=1, seed=11, n=3)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        max_tokens=6,
        temperature=1,
        seed=11,
        n=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    order: list[int] = []
    chunks = list(stream)
    for chunk in chunks:
        for choice in chunk.choices:
            order.append(choice.index)
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason is not None:
                assert choice.index not in finishes  # one finish per choice
                finishes[choice.index] = choice.finish_reason
    assert texts == {choice.index: choice.message.content for choice in whole.choices}
    assert finishes == {0: "length", 1: "length", 2: "length"}
    assert order[:3] == [0, 1, 2]  # each choice opens with its role
    assert sorted(set(order[3:])) == [0, 1, 2]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert whole.usage is not None and chunks[-1].usage.model_dump() == whole.usage.model_dump()


def test_completions_choices_whole_and_streamed(client: openai.OpenAI) -> None:
    whole = client.completions.create(model=MODEL, prompt="The sea is", max_tokens=5, temperature=1, seed=5, n=2)
    assert [choice.index for choice in whole.choices] == [0, 1]
    assert whole.usage is not None and whole.usage.completion_tokens == 10
    streamed: dict[int, str] = {}
    usage = None
    for chunk in client.completions.create(
        model=MODEL,
        prompt="The sea is",
        max_tokens=5,
        temperature=1,
        seed=5,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
    ):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert streamed == {choice.index: choice.text for choice in whole.choices}
    assert usage is not None and usage.model_dump() == whole.usage.model_dump()


@pytest.mark.parametrize("n", [0, MAX_N + 1, 1.5, "2"])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_n_out_of_range_is_refused_naming_it(http: httpx.Client, path: str, n: object) -> None:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 2, "n": n}
    body.update({"messages": ASK} if "chat" in path else {"prompt": "hi"})
    response = http.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "n"
    assert f"from 1 to {MAX_N}" in error["message"]


def test_samples_count_against_the_batch_and_the_server_keeps_serving(http: httpx.Client) -> None:
    body = {"model": MODEL, "messages": ASK, "max_tokens": 3, "n": MAX_N, "temperature": 0}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200 and len(response.json()["choices"]) == MAX_N
    health = http.get("/health").json()
    assert health["scheduler"]["running"] == 0 and health["scheduler"]["completed"] >= 1


def test_cache_writes_are_counted_once_for_all_samples(client: openai.OpenAI) -> None:
    ask: list[Any] = [{"role": "user", "content": "Which lighthouse is the oldest one still working?"}]
    one = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=2, temperature=0)
    assert one.usage is not None and one.usage.prompt_tokens_details is not None
    details = one.usage.prompt_tokens_details
    assert details.cache_write_tokens == one.usage.prompt_tokens - (details.cached_tokens or 0) > 0
    other: list[Any] = [{"role": "user", "content": "Which river is the longest one in Europe?"}]
    many = client.chat.completions.create(model=MODEL, messages=other, max_tokens=2, temperature=0, n=3)
    assert many.usage is not None and many.usage.prompt_tokens_details is not None
    written = many.usage.prompt_tokens_details.cache_write_tokens
    # Only the conversation's history is kept for samples (not each reply), and it is written once.
    assert written is not None
    assert 0 < written < many.usage.prompt_tokens - (many.usage.prompt_tokens_details.cached_tokens or 0)
