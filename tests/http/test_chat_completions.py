"""Chat Completions and Completions end to end: a real server (tiny llama), the official openai client."""

from __future__ import annotations

import openai
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionMessageParam

from tests.support.server import RunningServer

QUESTION: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Tell me a story about a lighthouse."}]


@pytest.fixture(scope="module")
def server(tiny_server: RunningServer) -> RunningServer:
    return tiny_server  # the session's shared default server (tests/conftest.py)


def greedy(
    client: openai.OpenAI,
    max_tokens: int,
    *,
    stop: list[str] | None = None,
    top_logprobs: int | None = None,
    messages: list[ChatCompletionMessageParam] = QUESTION,
) -> ChatCompletion:
    return client.chat.completions.create(
        model="tiny-llama",
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        stop=stop,
        logprobs=top_logprobs is not None,
        top_logprobs=top_logprobs,
    )


def test_chat_completion_has_openai_shape_and_usage(client: openai.OpenAI) -> None:
    # Opening with a system prompt no other test sends (the server is shared): none of it is in the prompt cache.
    system: ChatCompletionMessageParam = {"role": "system", "content": "Shape and usage of a chat completion."}
    completion = greedy(client, 6, messages=[system, *QUESTION])
    choice = completion.choices[0]
    assert completion.object == "chat.completion"
    assert completion.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str) and choice.message.content
    assert choice.finish_reason == "length"
    assert completion.usage is not None
    assert completion.usage.completion_tokens == 6
    assert completion.usage.prompt_tokens > 10
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + 6
    assert completion.usage.prompt_tokens_details is not None
    assert completion.usage.prompt_tokens_details.cached_tokens == 0


def test_stream_concatenates_to_the_same_greedy_text(client: openai.OpenAI) -> None:
    whole = greedy(client, 12).choices[0].message.content
    stream = client.chat.completions.create(
        model="tiny-llama",
        messages=QUESTION,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert text == whole
    finishing = [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices and chunk.choices[0].finish_reason]
    assert finishing == ["length"]
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12


def test_stop_sequence_cuts_the_text_before_it(client: openai.OpenAI) -> None:
    full = greedy(client, 24).choices[0].message.content or ""
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop.strip(), full
    cut = greedy(client, 24, stop=[stop, "never-appears-here"])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == full[: full.index(stop)]


def test_stop_sequence_in_a_stream_is_never_sent(client: openai.OpenAI) -> None:
    full = greedy(client, 24).choices[0].message.content or ""
    stop = full[len(full) // 3 : len(full) // 3 + 4]
    stream = client.chat.completions.create(
        model="tiny-llama",
        messages=QUESTION,
        max_tokens=24,
        temperature=0,
        stop=stop,
        stream=True,
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == full[: full.index(stop)]


def test_seed_makes_sampling_repeatable(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        completion = client.chat.completions.create(
            model="tiny-llama",
            messages=QUESTION,
            max_tokens=16,
            temperature=1.0,
            seed=seed,
        )
        return completion.choices[0].message.content or ""

    assert sample(7) == sample(7)
    assert len({sample(seed) for seed in range(4)}) > 1


def test_logprobs_and_top_logprobs(client: openai.OpenAI) -> None:
    completion = greedy(client, 5, top_logprobs=3)
    logprobs = completion.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    assert len(logprobs.content) == 5
    for entry in logprobs.content:
        tops = [top.logprob for top in entry.top_logprobs]
        assert len(tops) == 3
        assert tops == sorted(tops, reverse=True)
        assert entry.logprob == pytest.approx(tops[0], abs=1e-4)  # greedy picks the most likely token
    assert "".join(entry.token for entry in logprobs.content) == completion.choices[0].message.content


def test_text_parts_and_all_roles_are_accepted(client: openai.OpenAI) -> None:
    messages: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": "Be brief."},
        {"role": "developer", "content": [{"type": "text", "text": "Answer in English."}]},
        {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": " there"}]},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "Again?"},
    ]
    completion = client.chat.completions.create(
        model="tiny-llama",
        messages=messages,
        max_tokens=3,
        extra_body={"an_unknown_field": True},
    )
    assert completion.usage is not None and completion.usage.completion_tokens == 3


def test_completions_with_text_and_token_prompts(client: openai.OpenAI) -> None:
    text = client.completions.create(model="tiny-llama", prompt="Once upon a time", max_tokens=5, temperature=0)
    assert text.object == "text_completion"
    assert text.choices[0].finish_reason == "length"
    assert text.usage is not None and text.usage.completion_tokens == 5
    tokens = client.completions.create(model="tiny-llama", prompt=[1, 2, 3, 4], max_tokens=4, temperature=0)
    assert tokens.usage is not None and tokens.usage.prompt_tokens == 4


def test_completions_stream_matches_whole(client: openai.OpenAI) -> None:
    whole = client.completions.create(model="tiny-llama", prompt="The sea", max_tokens=10, temperature=0)
    stream = client.completions.create(
        model="tiny-llama",
        prompt="The sea",
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        logprobs=2,
    )
    chunks = list(stream)
    assert "".join(chunk.choices[0].text for chunk in chunks if chunk.choices) == whole.choices[0].text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 10
    logprobs = [chunk.choices[0].logprobs for chunk in chunks if chunk.choices and chunk.choices[0].logprobs]
    tops = [entry for logprob in logprobs if logprob is not None for entry in logprob.top_logprobs or []]
    assert len(tops) == 10
    assert all(len(entry) == 2 for entry in tops)


def test_concurrent_streams_all_complete(client: openai.OpenAI, server: RunningServer) -> None:
    import concurrent.futures

    def one(index: int) -> int:
        stream = client.chat.completions.create(
            model="tiny-llama",
            messages=[{"role": "user", "content": f"Request number {index} " * (index + 1)}],
            max_tokens=8 + index,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        usage = [chunk.usage for chunk in stream if chunk.usage is not None]
        return usage[0].completion_tokens

    with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
        counts = list(pool.map(one, range(8)))
    assert counts == [8 + index for index in range(8)]
    with server.http() as http:
        stats = http.get("/health").json()["scheduler"]
    assert (stats["running"], stats["waiting"]) == (0, 0)
